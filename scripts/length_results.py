"""Thin wrapper: the README's longer-texts (METHOD §7) and sufficiency (§5) runs as ``posgen-tl study``.

    python scripts/length_results.py gap --model smollm2-135m --n-seq 32 --prefix-len 128 --suffix-len 128
    python scripts/length_results.py attention --model smollm2-135m --n-seq 32 --classes results/heads_smollm2-135m.csv
    python scripts/length_results.py window --model gemma3-270m --n-seq 16 --seq-len 2048
    python scripts/length_results.py sufficiency --model smollm2-135m --n-seq 32 --seq-len 256 --tolerance d3:all
    python scripts/length_results.py ... --print          # only print the posgen-tl command

Each run is exactly one ``posgen-tl study length|gap_attention|sufficiency --param …`` command
(printed first) writing into ``--out/<what>_<model>[_<tag>]``; ``python scripts/length_readme.py
--dir OUT`` turns the folders into README tables.
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
    ap.add_argument("what", choices=["gap", "attention", "window", "sufficiency"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=32)
    ap.add_argument("--n-ref", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=256)
    ap.add_argument("--skip", type=int, default=16)
    ap.add_argument("--gaps", default="0,0.25,0.5,1,2")
    ap.add_argument("--gap", type=float, default=2.0, help="attention: gap in units of n_ctx")
    ap.add_argument("--classes", default=None, help="attention: per-head §6 taxonomy table (default: D3 proxy)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--bucket", type=int, default=256)
    ap.add_argument("--max-per-doc", type=int, default=None)
    ap.add_argument("--target-len", type=int, default=64)
    ap.add_argument("--delta0", type=int, default=0)
    ap.add_argument("--gamma", type=float, default=0.9)
    ap.add_argument("--tolerance", default="", help="sufficiency: 'source:group,...' pairs with a slope")
    ap.add_argument("--fracs", default="0,0.05,0.1,0.2")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="results/length")
    ap.add_argument("--print", action="store_true", help="print the posgen-tl command and stop")
    return ap


def study_argv(a: argparse.Namespace) -> list[str]:
    """The ``posgen-tl`` arguments of this run."""
    out = Path(a.out) / (f"{a.what}_{a.model}" + (f"_{a.tag}" if a.tag else ""))
    n_seq, seq_len = a.n_seq, a.prefix_len + a.suffix_len
    if a.what == "gap":
        study = "length"
        params = dict(window="false", gaps=a.gaps, prefix_len=a.prefix_len, suffix_len=a.suffix_len, skip=a.skip,
                      n_ref=a.n_ref, delta0=a.delta0, batch_size=a.batch_size)
    elif a.what == "window":
        study, seq_len = "length", a.seq_len
        params = dict(gap="false", window_seq_len=a.seq_len, window_n_seq=a.n_seq, bucket=a.bucket, n_ref=a.n_ref,
                      delta0=a.delta0, max_per_doc=a.max_per_doc)
    elif a.what == "sufficiency":
        study, seq_len = "sufficiency", a.seq_len
        params = dict(target_len=a.target_len, n_ref=a.n_ref, gamma=a.gamma, delta0=a.delta0, fracs=a.fracs,
                      batch_size=a.batch_size, tolerance=a.tolerance or None)
    else:
        study = "gap_attention"
        params = dict(gap=a.gap, prefix_len=a.prefix_len, suffix_len=a.suffix_len, skip=a.skip, n_ref=a.n_ref,
                      classes=a.classes)
    return study_command(study, dict(model=a.model, n_seq=n_seq, seq_len=seq_len, out=out), params)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    return print_and_run(study_argv(a), a.print)


if __name__ == "__main__":
    sys.exit(main())
