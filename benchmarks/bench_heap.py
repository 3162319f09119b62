"""A CPU forward with glibc's allocator defaults vs with large blocks kept in its heap (what every pass of the package
runs with: ``posgen_tl.hooks.heap.large_blocks_kept``), in ONE fresh process, defaults first.

    python benchmarks/bench_heap.py [--model smollm2-135m] [--n-seq 8] [--seq-len 512] [--threads 2] [--repeats 3]
        [--out benchmarks/results/results_heap.json]
    python benchmarks/bench_heap.py --memory sufficiency --n-seq 4 --seq-len 2048 [--glibc-defaults]

``--memory STEP``: instead, the peak resident memory above its start of one suite step (``suite_steps.Bench``;
``sufficiency``, ``decomposition``, ``pattern``, ``capture``) run once after a warm-up of its inputs, with large blocks
kept as the package runs it, or with ``--glibc-defaults`` as glibc would (run each in its own process).

With glibc's defaults every tensor above its ``mmap`` threshold (a layer's ``[batch, heads, n, n]`` scores) is mapped
afresh and page-faulted in at every layer. The process then times the same forward inside ``large_blocks_kept`` and,
last, with glibc's settings put back ("after"): the heap a pass leaves behind can keep later plain forwards fast, so
only the first figure is glibc's defaults as a fresh process has them. The suite's plain forward runs kept (like with
like); this script says what that baseline saves against a fresh process's forward.
"""

from __future__ import annotations

import argparse
import json
import platform
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
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--memory", default=None, help="a suite step whose peak memory to measure instead")
    ap.add_argument("--glibc-defaults", action="store_true", help="with --memory: the passes without the setting")
    a = ap.parse_args()
    if a.memory:
        memory(a)
        return
    import torch

    torch.set_num_threads(a.threads)
    from suite_steps import Bench

    from posgen_tl.hooks.heap import large_blocks_kept
    from posgen_tl.io.provenance import git_commit

    b = Bench(a.model, a.n_seq, a.seq_len)  # (its warm-up forward is 16 tokens: no big block yet)

    def plain() -> None:
        with torch.no_grad():
            for i in range(0, b.n_seq, b.bs):
                b.model(b.tokens[i : i + b.bs])

    def kept() -> None:
        with large_blocks_kept():
            plain()

    def timed(fn) -> list[float]:
        out = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out

    res = {"glibc_defaults": timed(plain), "large_blocks_kept": timed(kept), "after": timed(plain)}
    out = {"commit": git_commit(), "model": a.model, "tokens": [a.n_seq, a.seq_len], "batch": b.bs,
           "threads": a.threads, "machine": platform.platform(),
           **{k: {"seconds": v, "median_s": statistics.median(v), "min_s": min(v)} for k, v in res.items()}}
    out["kept_over_defaults_median"] = out["large_blocks_kept"]["median_s"] / out["glibc_defaults"]["median_s"]
    for k in res:
        print(f"{k:18s} median {out[k]['median_s']:.2f} s  (min {out[k]['min_s']:.2f} s)")
    print(f"kept / defaults: {out['kept_over_defaults_median']:.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


def memory(a: argparse.Namespace) -> None:
    """Peak RSS above its start of one suite step, with or without large blocks kept (``--glibc-defaults``)."""
    import contextlib

    import torch

    torch.set_num_threads(a.threads)
    import suite_steps
    from suite_steps import Bench, reset_peak, status_mib

    import posgen_tl.engine.swaps as swaps
    import posgen_tl.hooks.stream as stream

    if a.glibc_defaults:  # the passes as they ran before posgen_tl.hooks.heap
        swaps.large_blocks_kept = stream.large_blocks_kept = contextlib.nullcontext  # type: ignore[assignment]
    b = Bench(a.model, a.n_seq, a.seq_len)
    b.kbar()
    step = suite_steps.sufficiency_step(b)[0] if a.memory == "sufficiency" else getattr(b, a.memory)
    before = status_mib("VmRSS")
    reset_peak()
    step()
    peak = status_mib("VmHWM") - before
    print(f"{a.memory} {a.n_seq}x{a.seq_len} {'glibc defaults' if a.glibc_defaults else 'large blocks kept'}: "
          f"peak {peak:.0f} MiB above its start")


if __name__ == "__main__":
    main()
