"""One report stage under two versions of the package, alternating in fresh processes: the seconds of each run and
whether the two versions' tables are the same.

    python benchmarks/bench_stage_ab.py --base <commit> --stages sufficiency,taxonomy --rounds 3 [--out FILE]

The base version is checked out into a temporary git worktree and imported from there (``PYTHONPATH``); the other is
this checkout. Each run is a fresh process that loads SmolLM2, runs the stage's ``run(model, Config(twin=False))``
once with ``--threads`` threads and prints its seconds and a hash of its tables written as CSV (equal hashes: the same
numbers to the CSV's digits). The rounds alternate which version runs first, so a host whose speed drifts moves both
alike. Prints every run and, per stage, the median seconds of each version and the ratio of the medians; ``--out``
writes them as JSON with the host (:func:`bench_steps.host`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import hashlib, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from posgen_tl.io.models import load_model
from posgen_tl.experiments import registry
name = sys.argv[1]
model = load_model("smollm2-135m")
mod = registry.experiment(name)
fields = mod.Config.__dataclass_fields__
cfg = mod.Config(twin=False) if "twin" in fields else mod.Config()
t = time.perf_counter()
res = mod.run(model, cfg, progress=False)
dt = time.perf_counter() - t
digest = hashlib.sha1(b"".join(res.tables[k].to_csv(index=False).encode() for k in sorted(res.tables))).hexdigest()
print("RESULT", f"{dt:.3f}", digest, flush=True)
"""


def run_once(src: Path, stage: str, threads: int) -> tuple[float, str]:
    """Seconds and table hash of one run of ``stage`` with the package imported from ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", CHILD, stage, str(threads)], env=env, capture_output=True, text=True,
                         check=True, cwd=tempfile.gettempdir())
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
    _, seconds, digest = line.split()
    return float(seconds), digest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--stages", default="sufficiency,taxonomy")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from bench_steps import host

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "posgen_tl"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_dir), a.base], cwd=ROOT, check=True)
        try:
            versions = {"base": base_dir, "new": ROOT}
            runs: dict[str, dict[str, list]] = {s: {"base": [], "new": [], "hash_base": [], "hash_new": []}
                                                for s in a.stages.split(",")}
            for r in range(a.rounds):
                order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
                for stage in runs:
                    for v in order:
                        sec, digest = run_once(versions[v], stage, a.threads)
                        runs[stage][v].append(sec)
                        runs[stage][f"hash_{v}"].append(digest)
                        print(f"round {r + 1} {stage:12s} {v:4s} {sec:7.2f} s  tables {digest[:12]}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_dir)], cwd=ROOT, check=False)
    summary = {}
    for stage, d in runs.items():
        mb, mn = statistics.median(d["base"]), statistics.median(d["new"])
        same = len(set(d["hash_base"] + d["hash_new"])) == 1
        summary[stage] = {"median_base_s": mb, "median_new_s": mn, "ratio": mn / mb, "same_tables": same}
        print(f"{stage:12s} base {mb:7.2f} s  new {mn:7.2f} s  new/base {mn / mb:.3f}  same tables: {same}")
    if a.out:
        a.out.write_text(json.dumps({"what": "one stage, two package versions, alternating fresh processes",
                                     "command": " ".join(sys.argv), "base": a.base,
                                     "new": head + ("+modified" if dirty else ""), "threads": a.threads,
                                     "host": host(), "runs": runs, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
