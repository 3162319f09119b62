"""Thin CLI around the causal recipe (METHOD §4, §5, §8): writes CSVs + markdown under --out.

    python scripts/causal_study.py --model smollm2-135m --n-seq 64 --layers 10-19 --tag smollm2_L10-19 --out results/
    python scripts/causal_study.py --model smollm2-135m --n-seq 64 --t12-only --tag smollm2 --out results/
    python scripts/causal_study.py --queue jobs.txt      # one study per line (its arguments), one process

The recipe is :func:`posgen_tl.analysis.causal.causal_study` / :func:`t1_t2_study`; this file only
parses arguments and writes outputs (partial outputs, ``<tag>_partial*``, as soon as the primary
phase is done).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

torch.set_num_threads(int(os.environ.get("POSGEN_THREADS", "1")))

from posgen_tl.analysis import causal as ca  # noqa: E402
from posgen_tl.models import load_model  # noqa: E402


def ints(s: str) -> list[int]:
    out: list[int] = []
    for part in s.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


_MODELS: dict = {}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--target-len", type=int, default=64)
    ap.add_argument("--fracs", default="0,0.02,0.05,0.1,0.2")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--layers", type=ints, default=None, help="e.g. 10-19")
    ap.add_argument("--fast", type=ints, default=None, help="fast bands, e.g. 0-7 (default first quarter)")
    ap.add_argument("--slow", type=ints, default=None)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--controls", default="C1,C2,C3,C4")
    ap.add_argument("--match-subset", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--t12", action="store_true", help="also run the T1/T2 study (trained + random twin)")
    ap.add_argument("--t12-only", action="store_true")
    ap.add_argument("--twin-seeds", default=None, help="swap seeds for the twin (default: --seeds)")
    ap.add_argument("--costs", action="store_true", help="measure seconds per forward (full vs from L0)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default="results/")
    ap.add_argument("--queue", default=None, help="file with one study's arguments per line, run in order")
    return ap


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    if a.queue:
        jobs = [ln.split() for ln in Path(a.queue).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        for job in jobs:
            print(f"[study] queue: {' '.join(job)}", flush=True)
            run(parser().parse_args(job))
        return
    run(a)


def run(a: argparse.Namespace) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = a.tag or a.model
    fracs = tuple(float(x) for x in a.fracs.split(","))
    seeds = tuple(int(x) for x in a.seeds.split(","))
    t0 = time.time()
    if a.model not in _MODELS:
        _MODELS.clear()  # one model in memory at a time
        _MODELS[a.model] = load_model(a.model)
    model = _MODELS[a.model]
    print(f"[study] {tag}: {a.model} ready in {time.time() - t0:.0f}s", flush=True)
    if a.costs:
        ana, _ = ca.study_windows(model, None, n_seq=8, seq_len=a.seq_len, n_ref=2)
        layer = (a.layers or [10])[0]
        c = ca.forward_costs(model, ana.tokens, layer, target_len=a.target_len)
        (out / f"{tag}_forward_costs.json").write_text(json.dumps(c, indent=1))
        print("[study] forward costs", c, flush=True)
    if a.t12 or a.t12_only:
        ts = tuple(int(x) for x in a.twin_seeds.split(",")) if a.twin_seeds else None
        r = ca.t1_t2_study(model, None, n_seq=a.n_seq, seq_len=a.seq_len, target_len=a.target_len, fracs=fracs,
                           seeds=seeds, twin_seeds=ts, batch_size=a.batch_size)
        ca.write_t12_outputs(r, out, f"t12_{tag}")
        print(ca.t12_markdown(r), flush=True)
    if a.t12_only:
        return

    def partial(res: ca.CausalResult) -> None:
        res.config["command"] = command
        ca.write_causal_outputs(res, out, f"causal_{tag}_partial")
        c = res.contrasts
        prim = c[c["primary"].astype(bool)] if len(c) else c
        print(f"[study] {time.strftime('%H:%M:%S')} partial {res.config['n_seq_done']} running "
              f"{res.config['conditions_running']}: " + ("; ".join(f"{r.contrast} n={r.n_seq} d={r.mean_diff:.3g} "
              f"p={r.p_exact:.3g}" for r in c.itertuples()) if len(c) else "no contrast yet"), flush=True)

    command = "python scripts/causal_study.py " + " ".join(_argv(a))
    res = ca.causal_study(model, None, n_seq=a.n_seq, seq_len=a.seq_len, target_len=a.target_len, fracs=fracs,
                          seeds=seeds, layers=a.layers, fast=a.fast, slow=a.slow, alpha=a.alpha,
                          controls=tuple(a.controls.split(",")), match_subset=a.match_subset,
                          batch_size=a.batch_size, on_partial=partial)
    res.config["command"] = command
    p = ca.write_causal_outputs(res, out, f"causal_{tag}")
    print(p["md"].read_text(), flush=True)
    print(f"[study] total {time.time() - t0:.0f}s", flush=True)


def _argv(a: argparse.Namespace) -> list[str]:
    """The arguments that reproduce this one study (for the record in its outputs)."""
    out = []
    for k, v in vars(a).items():
        if k == "queue" or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif isinstance(v, list):
            out += [flag, ",".join(map(str, v))]
        else:
            out += [flag, str(v)]
    return out


if __name__ == "__main__":
    main()
