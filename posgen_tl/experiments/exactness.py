"""Exactness check: our RoPE, recomputed logits, mask and pattern against the model's own.

For every selected layer, on the given tokens:

* rotation: ``R_pos(q_pre)`` (our spec) against an INDEPENDENT rotation — the model's ``hook_rot_q``/
  ``hook_rot_k`` where they fire, and the model's own rotation table (``hook_cos``/``hook_sin`` of the
  same forward pass, or a rotary buffer such as GPT-J's sin/cos table) applied to the same q/k;
* scores: ``s · rot_q · rot_k`` (soft-capped where the model soft-caps) against ``hook_attn_scores`` on
  the entries the layer's mask (causal, and its sliding window) leaves visible — or, where the hook
  holds post-softmax weights, our pattern against it;
* mask: where the model's scores are masked before the hook, the entries it hides must be exactly the
  ones our mask hides;
* pattern: the softmax over the keys OUR mask leaves visible (learned attention sinks included) of the
  model's own pre-softmax logits, against ``hook_pattern`` (isolates the mask and the sinks; our logits
  were compared with the model's above).

A layer ``passed`` only if each of these was compared, at least :data:`MIN_COMPARED_ENTRIES` unmasked
score entries were compared, and every error is within tolerance. ``failed``: a comparison exceeded
its tolerance. ``not checked``: something could not be compared (no independent rotation, no usable
scores, too few entries) — the ``reason`` column says what; such a layer is never counted as passed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from posgen_tl.experiments import base
from posgen_tl.hooks.capture import HookInfo, QKCapture, masked_threshold, model_dtype, probe_hooks
from posgen_tl.hooks.stream import ROT_RTOL, rotation_tolerance, stream_qk
from posgen_tl.maths.rope import attention_pattern, causal_mask, rotate, rotate_with_table

__all__ = ["Config", "Result", "run", "render", "text", "verdict", "window_length", "exactness_table", "exceeds", "worst", "non_finite", "tolerances", "ROT_RTOL", "SCORE_RTOL", "PATTERN_ATOL", "MIN_COMPARED_ENTRIES"]

#: tolerances, relative to the largest |value| of the compared tensor (float32 maths); ROT_RTOL is the
#: capture's own (hooks.capture), which every capture checks its rotation against
SCORE_RTOL = 1e-5
PATTERN_ATOL = 1e-5
#: a layer passes only after comparing at least this many unmasked score entries (batch × heads × entries)
MIN_COMPARED_ENTRIES = 16


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """``{"rot", "score", "pattern"}`` tolerances for a model whose parameters are ``dtype``: the float32
    ones above, or ``8·eps`` of a bf16/fp16 dtype (such a model rounds its own rotation and scores to
    its precision; captures are float32). Rotation and scores are relative to the largest |value|,
    the pattern absolute."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    return {"rot": rotation_tolerance(dtype), "score": max(SCORE_RTOL, 8 * eps), "pattern": max(PATTERN_ATOL, 8 * eps)}


def exceeds(err: float, limit: float) -> bool:
    """``True`` unless ``err <= limit`` holds: a NaN or infinite error never counts as within tolerance."""
    return not (math.isfinite(err) and err <= limit)


def worst(*errs: float) -> float:
    """The largest error, NaN if any is NaN (Python's ``max`` silently drops a NaN that is not first)."""
    return math.nan if any(math.isnan(e) for e in errs) else max(errs)


def non_finite(**tensors: Tensor | None) -> list[str]:
    """The names of the given tensors (``None`` skipped) that hold a NaN or an infinity."""
    return [name for name, t in tensors.items() if t is not None and not bool(torch.isfinite(t).all())]


def exactness_table(
    model: Any, tokens: Tensor, layers: Sequence[int] | None = None, *, progress: bool = False
) -> pd.DataFrame:
    """One row per layer: what was compared with the model, the errors, and a status.

    Columns: ``layer, kind, rot_source, rot_check, rot_q_max_err, rot_k_max_err, rot_ref, scores_kind,
    score_max_err, score_ref, score_rel_err, mask_mismatch, pattern_max_err, n_compared, status, reason,
    passed``. Errors are max absolute differences; ``*_ref`` is the max |value| they are relative to;
    ``rot_check`` names the independent rotation(s) compared with (``hook_rot``, ``hook_cos/hook_sin``,
    ``embed_positions``, ``rotary.cos_cached``; ``none``); ``n_compared`` counts the unmasked score
    entries compared; ``status`` is ``passed`` / ``failed`` / ``not checked`` and ``reason`` says why
    when not passed; ``passed`` is ``status == "passed"``. Tolerances: :func:`tolerances` of the model's
    dtype.
    """
    spec, info = probe_hooks(model)
    rows: list[dict] = []
    tol = tolerances(model_dtype(model))
    thr = masked_threshold(model_dtype(model))
    with_scores = info.scores_kind in ("pre_softmax", "post_softmax")
    with_pattern = info.pattern_fires and info.scores_kind != "post_softmax"
    cap = spec.extra.get("attn_logit_softcapping")
    sinks_all = spec.extra.get("attention_sinks") or {}

    def check(c: QKCapture) -> None:
        rows.append(_layer_row(c, info, tol, thr, cap, sinks_all.get(c.layer)))

    stream_qk(model, tokens, check, layers, with_scores=with_scores, batch_size=max(1, tokens.shape[0]),
              progress="exactness" if progress else False, with_tables=True, with_pattern=with_pattern, _gate=False)
    return pd.DataFrame(rows)


def _layer_row(c: QKCapture, info: HookInfo, tol: dict[str, float], thr: float, cap: float | None,
               sinks: Tensor | None) -> dict[str, Any]:
    """The row of :func:`exactness_table` for one captured layer ``c``: every comparison with its errors, then
    ``status``, ``reason`` and ``passed``. ``info``: the model's hooks (:func:`~posgen_tl.hooks.capture.probe_hooks`);
    ``tol``: :func:`tolerances` of the model's dtype; ``thr``: a score at or below it is a masked entry; ``cap``: the
    logit soft-cap (falsy: none); ``sinks``: the layer's learned attention sinks ``[head]`` (``None``: none)."""
    lr = c.rope
    row: dict[str, Any] = dict(layer=c.layer, kind=lr.kind, rot_source=c.rot_source)
    checks, eq, ek, ref = _rotation_errors(c, row)
    row["scores_kind"] = c.scores_kind
    failed: list[str] = []
    unchecked: list[str] = []
    visible_scores = None
    if c.scores is not None and c.scores_kind == "pre_softmax":
        visible_scores = c.scores[..., causal_mask(c.q.shape[1], sliding_window=lr.sliding_window,
                                                  device=c.q.device)]
    bad = non_finite(q=c.q, k=c.k, rot_q=c.rot_q, rot_k=c.rot_k, table_cos=c.table_cos, table_sin=c.table_sin,
                     scores=visible_scores if c.scores_kind == "pre_softmax" else c.scores, pattern=c.pattern)
    if bad:
        failed.append(f"non-finite values (NaN or inf) in the captured {', '.join(bad)}: nothing compared with "
                      "them can be called equal")
    if not checks:
        unchecked.append("no independent rotation to compare with (hook_rot_q/k, hook_cos/hook_sin and a "
                         "rotary table are all unavailable)")
    elif exceeds(worst(eq, ek), tol["rot"] * ref):
        failed.append(f"rotation differs from {row['rot_check']} by {worst(eq, ek) / ref:.3g} (relative)")
    n = c.q.shape[1]
    m = causal_mask(n, sliding_window=lr.sliding_window, device=c.q.device)
    row.update(score_max_err=float("nan"), score_ref=float("nan"), score_rel_err=float("nan"),
               mask_mismatch=float("nan"), pattern_max_err=float("nan"), n_compared=0)
    w = c.logits()
    if cap:
        w = torch.tanh(w / cap) * cap
    _compare_scores(c, w, m, sinks, info, tol, thr, row, failed, unchecked)
    if c.pattern is not None:
        # the mask and sinks, isolated: our mask (and sinks) applied to the model's OWN logits where the
        # hook gives them (a bf16/fp16 model's logits round to its precision; ours were compared above)
        base = c.scores if c.scores is not None and c.scores_kind == "pre_softmax" else w
        p = attention_pattern(base, m, sinks).to(c.pattern.dtype)
        perr = (p - c.pattern).abs().max().item()
        row["pattern_max_err"] = perr
        if exceeds(perr, tol["pattern"]):
            failed.append(f"attention pattern differs from hook_pattern by {perr:.3g}"
                          + ("" if sinks is not None else " (learned attention sinks, if any, are not modelled)"))
    status = "failed" if failed else ("not checked" if unchecked else "passed")
    row.update(status=status, reason="; ".join(failed + unchecked), passed=status == "passed")
    return row


def _rotation_errors(c: QKCapture, row: dict[str, Any]) -> tuple[list[str], float, float, float]:
    """Our rotation of the captured pre-rotation q/k against every independent rotation the capture holds (the
    model's ``hook_rot_q/k``, its own rotation table); writes ``rot_ref``, ``rot_check``, ``rot_q_max_err`` and
    ``rot_k_max_err`` into ``row``.

    Returns:
        ``(checks, eq, ek, ref)``: the names of the rotations compared with (empty: none), the max |error| of our
        rotated q and of our rotated k (the worst over ``checks``), and ``ref``, the max |value| of the model's
        rotated q/k the errors are relative to.
    """
    lr = c.rope
    rq, rk = rotate(c.q, c.positions, lr), rotate(c.k, c.positions, lr)
    ref = max(c.rot_q.abs().max().item(), c.rot_k.abs().max().item()) + 1e-30
    row["rot_ref"] = ref
    checks, eq, ek = [], 0.0, 0.0
    if c.rot_source == "hook":
        checks.append("hook_rot")
        eq, ek = (rq - c.rot_q).abs().max().item(), (rk - c.rot_k).abs().max().item()
    if c.table_cos is not None:
        checks.append(c.table_source)
        tq = rotate_with_table(c.q, c.table_cos, c.table_sin, lr)
        tk = rotate_with_table(c.k, c.table_cos, c.table_sin, lr)
        eq = worst(eq, (rq - tq).abs().max().item(), c.table_format_err * c.q.abs().max().item())
        ek = worst(ek, (rk - tk).abs().max().item(), c.table_format_err * c.k.abs().max().item())
    row["rot_check"] = "+".join(checks) or "none"
    row["rot_q_max_err"], row["rot_k_max_err"] = (eq, ek) if checks else (float("nan"), float("nan"))
    return checks, eq, ek, ref


def _compare_scores(c: QKCapture, w: Tensor, m: Tensor, sinks: Tensor | None, info: HookInfo, tol: dict[str, float],
                    thr: float, row: dict[str, Any], failed: list[str], unchecked: list[str]) -> None:
    """Our (soft-capped) logits ``w`` ``[batch, head, query, key]`` (or their pattern, where the hook holds
    post-softmax weights) against the model's ``hook_attn_scores`` on the entries our mask ``m`` ``[query, key]``
    leaves visible, and the model's own mask against ours; writes the score columns of ``row`` and appends what
    failed or could not be compared to ``failed`` / ``unchecked``."""
    lr = c.rope
    if c.scores is not None and c.scores_kind in ("pre_softmax", "post_softmax"):
        n_cmp = int(m.sum().item()) * w.shape[0] * w.shape[1]
        row["n_compared"] = n_cmp
        if c.scores_kind == "post_softmax":
            p = attention_pattern(w, m, sinks).to(c.scores.dtype)
            err = (p - c.scores).abs().max().item()  # every entry: masked ones must be 0 in the model too
            row.update(score_max_err=err, score_ref=1.0, score_rel_err=err, pattern_max_err=err)
            if exceeds(err, tol["pattern"]):
                failed.append(f"attention pattern (post-softmax hook_attn_scores) differs by {err:.3g}")
        else:
            err = (w - c.scores)[..., m].abs().max().item()
            sref = c.scores[..., m].abs().max().item() + 1e-30
            row.update(score_max_err=err, score_ref=sref, score_rel_err=err / sref)
            if exceeds(err, tol["score"] * sref):
                failed.append(f"scores differ from hook_attn_scores by {err / sref:.3g} (relative)")
            if info.scores_masked:
                hidden = c.scores <= thr
                mism = int((hidden[..., m]).sum().item() + (~hidden[..., ~m]).sum().item())
                row["mask_mismatch"] = mism
                if mism:
                    failed.append(f"the model's mask differs from ours (sliding window {lr.sliding_window}) "
                                  f"in {mism} entries")
        if n_cmp < MIN_COMPARED_ENTRIES:
            unchecked.append(f"only {n_cmp} unmasked score entries compared (< {MIN_COMPARED_ENTRIES}); "
                             "use longer or more sequences")
    elif info.scores_kind == "unknown":
        unchecked.append("hook_attn_scores matched neither our logits nor our pattern in the probe ('unknown'): "
                         "no score was compared")
    else:
        unchecked.append(f"hook_attn_scores is {info.scores_kind!r}: no score was compared")


# ----------------------------------------------------------------------------- the experiment


NAME = "exactness"
ABOUT = "captured q/k reproduce the model's rotation and scores (docs/method.md §1)"
NEEDS: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config(base.Config):
    """Options of the exactness check (``posgen-tl check`` and the report's first section)."""

    NAME: ClassVar[str] = NAME
    n_seq: int = base.option(2, "sequences compared", "int")
    seq_len: int = base.option(64, "tokens per sequence", "int")
    layers: Any = base.option("all", "layers checked", "layers")


def window_length(spec: Any, seq_len: int) -> tuple[int, str]:
    """``(length, note)``: ``seq_len``, raised past the longest sliding window (+8 tokens, at most the
    model's context) so the window masks keys and the mask is compared; ``note`` says so ("" if unchanged)."""
    windows = sorted({lr.sliding_window for lr in spec.layers if lr.sliding_window})
    if not windows or seq_len > windows[-1]:
        return seq_len, ""
    longer = min(windows[-1] + 8, spec.n_ctx or windows[-1] + 8)
    if longer <= seq_len:
        return seq_len, ""
    return longer, (f"seq-len {seq_len} -> {longer}: the sliding window{'s' if len(windows) > 1 else ''} "
                    f"({', '.join(map(str, windows))} tokens) must mask keys for the mask to be checked")


class Result(base.Result):
    """The outcome of :func:`run`: ``tables["layers"]`` (:func:`exactness_table`, one row per layer), the Config's
    options and ``meta`` (model, the compared windows' length and why it was raised, dtype, tolerances);
    ``result.table`` is ``tables["layers"]``."""

    ALIASES: ClassVar[dict[str, str]] = {"table": "layers"}



#: the table's file in a study folder (the name published runs already carry)
FILES = {"layers": "exactness.csv"}


@base.shares_heap
def run(model: Any, cfg: Config | None = None, *, progress: bool = True, **overrides: Any) -> Result:
    """:func:`exactness_table` on ``cfg.n_seq`` consecutive chunks of the corpus, each
    :func:`window_length` tokens long, on the layers ``cfg.layers`` selects. Returns its :class:`Result`."""
    from posgen_tl.hooks.capture import model_dtype  # noqa: PLC0415
    from posgen_tl.io.corpus import corpus_tokens  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, overrides)
    spec = probe_hooks(model)[0]
    seq_len, note = window_length(spec, cfg.seq_len)
    layers = base.resolve_layers(cfg.layers, spec.n_layers)  # an index outside the model: a named error, first
    tokens = corpus_tokens(model, cfg.corpus, seq_len=seq_len, n_seq=cfg.n_seq)
    table = exactness_table(model, tokens, layers, progress=progress)
    dtype = model_dtype(model)
    meta = dict(model=spec.model_name, n_seq=int(tokens.shape[0]), seq_len=seq_len, seq_len_note=note,
                dtype=str(dtype).removeprefix("torch."), tolerances=tolerances(dtype),
                min_compared_entries=MIN_COMPARED_ENTRIES)
    return Result({"layers": table}, cfg.as_dict(), meta)


def text(result: Result) -> str:
    """What ``posgen-tl check`` prints of a :class:`Result`: the per-layer table, the reason of every layer that
    did not pass, and one closing line with the sizes, the tolerances and PASS/FAIL."""
    table, meta = result.tables["layers"], result.meta
    cols = ["layer", "kind", "rot_check", "rot_q_max_err", "rot_k_max_err", "scores_kind", "score_max_err",
            "score_rel_err", "mask_mismatch", "pattern_max_err", "n_compared", "status"]
    lines = [meta["seq_len_note"]] if meta.get("seq_len_note") else []
    with pd.option_context("display.width", 220, "display.max_rows", 200, "display.float_format", "{:.3g}".format):
        lines.append(table.reindex(columns=cols).to_string(index=False))
    ok, line = verdict(table)
    lines += [f"layer {r.layer}: {r.status}: {r.reason}" for r in table.itertuples() if r.status != "passed"]
    tol = meta["tolerances"]
    lines.append(f"exactness ({meta['n_seq']}×{meta['seq_len']} tokens of "
                 f"{'pydoc prose' if not result.config.get('corpus') else result.config['corpus']}; a layer passes after "
                 f"comparing ≥ {meta['min_compared_entries']} unmasked score entries and its rotation against the "
                 f"model's own; tolerances: rotation {tol['rot']:g}, scores {tol['score']:g} relative to max |value|, "
                 f"pattern {tol['pattern']:g}): {line}")
    return "\n".join(lines)


def verdict(table: pd.DataFrame) -> tuple[bool, str]:
    """``(passed, one line)``: passed only if the table has rows and every layer's status is
    ``passed``; otherwise the line counts failed and not-checked layers."""
    if table.empty:
        return False, "FAIL (no layer was compared)"
    bad = table[table["status"] != "passed"]
    if bad.empty:
        return True, "PASS"
    n_un = int((bad["status"] == "not checked").sum())
    return False, f"FAIL ({n_un} layer(s) not checked, {len(bad) - n_un} failed)"


def render(result: Result) -> Any:
    """The report section: PASS on every layer (the table folded away), or which layers failed and why."""
    from posgen_tl.report.html import Section, skipped_section  # noqa: PLC0415

    if result.skipped:
        return skipped_section("1 · Exactness of captured q/k", result.skipped, None, result.meta.get("hint"))
    df = result.tables["layers"]
    ok, line = verdict(df)
    res = {"passed": ok, "status_counts": df["status"].value_counts().to_dict(),
           "min_compared": int(df["n_compared"].min()),
           "max_rot_err": float(np.nanmax(df[["rot_q_max_err", "rot_k_max_err"]].to_numpy()))
           if df["rot_q_max_err"].notna().any() else None,
           "max_score_rel_err": float(df["score_rel_err"].max())}
    table = ("Per layer", df[["layer", "kind", "rot_check", "rot_q_max_err", "rot_k_max_err", "scores_kind",
                              "score_rel_err", "mask_mismatch", "pattern_max_err", "n_compared", "status"]])
    bad = df[df["status"] != "passed"]
    reasons = [f"Layer {r.layer}: {r.status}: {r.reason}" for r in bad.itertuples()]
    return Section(
        "1 · Exactness of captured q/k",
        verdict=(f"PASS on all {len(df)} layers: our RoPE on the pre-rotation q/k reproduces the model's own rotation "
                 f"({', '.join(sorted(set(df['rot_check'])))}), and s·rot_q·rot_k reproduces hook_attn_scores "
                 f"(max relative score error {res['max_score_rel_err']:.3g}; at least {res['min_compared']} "
                 "unmasked entries compared per layer)." if ok else
                 f"{line}: the captured q/k are not shown to reproduce the model's scores on every layer; every "
                 "later number is suspect."),
        paragraphs=[] if ok else ["Every later number is computed from these captured tensors; a layer that failed or "
                                  "was not checked makes them unverified.", *reasons],
        tables=[] if ok else [table],
        details=[table] if ok else [],
        results=res,
    )
