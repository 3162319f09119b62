"""Multi-process runs with ``torch.distributed``: documents sharded across ranks, mergeable
accumulators all-reduced, per-sequence rows gathered — the merged tables EQUAL a single-process
run (to float tolerance).

    torchrun --nproc_per_node 2 -m posgen_tl.distributed --model smollm2-135m --n-seq 16 --out run/

Design (no analysis is re-defined here: each wrapper calls the recipe of :mod:`posgen_tl.analysis`
on its rank's shard and merges what it returns):

* :func:`shard_documents` — windows are grouped by document id and whole documents are dealt to
  ranks (balanced by window count, deterministic), so no document is split across ranks and the
  statistical unit of docs/method.md §8 stays intact. More ranks than documents is an error.
* mergeable accumulators — :class:`~posgen_tl.maths.band_stats.BandStats` states are summed
  (:func:`all_reduce_states`); means (the D3 ``k̄``) are merged weighted by their token counts
  (:func:`merge_means`); per-sequence rows are gathered with global sequence indices
  (:func:`gather_frame`).
* failure — every rank runs its local work inside :func:`guarded`; a status exchange follows,
  and if ANY rank raised, EVERY rank raises :class:`DistributedRunError` naming the failing
  rank(s) and its error. Nothing is merged or written after a failure, so no partial table is
  ever presented as complete. A rank that dies outright (killed, segfault) makes the other
  ranks' next collective fail (or time out after ``timeout_s``); that too is raised as
  :class:`DistributedRunError`.
* only rank 0 writes (:func:`main`), after the last status exchange.

Without a process group (plain ``python``), every helper degrades to the single-process call
(world size 1), so code written against this module runs unchanged on one process.

The plumbing (process group, sharding, failure handling, merging) lives in :mod:`posgen_tl.collectives`;
its names are importable from here too. This module holds the sharded analyses and the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from posgen_tl.collectives import (
    Dist,
    DistributedRunError,
    ShardError,
    all_reduce_states,
    current,
    gather_frame,
    gather_objects,
    guarded,
    merge_means,
    setup,
    shard_documents,
    shard_rows,
    teardown,
)
from posgen_tl.io.sampling import Windows

__all__ = [
    "Dist",
    "DistributedRunError",
    "ShardError",
    "setup",
    "teardown",
    "current",
    "shard_documents",
    "guarded",
    "all_reduce_states",
    "merge_means",
    "gather_frame",
    "decompose_distributed",
    "pattern_distributed",
    "key_means_distributed",
    "tolerance_distributed",
    "main",
]


# ----------------------------------------------------------------------------- analyses


def _as_windows(x: Windows | Tensor) -> Windows:
    if isinstance(x, Windows):
        return x
    t = x if x.ndim == 2 else x[None]
    n = t.shape[0]
    return Windows(t, torch.arange(n), torch.zeros(n, dtype=torch.long), [f"row{i}" for i in range(n)])


def _local(windows: Windows | Tensor) -> tuple[Windows, Tensor]:
    """This rank's windows (whole documents) and their global indices."""
    w = _as_windows(windows)
    d = current()
    idx = shard_documents(w.doc_ids, d.world_size, d.rank)
    return w.subset(idx), idx


def key_means_distributed(
    model: Any, tokens: Int[Tensor, "batch pos"], layers: Sequence[int] | None = None, *, sink: int = 1,
    batch_size: int = 4, shard: bool = True,
) -> dict[int, Float[Tensor, "kv_head d_head"]]:  # fmt: skip
    """The D3 ``k̄`` (:func:`posgen_tl.hooks.edits.reference_key_means`) over ``tokens``,
    rows split across ranks (a mean does not care about documents), merged by token count.

    Returns ``{layer: [kv_head, d_head]}`` float64 on CPU, equal on every rank (and, to float64
    rounding, to the single-process value). ``shard=False``: every rank uses all rows.
    """
    from posgen_tl.hooks.capture import probe_hooks  # noqa: PLC0415
    from posgen_tl.hooks.edits import reference_key_means  # noqa: PLC0415

    spec, _ = probe_hooks(model)
    d = current()
    rows = shard_rows(tokens.shape[0], d.world_size, d.rank) if shard and d.active else torch.arange(tokens.shape[0])
    want = spec.layer_indices(layers)

    def local() -> dict[int, Tensor]:
        if len(rows) == 0:
            return {layer: torch.zeros(spec.n_kv_heads, spec.d_head, dtype=torch.float64) for layer in want}
        return reference_key_means(model, tokens[rows], want, sink=sink, batch_size=batch_size, progress=False)

    means = guarded(local, what="k̄ reference pass")
    n_tok = len(rows) * max(tokens.shape[1] - sink, 0)
    return merge_means(means, n_tok, what="k̄") if shard else {k: v.double().cpu() for k, v in means.items()}


def decompose_distributed(
    model: Any, windows: Windows, reference: Windows | Tensor | None = None, *, k_mean: Sequence[str] | str = ("global", "per_sequence"),
    layers: Sequence[int] | None = None, sink: int = 1, batch_size: int = 4, bound_rows: int = 32,
    twin_label: str = "trained", model_label: str | None = None, extra_hooks: Sequence = (),
) -> pd.DataFrame:  # fmt: skip
    """:func:`posgen_tl.experiments.decomposition.decompose_model` over ``windows``, documents sharded.

    The ``global`` k̄ comes from ``reference`` (other documents; rows split across ranks, merged by
    token count); ``per_sequence`` k̄ is each sequence's own. Returns, on every rank, the frame a
    single process returns for ``decompose_model(model, windows, reference=reference, k_mean=k_mean)``
    — same columns (:data:`~posgen_tl.experiments.decomposition.COLUMNS`), rows and order (``seq`` =
    index into ``windows``, ``doc`` its document). Raises :class:`ShardError` (more ranks than
    documents) before any work, and :class:`DistributedRunError` on every rank if any rank fails.
    """
    from posgen_tl.experiments.decomposition import COLUMNS, k_mean_kinds, score_windows  # noqa: PLC0415

    kinds, given = k_mean_kinds(k_mean)
    loc, idx = _local(windows)
    if "global" in kinds:
        if reference is None:
            raise ValueError("k_mean='global' needs reference windows from other documents: pass reference=")
        ref = reference.tokens if isinstance(reference, Windows) else reference
        given = key_means_distributed(model, ref, layers, sink=sink, batch_size=batch_size)

    def local() -> pd.DataFrame:
        return score_windows(model, loc, kinds, given, layers, sink=sink, batch_size=batch_size, bound_rows=bound_rows,
                    twin_label=twin_label, model_label=model_label, progress=False, extra_hooks=extra_hooks)

    df = gather_frame(guarded(local, what="decomposition"), idx, what="decomposition rows")
    df = df[COLUMNS].sort_values(["layer", "estimator", "k_mean", "sink_excluded", "seq", "head"], kind="stable")
    return df.reset_index(drop=True)


def pattern_distributed(
    model: Any, windows: Windows, reference: Windows | Tensor | None = None, *, layers: Sequence[int] | None = None,
    sink: int = 1, batch_size: int = 8, model_label: str | None = None, twin_label: str = "trained", n_splits: int = 16,
):  # fmt: skip
    """:func:`posgen_tl.experiments.pattern.feature_pattern` over ``windows``, documents sharded: each rank
    streams its documents, the raw states (``BandStats`` sums, per-sequence band sums with their
    document ids, logit spread) are gathered and merged with
    :meth:`~posgen_tl.experiments.pattern.PatternResult.merge`; the global k̄ (for the predicted D3
    error) comes from ``reference``, merged across ranks.

    Returns a :class:`~posgen_tl.experiments.pattern.PatternResult` equal (to float rounding) to
    ``feature_pattern(model, windows, reference=reference)`` in one process, on every rank.
    """
    from posgen_tl.experiments.pattern import feature_pattern  # noqa: PLC0415

    loc, _ = _local(windows)
    label = model_label or str(getattr(getattr(model, "cfg", None), "model_name", None) or type(model).__name__)
    km = None
    if reference is not None:
        ref = reference.tokens if isinstance(reference, Windows) else reference
        km = key_means_distributed(model, ref, layers, sink=sink, batch_size=batch_size)
    res = guarded(lambda: feature_pattern(model, loc, k_means=km, layers="all" if layers is None else layers, sink=sink,
                                          batch_size=batch_size, model_label=label, twin_label=twin_label,
                                          n_splits=n_splits, progress=False, n_seq=len(loc)),
                  what="feature pattern")
    if not current().active:
        return res
    parts = gather_objects(res, what="pattern states")
    out = parts[0]
    for p in parts[1:]:
        out = out.merge(p)
    return out


def tolerance_distributed(
    model: Any, windows: Windows, interventions: Sequence[Any] = (), *, k_means: dict | None = None,
    fracs: Sequence[float] = (0.0, 0.05, 0.1, 0.2), seeds: Sequence[int] = (0, 1), target_len: int = 64,
    mode: str = "T1", batch_size: int = 4, sink: int = 1, base_seed: int = 0,
) -> pd.DataFrame:  # fmt: skip
    """Per-sequence T1/T2 rows of the unmodified model (``none``) and of each intervention, documents
    sharded: :func:`posgen_tl.engine.conditions.condition_rows` on each rank's windows in batches
    (swaps seeded per document and window start, so they do not depend on the sharding).

    ``k_means`` (needed by interventions) defaults to the mean key of the analysed windows' context
    (``tokens[:, :N − target_len]``, first ``sink`` positions excluded), merged across ranks.
    Returns ``condition, kind, alpha, seq, doc, frac, seed, clean_nll, nll, delta`` (``seq`` =
    index into ``windows``), on every rank, ordered by condition, frac, seed, seq.
    """
    from posgen_tl.engine.conditions import Condition, condition_rows  # noqa: PLC0415
    from posgen_tl.hooks.edits import key_means  # noqa: PLC0415

    loc, idx = _local(windows)
    n = windows.tokens.shape[1]
    conds = [Condition("none", None)] + [iv if isinstance(iv, Condition) else Condition(iv.label, iv) for iv in interventions]
    if k_means is None and any(c.intervention is not None and c.intervention.kind != "noop" for c in conds):
        ctx = loc.tokens[:, : n - target_len]
        km = guarded(lambda: key_means(model, ctx, sink=sink), what="key means")
        k_means = {k: v.float() for k, v in merge_means(km, len(loc) * max(ctx.shape[1] - sink, 0)).items()}

    def local() -> pd.DataFrame:
        frames = []
        for cond in conds:
            for s in range(0, len(loc), batch_size):
                sub = loc.subset(range(s, min(s + batch_size, len(loc))))
                rows, _, _ = condition_rows(model, sub, cond, k_means=k_means, target_len=target_len, fracs=fracs,
                                            seeds=seeds, mode=mode, base_seed=base_seed)
                rows["seq"] += s
                rows.insert(0, "condition", cond.key)
                rows.insert(1, "kind", cond.kind)
                rows.insert(2, "alpha", 0.0 if cond.intervention is None else float(cond.intervention.alpha))
                frames.append(rows)
        return pd.concat(frames, ignore_index=True)

    df = gather_frame(guarded(local, what="tolerance"), idx, what="tolerance rows")
    rank = {"condition": {c.key: i for i, c in enumerate(conds)}, "frac": {float(f): i for i, f in enumerate(fracs)},
            "seed": {int(x): i for i, x in enumerate(seeds)}}
    df = df.sort_values(["condition", "frac", "seed", "seq"], kind="stable",
                        key=lambda c: c.map(rank[c.name]) if c.name in rank else c).reset_index(drop=True)
    df.insert(4, "doc", windows.doc_ids.numpy()[df["seq"].to_numpy()])
    return df


# ----------------------------------------------------------------------------- command line


def _atomic_csv(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)


#: the experiments' options this entry point takes, and the Config each one's default and help come from (the same
#: values `posgen-tl study` uses; the first Config that declares an option owns it)
OPTIONS = ("corpus", "seq_len", "n_seq", "n_ref", "layers", "target_len", "batch_size", "seed")


def _owners() -> dict[str, Any]:
    """``{option: the Config class that declares it}`` over the stages' Configs (decomposition, pattern, tolerance)."""
    from posgen_tl.experiments import decomposition, pattern, tolerance  # noqa: PLC0415

    out: dict[str, Any] = {}
    for cfg in (decomposition.Config, pattern.Config, tolerance.Config):
        for o in cfg.options():
            out.setdefault(o.name, cfg)
    return out


def _parser() -> argparse.ArgumentParser:
    """The arguments of ``python -m posgen_tl.distributed``: the run's own (model, stages, device, out, backend), and
    the experiments' options of :data:`OPTIONS`, generated from their Configs (default and help as ``study``)."""
    p = argparse.ArgumentParser(
        prog="python -m posgen_tl.distributed",
        description="Decomposition, feature pattern and tolerance rows over many documents, sharded over "
                    "torch.distributed ranks (launch with torchrun --nproc_per_node N -m posgen_tl.distributed ...).")
    from posgen_tl.io.defaults import DEFAULT_MODEL  # noqa: PLC0415

    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or path (default: {DEFAULT_MODEL})")
    owners = _owners()
    for name in OPTIONS:
        cfg = owners[name]
        o = next(x for x in cfg.options() if x.name == name)
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, metavar=o.kind.upper(),
                       help=f"{o.help} (default {o.default!r}, as {cfg.__module__.rsplit('.', 1)[-1]}'s Config)")
    p.add_argument("--stages", default="decomposition,pattern,tolerance",
                   help="comma-separated stages to run (default: decomposition,pattern,tolerance)")
    p.add_argument("--device", default="cpu", help="torch device of each rank's model (default: cpu)")
    p.add_argument("--out", default="posgen_distributed", help="output folder, written by rank 0 (default: "
                                                              "posgen_distributed)")
    p.add_argument("--backend", default="gloo", help="torch.distributed backend (default: gloo)")
    return p


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The typed values of :data:`OPTIONS` — given on the command line or their Config's default.

    Raises:
        ValueError: a value that does not parse as its option's kind (named)."""
    owners = _owners()
    out = {}
    for name in OPTIONS:
        text = getattr(args, name)
        cfg = owners[name].from_text({name: text} if text is not None else {}, strict=True)
        out[name] = getattr(cfg, name)
    if out["target_len"] == 0:  # the experiments' rule: min(64, seq_len // 4)
        out["target_len"] = min(64, int(out["seq_len"]) // 4)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m posgen_tl.distributed`` / ``torchrun -m posgen_tl.distributed``.

    Writes ``decomposition.csv``, ``pattern_bands.csv``, ``pattern_heads.csv``,
    ``tolerance_rows.csv`` and ``run.json`` into ``--out`` — on rank 0 only, and only after every
    stage succeeded on every rank (stale outputs are removed first). Exit 0 on success, 1 if a
    rank failed (every rank prints the same error), 2 on bad arguments.
    """
    args = _parser().parse_args(argv)
    try:
        opt = _options(args)
    except ValueError as e:
        print(f"posgen_tl.distributed: error: {e}", file=sys.stderr)
        return 2
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - {"decomposition", "pattern", "tolerance"}
    if unknown:
        print(f"posgen_tl.distributed: error: unknown stage(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    d = setup(args.backend)
    threads = os.environ.get("POSGEN_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    out = Path(args.out)
    names = ["decomposition.csv", "pattern_bands.csv", "pattern_heads.csv", "tolerance_rows.csv", "run.json"]
    if d.is_main:
        out.mkdir(parents=True, exist_ok=True)
        for nm in names:
            (out / nm).unlink(missing_ok=True)  # never leave old, complete-looking tables beside a new run
    try:
        from posgen_tl.io.corpus import CorpusError  # noqa: PLC0415
        from posgen_tl.io.models import load_model  # noqa: PLC0415
        from posgen_tl.io.sampling import sample_windows  # noqa: PLC0415

        t0 = time.perf_counter()
        model = guarded(lambda: load_model(args.model, device=args.device), what="model load")
        try:
            win, ref = sample_windows(model, opt["corpus"], n_seq=opt["n_seq"], seq_len=opt["seq_len"],
                                      n_ref=opt["n_ref"], seed=opt["seed"])
        except CorpusError as e:
            raise ShardError(str(e)) from e
        from posgen_tl.experiments.base import resolve_layers  # noqa: PLC0415

        layers = resolve_layers(opt["layers"], model.cfg.n_layers)
        shard_documents(win.doc_ids, d.world_size, d.rank)  # ShardError on every rank before any work
        tables: dict[str, pd.DataFrame] = {}
        timing: dict[str, float] = {}
        if "decomposition" in stages:
            ts = time.perf_counter()
            tables["decomposition.csv"] = decompose_distributed(model, win, ref, layers=layers,
                                                                batch_size=opt["batch_size"])
            timing["decomposition"] = time.perf_counter() - ts
        if "pattern" in stages:
            ts = time.perf_counter()
            pr = pattern_distributed(model, win, ref, layers=layers, batch_size=opt["batch_size"])
            tables["pattern_bands.csv"], tables["pattern_heads.csv"] = pr.bands, pr.heads
            timing["pattern"] = time.perf_counter() - ts
        if "tolerance" in stages:
            ts = time.perf_counter()
            tables["tolerance_rows.csv"] = tolerance_distributed(model, win, (), target_len=opt["target_len"],
                                                                 batch_size=opt["batch_size"])
            timing["tolerance"] = time.perf_counter() - ts
        guarded(lambda: None, what="final check")
    except (DistributedRunError, ShardError) as e:
        print(f"posgen_tl.distributed: rank {d.rank}: error: {e}", file=sys.stderr)
        teardown()
        return 1
    if d.is_main:
        for nm, df in tables.items():
            _atomic_csv(df, out / nm)
        meta = {"world_size": d.world_size, "threads_per_rank": torch.get_num_threads(), "model": args.model,
                "options": opt, "n_seq": opt["n_seq"], "seq_len": opt["seq_len"], "n_docs": win.n_docs, "stage_seconds": timing,
                "total_seconds": time.perf_counter() - t0}
        tmp = out / ".run.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, out / "run.json")
        print(f"posgen_tl.distributed: {d.world_size} rank(s) wrote {', '.join(tables)} to {out}")
    teardown()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
