"""Thin wrapper: the README's estimator runs (METHOD §2–§3) as ``posgen-tl study pattern``.

    python scripts/estimators_results.py --model smollm2-135m --n-seq 32 --seq-len 256 --n-ref 8 --out results/est
    python scripts/estimators_results.py ... --print          # only print the posgen-tl command
    python scripts/estimators_tables.py results/est/pattern_smollm2-135m   # the README tables

One run is exactly one ``posgen-tl study pattern --model M --n-seq N --seq-len L --seed S --out
OUT/pattern_<model>[_tag] --param n_ref=… --param …`` command (printed first). The pattern study needs
the decomposition, so it runs the report's decomposition stage first and then its pattern stage, on
the same windows (:func:`posgen_tl.io.corpus.reference_windows`: the pydoc-topic DOCUMENTS split, seeded,
into ``--n-ref`` reference windows — the global k̄ — and ``--n-seq`` analysed windows, one per
document first), trained beside its random twin (seed ``--seed``). The folder gets
``decomposition.csv`` (per layer/head/sequence/estimator/k̄ rows), ``pattern_bands.csv``,
``pattern_heads.csv``, ``pattern_vs_d3*.csv``, ``windows.json`` (the documents) and
``decomposition.md`` / ``pattern.md`` (command, commit, wall time, tables).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _study_cmd import print_and_run, study_command  # noqa: E402

torch.set_num_threads(int(os.environ.get("POSGEN_THREADS", "1")))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--n-ref", type=int, default=8)
    ap.add_argument("--layers", default=None, help="e.g. 0,5,10-12 (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="random-twin and document-split seed")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--bound-rows", type=int, default=32)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="results/est")
    ap.add_argument("--print", action="store_true", help="print the posgen-tl command and stop")
    return ap


def study_argv(a: argparse.Namespace) -> list[str]:
    """The ``posgen-tl`` arguments of this run."""
    out = Path(a.out) / (f"pattern_{a.model}" + (f"_{a.tag}" if a.tag else ""))
    params = dict(n_ref=a.n_ref, layers=a.layers, batch_size=a.batch_size, bound_rows=a.bound_rows)
    return study_command("pattern", dict(model=a.model, n_seq=a.n_seq, seq_len=a.seq_len, seed=a.seed, out=out), params)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    return print_and_run(study_argv(a), a.print)


if __name__ == "__main__":
    sys.exit(main())
