"""Thin wrapper: the README's causal/T1-T2 runs as ``posgen-tl study tolerance`` command lines.

    python scripts/causal_study.py --model smollm2-135m --n-seq 64 --layers 10-19 --tag smollm2_L10-19 --out results/causal
    python scripts/causal_study.py --model smollm2-135m --n-seq 64 --t12-only --tag smollm2 --out results/causal
    python scripts/causal_study.py --queue jobs.txt      # one study per line (its arguments), one process
    python scripts/causal_study.py ... --print            # only print the posgen-tl command

Each run is exactly ``posgen-tl study tolerance --model M --n-seq N --out OUT/TAG --param …`` (the
recipe :func:`posgen_tl.experiments.causal.causal_study` / :func:`t1_t2_study`, the report's
tolerance stage); this file only translates the README's sizes into study parameters (printed
first, so the command can be copied) and runs the studies of a queue in one process (the model
is loaded once). Partial tables (``causal_partial_*``) appear in ``OUT/TAG`` while the causal
phase runs. ``python scripts/causal_readme.py --dir OUT`` turns the folders into README tables.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _study_cmd import print_and_run, study_command  # noqa: E402

torch.set_num_threads(int(os.environ.get("POSGEN_THREADS", "1")))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--target-len", type=int, default=64)
    ap.add_argument("--fracs", default="0,0.02,0.05,0.1,0.2")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--layers", default=None, help="edited layers, e.g. 10-19 (default: the middle third)")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--controls", default="C1,C2,C3,C4")
    ap.add_argument("--n-ref", type=int, default=8)
    ap.add_argument("--match-subset", type=int, default=16)
    ap.add_argument("--match-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--t12", action="store_true", help="also run the T1/T2 study (trained + random twin)")
    ap.add_argument("--t12-only", action="store_true")
    ap.add_argument("--twin-seeds", default=None, help="swap seeds for the twin (default: --seeds)")
    ap.add_argument("--tag", default=None, help="sub-folder of --out (default: the model name)")
    ap.add_argument("--out", default="results/causal")
    ap.add_argument("--queue", default=None, help="file with one study's arguments per line, run in order")
    ap.add_argument("--print", action="store_true", help="print the posgen-tl command(s) and stop")
    return ap


def study_argv(a: argparse.Namespace) -> list[str]:
    """The ``posgen-tl`` arguments of one run (``study tolerance …``)."""
    params = {"target_len": a.target_len, "fracs": a.fracs, "seeds": a.seeds, "alpha": a.alpha, "controls": a.controls,
              "n_ref": a.n_ref, "match_subset": a.match_subset, "match_steps": a.match_steps, "batch_size": a.batch_size,
              "t12": str(bool(a.t12 or a.t12_only)).lower(), "causal": str(not a.t12_only).lower(),
              "twin_seeds": a.twin_seeds or a.seeds}
    if a.layers:
        params["layers"] = a.layers
    out = Path(a.out) / (a.tag or a.model)
    return study_command("tolerance", dict(model=a.model, n_seq=a.n_seq, seq_len=a.seq_len, out=out), params)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    jobs = ([parser().parse_args(shlex.split(ln)) for ln in Path(a.queue).read_text().splitlines()
             if ln.strip() and not ln.startswith("#")] if a.queue else [a])
    cmds = [study_argv(j) for j in jobs]
    if len(cmds) == 1:
        return print_and_run(cmds[0], a.print)
    for c in cmds:
        print("posgen-tl " + shlex.join(c), flush=True)
    if a.print:
        return 0
    # a queue: one process, the model loaded once per model name
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    from posgen_tl.io.models import load_model  # noqa: PLC0415
    from posgen_tl.report.context import ReportConfig  # noqa: PLC0415
    from posgen_tl.report.params import parse_param_args  # noqa: PLC0415
    from posgen_tl.studies import run_study  # noqa: PLC0415

    model, name = None, None
    for j, c in zip(jobs, cmds):
        if j.model != name:
            model, name = None, j.model
            model = load_model(j.model, verbose=True)
        params = parse_param_args([c[i + 1] for i, x in enumerate(c) if x == "--param"])
        cfg = ReportConfig(model=j.model, seq_len=j.seq_len, n_seq=j.n_seq, out=c[c.index("--out") + 1], params=params)
        run_study("tolerance", cfg, model=model, command="posgen-tl " + shlex.join(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
