"""The default report's wall time, as a user gets it: ``posgen-tl report --model smollm2-135m --out DIR`` in a fresh
process (the README's first command after set-up), then the plain forward of 8 × 512 tokens in another fresh process,
so that a reader can tell a slow host from a slow report.

    python benchmarks/bench_report.py [--model smollm2-135m] [--runs 1] [--repeats 3] [--out benchmarks/results/report_<commit>.json]

Writes the wall time of the whole command (model load included), its peak resident memory and minor page faults, the
stage times the report printed into its results.json, and the forward's seconds (median of ``--repeats``). With
``--runs N`` the report and the forward's timing alternate N times (each in fresh processes): every run is kept under
``runs`` and the top-level ``wall_s`` / ``forward_8x512_s`` are the medians over the runs (``peak_rss_mib`` is the
largest child process's so far — a run's own peak cannot be read apart from the runs before it —, ``minor_faults`` the
last run's). Run it on an idle machine:
the report's target (≤ 5 minutes on an idle 2-core machine) is read from it by benchmarks/targets.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FORWARD = """
import sys, time, statistics, torch
sys.path.insert(0, {bench!r})
from suite_steps import Bench  # torch's default threads, as the report runs
b = Bench({model!r}, 8, 512)
b.forward()
s = []
for _ in range({repeats}):
    t = time.perf_counter(); b.forward(); s.append(time.perf_counter() - t)
print(torch.get_num_threads(), ",".join(f"{{x:.4f}}" for x in s))
"""


def cli_path(which: str | None = None, python: str = sys.executable) -> str | None:
    """The ``posgen-tl`` command to time: the one on PATH (``which``: what ``shutil.which`` found, for tests), else the
    one beside ``python`` (a virtualenv's ``bin/``, run as ``.venv/bin/python`` without activating it), else None."""
    found = shutil.which("posgen-tl") if which is None else which
    if found:
        return found
    beside = Path(python).parent / "posgen-tl"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def one_run(model: str, repeats: int) -> dict:
    """One report in a fresh process, then the forward of 8 × 512 tokens timed ``repeats`` times in another."""
    work = Path(tempfile.mkdtemp(prefix="posgen_report_bench_"))
    load_start = os.getloadavg()
    try:
        cli = cli_path() or sys.exit("posgen-tl is neither on PATH nor beside this Python: install the package first")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run([cli, "report", "--model", model, "--out", str(work / "report")], check=True)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = json.loads((work / "report" / "results.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    code = FORWARD.format(bench=str(ROOT / "benchmarks"), model=model, repeats=repeats)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"the forward's timing failed:\n{proc.stderr[-4000:]}")
    threads, secs = proc.stdout.strip().splitlines()[-1].split()
    fwd = [float(x) for x in secs.split(",")]
    # ru_maxrss of the children is the largest child so far: the report, whose peak exceeds the forward's process
    return {"wall_s": wall, "report_total_s": res.get("total_seconds"), "stage_seconds": res.get("stage_seconds"),
            "peak_rss_mib": after.ru_maxrss / 1024, "minor_faults": after.ru_minflt - before.ru_minflt,
            "forward_threads": int(threads), "forward_8x512_s": statistics.median(fwd), "forward_8x512_seconds": fwd,
            "load_avg_start": load_start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=1, help="reports run, each followed by the forward's timing")
    ap.add_argument("--repeats", type=int, default=3, help="forwards of 8 × 512 tokens timed after each report")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.runs < 1 or a.repeats < 1:
        sys.exit(f"--runs {a.runs} / --repeats {a.repeats}: each must be at least 1")
    from posgen_tl.io.provenance import git_commit

    commit, started = git_commit(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_steps import host  # the CPU's model and extensions, as the ratio files record them

    h = host()
    machine = {"cpus": os.cpu_count(), "cpu": h["cpu"], "isa": h["isa"], "platform": platform.platform(),
               "load_avg_start": os.getloadavg()}
    runs = []
    for i in range(a.runs):
        runs.append(one_run(a.model, a.repeats))
        print(f"run {i + 1}/{a.runs}: {runs[-1]['wall_s']:.1f} s, forward {runs[-1]['forward_8x512_s']:.2f} s", flush=True)
    last = runs[-1]
    rec = {"what": "the default report, wall time", "command": f"posgen-tl report --model {a.model} --out DIR",
           "commit": commit, "started": started, "machine": {**machine, "load_avg_end": os.getloadavg()},
           "forward_threads": last["forward_threads"],
           "wall_s": statistics.median(r["wall_s"] for r in runs),
           "report_total_s": statistics.median(r["report_total_s"] for r in runs),
           "stage_seconds": {k: statistics.median(r["stage_seconds"][k] for r in runs) for k in last["stage_seconds"]},
           "peak_rss_mib": max(r["peak_rss_mib"] for r in runs), "minor_faults": last["minor_faults"],
           "forward_8x512_s": statistics.median(r["forward_8x512_s"] for r in runs),
           "forward_8x512_seconds": [x for r in runs for x in r["forward_8x512_seconds"]]}
    if a.runs > 1:
        rec["runs"] = runs
    print(json.dumps(rec, indent=1))
    path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"report_{str(rec['commit'])[:7]}.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
