"""The head taxonomy's region scores of every RoPE band taken alone as a 2-D head, without the band maps.

A band's logit over the region is ``t_ij = s·(a_i·a'_j + b_i·b'_j)``: the query's two coordinates ``u_i = (a_i, b_i)`` in
that band against the key's ``(a'_j, b'_j)``. Centred over the keys of a row it is ``s·u_iᵀ K_j`` with ``K`` the band's
key coordinates centred over the region (``2 × L``), so every quantity :func:`posgen_tl.maths.taxonomy.region_logit_scores`
computes from the rows of a band's map is a product of 2-vectors and 2 × 2 moments of the keys:

* a row's centred norm² ``s²·uᵀ(KKᵀ)u``, hence its exclusion (its within-row std against ``min_std``);
* the positional correlation ``x·y = ûᵀ(K Kₚᵀ)ûₚ`` (``û = s·u/‖row‖``), the symbolic one ``x[π]·y = ûᵀ(K[:, π] Kₚᵀ)ûₚ``
  and the null ``ûᵀ(K[:, σ] Kₚᵀ)ûₚ``;
* the null variance ``‖Xᵀ diag(w) Y‖²_F = tr(Aᵀ (KKᵀ) A (KₚKₚᵀ))`` with ``A = Σ_i w_i û_i ûₚ,iᵀ``.

So a prompt's band scores cost ``O((rows + keys) · bands)`` per head and permutation instead of the
``rows × keys × bands`` of the maps, computed in float64. :func:`band_region_scores` equals ``region_logit_scores`` of
:func:`posgen_tl.maths.taxonomy.band_logits`' maps within float rounding (test).
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from posgen_tl.maths.rope import LayerRope, band_parts, expand_kv
from posgen_tl.maths.taxonomy import LogitScoreSums, check_permutations

__all__ = ["band_region_scores"]


def _form(x: Tensor, m: Tensor, y: Tensor) -> Tensor:
    """``xᵀ M y`` over the last axes (2-vectors ``[..., 2]``, ``M`` ``[..., 2, 2]``), broadcast: written out, since a
    batch of 2 × 2 matrix products runs far slower on the CPU than these four elementwise products."""
    x0, x1, y0, y1 = x[..., 0], x[..., 1], y[..., 0], y[..., 1]
    return x0 * (m[..., 0, 0] * y0 + m[..., 0, 1] * y1) + x1 * (m[..., 1, 0] * y0 + m[..., 1, 1] * y1)


def band_region_scores(
    rot_q: Float[Tensor, "variant query_pos head_index d_head"],
    rot_k: Float[Tensor, "variant key_pos kv_head d_head"],
    rope: LayerRope,
    perm: Int[Tensor, "n_perm key_pos"],
    null_perm: Int[Tensor, "n_perm key_pos"],
    weights: Float[Tensor, "head_index query_pos"],
    *,
    min_std: float,
) -> LogitScoreSums:
    """:func:`posgen_tl.maths.taxonomy.region_logit_scores` of every band's logits taken alone, per head.

    ``rot_q``: the POST-rotation queries of the scored rows, ``rot_k``: the post-rotation keys of the region (region
    positions in order; fewer kv heads are expanded), each for the clean prompt (variant 0) and then its ``n_perm``
    permutations (``perm[p]``: ``new_region = old_region[perm[p]]``); ``null_perm``: the independent permutations of the
    null; ``weights``: each row's clean attention mass on the region (the same for every band of a head). A band row
    whose within-row std is below ``min_std`` before or after the permutation is excluded, as there.

    Returns:
        :class:`~posgen_tl.maths.taxonomy.LogitScoreSums` with fields ``[head_index, band]`` (float64).

    Raises:
        ValueError: mismatched shapes, a region of fewer than 3 keys, or a row of ``perm`` / ``null_perm`` that is not
            a permutation.
    """
    n_v, n_q, n_h = rot_q.shape[:3]
    n_p, n_k = perm.shape
    if rot_k.shape[0] != n_v or n_v != n_p + 1 or rot_k.shape[1] != n_k or null_perm.shape != perm.shape:
        raise ValueError(f"rot_q {tuple(rot_q.shape)} / rot_k {tuple(rot_k.shape)} need the clean prompt and one "
                         f"variant per permutation ({n_p}) over the {n_k} region keys of perm {tuple(perm.shape)} "
                         f"(null_perm {tuple(null_perm.shape)})")
    if weights.shape != (n_h, n_q):
        raise ValueError(f"weights must be [head_index, query_pos] = [{n_h}, {n_q}], got {tuple(weights.shape)}")
    if n_k < 3:
        raise ValueError(f"the region needs at least 3 keys, got {n_k}")
    check_permutations(perm, null_perm, names="perm and null_perm")
    k = expand_kv(rot_k, n_h) if rot_k.shape[-2] != n_h else rot_k
    u = torch.stack(band_parts(rot_q.double(), rope.rotary_dim, rope.layout), -1)  # [v, q, h, band, 2]
    kk = torch.stack(band_parts(k.double(), rope.rotary_dim, rope.layout), -1)  # [v, L, h, band, 2]
    kc = rearrange(kk - kk.mean(1, keepdim=True), "v l h m c -> v h m c l")  # centred over the region
    u = rearrange(u, "v q h m c -> v h m q c")
    gram = kc @ kc.transpose(-1, -2)  # [v, h, band, 2, 2]
    s = float(rope.score_scale)
    norm = (s * s * _form(u, gram[..., None, :, :], u)).clamp_min(0).sqrt()  # each band row's centred norm [v, h, band, q]
    keep = (norm / math.sqrt(n_k) >= min_std) & torch.isfinite(norm)
    uh = torch.where(keep[..., None], u * (s / norm.clamp_min(torch.finfo(norm.dtype).tiny))[..., None], 0.0)
    x_u, y_u, y_k = uh[0], uh[1:], kc[1:]  # the clean rows; the permuted rows and keys, [P, h, band, ...]
    idx = torch.stack([torch.arange(n_k).expand(n_p, -1), perm.cpu(), null_perm.cpu()]).to(kc.device)  # [3, P, L]
    k_ord = kc[0][..., idx].movedim(-3, 0).movedim(-2, 1)  # [3, P, h, band, 2, L]: the clean keys as is, by π_p, by σ_p
    mats = k_ord @ y_k.transpose(-1, -2)  # [3, P, h, band, 2, 2]: K K_pᵀ, K[:, π_p] K_pᵀ, K[:, σ_p] K_pᵀ
    r = _form(x_u, mats[..., None, :, :], y_u)  # [3, P, h, band, q]: positional, symbolic, null
    kept = keep[0] & keep[1:]  # [P, h, band, q]
    w = torch.where(kept, weights.to(r.device, torch.float64)[None, :, None, :].clamp_min(0), 0.0)
    pos, sym, null = (w * r).sum((1, -1)).unbind(0)
    a = (x_u * w[..., None]).transpose(-1, -2) @ y_u  # [P, h, band, 2, 2]: Σ_i w_i û_i û_p,iᵀ
    null_var = ((a.transpose(-1, -2) @ gram[0] @ a) * gram[1:].transpose(-1, -2)).sum((-1, -2)).sum(0) / (n_k - 1)
    n_used = kept.sum((0, -1)).double()
    return LogitScoreSums(pos, sym, null, null_var, w.sum((0, -1)), n_used, n_q * n_p - n_used)
