"""The capture pass in chunks through the model's key/value cache vs one whole forward (diagnostic).

    python benchmarks/bench_chunks.py --n-seq 4 --seq-len 512 --chunks 128,256 [--threads 1] [--repeats 2]

In one process, rounds alternating: the plain forward, the whole-forward capture (:func:`stream_qk` with a no-op
callback) and the capture with each ``chunk`` (:mod:`posgen_tl.hooks.chunked`); prints each one's seconds and its
best time over the forward's best.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--chunks", default="128,256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    import torch
    from suite import Bench

    from posgen_tl.hooks.chunked import check_chunked
    from posgen_tl.hooks.stream import stream_qk

    torch.set_num_threads(a.threads)
    b = Bench(a.model, a.n_seq, a.seq_len)
    check_chunked(b.model)
    chunks = [int(c) for c in a.chunks.split(",")]
    steps = {"forward": b.forward, "capture": lambda: stream_qk(b.model, b.tokens, lambda c: None, batch_size=b.bs,
                                                                progress=False)}
    for c in chunks:
        steps[f"capture, chunks of {c}"] = lambda c=c: stream_qk(b.model, b.tokens, lambda x: None, batch_size=b.bs,
                                                                  progress=False, chunk=c)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(a.repeats):
        for k, f in steps.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    best = min(times["forward"])
    print(f"{a.model}, {a.n_seq} × {a.seq_len} tokens, batch {b.bs}, {a.threads} thread(s)")
    for k, v in times.items():
        print(f"{k:<26}{' '.join(f'{x:7.2f}' for x in v)} s   best / forward's best {min(v) / best:.3f}")


if __name__ == "__main__":
    main()
