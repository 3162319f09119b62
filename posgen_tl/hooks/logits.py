"""Logit substitution hooks: rewrite a layer's pre-softmax scores from its captured q/k — LM-Infinite,
the "disentangled" approximation, the sufficiency substitution ``W ← f + g`` and window removal
(docs/method.md §5, §7).

One generic builder (:func:`logit_substitution_hooks`) and small specialisations; each returns
``list[(hook_name, fn)]``. The pure logit maps live in :mod:`posgen_tl.maths.approx_logits`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from posgen_tl.hooks.capture import (
    CaptureError,
    pre_rotation_stash,
    probe_hooks,
    refuse_multistream,
    require_pre_softmax,
)
from posgen_tl.hooks.chunked import chunk_safe, chunk_span
from posgen_tl.hooks.gate import require_exact
from posgen_tl.hooks.stacking import cache_rows
from posgen_tl.io.spec import live_rope
from posgen_tl.maths.approx_logits import (
    causal_visible,
    d3_approx_logits,
    d3_row_blocks,
    disentangled_logits,
    distances,
    exact_logits,
    lm_infinite_logits,
    quantile_mask,
)
from posgen_tl.maths.decompose import fit_additive
from posgen_tl.maths.rope import LayerRope, expand_kv, rotate

__all__ = ["LogitContext", "RowValues", "logit_substitution_hooks", "lm_infinite_hooks", "disentangled_hooks",
           "sufficiency_hooks", "window_removal_hooks", "local_layers"]

HookList = list[tuple[str, Callable]]


@dataclass
class LogitContext:
    """What a logit-substitution function receives, per layer and forward pass.

    Attributes:
        layer: layer index.
        q: pre-rotation queries ``[batch, pos, head_index, d_head]`` float32 (Gemma3: after QK-norm).
        k: pre-rotation keys ``[batch, pos, kv_head, d_head]`` float32.
        positions: position ids the model's RoPE used ``[batch, pos]``.
        rope: this layer's :class:`~posgen_tl.maths.rope.LayerRope`.
        scores: the model's own ``hook_attn_scores`` ``[batch, head_index, query_pos, key_pos]``
            (masked, soft-capped where the model soft-caps).
    """

    layer: int
    q: Tensor
    k: Tensor
    positions: Tensor
    rope: LayerRope
    scores: Tensor


@dataclass(frozen=True)
class RowValues:
    """What a substitution function may return instead of ``(values, replace)`` when its values come a block of
    query rows at a time: ``of(r0, r1)`` gives rows ``r0 … r1 − 1`` on keys ``0 … r1 − 1`` (PRE-soft-cap logits
    ``[batch, head_index, r1 − r0, r1]``), and every entry the model may see with key index ``≥ first_key`` is
    replaced. The hook then writes the new scores block by block (on the CPU blocks of cache size,
    :func:`posgen_tl.hooks.stacking.cache_rows`; on other devices the whole map at once) instead of building the
    map-sized ``values`` and ``replace`` and combining them in passes over memory — and never computes a key after its
    query's row."""

    of: Callable[[int, int], Tensor]
    first_key: int = 0


SubstFn = Callable[[LogitContext], "tuple[Tensor | None, Tensor] | RowValues"]


def local_layers(model: Any) -> list[int]:
    """Layers with a sliding window (Gemma3 'local' layers); ``[]`` for full-attention models."""
    spec, _ = probe_hooks(model)
    return [layer for layer in range(spec.n_layers) if spec.layer(layer).sliding_window is not None]


def _softcap(x: Tensor, cap: float | None) -> Tensor:
    if not cap:
        return x
    return torch.where(torch.isfinite(x), torch.tanh(x / cap) * cap, x)


def logit_substitution_hooks(
    model: Any, fn: SubstFn | None, layers: Sequence[int] | None = None, *,
    position_ids: Int[Tensor, "pos"] | Int[Tensor, "batch pos"] | None = None, remove_window: bool = False,
    rows_only: bool = False,
) -> HookList:  # fmt: skip
    """The generic substitution: rewrite the pre-softmax scores of ``layers`` from captured q/k.

    Hooks on the layer's pre-rotation q/k hooks (``hook_q``/``hook_k``, or ``hook_q_normed``/
    ``hook_k_normed`` on QK-norm models) stash the tensors; the ``hook_attn_scores`` hook calls
    ``fn(LogitContext)`` → ``(values, replace)``: ``values`` are PRE-soft-cap logits
    ``[batch, head_index, query_pos, key_pos]`` (``-inf`` = hide the key; ``None`` when ``replace``
    is all False), ``replace`` a bool mask broadcastable to them — or a :class:`RowValues` (values a block of query
    rows at a time, every visible key from its ``first_key`` on replaced; the sufficiency substitution's ``f + g``).
    The returned scores are ``where(replace, softcap(values), scores)``
    restricted to the entries the model may see: causal by sequence index and, unless
    ``remove_window``, inside the layer's sliding window. Entries not replaced keep the model's
    own value bit for bit (so a substitution that replaces nothing is an exact no-op).

    ``remove_window=True``: on layers with a sliding window the entries outside it are
    recomputed (``fn``'s values there, or the exact logits when ``fn`` is None) — local layers
    then attend over the whole causal context. Layers without a window are untouched by it.

    ``position_ids``: the ids passed to the model's forward (a gap probe); ``None`` = ``arange``.

    ``rows_only``: ``fn`` always returns :class:`RowValues` — then the hooks are
    :func:`~posgen_tl.hooks.chunked.chunk_safe` and also rewrite the scores of a forward run a chunk at a time through
    the model's cache (:func:`_chunk_scores`: the chunk's queries against the keys the cache hands it), so the
    substitution runs on sequences whose whole forward does not fit in memory. Not with ``remove_window`` (the cache
    holds no key beyond a window).

    Returns:
        ``[(hook_name, fn), ...]`` for ``model.hooks(fwd_hooks=...)`` / ``run_with_hooks``.

    Raises:
        CaptureError: the model's ``hook_attn_scores`` are not pre-softmax logits.
    """
    spec, info = require_pre_softmax(model, "logit substitution")
    softcap = spec.extra.get("attn_logit_softcapping")
    layers = range(spec.n_layers) if layers is None else layers
    require_exact(model, layers, "logit substitution")
    if position_ids is not None:
        refuse_multistream(position_ids, spec.model_name)
    if rows_only and (fn is None or remove_window):
        raise ValueError("rows_only needs a substitution fn and cannot remove windows")
    out: HookList = []
    for layer in spec.layer_indices(layers):
        rope, stash, keys = spec.layer(layer), dict[str, Tensor](), dict[str, Tensor]()
        if fn is None and not (remove_window and rope.sliding_window is not None):
            continue  # nothing to do on this layer

        def scores(w: Tensor, hook: Any, stash=stash, rope=rope, layer=layer, keys=keys) -> Tensor:
            q, k = stash.pop("q"), stash.pop("k")
            rope = live_rope(model, spec, layer, rope)  # dynamic NTK: the frequencies of THIS forward
            span = chunk_span()
            if span is not None:
                if not rows_only:
                    raise CaptureError(f"layer {layer}: a logit substitution without rows_only ran in a chunked forward")
                return _chunk_scores(w, q, k, span, keys, fn, layer, rope, position_ids, softcap)  # type: ignore[arg-type]
            b, n = q.shape[0], q.shape[1]
            pos = torch.arange(n, device=q.device) if position_ids is None else position_ids.to(q.device)
            if pos.shape[-1] != n:
                raise ValueError(f"position_ids have {pos.shape[-1]} entries but the sequence has {n}")
            pos = pos.expand(b, n) if pos.ndim == 1 else pos
            vis = causal_visible(n, q.device)
            unwin = torch.zeros_like(vis)
            if rope.sliding_window is not None:
                idx = torch.arange(n, device=q.device)
                inside = idx[:, None] - idx[None, :] < rope.sliding_window
                if remove_window:
                    unwin = vis & ~inside
                else:
                    vis = vis & inside
            if fn is None:
                if not bool(unwin.any()):
                    return w
                values, replace = exact_logits(q, k, rope, pos, dtype=torch.float32), unwin
            else:
                res = fn(LogitContext(layer, q, k, pos, rope, w))
                if isinstance(res, RowValues):
                    return _write_rows(w, res, vis, unwin, softcap)
                values, replace = res
                replace = (replace & vis) | unwin
                if values is None:  # fn replaces nothing; only the window's entries may need values
                    if not bool(unwin.any()):
                        return w
                    values = exact_logits(q, k, rope, pos, dtype=torch.float32)
            if not bool(replace.any()):
                return w
            return torch.where(replace, _softcap(values, softcap).to(w.dtype), w)

        hooks = pre_rotation_stash(model, info, layer, spec.d_head, stash) + [(info.name(layer, "hook_attn_scores"), scores)]
        out += [(nm, chunk_safe(f)) for nm, f in hooks] if rows_only else hooks
    return out


def _chunk_scores(w: Tensor, q: Tensor, k: Tensor, span: tuple[int, int, int], keys: dict[str, Tensor], fn: SubstFn,
                  layer: int, rope: LayerRope, position_ids: Tensor | None, softcap: float | None) -> Tensor:
    """The substitution on the chunk ``[c0, c1)`` of an ``n``-token chunked forward: ``w`` ``[batch, head_index, c1 −
    c0, n_keys]`` holds the chunk's queries against the last ``n_keys`` positions the model's cache hands on (all
    ``c1`` of them, or a sliding window's); ``q``/``k`` are the chunk's own pre-rotation q/k, the keys before it are
    kept in ``keys`` from the earlier chunks (dropped after the last). ``fn`` sees those keys with the chunk's queries
    in their last rows; its :class:`RowValues` give the chunk's rows. Checked first: the model's diagonal scores
    (each query with its own key) equal ours, so the keys are where they are assumed to be.

    Raises:
        CaptureError: the chunk's shapes, or its diagonal scores, are not the ones assumed."""
    c0, c1, n = span
    prev = keys.pop("k", None)
    prev = prev if c0 else None  # a new sequence (or an earlier forward that stopped half-way): no keys before
    kall = k if prev is None else torch.cat([prev, k], 1)
    if c1 < n:
        keys["k"] = kall
    b, m, h, d = q.shape
    nk = w.shape[-1]
    if k.shape[1] != m or kall.shape[1] != c1 or not m <= nk <= c1:
        raise CaptureError(f"layer {layer}: a chunk of positions {c0} … {c1 - 1} brought {k.shape[1]} keys "
                           f"({kall.shape[1]} so far) and scores on {nk} keys")
    pos = torch.arange(n, device=q.device) if position_ids is None else position_ids.to(q.device)
    pos = pos.expand(b, n) if pos.ndim == 1 else pos
    _check_diagonal(w, q, k, pos[:, c0:c1], rope, softcap, layer)
    qw = q.new_zeros((b, nk, h, d))
    qw[:, nk - m :] = q
    res = fn(LogitContext(layer, qw, kall[:, c1 - nk :], pos[:, c1 - nk : c1], rope, w))
    if not isinstance(res, RowValues):
        raise CaptureError(f"layer {layer}: a chunked forward needs a substitution that returns RowValues")
    i = torch.arange(c0, c1, device=w.device)[:, None]
    j = torch.arange(c1 - nk, c1, device=w.device)[None, :]
    keep = (j <= i) & (j >= res.first_key)
    if rope.sliding_window is not None:
        keep = keep & (i - j < rope.sliding_window)
    return torch.where(keep, _softcap(res.of(nk - m, nk), softcap).to(w.dtype), w)


def _check_diagonal(w: Tensor, q: Tensor, k: Tensor, pos: Tensor, rope: LayerRope, softcap: float | None,
                    layer: int) -> None:
    """Each query's score on its own key (the last ``m`` key columns of ``w``, on their diagonal) equals
    ``s·(R_p q)·(R_p k)`` from the chunk's pre-rotation q/k (soft-capped where the model caps), within ``max(1e-4,
    8·eps)`` of the scores' dtype times the larger of 1 and the largest |score|. Raises CaptureError if not."""
    m, h = q.shape[1], q.shape[2]
    rq, rk = rotate(q, pos, rope), rotate(expand_kv(k, h), pos, rope)
    ours = _softcap((rq * rk).sum(-1).transpose(1, 2) * rope.score_scale, softcap)  # b h m
    theirs = torch.diagonal(w[..., w.shape[-1] - m :], dim1=-2, dim2=-1).float()
    eps = torch.finfo(w.dtype).eps if w.dtype.is_floating_point else 1e-7
    err, ref = float((ours - theirs).abs().max()), float(ours.abs().max())
    if not err <= max(1e-4, 8 * eps) * max(1.0, ref):
        raise CaptureError(f"layer {layer}: in a chunked forward the model's scores of each query on its own key differ "
                           f"from ours by {err:.2e} (largest {ref:.2e}): its cache hands on keys other than assumed")


def _write_rows(w: Tensor, rv: RowValues, vis: Tensor, unwin: Tensor, softcap: float | None) -> Tensor:
    """New scores ``[batch, head_index, query_pos, key_pos]``: ``rv``'s values (soft-capped, in ``w``'s dtype) on the
    entries ``(vis & key ≥ rv.first_key) | unwin``, ``w`` elsewhere — written a block of query rows at a time into a
    fresh tensor (``w`` is left as it is: another hook, e.g. a cache, may hold it)."""
    n = w.shape[-1]
    keep = (vis & (torch.arange(n, device=w.device) >= rv.first_key)) | unwin  # [query_pos, key_pos]
    out = torch.empty_like(w)
    block = cache_rows(w.shape[0] * w.shape[1], n) if w.device.type == "cpu" else n
    for r0 in range(0, w.shape[-2], block):
        r1 = min(w.shape[-2], r0 + block)
        v = _softcap(rv.of(r0, r1), softcap).to(w.dtype)
        torch.where(keep[r0:r1, :r1], v, w[:, :, r0:r1, :r1], out=out[:, :, r0:r1, :r1])
        out[:, :, r0:r1, r1:] = w[:, :, r0:r1, r1:]  # keys after the block's last row: never visible, as they were
    return out


def window_removal_hooks(model: Any, layers: Sequence[int] | None = None) -> HookList:
    """Gemma3: local (sliding-window) layers attend over the whole causal context.

    Entries outside the window get their exact RoPE logits ``s·q_iᵀR_{j−i}k_j``; every entry the
    model already sees keeps its value bit for bit; layers without a window get no hook at all.
    ``layers``: restrict to these (default: all local layers).
    """
    local = local_layers(model)
    layers = local if layers is None else [x for x in layers if x in local]
    return logit_substitution_hooks(model, None, layers, remove_window=True) if layers else []


def _lm_infinite(ctx: LogitContext, *, cap: int, n_sink: int, lambda_window: int | None, sink_capped: bool):
    d = distances(ctx.positions)[:, None]
    n = ctx.q.shape[1]
    if not bool((d > cap).any()) and lambda_window is None:  # nothing is far: exact no-op
        return None, torch.zeros((), dtype=torch.bool, device=ctx.q.device)
    values = lm_infinite_logits(ctx.q, ctx.k, ctx.rope, cap, n_sink=n_sink, positions=ctx.positions,
                                lambda_window=lambda_window, sink_capped=sink_capped, dtype=torch.float32)
    sink = torch.arange(n, device=ctx.q.device) < n_sink
    replace = (d > cap) if sink_capped else (d > cap) & ~sink
    return values, replace | torch.isneginf(values)


def lm_infinite_hooks(
    model: Any, cap: int, *, n_sink: int = 1, layers: Sequence[int] | None = None,
    position_ids: Tensor | None = None, lambda_window: int | None = None, sink_capped: bool = False,
    remove_window: bool = False,
) -> HookList:  # fmt: skip
    """LM-Infinite as hooks: distances ``> cap`` (position ids) clamped to ``cap``; the first
    ``n_sink`` keys keep their true distance (``sink_capped`` clamps them too, as the repository's
    Λ-attention does); optional Λ window (:func:`posgen_tl.maths.approx_logits.lm_infinite_logits`).

    Only far entries (and Λ-hidden ones) are replaced: with ``cap`` ≥ every distance and no Λ
    window the hooks return the model's scores unchanged (bit for bit).

    Raises:
        ValueError: ``cap < 0`` or ``n_sink < 0``. CaptureError: scores not pre-softmax.
    """
    for name, v in (("cap", cap), ("n_sink", n_sink)):
        if int(v) != v or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    fn = functools.partial(_lm_infinite, cap=int(cap), n_sink=int(n_sink), lambda_window=lambda_window,
                           sink_capped=sink_capped)
    return logit_substitution_hooks(model, fn, layers, position_ids=position_ids, remove_window=remove_window)


def _disentangled(ctx: LogitContext, *, k_means: dict, cap: int, delta0: int, n_sink: int):
    d = distances(ctx.positions)[:, None]
    far = (d > cap) & (torch.arange(ctx.q.shape[1], device=ctx.q.device) >= n_sink)
    if not bool(far.any()):
        return None, far
    values = disentangled_logits(ctx.q, ctx.k, _mean_for(k_means, ctx.layer), ctx.rope, cap, delta0=delta0,
                                 n_sink=n_sink, positions=ctx.positions, dtype=torch.float32)
    return values, far


def _mean_for(k_means: dict, layer: int) -> Tensor:
    if layer not in k_means:
        raise ValueError(f"no k̄ for layer {layer}: pass key means for every substituted layer")
    return k_means[layer]


def disentangled_hooks(
    model: Any, k_means: dict[int, Tensor], cap: int, *, delta0: int = 0, n_sink: int = 1,
    layers: Sequence[int] | None = None, position_ids: Tensor | None = None, remove_window: bool = False,
) -> HookList:  # fmt: skip
    """The "disentangled" approximation as hooks: entries with distance ``> cap`` (non-sink keys)
    get ``f(q_i, cap) + g_Δ0(q_i, k_j)`` with the GLOBAL ``k_means[layer]``
    (:func:`posgen_tl.maths.approx_logits.disentangled_logits`); nearer entries keep the model's scores bit
    for bit (so ``cap`` ≥ every distance is an exact no-op).
    """
    if int(cap) != cap or cap < 0:
        raise ValueError(f"cap must be a non-negative integer, got {cap!r}")
    fn = functools.partial(_disentangled, k_means=k_means, cap=int(cap), delta0=int(delta0), n_sink=int(n_sink))
    return logit_substitution_hooks(model, fn, layers, position_ids=position_ids, remove_window=remove_window)


def _sufficiency(ctx: LogitContext, *, source: str, k_means: dict | None, delta0: int, gamma: float | None,
                 keep_sink: int, mean_layer: dict | None):
    if source == "d3" and gamma is None:  # every visible key from keep_sink on: the values a row block at a time
        src = ctx.layer if mean_layer is None else mean_layer[ctx.layer]
        return RowValues(d3_row_blocks(ctx.q, ctx.k, _mean_for(k_means, src), ctx.rope, delta0=delta0,
                                       positions=ctx.positions), keep_sink)
    n = ctx.q.shape[1]
    vis = causal_visible(n, ctx.q.device)
    if ctx.rope.sliding_window is not None:
        idx = torch.arange(n, device=ctx.q.device)
        vis = vis & (idx[:, None] - idx[None, :] < ctx.rope.sliding_window)
    fit_mask = vis & (torch.arange(n, device=ctx.q.device) >= keep_sink)
    if source == "d3":
        src = ctx.layer if mean_layer is None else mean_layer[ctx.layer]
        values = d3_approx_logits(ctx.q, ctx.k, _mean_for(k_means, src), ctx.rope, delta0=delta0,
                                  positions=ctx.positions, dtype=torch.float32)
    else:  # D1: the least-squares a[i−j] + b[i] + c[j] fit of this very map
        w = exact_logits(ctx.q, ctx.k, ctx.rope, ctx.positions)
        values = fit_additive(torch.where(fit_mask, w, 0.0), fit_mask).fitted
    replace = fit_mask
    if gamma is not None:
        replace = replace & quantile_mask(ctx.scores.float(), gamma, vis)
    return values, replace


def sufficiency_hooks(
    model: Any, *, source: Literal["d3", "d1"] = "d3", k_means: dict[int, Tensor] | None = None,
    layers: Sequence[int] | None = None, delta0: int = 0, gamma: float | None = None, keep_sink: int = 1,
    mean_layer: dict[int, int] | None = None, position_ids: Tensor | None = None,
) -> HookList:  # fmt: skip
    """Faithfulness test (docs/method.md §5): SUBSTITUTE the logits of ``layers`` by a decomposition.

    ``source="d3"``: ``W ← f + g_Δ0`` with ``k_means[layer]`` (a GLOBAL k̄ from disjoint reference
    documents; ``mean_layer={layer: other}`` builds it from another layer's k̄ — the wrong-k̄
    control). ``source="d1"``: ``W ← `` the D1 least-squares fit ``a[i−j] + b[i] + c[j]`` of the
    map itself (in-sample, the additive-fit control). All visible entries with key index
    ``≥ keep_sink`` are replaced (the sink column stays exact), or with ``gamma`` only those below
    the row's ``gamma``-quantile of the model's scores (LM-Infinite keeps the top ones).

    Raises:
        ValueError: unknown ``source``, ``gamma`` outside [0, 1], missing k̄.
        CaptureError: scores not pre-softmax.
    """
    if source not in ("d3", "d1"):
        raise ValueError(f"source must be 'd3' or 'd1', got {source!r}")
    if gamma is not None and not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if source == "d3" and k_means is None:
        raise ValueError("source='d3' needs k_means (e.g. reference_key_means on disjoint documents)")
    fn = functools.partial(_sufficiency, source=source, k_means=k_means, delta0=int(delta0), gamma=gamma,
                           keep_sink=int(keep_sink), mean_layer=mean_layer)
    rows = source == "d3" and gamma is None  # f + g a block of rows at a time: also through a chunked forward
    return logit_substitution_hooks(model, fn, layers, position_ids=position_ids, rows_only=rows)
