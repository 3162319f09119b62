"""Thin wrapper: the README's METHOD §6 head-taxonomy runs as ``posgen-tl study heads``.

    python scripts/heads_results.py --model smollm2-135m --n-prompts 32 --seq-len 256 --out results/heads_n32
    python scripts/heads_results.py ... --print          # only print the posgen-tl command

Each run is exactly one ``posgen-tl study heads --model M --seq-len L --seed S --out OUT/heads_<model>[_tag]
--param n_prompts=… --param …`` command (printed first): the report's taxonomy stage
(:func:`posgen_tl.experiments.taxonomy.head_taxonomy_with_twin`, trained model and its random twin on the
same windows of distinct documents, the same region permutations and the same global k̄ from disjoint
documents). The folder gets ``heads.csv`` (one row per head), ``heads_bands.csv`` (per head and band),
``heads_link.csv``, ``heads_band_counts.csv``, the four figures and ``heads.md`` (command, commit, wall
time, every table of the section, including labels by layer third and the Spearman agreement).
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
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--n-ref", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--region-len", type=int, default=64)
    ap.add_argument("--n-query", type=int, default=64)
    ap.add_argument("--n-perm", type=int, default=8)
    ap.add_argument("--block", type=int, default=1)
    ap.add_argument("--min-score", type=float, default=0.2)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--layers", default=None, help="e.g. 0,5,10-12 (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="random twin, document split and permutation seed")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="results/heads")
    ap.add_argument("--print", action="store_true", help="print the posgen-tl command and stop")
    return ap


def study_argv(a: argparse.Namespace) -> list[str]:
    """The ``posgen-tl`` arguments of this run."""
    out = Path(a.out) / (f"heads_{a.model}" + (f"_{a.tag}" if a.tag else ""))
    params = dict(n_prompts=a.n_prompts, n_ref=a.n_ref, region_len=a.region_len, n_query=a.n_query, n_perm=a.n_perm,
                  block=a.block, min_score=a.min_score, batch_size=a.batch_size, layers=a.layers)
    return study_command("heads", dict(model=a.model, seq_len=a.seq_len, seed=a.seed, out=out), params)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    return print_and_run(study_argv(a), a.print)


if __name__ == "__main__":
    sys.exit(main())
