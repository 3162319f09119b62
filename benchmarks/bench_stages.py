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

``--by-site`` (with ``--forwards``): that work split by where each forward came from — the two innermost package
functions above the code that only runs a forward (:func:`forward_site`), and whether it resumed at a later block — the
places to look for passes two parts of a stage run alike. Each stage runs on its own here, so a reference k̄ that the
report computes once for several stages (``shared_means``) counts in each of them.
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
import sys
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


#: frames that only carry a forward to the model (running it, resuming it, streaming its hooks): a site is named by the
#: package frames above them
PLUMBING_MODULES = ("hooks/reentry.py", "hooks/capture.py", "hooks/stream.py", "hooks/chunked.py", "hooks/positions.py")
PLUMBING_FUNCTIONS = {("swaps", "nll_on_target"), ("swaps", "_target_nll"), ("patching", "_run_logits"),
                      ("patching", "_run_metric")}


def forward_site(frame: Any, depth: int = 2) -> tuple[str, bool]:
    """Where a forward came from: the ``depth`` innermost frames of ``posgen_tl`` above :data:`PLUMBING_MODULES` and
    :data:`PLUMBING_FUNCTIONS`, outermost first (``"pilot._tune > pilot._mean_damage"``), and whether the forward was
    resumed at a later block (:func:`posgen_tl.hooks.reentry.forward_from` on the stack). ``"(outside posgen_tl)"`` when
    no package frame called it."""
    names: list[str] = []
    resumed = False
    f = frame
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        if "/posgen_tl/" in path:
            mod = Path(path).stem
            if path.endswith("hooks/reentry.py") and f.f_code.co_name == "forward_from":
                resumed = True
            elif not path.endswith(PLUMBING_MODULES) and (mod, f.f_code.co_name) not in PLUMBING_FUNCTIONS \
                    and len(names) < depth:
                names.append(f"{mod}.{f.f_code.co_name}")
        f = f.f_back
    return (" > ".join(reversed(names)) or "(outside posgen_tl)"), resumed


class LayerTokens:
    """Tokens processed by every layer's MLP of each model in ``models`` (``{label: model}``) while active: a forward
    pre-hook on each ``model.blocks[i].mlp`` (TransformerLens 3.x and 4.x both have the module; a block a resumed
    forward passes through never calls it). ``counts``: ``{label: tokens × layers}``; with ``by_site``, ``sites`` splits
    them by where each forward came from, ``{(label, site, resumed): tokens × layers}`` (:func:`forward_site`); the
    hooks are removed on exit."""

    def __init__(self, models: dict[str, Any], by_site: bool = False) -> None:
        self.models = models
        self.by_site = by_site
        self.counts: dict[str, int] = {label: 0 for label in models}
        self.sites: dict[tuple[str, str, bool], int] = {}
        self._handles: list[Any] = []

    def _hook(self, label: str) -> Any:
        def pre(_module: Any, args: tuple, kwargs: dict) -> None:
            x = next((a for a in (*args, *kwargs.values()) if hasattr(a, "shape") and a.ndim >= 2), None)
            if x is None:
                raise RuntimeError(f"{label}: an MLP was called without a hidden-state tensor; nothing to count")
            n = int(x.numel() // x.shape[-1])
            self.counts[label] += n
            if self.by_site:
                key = (label, *forward_site(sys._getframe(1)))
                self.sites[key] = self.sites.get(key, 0) + n

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
    ap.add_argument("--by-site", action="store_true", help="with --forwards: split each stage's forward work by where "
                                                           "its forwards came from (see above)")
    a = ap.parse_args()
    if a.by_site and not a.forwards:
        raise SystemExit("--by-site splits the forward work --forwards counts: give both")
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
    sites: dict[str, set[tuple]] = {s: set() for s in stages}
    for r in range(a.repeats):
        rows["forward"].append(forward())
        if a.forwards:
            rows["blocks"].append(blocks())
        for s in stages:
            with LayerTokens(models, a.by_site) if a.forwards else contextlib.nullcontext() as counter:
                t = time.perf_counter()
                result = run(s)
                rows[s].append(time.perf_counter() - t)
            prints[s].add(fingerprint(result.tables))
            if counter is not None:
                counts[s].add(tuple(counter.counts[m] for m in models))
                sites[s].add(tuple(sorted(counter.sites.items())))
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
            if a.by_site:
                if len(sites[s]) != 1:
                    raise SystemExit(f"{s}: where its forwards came from differed between rounds")
                split = sorted(next(iter(sites[s])), key=lambda kv: -kv[1])
                work_of[s]["by_site"] = [{"model": m, "site": site, "resumed": res, "forward_equivalents": v / unit}
                                         for (m, site, res), v in split]
                for (m, site, res), v in split:
                    print(f"    {v / unit:6.2f}  {m:<7}  {site}{'  (resumed)' if res else ''}")
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
