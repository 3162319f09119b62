"""The logits W from the forward's own ``hook_attn_scores``, where it holds them: the decomposition
(:mod:`posgen_tl.engine.decompose_scores`) and the feature statistics' logit spread
(:mod:`posgen_tl.experiments.pattern`) read W there instead of recomputing it from q and k — after comparing it, on a
few query rows of every capture, with W recomputed from the captured q/k; a capture whose scores differ (a hook that
edits them, a soft-cap, scores that are the pattern) is recomputed."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from posgen_tl.hooks.capture import QKCapture, model_dtype, probe_hooks

__all__ = ["SCORES_RTOL", "hook_w", "scores_are_w"]

#: the largest difference (relative to the rows' largest |W|) at which the score hook's logits count as W
SCORES_RTOL = 1e-5


def scores_are_w(model: Any) -> bool:
    """Whether ``hook_attn_scores`` holds the logits W themselves on this model: pre-softmax (the probe compared
    them with our logits), no soft-cap, float32 (a half-precision model's own logits are rounded to its dtype)."""
    spec, info = probe_hooks(model)
    return (info.scores_kind == "pre_softmax" and not spec.extra.get("attn_logit_softcapping")
            and model_dtype(model) == torch.float32)


def hook_w(c: QKCapture, w_rows: Float[Tensor, "maps rows key_pos"], rows: Tensor,
           mask: Bool[Tensor, "rows key_pos"]) -> Float[Tensor, "maps query_pos key_pos"] | None:
    """The capture's W from the forward's own ``hook_attn_scores`` (float32 ``[(batch head_index), query_pos,
    key_pos]``, a view: never written to), after comparing it on the query ``rows`` with ``w_rows`` — W recomputed
    there from q and k (float32 products of other roundings than the model's, ~1e-7 of the largest |W| from it) — on
    the entries of ``mask`` (the mask's ``rows``: the hidden entries, −inf in the scores, left out); ``None``
    (recompute) when the capture has no scores, ``mask`` keeps nothing, or they differ by more than
    :data:`SCORES_RTOL` of the rows' largest |W| (a NaN anywhere fails too)."""
    if c.scores is None:  # (the capture holds float32: a half-precision model is excluded by scores_are_w)
        return None
    b, h, n = c.scores.shape[0], c.scores.shape[1], c.scores.shape[-1]
    sv = c.scores.reshape(b * h, n, n)
    if not bool(mask.any()):  # nothing to compare on these rows: never taken unchecked
        return None
    d = torch.where(mask, sv.index_select(1, rows) - w_rows, 0.0)  # the hidden entries (−inf) left out
    scale = torch.where(mask, w_rows, 0.0).abs_().amax()
    err = d.abs_().amax()
    return sv if bool(err <= SCORES_RTOL * scale) else None
