"""Patching hooks (docs/method.md §9): record a quantity of attention in one run, write it into another.

Two runs of the SAME tokens that differ only in their position ids (a clean run at ``0 … n−1`` and a
corrupted one, :mod:`posgen_tl.patching`) are aligned token by token, so every quantity below has the
same shape in both and a patch is well defined. Quantities, per layer and head:

* ``rot_q`` / ``rot_k`` — the rotated queries / keys (``hook_rot_q``/``hook_rot_k``; where those do not
  fire, the pre-rotation hook the re-positioning acts on, which the model's own rotation then turns into
  the same rotated tensor). ``rot_k`` is indexed by key/value head (GQA: one kv head serves a group).
* ``pos_term`` / ``sem_term`` / ``remainder`` — one term of the head's pre-softmax logits
  ``W = f + g + (W − f − g)`` (docs/method.md §2 with a global ``k̄``): ``f = s·q_iᵀR_{p_j−p_i}k̄`` (the
  positional term), ``g = s·q_iᵀ(k_j − k̄)`` (the semantic term). Patching a term writes
  ``W_base − term_base + term_source`` into ``hook_attn_scores``; the other terms stay the base run's.
* ``pattern`` — the attention pattern (``hook_pattern``).

A patch is described by a boolean mask per layer, ``[replica, pos, index]`` (index = head, or kv head for
``rot_k``; pos = the query position, the key position for ``rot_k``): several patches run in ONE forward,
stacked in the batch dimension as replicas of the batch (``batch·replica`` rows, replica-major).

Builders return a :class:`Hooks` pair ``(before, after)`` of ``list[(hook_name, fn)]``: a forward lists
``before + <re-positioning hooks> + after`` in ``model.hooks(fwd_hooks=...)`` (TransformerLens runs the hooks
of one hook point in that order). With the other modules of :mod:`posgen_tl.hooks`, the only code that
knows hook names.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from posgen_tl.hooks.capture import CaptureError, from_heads, model_device, pre_rotation_stash, probe_hooks, to_heads
from posgen_tl.hooks.chunked import chunk_safe, chunk_span
from posgen_tl.maths.decompose import d3_split, d3_terms

__all__ = ["QUANTITIES", "TERMS", "CHUNKABLE", "Hooks", "PatchSite", "patch_site", "record_hooks", "patch_hooks",
           "term_maps"]

HookList = list[tuple[str, Callable]]
#: the quantities whose hooks also run in a forward a chunk of positions at a time
#: (:mod:`posgen_tl.hooks.chunked`): a chunk's rotated q/k are its rows of the whole sequence's
CHUNKABLE = ("rot_q", "rot_k")


class Hooks(NamedTuple):
    """Hooks to list before a re-positioning (they read the model's own pre-rotation q/k) and after it."""

    before: HookList
    after: HookList

    def around(self, middle: Sequence[tuple[str, Callable]] = ()) -> HookList:
        """``before + middle + after``: the order a forward must list them in."""
        return [*self.before, *middle, *self.after]

#: every patchable quantity, in the order tables list them
QUANTITIES = ("rot_q", "rot_k", "pos_term", "sem_term", "remainder", "pattern")
#: the logit terms (they need pre-softmax ``hook_attn_scores`` and a global ``k̄``)
TERMS = ("pos_term", "sem_term", "remainder")


@dataclass(frozen=True)
class PatchSite:
    """Where a quantity is read and written in one model.

    Attributes:
        quantity: one of :data:`QUANTITIES`.
        hook: the hook name relative to ``blocks.{layer}.attn.``.
        layout: ``"bshd"`` (``[batch, pos, index, d]``), ``"bhsd"``, ``"flat"`` (a pre-rotation hook's layout)
            or ``"scores"`` (``[batch, head, query_pos, key_pos]``: scores and patterns).
        kv: the index runs over key/value heads (``rot_k``).
    """

    quantity: str
    hook: str
    layout: str
    kv: bool


def patch_site(model: Any, quantity: str) -> PatchSite:
    """The :class:`PatchSite` of ``quantity`` on ``model`` (probed once per model).

    Raises:
        ValueError: an unknown quantity.
        CaptureError: the model cannot deliver it (e.g. ``hook_pattern`` does not fire; the logit terms on a
            model whose ``hook_attn_scores`` are not pre-softmax logits, or that soft-caps its logits)."""
    if quantity not in QUANTITIES:
        raise ValueError(f"unknown patched quantity {quantity!r}; choose one of {', '.join(QUANTITIES)}")
    spec, info = probe_hooks(model)
    if quantity in ("rot_q", "rot_k"):
        kv = quantity == "rot_k"
        if info.rot_fires:
            return PatchSite(quantity, "hook_rot_k" if kv else "hook_rot_q", "bshd", kv)
        if info.normed_layout == "flat_prescale":  # pragma: no cover - a HookedTransformer always fires hook_rot_*
            raise CaptureError(f"{spec.model_name}: QK-norm without firing hook_rot_q/k: rotated q/k cannot be patched")
        return PatchSite(quantity, info.k_hook if kv else info.q_hook, info.normed_layout, kv)
    if quantity == "pattern":
        if not info.pattern_fires:
            raise CaptureError(f"{spec.model_name}: hook_pattern does not fire on this model; the attention pattern "
                               "cannot be patched (patch rot_q/rot_k or a logit term instead)")
        if not _pattern_writes_reach(model, info):
            raise CaptureError(f"{spec.model_name}: hook_pattern fires after the attention output is computed (a "
                               "value written there is discarded), so the attention pattern cannot be patched; "
                               "patch rot_q/rot_k or a logit term instead")
        return PatchSite(quantity, "hook_pattern", "scores", False)
    if info.scores_kind != "pre_softmax":
        raise CaptureError(f"{spec.model_name}: hook_attn_scores holds {info.scores_kind!r} values, not pre-softmax "
                           f"logits; the logit term {quantity!r} cannot be patched on this model")
    if spec.extra.get("attn_logit_softcapping"):
        raise CaptureError(f"{spec.model_name}: the model soft-caps its attention logits (tanh), so they are not the "
                           f"sum f + g + remainder; patching the logit term {quantity!r} would not be exact")
    return PatchSite(quantity, "hook_attn_scores", "scores", False)


_PATTERN_WRITES: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


@torch.no_grad()
def _pattern_writes_reach(model: Any, info: Any) -> bool:
    """Does a value written into layer 0's ``hook_pattern`` change the model's output? (Probed once per model with
    two 8-token forwards: the pattern replaced by uniform attention over the visible keys, and unchanged.)"""
    if model in _PATTERN_WRITES:
        return _PATTERN_WRITES[model]
    vocab = int(getattr(getattr(model, "cfg", None), "d_vocab", 0) or 50)
    toks = (torch.arange(8) * 7 % max(2, min(vocab, 1000))).unsqueeze(0).to(model_device(model))

    def uniform(x: Tensor, hook: Any) -> Tensor:
        vis = torch.tril(torch.ones(x.shape[-2:], dtype=x.dtype, device=x.device)).expand_as(x)
        return vis / vis.sum(-1, keepdim=True)

    plain = model(toks)
    with model.hooks(fwd_hooks=[(info.name(0, "hook_pattern"), uniform)]):
        written = model(toks)
    _PATTERN_WRITES[model] = not torch.equal(plain, written)
    return _PATTERN_WRITES[model]


def _as_bshd(x: Tensor, site: PatchSite, d_head: int) -> Tensor:
    return to_heads(x, site.layout, d_head) if site.layout != "scores" else x


def record_hooks(model: Any, quantity: str, layers: Sequence[int], store: dict[int, Any]) -> Hooks:
    """Hooks that copy ``quantity`` of ``layers`` into ``store[layer]`` as the run computes it.

    ``rot_q``/``rot_k``/``pattern``: the hook's tensor in the model's dtype, ``[batch, pos, index, d_head]``
    (``pattern``: ``[batch, head_index, query_pos, key_pos]``), taken AFTER any hooks listed before these (a
    re-positioning) — the value the model then uses. Logit terms: ``store[layer]`` is ``{"q", "k"}``, the
    pre-rotation queries and keys (float32, :func:`~posgen_tl.hooks.capture.pre_rotation_stash`), read by
    the ``before`` hooks.

    Returns :class:`Hooks` (the hooks return nothing: the forward is unchanged)."""
    spec, info = probe_hooks(model)
    site = patch_site(model, quantity)
    before: HookList = []
    out: HookList = []
    for layer in spec.layer_indices(layers):
        if quantity in TERMS:
            before += pre_rotation_stash(model, info, layer, spec.d_head, store.setdefault(layer, {}))
            continue

        def keep(x: Tensor, hook: Any, layer: int = layer) -> None:
            x = _as_bshd(x, site, spec.d_head).detach().clone()
            span = chunk_span()  # a chunked forward: each chunk's rows after the earlier chunks'
            store[layer] = x if span is None or span[0] == 0 else torch.cat([store[layer], x], 1)

        out.append((info.name(layer, site.hook), chunk_safe(keep) if quantity in CHUNKABLE else keep))
    return Hooks(before, out)


def term_maps(
    q: Float[Tensor, "batch pos head_index d_head"], k: Float[Tensor, "batch pos kv_head d_head"],
    k_mean: Float[Tensor, "kv_head d_head"], positions: Int[Tensor, "batch pos"], rope: Any, quantity: str,
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """One logit term of docs/method.md §2 from pre-rotation ``q``, ``k`` and the global ``k_mean`` at the
    ids ``positions``: ``pos_term`` = f, ``sem_term`` = g, ``remainder`` = W − f − g (float64, unmasked)."""
    if quantity in ("pos_term", "sem_term"):  # one map, not all three
        term = "f" if quantity == "pos_term" else "g"
        return d3_terms(q, k, k_mean, positions, rope, terms=(term,))[term]
    sp = d3_split(q, k, k_mean, positions, rope)
    return sp.W - sp.f - sp.g


def _replicas(x: Tensor, n_rep: int) -> Tensor:
    if x.shape[0] % n_rep:
        raise ValueError(f"a batch of {x.shape[0]} rows is not {n_rep} replicas of one batch")
    return x.reshape(n_rep, x.shape[0] // n_rep, *x.shape[1:])


def _head_mask(mask: Tensor, site: PatchSite) -> Tensor:
    """``[replica, pos, index]`` → broadcastable to the replica-split hook tensor."""
    if site.layout == "scores":  # r b head q k ← r q head
        return mask.permute(0, 2, 1)[:, None, :, :, None]
    return mask[:, None, :, :, None]  # r b pos index d


def patch_hooks(
    model: Any, quantity: str, masks: Mapping[int, Bool[Tensor, "replica pos index"]], source: Mapping[int, Any], *,
    k_means: Mapping[int, Tensor] | None = None, base_positions: Int[Tensor, "batch pos"] | None = None,
    source_positions: Int[Tensor, "batch pos"] | None = None,
) -> Hooks:  # fmt: skip
    """Hooks that write ``source`` (from :func:`record_hooks` on a run of ONE batch) into the entries ``masks``
    selects, in a forward of ``replica`` stacked copies of that batch (``batch·replica`` rows, replica-major).

    ``rot_q``/``rot_k``/``pattern``: the selected heads (and positions) take the source's values bit for bit.
    Logit terms: the selected rows of the selected heads become ``W − term_base + term_source`` on the entries the
    model sees (masked keys stay masked); ``term_base`` is computed from this forward's own pre-rotation q/k at
    ``base_positions``, ``term_source`` from the recorded ones at ``source_positions`` (``None`` = ``0 … n−1``),
    both with the global ``k_means[layer]``.

    Returns :class:`Hooks`: ``before`` stashes this forward's pre-rotation q/k (logit terms), ``after`` writes.

    Raises:
        ValueError: a mask of the wrong shape, or a logit term without ``k_means`` for a patched layer.
    """
    spec, info = probe_hooks(model)
    site = patch_site(model, quantity)
    n_idx = spec.n_kv_heads if site.kv else spec.n_heads
    before: HookList = []
    out: HookList = []
    for layer in spec.layer_indices(list(masks)):
        mask = masks[layer]
        if mask.ndim != 3 or mask.shape[2] != n_idx:
            raise ValueError(f"layer {layer}: a patch mask must be [replica, pos, {n_idx}], got {tuple(mask.shape)}")
        if not bool(mask.any()):
            continue
        if quantity not in TERMS:
            def write(x: Tensor, hook: Any, layer: int = layer, mask: Tensor = mask) -> Tensor:
                xs = _replicas(_as_bshd(x, site, spec.d_head), mask.shape[0])
                src = source[layer].to(xs.device, xs.dtype)
                span = chunk_span()
                if span is not None:  # a chunked forward (rot_q/rot_k): the chunk's positions of source and mask
                    src, mask = src[:, span[0] : span[1]], mask[:, span[0] : span[1]]
                if src.shape != xs.shape[1:]:
                    raise ValueError(f"layer {layer}: the recorded {quantity} has shape {tuple(src.shape)}, the run "
                                     f"{tuple(xs.shape[1:])} per replica: clean and corrupted runs must be aligned")
                y = torch.where(_head_mask(mask.to(xs.device), site), src[None], xs).reshape(-1, *xs.shape[2:])
                return y if site.layout == "scores" else from_heads(y, site.layout, x)

            out.append((info.name(layer, site.hook), chunk_safe(write) if quantity in CHUNKABLE else write))
            continue
        if k_means is None or layer not in k_means:
            raise ValueError(f"patching {quantity} at layer {layer} needs the global mean key k̄ of that layer (k_means)")
        stash: dict[str, Tensor] = {}
        rope = spec.layer(layer)

        def rewrite(w: Tensor, hook: Any, layer: int = layer, mask: Tensor = mask, stash: dict = stash,
                    rope: Any = rope) -> Tensor:
            q, k = stash.pop("q"), stash.pop("k")
            n_rep, n = mask.shape[0], w.shape[-1]
            src = source[layer]
            if src["q"].shape[0] * n_rep != q.shape[0] or src["q"].shape[1:] != q.shape[1:]:
                raise ValueError(f"layer {layer}: the recorded q {tuple(src['q'].shape)} is not one replica of this "
                                 f"forward's {tuple(q.shape)} in {n_rep} replicas: clean and corrupted runs must be "
                                 "aligned")
            km = k_means[layer].to(q.device)
            pos_b = _positions(base_positions, q.shape[0] // n_rep, n, q.device).repeat(n_rep, 1)
            pos_s = _positions(source_positions, src["q"].shape[0], n, q.device)
            t_src = term_maps(src["q"].to(q.device), src["k"].to(q.device), km, pos_s, rope, quantity)
            t_base = _base_term(q, k, km, pos_b, rope, quantity, n_rep)
            ws = _replicas(w, n_rep)
            delta = (t_src[None] - t_base).to(w.dtype)
            sel = _head_mask(mask.to(w.device), site) & torch.isfinite(ws)
            return torch.where(sel, ws + delta, ws).reshape(w.shape)

        before += pre_rotation_stash(model, info, layer, spec.d_head, stash)
        out.append((info.name(layer, "hook_attn_scores"), rewrite))
    return Hooks(before, out)


def _base_term(q: Tensor, k: Tensor, km: Tensor, pos: Tensor, rope: Any, quantity: str, n_rep: int) -> Tensor:
    """``term_maps`` of a forward of ``n_rep`` stacked replicas, ``[replica or 1, batch, head_index, query_pos,
    key_pos]``: computed once and broadcast when every replica's q, k and positions equal the first's (the layer a
    forward resumes at, where no patch has acted yet), otherwise per replica."""
    qs, ks, ps = _replicas(q, n_rep), _replicas(k, n_rep), _replicas(pos, n_rep)
    if n_rep > 1 and bool((qs == qs[:1]).all() & (ks == ks[:1]).all() & (ps == ps[:1]).all()):
        return term_maps(qs[0], ks[0], km, ps[0], rope, quantity)[None]
    return _replicas(term_maps(q, k, km, pos, rope, quantity), n_rep)


def _positions(p: Tensor | None, batch: int, n: int, device: Any) -> Tensor:
    if p is None:
        return torch.arange(n, device=device).expand(batch, n)
    p = p.to(device)
    if p.shape[-1] != n or (p.ndim == 2 and p.shape[0] != batch):
        raise ValueError(f"position ids of shape {tuple(p.shape)} do not fit {batch} sequences of {n} tokens")
    return p.expand(batch, n) if p.ndim == 1 else p
