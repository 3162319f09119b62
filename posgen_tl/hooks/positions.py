"""Position hooks: run a model as if its RoPE saw other position ids, or capped distances, and stop
the forward pass early once the target residual is read (docs/method.md §4, §7).

Each builder returns ``list[(hook_name, fn)]`` for ``model.hooks(fwd_hooks=...)`` /
``model.run_with_hooks``; with :mod:`posgen_tl.hooks.capture`, :mod:`posgen_tl.hooks.edits` and
:mod:`posgen_tl.hooks.logits`, the only code that knows hook names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from posgen_tl.hooks.capture import (
    CaptureError,
    StopForward,
    from_heads,
    pre_rotation_stash,
    probe_hooks,
    refuse_multistream,
    require_pre_softmax,
    stash_shape,
    to_heads,
)
from posgen_tl.hooks.chunked import chunk_range, chunk_safe, run_chunks
from posgen_tl.hooks.gate import require_exact
from posgen_tl.io.spec import live_rope
from posgen_tl.maths.perturb import capped_scores
from posgen_tl.maths.rope import LayerRope, RopeError, rotate, unrotate

__all__ = ["reposition_hooks", "distance_cap_hooks", "final_residual_hook", "chunked_logit_rows", "StopForward",
           "stash_shape", "HookList"]

HookList = list[tuple[str, Callable]]


def _pos_for(position_ids: Tensor, batch: int, device) -> Tensor:
    p = position_ids.to(device)
    return p.expand(batch, -1) if p.ndim == 1 else p


def _span_ids(position_ids: Tensor, batch: int, n_pos: int, device) -> tuple[Tensor, Tensor]:
    """``(the positions the forward runs at, the ids to give them)`` for the ``n_pos`` positions a hook sees: all of
    them, or in a chunked forward (:func:`~posgen_tl.hooks.chunked.chunk_range`) the chunk's."""
    c0, c1, _ = chunk_range(n_pos)
    return torch.arange(c0, c1, device=device), _pos_for(position_ids, batch, device)[:, c0:c1]


def reposition_hooks(model: Any, position_ids: Int[Tensor, "pos"] | Int[Tensor, "batch pos"]) -> HookList:
    """T2 by re-rotation: the model runs with positions ``arange``; these hooks make every
    layer's RoPE use ``position_ids`` instead.

    Where ``hook_rot_q``/``hook_rot_k`` fire: ``x ← rotate(unrotate(x, arange), position_ids)``.
    Otherwise (rotation inside the model without hooks) at the pre-rotation hooks:
    ``x ← unrotate(rotate(x, position_ids), arange) = R_{ids − arange} x``, which the model's own
    rotation then turns into ``R_ids x``. Equal to passing ``position_ids`` to the forward up to
    float rounding.
    """
    spec, info = probe_hooks(model)
    require_exact(model, None, "re-positioning by hooks")
    refuse_multistream(position_ids, spec.model_name)
    dyn = spec.extra.get("dynamic_max_len")
    if dyn is not None and int(torch.as_tensor(position_ids).max()) + 1 > int(dyn):
        raise RopeError(
            f"{spec.model_name}: dynamic-NTK RoPE recomputes its frequencies from the largest position id past "
            f"{dyn}; re-rotating to ids up to {int(torch.as_tensor(position_ids).max())} inside a forward run at "
            "0…n−1 would not give the frequencies the model would use: pass position_ids to the forward instead "
            "(a TransformerBridge takes them)"
        )
    out: HookList = []

    def at_rot(x: Tensor, hook: Any, rope: LayerRope) -> Tensor:
        ar, new = _span_ids(position_ids, x.shape[0], x.shape[1], x.device)
        return rotate(unrotate(x.float(), ar, rope), new, rope).to(x.dtype)

    def at_pre(x: Tensor, hook: Any, rope: LayerRope) -> Tensor:
        xs = to_heads(x, info.normed_layout, spec.d_head)
        ar, new = _span_ids(position_ids, xs.shape[0], xs.shape[1], x.device)
        y = unrotate(rotate(xs.float(), new, rope), ar, rope).to(x.dtype)
        return from_heads(y, info.normed_layout, x)

    for layer in range(spec.n_layers):
        rope = spec.layer(layer)
        if not info.rot_fires and info.normed_layout == "flat_prescale":  # pragma: no cover - TL guarantees it
            raise CaptureError(f"{spec.model_name}: QK-norm without firing hook_rot_q/k: cannot re-position")
        if not info.rot_fires and info.clip_qk is not None:
            raise CaptureError(f"{spec.model_name}: q/k are clamped (clip_qkv = {info.clip_qk:g}) after the pre-rotation "
                               "hook and hook_rot_q/k do not fire: a rotation applied at that hook would be clamped "
                               "too, so re-positioning by hooks is not exact; pass position_ids to the forward instead")
        # chunk_safe: in a chunked forward each chunk is re-rotated at its own positions (a cached key keeps its ids)
        if info.rot_fires:
            for h in ("hook_rot_q", "hook_rot_k"):
                out.append((info.name(layer, h), chunk_safe(functools.partial(at_rot, rope=rope))))
        else:
            for h in (info.q_hook, info.k_hook):
                out.append((info.name(layer, h), chunk_safe(functools.partial(at_pre, rope=rope))))
    return out


def distance_cap_hooks(model: Any, cap: int, layers: Sequence[int] | None = None) -> HookList:
    """T3, LM-Infinite style: replace ``hook_attn_scores`` by logits with distance ``min(i−j, cap)``.

    Pre-rotation q/k of the layer are stashed by hooks on the q/k hooks, then the scores
    hook returns :func:`posgen_tl.maths.perturb.capped_scores` (``-inf`` on masked keys, the
    layer's sliding window kept; Gemma-style logit soft-capping applied if the model has it).

    Raises:
        CaptureError: the model's ``hook_attn_scores`` are not pre-softmax logits.
    """
    spec, info = require_pre_softmax(model, "recomputing capped logits")
    softcap = spec.extra.get("attn_logit_softcapping")
    layers = range(spec.n_layers) if layers is None else layers
    require_exact(model, layers, "distance-capped logits")
    out: HookList = []
    for layer in spec.layer_indices(layers):
        rope, stash = spec.layer(layer), dict[str, Tensor]()

        def scores(w: Tensor, hook: Any, stash=stash, rope=rope, layer=layer) -> Tensor:
            rope = live_rope(model, spec, layer, rope)  # dynamic NTK: the frequencies of THIS forward
            new = capped_scores(stash["q"], stash["k"], rope, cap)
            if softcap:
                new = torch.tanh(new / softcap) * softcap
            stash.clear()
            return new.to(w.dtype)

        out += pre_rotation_stash(model, info, layer, spec.d_head, stash)
        out.append((info.name(layer, "hook_attn_scores"), scores))
    return out


def final_residual_hook(model: Any, store: dict, start: int, stop: int) -> tuple[str, Callable] | None:
    """``(name, fn)`` on the final norm's output: stores ``x[:, start:stop]`` in ``store['resid']``
    and raises :class:`StopForward` (so no full-vocabulary logits are computed).

    Returns ``None`` when the model has no ``ln_final.hook_out`` or no ``unembed``, or soft-caps its
    output logits after the unembedding (Gemma2: ``final_logit_softcapping``, which ``model.unembed``
    alone would skip) — then compute full logits instead.
    """
    name = "ln_final.hook_out"
    if name not in getattr(model, "hook_dict", {}) or not hasattr(model, "unembed"):
        return None
    if probe_hooks(model)[0].extra.get("final_logit_softcapping"):
        return None

    def fn(x: Tensor, hook: Any) -> None:
        store["resid"] = x[:, start:stop]
        raise StopForward

    return name, fn


def chunked_logit_rows(model: Any, tokens: Tensor, chunk: int, hooks: Sequence[tuple[str, Callable]],
                       rows: tuple[int, int], position_ids: Tensor | None = None) -> Tensor:
    """The logits of rows ``[r0, r1)`` of a forward of ``tokens`` run ``chunk`` positions at a time through the
    model's cache (:func:`~posgen_tl.hooks.chunked.run_chunks`, ``hooks`` on every chunk): those rows' final-norm
    outputs gathered from the chunks that hold them and unembedded (a model that soft-caps its output logits: those
    chunks' own logits), every other chunk stopped at the final norm — no logits of the whole sequence.

    Returns ``[batch, r1 − r0, d_vocab]``."""
    n = tokens.shape[1]
    r0, r1 = rows
    if not 0 <= r0 < r1 <= n:
        raise ValueError(f"rows {r0} … {r1 - 1} are outside the {n} positions")
    final = "ln_final.hook_out" in getattr(model, "hook_dict", {})
    resid = final_residual_hook(model, {}, 0, 1) is not None  # False: the logits are soft-capped (or no final hook)
    stores: dict[int, dict] = {}

    def halt(x: Tensor, hook: Any) -> None:
        raise StopForward

    def hooks_for(c0: int, c1: int) -> list:
        lo, hi = max(r0, c0), min(r1, c1)
        if lo >= hi:  # no row wanted in this chunk: its keys and values are cached, nothing more is needed
            return list(hooks) + ([("ln_final.hook_out", halt)] if final else [])
        fin = final_residual_hook(model, stores.setdefault(c0, {}), lo - c0, hi - c0) if resid else None
        return list(hooks) + ([fin] if fin else [])

    outs = run_chunks(model, tokens, chunk, hooks_for, position_ids=position_ids,
                      return_type=None if resid else "logits")
    parts = []
    for c0 in range(0, n, chunk):
        lo, hi = max(r0, c0), min(r1, c0 + chunk)
        if lo < hi:
            parts.append(stores[c0]["resid"] if resid else outs[c0][:, lo - c0 : hi - c0])
    return model.unembed(torch.cat(parts, 1)) if resid else torch.cat(parts, 1)
