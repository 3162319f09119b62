"""Stages of the default report, each timed as the report runs it, alternating with the plain forward in ONE process,
with a fingerprint of every table the stage produced — so that two commits can be compared for time AND for results.

    python benchmarks/bench_stages.py --stages taxonomy,patching --repeats 2 [--out FILE]

Each round runs the plain forward of 8 × 128 tokens (8 windows of the stages' most common ``seq_len``), then each
stage with the report's own configuration (``posgen_tl.report.run.ReportSettings().configs()``; a stage's upstream
Results are computed once, first, untimed). A stage's fingerprint is the SHA-256 of its tables written as CSV with every
float at full precision (``float_format="%.17g"``): two runs with the same fingerprint produced the same numbers to the
last bit.
To compare two commits, run the same command in a worktree of each, alternating (the host drifts); ``OLD`` is a
folder of your choice:

    git worktree add "$OLD" <commit> && PYTHONPATH="$OLD" python benchmarks/bench_stages.py --stages taxonomy

Prints every round, then per stage the median seconds and the ratio of medians to the forward's; ``--out`` writes them
with the commit, machine and fingerprints as JSON.

``--forwards``: also count the forward work each stage does — the tokens every layer's MLP processed, per model (the
trained model and its random twin), through a forward pre-hook on each block's ``mlp`` module, so that a block a resumed
forward skips is not counted — as *forward equivalents*: that work over one pass of the 8 windows through every
layer. Each round then also times that pass without the unembedding (``stop_at_layer``; the stages unembed only
their target rows) inside :func:`posgen_tl.hooks.heap.large_blocks_kept` (as the stages' passes run), and each stage
reads "its forwards": equivalents × that time, and the share of the stage's seconds they make.
"""

from __future__ import annotations

import argparse
import contextlib
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


class LayerTokens:
    """Tokens processed by every layer's MLP of each model in ``models`` (``{label: model}``) while active: a forward
    pre-hook on each ``model.blocks[i].mlp`` (TransformerLens 3.x and 4.x both have the module; a block a resumed
    forward passes through never calls it). ``counts``: ``{label: tokens × layers}``; the hooks are removed on exit."""

    def __init__(self, models: dict[str, Any]) -> None:
        self.models = models
        self.counts: dict[str, int] = {label: 0 for label in models}
        self._handles: list[Any] = []

    def _hook(self, label: str) -> Any:
        def pre(_module: Any, args: tuple, kwargs: dict) -> None:
            x = next((a for a in (*args, *kwargs.values()) if hasattr(a, "shape") and a.ndim >= 2), None)
            if x is None:
                raise RuntimeError(f"{label}: an MLP was called without a hidden-state tensor; nothing to count")
            self.counts[label] += int(x.numel() // x.shape[-1])

        return pre

    def __enter__(self) -> LayerTokens:
        for label, model in self.models.items():
            for block in model.blocks:
                self._handles.append(block.mlp.register_forward_pre_hook(self._hook(label), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", default="taxonomy,patching", help="report stages, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--forwards", action="store_true", help="also count each stage's forward work (see above)")
    a = ap.parse_args()
    import torch

    from posgen_tl.experiments import registry
    from posgen_tl.hooks.capture import probe_hooks
    from posgen_tl.hooks.heap import large_blocks_kept
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

    window = statistics.mode(configs[s].seq_len for s in stages)  # the stages' window (exactness alone uses 64)
    tokens = torch.randint(100, 1000, (8, window), generator=torch.Generator().manual_seed(0))

    def forward() -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model(tokens, return_type=None)
        return time.perf_counter() - t

    def blocks() -> float:  # the pass the stages' forwards are counted in: every layer, no unembedding
        t = time.perf_counter()
        with torch.inference_mode(), large_blocks_kept():
            model(tokens, stop_at_layer=spec.n_layers)
        return time.perf_counter() - t

    # the report's twin, built once before the rounds (as the report does) where a chosen stage measures one
    twin_used = any("twin" in registry.inputs(s, twin=ctx.twin) and getattr(configs[s], "twin", True) for s in stages)
    models = {"trained": model, **({"twin": ctx.twin()} if twin_used else {})}
    unit = tokens.numel() * spec.n_layers  # one forward equivalent: the tokens through every layer
    forward()
    rows: dict[str, list[float]] = {"forward": [], **({"blocks": []} if a.forwards else {}), **{s: [] for s in stages}}
    prints: dict[str, set[str]] = {s: set() for s in stages}
    counts: dict[str, set[tuple[int, ...]]] = {s: set() for s in stages}
    for r in range(a.repeats):
        rows["forward"].append(forward())
        if a.forwards:
            rows["blocks"].append(blocks())
        for s in stages:
            with LayerTokens(models) if a.forwards else contextlib.nullcontext() as counter:
                t = time.perf_counter()
                result = run(s)
                rows[s].append(time.perf_counter() - t)
            prints[s].add(fingerprint(result.tables))
            if counter is not None:
                counts[s].add(tuple(counter.counts[m] for m in models))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    work_of: dict[str, dict[str, Any]] = {}
    for s in stages:
        fp = sorted(prints[s])
        same = f"tables {fp[0][:16]}…" if len(fp) == 1 else f"DIFFERENT tables in different rounds ({len(fp)} fingerprints)"
        print(f"{s}: median {med[s]:.1f} s = {med[s] / med['forward']:.1f} forwards of 8 × {tokens.shape[1]} "
              f"(median {med['forward']:.2f} s); {same}")
        if a.forwards:
            if len(counts[s]) != 1:
                raise SystemExit(f"{s}: its forward work differed between rounds ({sorted(counts[s])})")
            per_model = dict(zip(models, next(iter(counts[s])), strict=True))
            eq = sum(per_model.values()) / unit
            work_of[s] = {"layer_tokens": per_model, "forward_equivalents": eq,
                          "forward_seconds": eq * med["blocks"], "share": eq * med["blocks"] / med[s]}
            print(f"  forwards: {eq:.1f} equivalents (" + ", ".join(f"{m} {v / unit:.1f}" for m, v in per_model.items())
                  + f") × {med['blocks']:.2f} s = {eq * med['blocks']:.1f} s, {work_of[s]['share']:.0%} of the stage")
    shutil.rmtree(work.dir, ignore_errors=True)
    if a.out:
        out = {"what": "report stages at the report's configuration, alternating with the plain forward",
               "commit": git_commit(), "started": started,
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_end": os.getloadavg()},
               "threads": torch.get_num_threads(), "forward_tokens": list(tokens.shape), "seconds": rows,
               "median_s": med, "tables_sha256": {s: sorted(v) for s, v in prints.items()},
               **({"forward_work": work_of,
                   "forward_work_unit": f"8 × {tokens.shape[1]} tokens × {spec.n_layers} layers"} if a.forwards else {})}
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
