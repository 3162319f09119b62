"""Stages of the default report, each timed as the report runs it, alternating with the plain forward in ONE process,
with a fingerprint of every table the stage produced — so that two commits can be compared for time AND for results.

    python benchmarks/bench_stages.py --stages taxonomy,patching --repeats 2 [--out FILE]

Each round runs the plain forward of 8 × 128 tokens (the report's window length), then each stage with the report's
own configuration (``posgen_tl.report.run.ReportSettings().configs()``; a stage's upstream Results are computed
once, first, untimed). A stage's fingerprint is the SHA-256 of its tables written as CSV with every float at full
precision (``float_format="%.17g"``): two runs with the same fingerprint produced the same numbers to the last bit.
To compare two commits, run the same command in a worktree of each, alternating (the host drifts); ``OLD`` is a
folder of your choice:

    git worktree add "$OLD" <commit> && PYTHONPATH="$OLD" python benchmarks/bench_stages.py --stages taxonomy

Prints every round, then per stage the median seconds and the ratio of medians to the forward's; ``--out`` writes them
with the commit, machine and fingerprints as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def fingerprint(tables: dict[str, Any]) -> str:
    """SHA-256 over a Result's tables (name, then the CSV of each DataFrame at full float precision)."""
    h = hashlib.sha256()
    for name in sorted(tables):
        df = tables[name]
        h.update(name.encode())
        h.update(df.to_csv(index=False, float_format="%.17g").encode() if hasattr(df, "to_csv") else repr(df).encode())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", default="taxonomy,patching", help="report stages, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from posgen_tl.experiments import registry
    from posgen_tl.hooks.capture import probe_hooks
    from posgen_tl.io.models import load_model
    from posgen_tl.io.provenance import git_commit
    from posgen_tl.report.context import Context, Work
    from posgen_tl.report.run import ReportSettings

    settings = ReportSettings()
    configs = settings.configs()
    stages = [s for s in a.stages.split(",") if s]
    unknown = [s for s in stages if s not in configs]
    if unknown:
        raise SystemExit(f"unknown stage(s) {unknown}: the report's are {', '.join(configs)}")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    model = load_model(settings.model)
    spec, _ = probe_hooks(model)
    work = Work(Path(tempfile.mkdtemp(prefix="posgen_stages_")), {"bench": "stages"})
    seed = next(iter(configs.values())).seed
    ctx = Context(model, work, spec.model_name, seed=seed)
    upstream: dict[str, Any] = {}

    def run(name: str) -> Any:
        kw = registry.inputs(name, checkpoint=None, twin=ctx.twin,
                             upstream={d: upstream[d] for d in registry.experiment(name).NEEDS})
        return registry.run_or_skip(name, model, configs[name], **kw)

    def prepare(name: str) -> None:  # every upstream Result, computed once before anything is timed
        for need in registry.experiment(name).NEEDS:
            if need not in upstream:
                prepare(need)
                upstream[need] = run(need)

    for s in stages:
        prepare(s)

    tokens = torch.randint(100, 1000, (8, configs[stages[0]].seq_len), generator=torch.Generator().manual_seed(0))

    def forward() -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model(tokens, return_type=None)
        return time.perf_counter() - t

    forward()
    rows: dict[str, list[float]] = {"forward": [], **{s: [] for s in stages}}
    prints: dict[str, set[str]] = {s: set() for s in stages}
    for r in range(a.repeats):
        rows["forward"].append(forward())
        for s in stages:
            t = time.perf_counter()
            result = run(s)
            rows[s].append(time.perf_counter() - t)
            prints[s].add(fingerprint(result.tables))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    for s in stages:
        fp = sorted(prints[s])
        same = f"tables {fp[0][:16]}…" if len(fp) == 1 else f"DIFFERENT tables in different rounds ({len(fp)} fingerprints)"
        print(f"{s}: median {med[s]:.1f} s = {med[s] / med['forward']:.1f} forwards of 8 × {tokens.shape[1]} "
              f"(median {med['forward']:.2f} s); {same}")
    shutil.rmtree(work.dir, ignore_errors=True)
    if a.out:
        out = {"what": "report stages at the report's configuration, alternating with the plain forward",
               "commit": git_commit(), "started": started,
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_end": os.getloadavg()},
               "threads": torch.get_num_threads(), "forward_tokens": list(tokens.shape), "seconds": rows,
               "median_s": med, "tables_sha256": {s: sorted(v) for s, v in prints.items()}}
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
