"""The dose–response run of causal verdicts v3 (docs/method.md §5, §8; the verdict: :mod:`posgen_tl.stats.dose`).

Every condition (destroy and each control) runs at a grid of strengths on the same windows and the same
swaps. Per window: the unedited clean NLL and its swapped passes are computed ONCE and are every
condition's α = 0 point; per condition and α > 0 one clean pass (its damage) and one pass per swap
fraction and seed — each resumed at the condition's first edited layer from the residual its unedited
pass recorded there (the blocks below are not computed again). The passes that resume at the same layer run side by
side in one forward's batch, each edit on its own rows, as many as memory allows (:func:`stack_size`). Long texts
(beyond 2 048 tokens, or where the stored attention patterns would not fit the free memory) run every pass in chunks
through the model's cache instead, none resumed, the attention change read from unedited and edited rows side by side
in one batch. A random control keeps one draw per document across its strengths (a dose curve of one edit), drawn
afresh for every document.

:func:`dose_rows` returns the passes; :func:`dose_units` turns them into one row per document × condition
× strength — damage, tolerance loss against the condition's own clean NLL, and against the unedited
one — the input of :func:`posgen_tl.stats.dose.common_damage_contrasts`.

The study around it — the pilot that declares the levels and grids, the power, resumable runs — is
:mod:`posgen_tl.experiments.causal`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from posgen_tl.engine.conditions import (
    AttentionKL,
    Condition,
    PairedKL,
    StackedKL,
    condition_rows,
    edit_hooks,
    first_edited,
)
from posgen_tl.engine.swaps import Prefixes, curve_rows, nll_on_target
from posgen_tl.hooks.capture import CaptureError, model_device, model_dtype, probe_hooks
from posgen_tl.hooks.chunked import CHUNK, check_chunked, forward_chunk, hooks_chunk_safe
from posgen_tl.hooks.edits import hooks_on_rows, intervention_hooks
from posgen_tl.hooks.memory import FREE_SHARE, attention_bytes, free_bytes, logit_row_bytes, sequences_per_forward
from posgen_tl.hooks.reentry import recorded, resid_hooks
from posgen_tl.hooks.stream import pattern_hooks
from posgen_tl.io.sampling import Windows
from posgen_tl.stats.curves import document_units

__all__ = ["dose_rows", "dose_batches", "dose_units", "stack_size", "strength_grid"]

#: strengths relative to a condition's tuned point: ×0.25 … ×4 (docs/method.md §5 v3)
RELATIVE_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)


def strength_grid(tuned: float, relative: Sequence[float] = RELATIVE_GRID, *, alpha_max: float | None = None) -> tuple[float, ...]:
    """The strengths of one condition: ``tuned × relative`` (capped at ``alpha_max``, duplicates dropped), α = 0
    first. Raises ``ValueError`` for a non-positive tuned strength or grid."""
    if not tuned > 0 or not relative or min(relative) <= 0:
        raise ValueError(f"need a positive tuned strength and grid, got {tuned!r}, {tuple(relative)!r}")
    grid = sorted({round(min(tuned * r, alpha_max) if alpha_max else tuned * r, 12) for r in relative})
    return (0.0, *grid)


def _grid(strengths: Mapping[Any, Sequence[float]], c: Condition) -> list[float]:
    """The strengths of condition ``c``: keyed ``(group, key)`` or, for a single group, ``key``."""
    return [float(x) for x in strengths.get((c.group, c.key), strengths.get(c.key, ()))]


def dose_rows(
    model: Any, windows: Windows, conditions: Sequence[Condition], strengths: Mapping[Any, Sequence[float]], *,
    k_means: dict | None, target_len: int, fracs: Sequence[float], seeds: Sequence[int], base_seed: int = 0,
    seed: int = 0, redraw: bool = True, batch_size: int = 4, progress: bool = True, chunk: int = -1, stack: int = 0,
) -> pd.DataFrame:  # fmt: skip
    """Every condition at every strength on ``windows`` (T1 swaps, the same for all).

    ``strengths``: per condition, keyed ``(condition.group, condition.key)`` (several layer groups in one
    run) or ``condition.key`` (one group).

    Returns one row per window × condition × strength × (frac, seed): ``seq`` (window index), ``doc``,
    ``layers`` (the condition's group), ``condition``, ``alpha``, ``frac``, ``seed``, ``clean_nll`` (the condition's own), ``base_clean_nll``
    (unedited), ``nll``, ``delta`` (= nll − clean_nll) and ``delta_unedited`` (= nll − base_clean_nll).
    The α = 0 rows of every condition are the unedited passes (computed once per batch for all groups); each
    edited pass resumes at its condition's first edited layer from the residual its unedited pass recorded there
    (:mod:`posgen_tl.hooks.reentry`), so the batch keeps (1 + swap passes) × (distinct first layers) residuals of
    ``[batch, pos, d_model]`` while it runs.
    ``chunk`` (as in :func:`posgen_tl.engine.swaps.nll_on_target`; ``-1``: beyond 2 048 tokens where the model's
    cached forward is exact, or where the whole run's stored patterns would not fit the free memory,
    :func:`_dose_chunk`): every pass runs a chunk of positions at a time through the model's cache, none resumed;
    each condition's edited clean pass then holds the unedited sequences beside the edited ones in its batch
    (:func:`_chunked_batch`) so the attention change is read row by row — long texts in memory O(chunk · n).
    ``stack``: in whole forwards, the (condition, α > 0) passes that resume at the same layer run up to this many side
    by side in one forward's batch, each edit on its own rows (:func:`posgen_tl.hooks.edits.hooks_on_rows`; the same
    numbers up to float rounding, fewer and larger forwards); ``0`` (default): as many as :func:`stack_size` allows,
    ``1``: one per forward.

    Raises:
        ValueError: a condition without strengths, a strength < 0, or no α > 0."""
    grids = {(c.group, c.key): _grid(strengths, c) for c in conditions}
    if len(grids) < len(conditions):
        raise ValueError("two conditions share a (group, key): give each layer group its own label")
    for c in conditions:
        grid = grids[(c.group, c.key)]
        if not grid or min(grid) < 0 or max(grid) <= 0:
            raise ValueError(f"condition {c.key!r}: strengths must be ≥ 0 with at least one > 0, got {grid}")
    n = len(windows)
    edited = {(c.group, c.key): list(c.intervention.layers or ()) for c in conditions if c.intervention is not None}
    if any(not v for v in edited.values()):
        raise ValueError("every condition of a dose–response run edits named layers (Intervention.layers)")
    union = sorted({x for v in edited.values() for x in v})
    chunk = _dose_chunk(model, windows.tokens.shape[1], edit_hooks(model, conditions, k_means), len(union),
                        min(batch_size, n), chunk)
    passes = sum(len([a for a in grids[(c.group, c.key)] if a > 0]) for c in conditions) + 1
    bar = tqdm(total=passes * ((n + batch_size - 1) // batch_size), desc="dose–response", disable=not progress,
               leave=False)
    run = _chunked_batch if chunk else _whole_batch
    frames = []
    try:
        for b0 in range(0, n, batch_size):
            w = windows.subset(range(b0, min(n, b0 + batch_size)))
            more = {} if chunk else {"stack": stack}
            base, batch = run(model, w, conditions, grids, edited, k_means=k_means, target_len=target_len, fracs=fracs,
                              seeds=seeds, base_seed=base_seed, seed=seed, redraw=redraw, chunk=chunk, bar=bar, **more)
            b = pd.concat(batch, ignore_index=True)
            local = b["seq"].to_numpy()
            frames.append(b.assign(base_clean_nll=base.cpu().numpy()[local], doc=w.doc_ids.numpy()[local],
                                   seq=local + b0))
    finally:
        bar.close()
    rows = pd.concat(frames, ignore_index=True)
    for col in ("clean_nll", "nll", "delta", "base_clean_nll"):  # float64: a checkpoint's CSV reads back the same
        rows[col] = rows[col].astype(np.float64)
    rows["delta_unedited"] = rows["nll"] - rows["base_clean_nll"]
    return rows


def _dose_chunk(model: Any, n: int, hooks: list, stored_layers: int, batch_size: int, chunk: int) -> int:
    """The chunk of a dose run's passes (0: whole forwards): ``chunk`` as given (:func:`forward_chunk`); for ``-1``
    chunks beyond 2 048 tokens, and also below where the whole run's stored attention patterns (``stored_layers`` maps
    of ``batch_size · heads · n²`` float32 entries, beside a forward's own) would take more than
    :data:`~posgen_tl.hooks.memory.FREE_SHARE` of the free memory — then in quarters of the sequence (at most 512
    positions). Raises MemoryError, naming the sizes, on the CPU where neither fits (a model whose cached forward is
    not exact, or hooks that are not chunk-safe)."""
    got = forward_chunk(model, n, hooks, chunk=chunk)
    if got or chunk >= 0:
        return got
    free = free_bytes(model_device(model))
    heads = probe_hooks(model)[0].n_heads
    need = 4 * batch_size * heads * n * n * stored_layers + attention_bytes(heads, n, batch_size)
    if free is None or need <= FREE_SHARE * free:
        return 0
    why = "its hooks are not chunk-safe"
    if hooks_chunk_safe(hooks):
        try:
            check_chunked(model)
            return min(CHUNK, -(-n // 4))
        except CaptureError as e:
            why = str(e)
    if model_device(model).type != "cpu":
        return 0
    gib = 2**30
    raise MemoryError(f"a dose–response run of {batch_size} × {n} tokens in whole forwards keeps about {need / gib:.1f} "
                      f"GiB of attention patterns and maps, {free / gib:.1f} GiB are free, and it cannot run in chunks "
                      f"({why}) — use a smaller batch_size or shorter texts")


def _whole_batch(model: Any, w: Windows, conditions: Sequence[Condition], grids: dict, edited: dict, *, k_means: dict | None,
                 target_len: int, fracs: Sequence[float], seeds: Sequence[int], base_seed: int, seed: int, redraw: bool,
                 chunk: int, bar: Any, stack: int = 0) -> tuple[Tensor, list[pd.DataFrame]]:
    """One batch of :func:`dose_rows` in whole forwards: the unedited passes record the attention patterns of the
    edited layers and the residuals where the conditions' edits start; each edited pass resumes there, up to
    ``stack`` (condition, α) pairs of the same first edited layer side by side in one forward (:func:`_stacked_rows`;
    ``0``: :func:`stack_size`). Returns ``(unedited clean NLL [batch], the batch's frames)``."""
    union = sorted({x for v in edited.values() for x in v})
    starts = sorted({s for c in conditions if (s := first_edited(c))})  # where the edited passes resume
    docs = w.doc_ids.tolist()
    kl = AttentionKL(union)  # the unedited patterns of this batch, then each condition's change from them
    store: dict[int, list] = {}
    base = nll_on_target(model, w.tokens, target_len=target_len, batch_size=len(w), chunk=0,
                         fwd_hooks=pattern_hooks(model, union, kl) + resid_hooks(starts, store))
    prefix: Prefixes = {"clean": recorded(store)}  # every condition resumes at its first edited layer
    zero = pd.DataFrame(curve_rows(model, w, base, fracs=fracs, seeds=seeds, mode="T1", target_len=target_len,
                                   base_seed=base_seed, record=prefix, record_at=starts, chunk=0))
    bar.update(1)
    items = [(c, a, c.with_alpha(a).for_documents(docs, seed, redraw))  # every edited pass, in the rows' order
             for c in conditions for a in sorted(x for x in grids[(c.group, c.key)] if x > 0)]
    cap = stack if stack > 0 else stack_size(model, w.tokens.shape[1], len(w), target_len, len(items))
    done: dict[int, tuple[pd.DataFrame, Any]] = {}
    for part in _stacks([first_edited(c) for c, _, _ in items], cap):
        got = _stacked_rows(model, w, [items[i] for i in part], edited, union, kl, prefix, k_means=k_means,
                            target_len=target_len, fracs=fracs, seeds=seeds, base_seed=base_seed)
        done.update(zip(part, got))
        bar.update(len(part))
    batch = []
    for c in conditions:
        batch.append(zero.assign(layers=c.group, condition=c.key, alpha=0.0, attn_kl=0.0))
        batch += [done[i][0].assign(layers=c.group, condition=c.key, alpha=a, attn_kl=done[i][1])
                  for i, (ci, a, _) in enumerate(items) if ci is c]
    return base, batch


def stack_size(model: Any, n: int, n_seq: int, target_len: int, n_items: int) -> int:
    """How many (condition, α) passes of a batch of ``n_seq`` sequences of ``n`` tokens one forward holds side by side
    (:func:`_whole_batch`): all ``n_items`` where their attention maps and the target span's float32 logits (counted
    twice: the logits and their log-softmax) fit their share of the free memory
    (:func:`posgen_tl.hooks.memory.sequences_per_forward`), fewer where not, at least one; ``n_items`` where the free
    memory cannot be read on the CPU, one on another device."""
    fit = sequences_per_forward(model, n, extra=logit_row_bytes(model, target_len))
    if fit is None:
        return n_items if model_device(model).type == "cpu" else 1
    return max(1, min(n_items, fit // max(1, n_seq)))


def _stacks(starts: Sequence[int | None], cap: int) -> list[list[int]]:
    """The passes' indices grouped by the layer they resume at (``starts[i]``; ``None``: from the start), each group
    cut into runs of at most ``cap`` that differ in size by at most one, in order."""
    groups: dict[int | None, list[int]] = {}
    for i, s in enumerate(starts):
        groups.setdefault(s, []).append(i)
    out = []
    for idx in groups.values():
        k = -(-len(idx) // max(1, cap))  # forwards for this group
        size, extra = divmod(len(idx), k)
        at = 0
        for j in range(k):
            m = size + (j < extra)
            out.append(idx[at : at + m])
            at += m
    return out


def _stacked_rows(model: Any, w: Windows, part: Sequence[tuple[Condition, float, Condition]], edited: dict,
                  union: Sequence[int], kl: AttentionKL, prefix: Prefixes, *, k_means: dict | None, target_len: int,
                  fracs: Sequence[float], seeds: Sequence[int], base_seed: int) -> list[tuple[pd.DataFrame, Any]]:
    """The rows of the (condition, α, drawn condition) passes ``part`` — all resuming at the same layer — from ONE
    clean forward and one forward per swap, the passes side by side in the batch (each edit on its own rows, each
    condition's attention change read from its rows, :class:`~posgen_tl.engine.conditions.StackedKL`). Returns per
    pass ``(rows with seq in 0 … len(w) − 1, attention KL per row)``."""
    b, k = len(w), len(part)
    start = first_edited(part[0][0])
    if k == 1:  # one pass: the condition's own hooks on the batch as it is
        c, _, cd = part[0]
        kl.layers = edited.get((c.group, c.key), union)
        df, _, kv = condition_rows(model, w, cd, k_means=k_means, target_len=target_len, fracs=fracs, seeds=seeds,
                                   base_seed=base_seed, kl=kl, prefix=prefix if start else None)
        return [(df, _kl_rows(kv, df))]
    hooks = [h for i, (_, _, cd) in enumerate(part)
             for h in hooks_on_rows(intervention_hooks(model, cd.edit(), k_means), slice(i * b, (i + 1) * b))]
    skl = StackedKL(kl.ref, [edited.get((c.group, c.key), union) for c, _, _ in part], b)
    pre = None
    if start:  # each pass's residuals at the resumed layer, repeated for every stacked pass
        pre = {key: {start: v[start].repeat(k, 1, 1)} for key, v in prefix.items() if start in v}
    df, _, kv = condition_rows(model, w.subset(list(range(b)) * k), part[0][2], k_means=k_means,
                               target_len=target_len, fracs=fracs, seeds=seeds, base_seed=base_seed, kl=skl, prefix=pre,
                               hooks=hooks)
    item = df["seq"].to_numpy() // b
    out = []
    for i in range(k):
        one = df[item == i].assign(seq=lambda d: d["seq"] % b).reset_index(drop=True)
        out.append((one, _kl_rows(None if kv is None else kv[i * b : (i + 1) * b], one)))
    return out


def _kl_rows(kv: Tensor | None, df: pd.DataFrame) -> Any:
    """The attention KL of each row of ``df`` (its ``seq``'s), float64; NaN where none was read."""
    return kv.cpu().numpy().astype(np.float64)[df["seq"].to_numpy()] if kv is not None else np.nan


def _chunked_batch(model: Any, w: Windows, conditions: Sequence[Condition], grids: dict, edited: dict, *,
                   k_means: dict | None, target_len: int, fracs: Sequence[float], seeds: Sequence[int], base_seed: int,
                   seed: int, redraw: bool, chunk: int, bar: Any) -> tuple[Tensor, list[pd.DataFrame]]:
    """One batch of :func:`dose_rows` in chunked forwards (nothing of ``[batch, heads, n, n]`` kept): each condition's
    edited clean pass runs the batch twice side by side, unedited then edited (:func:`hooks_on_rows`), and
    :class:`PairedKL` compares their attention rows as each chunk makes them. Its unedited half must give the unedited
    NLL again — a check that the edit stayed in its rows (CaptureError if not). Returns ``(unedited clean NLL
    [batch], the batch's frames)``."""
    b, docs = len(w), w.doc_ids.tolist()
    base = nll_on_target(model, w.tokens, target_len=target_len, batch_size=b, chunk=chunk)
    zero = pd.DataFrame(curve_rows(model, w, base, fracs=fracs, seeds=seeds, mode="T1", target_len=target_len,
                                   base_seed=base_seed, chunk=chunk))
    bar.update(1)
    batch = []
    for c in conditions:
        batch.append(zero.assign(layers=c.group, condition=c.key, alpha=0.0, attn_kl=0.0))
        for a in sorted(x for x in grids[(c.group, c.key)] if x > 0):
            hooks = intervention_hooks(model, c.with_alpha(a).for_documents(docs, seed, redraw).edit(), k_means)
            kl = PairedKL(edited[(c.group, c.key)], b)
            both = nll_on_target(model, torch.cat([w.tokens, w.tokens]), target_len=target_len, batch_size=2 * b,
                                 chunk=chunk, fwd_hooks=hooks_on_rows(hooks, slice(b, 2 * b)) + kl.hooks(model))
            _check_unedited(both[:b], base, c.key, a, model_dtype(model))
            clean = both[b:]
            df = pd.DataFrame(curve_rows(model, w, clean, fracs=fracs, seeds=seeds, mode="T1", target_len=target_len,
                                         base_seed=base_seed, fwd_hooks=hooks, chunk=chunk))
            batch.append(df.assign(layers=c.group, condition=c.key, alpha=a, attn_kl=_kl_rows(kl.per_sequence(), df)))
            bar.update(1)
    return base, batch


def _check_unedited(got: Tensor, base: Tensor, key: str, alpha: float, dtype: torch.dtype) -> None:
    """The unedited half of a paired pass gives the unedited NLL within ``64·eps`` of the model's ``dtype`` (at
    least 1e-6) times ``max(1, |NLL|)`` — the two passes differ only in their batch's size, so in float rounding —
    else the edit reached rows it was not meant for: CaptureError."""
    tol = max(1e-6, 64 * float(torch.finfo(dtype).eps))
    err = float(((got - base).abs() / base.abs().clamp_min(1.0)).max())
    if not err <= tol:
        raise CaptureError(f"condition {key!r} at α = {alpha:g}: the unedited sequences beside the edited ones gave an "
                           f"NLL {err:.2e} (relative) away from their own pass — the edit reached rows it was not meant for")


def dose_batches(
    model: Any, windows: Windows, conditions: Sequence[Condition], strengths: Mapping[Any, Sequence[float]], cfg: Any,
    *, k_means: dict | None, load: Callable[[int], tuple[pd.DataFrame, float] | None] | None = None,
    save: Callable[[int, pd.DataFrame, float, int], None] | None = None, desc: str = "dose–response batches",
    progress: bool = True,
) -> tuple[pd.DataFrame, float]:  # fmt: skip
    """:func:`dose_rows` of ``windows`` in batches of ``cfg.batch_size`` (``seq`` counts over all windows), each
    finished batch taken from ``load(b0)`` (``(rows, seconds)`` or ``None``) and each new one handed to
    ``save(b0, rows, seconds, n_windows)`` — how an interrupted run continues. ``cfg``: the causal Config (its
    ``batch_size``, ``target()``, ``fracs``, ``seeds``, ``seed``).

    Returns ``(rows, seconds)``: every batch's rows and the seconds they took (those of loaded batches included)."""
    frames, seconds = [], 0.0
    for b0 in tqdm(range(0, len(windows), cfg.batch_size), desc=desc, disable=not progress, leave=False):
        got = load(b0) if load is not None else None
        if got is None:
            t0 = time.time()
            w = windows.subset(range(b0, min(b0 + cfg.batch_size, len(windows))))
            rows = dose_rows(model, w, conditions, strengths, k_means=k_means, target_len=cfg.target(), fracs=cfg.fracs,
                             seeds=cfg.seeds, base_seed=cfg.seed, seed=cfg.seed, batch_size=len(w), progress=False)
            rows["seq"] = rows["seq"] + b0
            got = (rows, time.time() - t0)
            if save is not None:
                save(b0, rows, got[1], len(w))
        frames.append(got[0])
        seconds += got[1]
    return pd.concat(frames, ignore_index=True), seconds


def dose_units(rows: pd.DataFrame) -> pd.DataFrame:
    """Per layer group (``layers``) × document × condition × strength (see :func:`_group_units`)."""
    if "layers" not in rows.columns or rows["layers"].nunique() <= 1:
        out = _group_units(rows)
        label = rows["layers"].iloc[0] if "layers" in rows.columns and len(rows) else ""
        return out.assign(layers=label)[["layers", *out.columns]]
    parts = [_group_units(r).assign(layers=g) for g, r in rows.groupby("layers", sort=False)]
    return pd.concat(parts, ignore_index=True)[["layers", *parts[0].columns.drop("layers")]]


def _group_units(rows: pd.DataFrame) -> pd.DataFrame:
    """Per document × condition × strength (sequences of a document averaged, seeds first): ``damage`` (mean
    clean-NLL increase over the unedited model, nats), ``attn_kl`` (when the rows have it), ``tolerance`` (area under the ΔNLL-over-p curve
    against the condition's own clean NLL, nats × p) and ``tolerance_unedited`` (the same area against the
    unedited clean NLL, the curve starting at the damage at p = 0)."""
    u = document_units(rows, by=("condition", "alpha"), value="delta")
    wide = u[u["estimator"].isin(["auc", "damage"])].pivot_table(index=["doc", "condition", "alpha"],
                                                                  columns="estimator", values="value")
    fr = np.asarray(u.attrs["fracs"], dtype=float)
    x = np.concatenate([[0.0], fr])
    curve = rows[rows["frac"] > 0].groupby(["condition", "alpha", "doc", "seq", "frac"])["delta_unedited"].mean()
    per_doc = curve.groupby(["condition", "alpha", "doc", "frac"]).mean().unstack("frac")[list(fr)]
    dmg = wide["damage"].reorder_levels(["condition", "alpha", "doc"]).reindex(per_doc.index).to_numpy()
    y = np.column_stack([dmg, per_doc.to_numpy()])
    tol_u = pd.Series(np.trapezoid(y, x, axis=1), index=per_doc.index).reorder_levels(["doc", "condition", "alpha"])
    out = wide.rename(columns={"auc": "tolerance"}).assign(tolerance_unedited=tol_u.reindex(wide.index).to_numpy())
    cols = ["doc", "condition", "alpha", "damage", "tolerance", "tolerance_unedited"]
    if "attn_kl" in rows.columns:  # per sequence (repeated over its fractions): sequences first, then the document
        seq_kl = rows.groupby(["doc", "condition", "alpha", "seq"])["attn_kl"].mean()
        out["attn_kl"] = seq_kl.groupby(["doc", "condition", "alpha"]).mean().reindex(out.index).to_numpy()
        cols.append("attn_kl")
    out = out.reset_index()[cols]
    out.columns.name = None
    return out
