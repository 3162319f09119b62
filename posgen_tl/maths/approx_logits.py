"""Approximated attention logits for length generalisation and faithfulness (docs/method.md §2, §5, §7).

Pure tensor functions of PRE-rotation ``q``/``k`` (``[batch, pos, head_index, d_head]``; ``k``
may hold kv-groups, expanded to query heads), position ids and a :class:`~posgen_tl.maths.rope.LayerRope`.
They never see a model; :mod:`posgen_tl.hooks.edits` turns them into hooks.

Notation (§1): ``W[i, j] = s·a²·q_iᵀ R_{p_j − p_i} k_j`` with ``d = p_i − p_j`` the distance in
position ids (not sequence indices). In the band picture ``W = s·a²·Re Σ_m q_m e^{i d θ_m} conj(k_m)``
(+ ``s·q_pass·k_pass`` on dims ``≥ rotary_dim``).

* :func:`lm_infinite_logits` — LM-Infinite (Han et al. 2023): distances ``d > C`` are clamped to
  ``C`` (``W = s·q_iᵀR_{−C}k_j``); the first ``n_sink`` keys are always visible at their TRUE
  distance (``sink_capped=True`` clamps them as the repository's Λ-attention does); an optional
  Λ window hides non-sink keys with ``i − j ≥ lambda_window`` (sequence index).
* :func:`d3_approx_logits` — ``f(q_i, min(d, C)) + g_Δ0(q_i, k_j)`` with
  ``f(q, d) = s·a²·q_iᵀR_{−d}k̄`` and ``g_Δ0 = s·a²·q_iᵀR_{−Δ0}(k_j − k̄)`` (pass-through dims:
  ``s·q_pass·k̄_pass`` and ``s·q_pass·(k − k̄)_pass``). ``cap=None`` is docs/method.md §2's D3 at offset
  Δ0 (the sufficiency substitution); ``cap=C`` is the value the "disentangled" condition uses on
  far entries.
* :func:`disentangled_logits` — exact ``W`` for ``d ≤ C`` (and sink keys), ``f(q_i, C) + g_Δ0``
  beyond: LM-Infinite's ``approximated_llama.py`` policy "disentangled" with a GLOBAL ``k̄``
  (their code uses the sequence's own mean key, the true distance in ``f`` and a per-row
  quantile instead of a distance to choose the replaced entries; the quantile form is
  :func:`quantile_mask`). Note ``Δ0 = C`` makes it identical to the cap
  (``f(q,C) + g_C = s·q_iᵀR_{−C}k_j``): the approximation only differs from LM-Infinite when
  ``Δ0 ≠ C``.

Every map is ``[batch, head_index, query_pos, key_pos]`` in ``dtype`` (float64 by default; the
hooks use float32 — the model's own precision — for speed) with ``-inf`` on hidden entries
(``j > i`` by sequence index, and Λ-hidden keys); the layer's sliding window is NOT applied here
(the hooks do it, so that it can be removed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from posgen_tl.maths.rope import LayerRope, expand_kv, rotate

__all__ = [
    "distances",
    "exact_logits",
    "lm_infinite_logits",
    "d3_approx_logits",
    "d3_row_blocks",
    "disentangled_logits",
    "quantile_mask",
    "causal_visible",
]


def _check_cap(name: str, value: int | None) -> None:
    if value is not None and (int(value) != value or value < 0):
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _positions(positions: Tensor | None, b: int, n: int, device) -> Int[Tensor, "batch pos"]:
    if positions is None:
        return torch.arange(n, device=device).expand(b, n)
    p = torch.as_tensor(positions, device=device)
    if p.shape[-1] != n:
        raise ValueError(f"positions have {p.shape[-1]} entries, the sequence has {n}")
    return p.expand(b, n) if p.ndim == 1 else p


def distances(positions: Int[Tensor, "batch pos"]) -> Int[Tensor, "batch query_pos key_pos"]:
    """``d[b, i, j] = p_i − p_j`` (position ids, so a gap enters here)."""
    return positions[:, :, None] - positions[:, None, :]


def causal_visible(n: int, device=None) -> Bool[Tensor, "query_pos key_pos"]:
    """``j ≤ i`` by sequence index (the model's causal mask)."""
    i = torch.arange(n, device=device)
    return i[None, :] <= i[:, None]


class _Bands:
    """q, k (expanded to query heads) in ``dtype`` and the position ids; logits by real matmuls.

    Rotations use :func:`posgen_tl.maths.rope.rotate` (float32 angles, HF op order, attention scaling
    ``a`` on the rotary dims, pass-through dims untouched), so ``(R_x q)·(R_y k) = a²·q_rotᵀR_{y−x}k_rot
    + q_pass·k_pass`` exactly as the model computes it; one ``[b h i d]×[b h d j]`` matmul per map.
    """

    def __init__(self, q: Tensor, k: Tensor, rope: LayerRope, positions: Tensor | None, dtype=torch.float64):
        if q.ndim != 4 or k.ndim != 4:
            raise ValueError(f"q and k must be [batch, pos, head, d_head], got {tuple(q.shape)} / {tuple(k.shape)}")
        if q.shape[-1] < rope.rotary_dim:
            raise ValueError(f"d_head={q.shape[-1]} is smaller than rotary_dim={rope.rotary_dim}")
        self.h = q.shape[-2]
        if k.shape[-2] != self.h:
            k = expand_kv(k, self.h)
        self.rope, self.r = rope, rope.rotary_dim
        self.q, self.k = q.to(dtype), k.to(dtype)
        b, n = q.shape[0], q.shape[1]
        self.pos = _positions(positions, b, n, q.device)
        self.scale = rope.score_scale

    def rot(self, x: Tensor, at: Tensor | int) -> Tensor:
        if isinstance(at, int):
            at = torch.full(self.pos.shape, at, dtype=torch.long, device=x.device)
        return rotate(x, at, self.rope)

    def mm(self, a: Tensor, b: Tensor) -> Tensor:
        """``s · a_i · b_j``: ``[b i h d], [b j h d] -> [b h i j]`` (scaled in place: a map of 4 × 2 048 tokens is 0.6 GB,
        and each fresh one is page-faulted in)."""
        return torch.einsum("bihd,bjhd->bhij", a, b).mul_(self.scale)

    def exact(self) -> Tensor:
        return self.mm(self.rot(self.q, self.pos), self.rot(self.k, self.pos))

    def at_offset(self, offset: int, k: Tensor) -> Tensor:
        """``s·(a²·q_iᵀR_{−offset} k_j + q_pass·k_pass)`` for every (i, j)."""
        return self.mm(self.rot(self.q, int(offset)), self.rot(k, 0))


def _finish(x: Tensor, hide: Tensor) -> Tensor:
    """``x`` (a map this module made; written in place) with ``-inf`` where ``hide``."""
    return x.masked_fill_(hide, float("-inf"))


def exact_logits(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos kv_head d_head"],
    rope: LayerRope,
    positions: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | None = None,
    *,
    dtype: torch.dtype = torch.float64,
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """The model's logits ``W`` recomputed from pre-rotation q/k (``dtype``, ``-inf`` for ``j > i``)."""
    z = _Bands(q, k, rope, positions, dtype)
    return _finish(z.exact(), ~causal_visible(q.shape[1], q.device))


def lm_infinite_logits(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos kv_head d_head"],
    rope: LayerRope,
    cap: int,
    *,
    n_sink: int = 0,
    positions: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | None = None,
    lambda_window: int | None = None,
    sink_capped: bool = False,
    dtype: torch.dtype = torch.float64,
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """LM-Infinite logits: distance ``min(d, cap)``, the first ``n_sink`` keys at their true distance.

    ``W[i, j] = s·a²·q_iᵀR_{−min(p_i − p_j, cap)}k_j`` for keys ``j ≥ n_sink``; sink keys
    (``j < n_sink``) keep ``d`` (or ``min(d, cap)`` with ``sink_capped``). With ``lambda_window``
    non-sink keys with ``i − j ≥ lambda_window`` are hidden (``-inf``): the Λ-shaped mask.

    Returns:
        float64 ``[batch, head_index, query_pos, key_pos]``, ``-inf`` where hidden.

    Raises:
        ValueError: ``cap < 0``, ``n_sink < 0``, ``lambda_window < 1``.
    """
    _check_cap("cap", cap)
    _check_cap("n_sink", n_sink)
    if lambda_window is not None and lambda_window < 1:
        raise ValueError(f"lambda_window must be >= 1, got {lambda_window}")
    z = _Bands(q, k, rope, positions, dtype)
    n = q.shape[1]
    w = z.exact()
    far = distances(z.pos)[:, None] > cap  # b 1 i j
    if not sink_capped:
        far = far & (torch.arange(n, device=q.device) >= n_sink)
    if bool(far.any()):
        w = torch.where(far, z.at_offset(cap, z.k), w, out=w)
    hide = ~causal_visible(n, q.device)
    if lambda_window is not None:
        idx = torch.arange(n, device=q.device)
        hide = hide | ((idx[:, None] - idx[None, :] >= lambda_window) & (idx[None, :] >= n_sink))
    return _finish(w, hide)


def _kbar(k_mean: Tensor, z: _Bands) -> Tensor:
    if k_mean.ndim != 2 or k_mean.shape[-1] != z.q.shape[-1]:
        raise ValueError(f"k_mean must be [kv_head, d_head={z.q.shape[-1]}], got {tuple(k_mean.shape)}")
    km = k_mean if k_mean.shape[0] == z.h else expand_kv(k_mean, z.h)
    return km.to(device=z.q.device, dtype=z.q.dtype)


def _check_delta0(delta0: int) -> None:
    if int(delta0) != delta0:
        raise ValueError(f"delta0 must be an integer offset, got {delta0!r}")


def d3_approx_logits(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos kv_head d_head"],
    k_mean: Float[Tensor, "kv_head d_head"],
    rope: LayerRope,
    *,
    delta0: int = 0,
    cap: int | None = None,
    positions: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | None = None,
    dtype: torch.dtype = torch.float64,
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """``f(q_i, min(d, cap)) + g_Δ0(q_i, k_j)`` for every causal entry (D3 at offset ``delta0``).

    ``f(q_i, d) = s·a²·q_iᵀR_{−d}k̄ + s·q_pass·k̄_pass`` (positional: q and distance only);
    ``g_Δ0 = s·a²·q_iᵀR_{−Δ0}(k_j − k̄) + s·q_pass·(k_j − k̄)_pass`` (semantic: no dependence on
    i − j). ``cap=None``: ``f`` at the true distance (docs/method.md §2, Δ0 = 0 is D3).

    Returns:
        float64 ``[batch, head_index, query_pos, key_pos]``, ``-inf`` for ``j > i``.
    """
    _check_cap("cap", cap)
    _check_delta0(delta0)
    z = _Bands(q, k, rope, positions, dtype)
    km = _kbar(k_mean, z)
    b, n = q.shape[0], q.shape[1]
    g = z.at_offset(int(delta0), z.k - km)
    km_b = km.expand(b, n, -1, -1)
    f = z.mm(z.rot(z.q, z.pos), z.rot(km_b, z.pos))  # f(q_i, i − j): k̄ placed at every key position
    if cap is not None:
        far = distances(z.pos)[:, None] > cap
        if bool(far.any()):
            f = torch.where(far, z.at_offset(cap, km_b), f, out=f)  # f(q_i, cap), constant over j
    return _finish(f.add_(g), ~causal_visible(n, q.device))


def d3_row_blocks(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos kv_head d_head"],
    k_mean: Float[Tensor, "kv_head d_head"],
    rope: LayerRope,
    *,
    delta0: int = 0,
    positions: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Callable[[int, int], Float[Tensor, "batch head_index rows keys"]]:
    """:func:`d3_approx_logits` (``cap=None``) a block of query rows at a time: returns ``(r0, r1) ↦`` rows ``r0 … r1 −
    1`` on keys ``0 … r1 − 1``, ``[batch, head_index, r1 − r0, r1]`` in ``dtype``, a fresh tensor per call — every
    entry computed, NO ``-inf`` above the diagonal (the caller masks).

    ``f + g_Δ0`` as ONE product per block over ``2·d_head`` dims, ``s·[R_{p_i} q | R_{Δ0} q]·[R_{p_j} k̄ ; R_0 (k_j −
    k̄)]`` (``R_0`` = the attention scaling ``a``; pass-through dims included on both sides, as in
    :func:`d3_approx_logits`), per kv-group: keys are not repeated per query head. Equal to :func:`d3_approx_logits`'s
    visible entries up to float rounding (one sum over ``2·d_head`` products instead of two sums added).
    """
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be [batch, pos, head, d_head], got {tuple(q.shape)} / {tuple(k.shape)}")
    _check_delta0(delta0)
    b, n, h, d = q.shape
    kv = k.shape[-2]
    if k_mean.ndim != 2 or k_mean.shape[-1] != d or k_mean.shape[0] not in (kv, h):
        raise ValueError(f"k_mean must be [kv_head={kv} (or head_index={h}), d_head={d}], got {tuple(k_mean.shape)}")
    if k_mean.shape[0] != kv:  # a k̄ per query head: keys repeated to query heads
        k, kv = expand_kv(k, h), h
    if h % kv:
        raise ValueError(f"{h} query heads do not split into {kv} kv-groups")
    pos = _positions(positions, b, n, q.device)
    qd, kd = q.to(dtype), k.to(dtype)
    km = k_mean.to(device=q.device, dtype=dtype)
    q2 = torch.cat([rotate(qd, pos, rope), rotate(qd, torch.full_like(pos, int(delta0)), rope)], -1)  # b i h 2d
    k2 = torch.cat([rotate(km.expand(b, n, kv, d), pos, rope), rotate(kd - km, torch.zeros_like(pos), rope)], -1)
    qg = q2.view(b, n, kv, h // kv, 2 * d).permute(0, 2, 3, 1, 4)  # b kv g i e: a view
    keys = k2.permute(0, 2, 3, 1).contiguous()  # b kv e j
    scale = rope.score_scale

    def rows(r0: int, r1: int) -> Tensor:
        if not 0 <= r0 < r1 <= n:
            raise ValueError(f"rows {r0} … {r1 - 1} are outside the {n} query positions")
        part = qg[:, :, :, r0:r1].reshape(b, kv, -1, 2 * d)  # b kv (g i) e: the block's queries, a small copy
        return torch.matmul(part, keys[..., :r1]).mul_(scale).view(b, h, r1 - r0, r1)  # (kv g) = query head

    return rows


def disentangled_logits(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos kv_head d_head"],
    k_mean: Float[Tensor, "kv_head d_head"],
    rope: LayerRope,
    cap: int,
    *,
    delta0: int = 0,
    n_sink: int = 0,
    positions: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | None = None,
    dtype: torch.dtype = torch.float64,
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """Exact logits for ``d ≤ cap`` and for the first ``n_sink`` keys; ``f(q_i, cap) + g_Δ0(q_i, k_j)``
    for ``d > cap`` (global ``k_mean``; see the module docstring for how this differs from the
    LM-Infinite repository's code).

    Returns:
        float64 ``[batch, head_index, query_pos, key_pos]``, ``-inf`` for ``j > i``.

    Raises:
        ValueError: ``cap < 0``, ``n_sink < 0``, bad ``k_mean`` shape.
    """
    _check_cap("cap", cap)
    _check_cap("n_sink", n_sink)
    z = _Bands(q, k, rope, positions, dtype)
    n = q.shape[1]
    w = z.exact()
    far = (distances(z.pos)[:, None] > cap) & (torch.arange(n, device=q.device) >= n_sink)
    if bool(far.any()):
        approx = d3_approx_logits(q, k, k_mean, rope, delta0=delta0, cap=cap, positions=positions, dtype=dtype)
        w = torch.where(far, approx, w, out=w)
    return _finish(w, ~causal_visible(n, q.device))


def quantile_mask(
    logits: Float[Tensor, "batch head_index query_pos key_pos"],
    gamma: float,
    visible: Bool[Tensor, "query_pos key_pos"] | None = None,
) -> Bool[Tensor, "batch head_index query_pos key_pos"]:
    """Entries strictly below the per-row ``gamma``-quantile of the visible logits (True = replace).

    The LM-Infinite "disentangled" code keeps logits above a quantile cap and replaces the rest;
    ``gamma = 1`` replaces every visible entry except each row's maximum; ``gamma = 0`` none.

    Raises:
        ValueError: ``gamma`` outside ``[0, 1]``.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    n = logits.shape[-1]
    vis = causal_visible(n, logits.device) if visible is None else visible.to(logits.device)
    vis = vis & torch.isfinite(logits)
    x = torch.where(vis, logits.double(), torch.nan)
    rows = x.flatten(0, -2)
    step = max(1, (1 << 22) // max(n, 1))  # torch.quantile refuses very large inputs
    thr = torch.cat([torch.nanquantile(rows[s : s + step], gamma, dim=-1) for s in range(0, rows.shape[0], step)])
    return vis & (x < thr.view(*x.shape[:-1], 1))
