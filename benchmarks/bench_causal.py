"""Benchmark: the causal dose–response passes of one batch (docs/method.md §5, §8) with residual re-entry against
the same passes with every block computed, as ratios to a plain forward pass over the same tokens.

    python benchmarks/bench_causal.py [--model smollm2-135m] [--n-seq 4] [--seq-len 128] [--entries 10-19,20-29]
                                      [--threads 1] [--stacked-repeats 0] [--out benchmarks/results/results_causal.json]

In one process, on the same windows (1 thread): (1) a plain forward; (2) :func:`posgen_tl.engine.dose.dose_rows` of
destroy and control C2 of each entry at a 3-point strength grid and swap fractions (0, 0.1, 0.2) — every edited
pass resumed at its condition's first edited layer from the unedited pass of the same swaps
(:mod:`posgen_tl.hooks.reentry`); (3) the same rows with every block computed
(:func:`posgen_tl.hooks.reentry.computing_every_block`, the cost before re-entry). Both are reported in seconds
and as forward-equivalents; the rows must agree (max |Δ NLL| is recorded, the run fails above 1e-4).

``--stacked-repeats R`` (R > 0) adds (4): the resumed rows with the (condition, α) passes of the same first edited
layer side by side in one forward's batch (``dose_rows(stack=0)``, the default) against one pass per forward
(``stack=1``), R rounds alternating the two, each round's ratio of the two recorded (and the median), with a plain
forward before each round; the rows must agree as above.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--entries", default="10-19,20-29", help="layer ranges edited, one entry each")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the run of the committed file)")
    ap.add_argument("--stacked-repeats", type=int, default=0,
                    help="rounds of stacked passes against one pass per forward (0: not measured)")
    ap.add_argument("--out", default="benchmarks/results/results_causal.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from posgen_tl.engine.conditions import build_conditions, entry_bands
    from posgen_tl.engine.dose import dose_rows
    from posgen_tl.hooks.capture import probe_hooks
    from posgen_tl.hooks.edits import key_means
    from posgen_tl.hooks.reentry import computing_every_block, skips_blocks
    from posgen_tl.io.models import load_model
    from posgen_tl.io.provenance import git_commit
    from posgen_tl.io.sampling import sample_windows

    model = load_model(args.model)
    spec, _ = probe_hooks(model)
    ana, ref = sample_windows(model, None, n_seq=args.n_seq, seq_len=args.seq_len, n_ref=2)
    target = args.seq_len // 4
    conds, strengths = [], {}
    for e in args.entries.split(","):
        lo, hi = (int(x) for x in e.split("-"))
        lay = list(range(lo, hi + 1))
        _, fast, slow = entry_bands(spec, lay, None, None)
        for c in build_conditions(lay, fast, slow, alpha=1.0, controls=("C2",), seed=0, group=f"L{e}"):
            conds.append(c)
            strengths[(c.group, c.key)] = (0.0, 0.5, 1.0, 2.0)
    km = key_means(model, ref.tokens[:, : args.seq_len - target], sorted({x for c in conds for x in c.intervention.layers}))

    def rows(stack: int = 1):
        return dose_rows(model, ana, conds, strengths, k_means=km, target_len=target, fracs=(0.0, 0.1, 0.2), seeds=(0,),
                         batch_size=args.n_seq, progress=False, stack=stack)

    with torch.no_grad():
        model(ana.tokens)  # warm-up
        t = time.perf_counter()
        model(ana.tokens)
        plain = time.perf_counter() - t
    skips = skips_blocks(model)
    t = time.perf_counter()
    fast = rows()
    resumed = time.perf_counter() - t
    with computing_every_block(model):
        t = time.perf_counter()
        slow = rows()
        every = time.perf_counter() - t
    diff = nll_difference(fast, slow)
    n_passes = 1 + 2 + sum((len(v) - 1) * 3 for v in strengths.values())  # unedited clean + swaps; per α: clean + swaps
    from bench_steps import host  # the CPU's model and extensions, as the other result files record them

    out = {"commit": git_commit(), "host": host(), "model": spec.model_name, "n_seq": args.n_seq, "seq_len": args.seq_len,
           "entries": args.entries, "threads": torch.get_num_threads(), "skips_blocks": skips,
           "plain_forward_s": plain, "passes": n_passes,
           "resumed": {"seconds": resumed, "forward_equivalents": resumed / plain},
           "every_block_computed": {"seconds": every, "forward_equivalents": every / plain},
           "speed_up": every / resumed, "max_abs_difference_nll": diff}
    print(f"{n_passes} passes: resumed {resumed:.1f} s = {resumed / plain:.1f} forwards; every block computed "
          f"{every:.1f} s = {every / plain:.1f} forwards; speed-up {every / resumed:.2f}×; max |Δ NLL| {diff:.2e}",
          flush=True)
    if not diff <= 1e-4:  # NaN fails too
        raise SystemExit("the resumed rows differ from the ones computing every block")
    if args.stacked_repeats > 0:
        out["stacked"] = stacked_rounds(model, ana, rows, fast, args.stacked_repeats)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


def nll_difference(a, b) -> float:
    """The largest |Δ NLL| between two dose-row tables of the same rows — NaN where either holds a NaN or they hold
    different rows (so that no comparison passes without having compared every row)."""
    keys = ["seq", "layers", "condition", "alpha", "frac", "seed"]
    if len(a) != len(b) or not a[keys].reset_index(drop=True).equals(b[keys].reset_index(drop=True)):
        return float("nan")
    return float(np.abs(a["nll"].to_numpy() - b["nll"].to_numpy()).max()) if len(a) else float("nan")


def stacked_rounds(model, ana, rows, one, repeats: int) -> dict:
    """``repeats`` rounds of: a plain forward, the rows one pass per forward (``rows(1)``), the rows stacked
    (``rows(0)``), in this order or the reverse (alternating); the seconds of each, each round's ratio stacked / one,
    their median, and the largest |Δ NLL| of the stacked rows from ``one``."""
    import statistics

    from posgen_tl.engine.dose import stack_size

    fwd, single, stacked, diffs = [], [], [], []
    for r in range(repeats):
        with torch.no_grad():
            t = time.perf_counter()
            model(ana.tokens)
            fwd.append(time.perf_counter() - t)
        for stack in ((1, 0) if r % 2 == 0 else (0, 1)):
            t = time.perf_counter()
            got = rows(stack)
            (single if stack == 1 else stacked).append(time.perf_counter() - t)
            diffs.append(nll_difference(got, one))
    diff = float(np.max(diffs))  # NaN if any round's is
    ratios = [s / o for s, o in zip(stacked, single)]
    edited = int(len(one.loc[one["alpha"] > 0, ["layers", "condition", "alpha"]].drop_duplicates()))
    res = {"repeats": repeats, "forward_s": fwd, "one_pass_per_forward_s": single, "stacked_s": stacked,
           "ratios_stacked_over_one": ratios, "ratio_median": statistics.median(ratios),
           "stack_size_cpu": stack_size(model, ana.tokens.shape[1], len(ana), ana.tokens.shape[1] // 4, 1000),
           "edited_passes": edited, "max_abs_difference_nll": diff}
    print(f"stacked / one pass per forward: {[round(x, 3) for x in ratios]} (median {res['ratio_median']:.3f}); "
          f"one {statistics.median(single):.2f} s, stacked {statistics.median(stacked):.2f} s, forward "
          f"{statistics.median(fwd):.2f} s; max |Δ NLL| {diff:.2e}", flush=True)
    if not diff <= 1e-4:  # NaN fails too
        raise SystemExit("the stacked rows differ from one pass per forward")
    return res


if __name__ == "__main__":
    main()
