"""Benchmark: a patching sweep (docs/method.md §9) as a ratio to a plain forward pass over the same tokens.

    python benchmarks/bench_patching.py [--model smollm2-135m] [--n-seq 4] [--seq-len 128] [--layers 3]
                                        [--out benchmarks/results/results_patching.json] [--device cuda]
                                        [--runs rot_q_stacked,pos_term_stacked] [--repeats 3]

``--model random:smollm2-135m`` times a random-init model of that shape (``random_shapes.py``: a lent GPU, where real
weights do not travel); on ``--device cuda`` the timers are read after the device's queue has drained.

In one process, on the same tokens (1 thread): (1) a plain forward ``model(tokens)``; (2) a per-head map of
``rot_q`` and of ``pos_term`` over ``--layers`` layers with the heads of a layer stacked in the batch
(``replicas`` = heads per layer, fewer where their attention maps would outgrow half the free memory:
:func:`posgen_tl.patching.default_replicas`, recorded) and (3) the same ``rot_q`` map one head per forward (``replicas=1``), each
patched forward resumed at its layer from the base run's residual (:mod:`posgen_tl.hooks.reentry`); and (4) the
stacked ``rot_q`` map again with every block below the patched layer computed (``computing_every_block``, the
cost before re-entry) — the same numbers (checked). Each is reported as seconds and as forward-equivalents (seconds / plain forward); the per-head cost is the map's
forward-equivalents over the number of heads patched. A map of one (quantity, direction) also runs the
clean and the corrupted baselines and one source forward: 3 forward-equivalents of fixed cost.

``--runs`` times only the sweeps named; ``--repeats R`` runs R rounds of (the plain forward, each sweep) and reports
the medians (a host whose speed drifts slows both alike); with one round the forward is the fastest of three.
``--base target_nll``: the unit is the unpatched target NLL as the package computes it (beyond 2 048 tokens a forward
a chunk at a time through the model's cache, as the sweep's own forwards then run) instead of ``model(tokens)`` — at a
length whose whole forward, or its full logits, do not fit in memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


RUNS = ("rot_q_stacked", "rot_q_stacked_every_block_computed", "rot_q_one_head_per_forward", "pos_term_stacked")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3, help="layers patched (the middle ones)")
    ap.add_argument("--out", default="benchmarks/results/results_patching.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", default="all", help="comma-separated sweeps to time (default: all four)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of (plain forward, each sweep); medians over them (1: the forward best of 3)")
    ap.add_argument("--target-len", type=int, default=0,
                    help="tokens whose NLL the metric reads (default: a quarter of the sequence)")
    ap.add_argument("--base", choices=["forward", "target_nll"], default="forward",
                    help="the unit: model(tokens), or the unpatched target NLL (chunked beyond 2 048 tokens)")
    args = ap.parse_args(argv)
    chosen = list(RUNS) if args.runs == "all" else args.runs.split(",")
    if unknown := sorted(set(chosen) - set(RUNS)):
        raise SystemExit(f"unknown --runs {unknown}; known: {list(RUNS)}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: at least 1")
    torch.set_num_threads(args.threads)

    import posgen_tl.patching as P
    from posgen_tl.engine.swaps import nll_on_target
    from posgen_tl.hooks.capture import probe_hooks
    from posgen_tl.hooks.chunked import CHUNK, auto_chunk
    from posgen_tl.hooks.edits import key_means
    from posgen_tl.hooks.reentry import computing_every_block, skips_blocks
    from posgen_tl.io.corpus import CorpusError, corpus_tokens
    from posgen_tl.io.models import load_model
    from posgen_tl.io.sampling import sample_windows

    if args.model.startswith("random:"):
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from random_shapes import build

        model = build(args.model, device=args.device)
    else:
        model = load_model(args.model, device=args.device)
    spec, _ = probe_hooks(model)
    try:  # windows of distinct documents, as the patching experiment samples them
        ana, ref = sample_windows(model, None, n_seq=args.n_seq, seq_len=args.seq_len, n_ref=2)
        tokens, ref_tokens, source = ana.tokens.to(args.device), ref.tokens, "windows of distinct documents"
    except CorpusError:  # no document that long: the corpus's documents one after another, as bench_steps.py takes
        toks = corpus_tokens(model, None, seq_len=args.seq_len, n_seq=args.n_seq + 2).to(args.device)
        tokens, ref_tokens, source = toks[: args.n_seq], toks[args.n_seq :], "the corpus's documents concatenated"
    mid = spec.n_layers // 2
    layers = list(range(mid, mid + args.layers))
    km = key_means(model, ref_tokens, layers) if "pos_term_stacked" in chosen else None  # only what is timed
    target_len = args.target_len or args.seq_len // 4
    metric = P.target_nll(tokens, target_len)
    corr = P.Swaps(0.2)
    with torch.no_grad():
        model(tokens[:, :16])  # warm-up (the plain forward is timed thrice below when one round runs)
    n_heads = spec.n_heads * len(layers)
    from posgen_tl.io.provenance import git_commit

    out = {"commit": git_commit(), "model": spec.model_name, "n_seq": args.n_seq, "seq_len": args.seq_len, "layers": layers,
           "heads_patched": n_heads, "threads": torch.get_num_threads(), "repeats": args.repeats, "tokens": source,
           "replicas": P.default_replicas(model, spec.n_heads, args.n_seq, args.seq_len,
                                          CHUNK if auto_chunk(model, args.seq_len, -1, memory_only=True) else None,
                                          target_len),
           "target_len": target_len,
           "base": args.base,
           "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    maps: dict = {}

    def every_block():
        with computing_every_block(model):
            maps["every_block"] = P.get_act_patch_rot_q(model, corr, tokens, metric, layers=layers, verbose=False)

    def stacked():
        maps["resumed"] = P.get_act_patch_rot_q(model, corr, tokens, metric, layers=layers, verbose=False)

    out["skips_blocks"] = skips_blocks(model)  # the model's forward can resume at a layer (whole forwards only)
    out["chunk"] = auto_chunk(model, args.seq_len, -1, memory_only=True)  # > 0: every forward a chunk at a time
    runs = {
        "rot_q_stacked": stacked,
        "rot_q_stacked_every_block_computed": every_block,
        "rot_q_one_head_per_forward": lambda: P.get_act_patch_rot_q(model, corr, tokens, metric, layers=layers,
                                                                    verbose=False, replicas=1),
        "pos_term_stacked": lambda: P.get_act_patch_pos_term(model, corr, tokens, metric, layers=layers,
                                                             k_means=km, verbose=False),
    }
    assert tuple(runs) == RUNS

    def plain_forward():
        if args.base == "target_nll":
            nll_on_target(model, tokens, target_len=target_len, batch_size=args.n_seq)
            return
        with torch.no_grad():
            model(tokens)

    secs: dict[str, list[float]] = {k: [] for k in ["plain", *chosen]}
    for r in range(args.repeats):  # each round: the plain forward, then each sweep (a drifting host hits both)
        secs["plain"].append(timed(plain_forward, repeat=3 if args.repeats == 1 else 1))
        for name in chosen:
            secs[name].append(timed(runs[name]))
            print(f"round {r + 1}: {name} {secs[name][-1]:.1f} s (plain forward {secs['plain'][-1]:.1f} s)", flush=True)
    plain = statistics.median(secs["plain"])
    out["plain_forward_s"], out["plain_forward_rounds_s"] = plain, secs["plain"]
    for name in chosen:
        s = statistics.median(secs[name])
        out[name] = {"seconds": s, "rounds_s": secs[name], "forward_equivalents": s / plain,
                     "per_head_forward_equivalents": s / plain / n_heads}
        print(f"{name}: {s:.1f} s = {s / plain:.1f} plain forwards ({s / plain / n_heads:.2f} per head)", flush=True)
    if "resumed" in maps and "every_block" in maps:
        diff = float((maps["resumed"] - maps["every_block"]).abs().nan_to_num().max())
        out["max_abs_difference_resumed_vs_every_block"] = diff
        print(f"resumed vs every block computed: max |Δ metric| = {diff:.2e}", flush=True)
        if diff > 1e-4:
            raise SystemExit("the resumed sweep differs from the one computing every block")
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
