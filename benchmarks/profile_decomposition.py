"""Per-function time split of the streaming decomposition (diagnostic, not a target).

    python benchmarks/profile_decomposition.py [--n-seq 4] [--seq-len 512] [--threads 1] [--ab-scores 3]

Prints the forward, the capture-only pass and the decomposition of the same tokens, then the
seconds spent in each piece of :mod:`posgen_tl.experiments.decomposition` (wrapped timers, summed
over layers and batches). Run it on an idle machine; under load the split is only indicative.
``--ab-scores N``: instead, N rounds of forward / decomposition with W from the score hook / decomposition with W
recomputed, alternating in one process (so a loaded machine slows all three alike), and their medians.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ab-scores", type=int, default=0)
    a = ap.parse_args()
    import torch
    from suite import Bench

    import posgen_tl.engine.decompose_maps as DM
    import posgen_tl.engine.decompose_scores as D
    import posgen_tl.maths.moments as M

    torch.set_num_threads(a.threads)
    if a.ab_scores:
        ab_scores(a, D)
        return
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(mod, name):
        f = getattr(mod, name)

        def g(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                spent[name] += time.perf_counter() - t

        setattr(mod, name, g)

    # the bound check in its own module from 2026-12-04 on (decompose_bound); in decompose_scores before
    bound = importlib.import_module("posgen_tl.engine.decompose_bound") if hasattr(D, "bound_checks") else D
    timed(D, "bound_checks" if hasattr(D, "bound_checks") else "_bound_checks")
    timed(bound, "band_bound_rows")
    for name in ("all_fit_moments", "moment_sums", "scores_of_sums", "_hook_w"):
        timed(D, name)
    for name in ("query_operand", "_w_into", "d3_map", "d3_moments", "streamed_moments"):
        timed(DM, name)
    timed(M.Target, "_finish")  # the whole-map target: its mask and sums
    timed(M, "_fits")  # inside all_fit_moments: the D1/D2 solves
    b = Bench(a.model, a.n_seq, a.seq_len)
    b.kbar()
    b.decomposition()  # warm-up: geometry, allocator
    for label, fn in (("forward", b.forward), ("capture", b.capture)):
        t = time.perf_counter()
        fn()
        print(f"{label:<18}{time.perf_counter() - t:8.2f} s")
    spent.clear()
    t = time.perf_counter()
    b.decomposition()
    print(f"{'decomposition':<18}{time.perf_counter() - t:8.2f} s   of which:")
    for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<16}{v:8.2f} s")


def ab_scores(a: argparse.Namespace, D) -> None:  # noqa: N803 - the module under test
    """Forward, decomposition with W from ``hook_attn_scores`` and with W recomputed, alternating."""
    import statistics

    from suite import Bench

    b = Bench(a.model, a.n_seq, a.seq_len)
    b.kbar()
    b.decomposition()  # warm-up
    real, secs = D.scores_are_w, collections.defaultdict(list)
    try:
        for _ in range(a.ab_scores):
            for label in ("forward", "W from the score hook", "W recomputed"):
                D.scores_are_w = (lambda m: True) if label.endswith("hook") else (lambda m: False)
                t = time.perf_counter()
                b.forward() if label == "forward" else b.decomposition()
                secs[label].append(time.perf_counter() - t)
    finally:
        D.scores_are_w = real
    fwd = statistics.median(secs["forward"])
    for label, v in secs.items():
        med = statistics.median(v)
        print(f"{label:<24}{med:8.2f} s median ({', '.join(f'{x:.2f}' for x in v)}); {med / fwd:.3f}× the forward")


if __name__ == "__main__":
    main()
