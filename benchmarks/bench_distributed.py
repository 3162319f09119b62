"""Speedup of 2 ranks × 1 thread (torchrun, gloo) over 1 process × 2 threads, same work.

    python benchmarks/bench_distributed.py [--n-seq 8] [--seq-len 256] [--repeats 3] [--model smollm2-135m]

Both run ``posgen_tl.distributed`` (decomposition, feature pattern and tolerance rows over the
same ``--n-seq`` windows of many documents, all layers): once as ``torchrun --nproc_per_node 2``
with ``OMP_NUM_THREADS=1`` per rank, once as one ``python -m posgen_tl.distributed`` with 2
torch threads. The figure per run is the sum of the stage times in ``run.json`` (model loading
and interpreter start excluded, identical for both); the runs alternate, and min and median over
``--repeats`` are reported (a shared machine makes single runs noisy). It also checks that the
2-rank tables equal the 1-process tables. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(kind: str, args: argparse.Namespace, out: Path) -> float:
    common = ["--model", args.model, "--n-seq", str(args.n_seq), "--seq-len", str(args.seq_len),
              "--n-ref", str(args.n_ref), "--target-len", str(args.target_len), "--batch-size", str(args.batch_size),
              "--out", str(out)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if kind.startswith("2x"):
        env.update(OMP_NUM_THREADS="1", POSGEN_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "posgen_tl.distributed", *common]
    else:
        threads = kind.split("x")[1]
        env.update(OMP_NUM_THREADS=threads, POSGEN_THREADS=threads)
        cmd = [sys.executable, "-m", "posgen_tl.distributed", *common]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{p.stderr[-2000:]}")
    meta = json.loads((out / "run.json").read_text())
    return float(sum(meta["stage_seconds"].values()))


def _same(a: Path, b: Path) -> dict:
    import pandas as pd

    out = {}
    for name in ("decomposition.csv", "pattern_bands.csv", "pattern_heads.csv", "tolerance_rows.csv"):
        x, y = pd.read_csv(a / name), pd.read_csv(b / name)
        num = [c for c in x.columns if pd.api.types.is_float_dtype(x[c])]
        diff = (x[num] - y[num]).abs().max().max() if len(x) == len(y) else float("inf")
        out[name] = float(diff)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--n-ref", type=int, default=4)
    ap.add_argument("--target-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default="2x1,1x2", help="ranks x threads; 1x1 adds the single-thread reference")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",")]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {k: Path(tmp) / k for k in times}
        for r in range(args.repeats):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                loads.append(os.getloadavg()[0])
                t = _run(kind, args, dirs[kind])
                times[kind].append(t)
                print(f"[{time.strftime('%H:%M:%S')}] {kind}: {t:.1f} s", file=sys.stderr, flush=True)
        diffs = _same(dirs["2x1"], dirs["1x2"]) if {"2x1", "1x2"} <= set(kinds) else {}
    res = {
        "model": args.model, "tokens": [args.n_seq, args.seq_len], "repeats": args.repeats,
        "seconds": times, "min": {k: min(v) for k, v in times.items()},
        "median": {k: statistics.median(v) for k, v in times.items()},
        "speedup_min": min(times["1x2"]) / min(times["2x1"]) if {"2x1", "1x2"} <= set(kinds) else None,
        "speedup_median": (statistics.median(times["1x2"]) / statistics.median(times["2x1"])
                           if {"2x1", "1x2"} <= set(kinds) else None),
        "max_abs_table_diff_2ranks_vs_1process": diffs, "load_avg_1min_during": loads, "cpus": os.cpu_count(),
    }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
