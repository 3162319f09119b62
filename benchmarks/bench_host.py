"""The host side of the feature statistics: what runs on the CPU after the last layer's capture, on any device.

    python benchmarks/bench_host.py [--model smollm2-135m] [--n-seq 8] [--seq-len 512] [--stack 30] [--repeats 5]
        [--threads 2] [--out benchmarks/results/host_<commit>.json]

``feature_pattern`` streams every layer's q and k through its accumulators (device work), then brings the sums to
the host once and builds the tables there: the per-layer states, the band and head statistics, the ρ forms, two
pandas frames. That last part costs the same milliseconds on a GPU as on this CPU — and on a GPU, where the forward of
8 × 512 tokens takes ~0.1 s (an H200, SmolLM2's shape), each 10 ms of it is 0.1 of the feature statistics' ratio
to a forward. Measured here: the time from the stream's end to the result (the stream is wrapped to stamp its end),
the step as a whole, and a plain forward of the same tokens in the same process, medians of ``--repeats``.
``--stack``: layers stacked on the head axis as a GPU stacks them (the CPU's own choice is one layer at a time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--stack", type=int, default=30, help="layers stacked on the head axis (0: the device's choice)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    import posgen_tl.experiments.pattern as pat

    if a.stack:
        pat.stack_size = lambda *args: a.stack  # type: ignore[assignment]
    from suite_steps import Bench

    b = Bench(a.model, a.n_seq, a.seq_len)
    stream, stamp = pat.stream_qk, {}

    def stamped(*args, **kw):  # the stream's end: what follows is host-side table work
        out = stream(*args, **kw)
        stamp["end"] = time.perf_counter()
        return out

    pat.stream_qk = stamped  # type: ignore[assignment]
    b.pattern()  # warm-up
    step, host, fwd = [], [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        b.pattern()
        t1 = time.perf_counter()
        step.append(t1 - t0)
        host.append(t1 - stamp["end"])
        t0 = time.perf_counter()
        b.forward()
        fwd.append(time.perf_counter() - t0)
    from posgen_tl.io.provenance import git_commit

    res = {"commit": git_commit(short=True), "model": a.model, "n_seq": a.n_seq,
           "seq_len": a.seq_len, "stack": a.stack, "threads": a.threads, "repeats": a.repeats,
           "host_ms": [round(1e3 * x, 2) for x in host], "step_s": [round(x, 4) for x in step],
           "forward_s": [round(x, 4) for x in fwd], "host_ms_median": round(1e3 * statistics.median(host), 2),
           "step_over_forward_median": round(statistics.median(step) / statistics.median(fwd), 3)}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
