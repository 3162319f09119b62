"""The within-row logit spread from logit maps that are already there — the forward's own ``hook_attn_scores`` —
instead of recomputing them (:func:`within_row_spread_of_scores`), and the comparison that decides whether those maps
are the logits ``W`` (:func:`scores_mismatch`). The definition and the versions that compute ``W`` are in
:mod:`posgen_tl.maths.band_stats`; the feature statistics (:mod:`posgen_tl.experiments.pattern`) take this path on the
CPU where the score hook holds ``W``."""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from posgen_tl.maths.band_stats import spread_row_keys

__all__ = ["masked_difference", "scores_mismatch", "within_row_spread_of_scores"]


def _row_means(rot_q: Tensor, rot_k: Tensor, score_scale: float, lo: Tensor, cnt: Tensor) -> Tensor:
    """Each query row's mean logit over its keys ``lo[i] … i``, ``[batch, head_index, pos]`` in the inputs' dtype:
    ``s·q_i·(Σ_j k_j)/cnt_i`` from prefix sums of the keys (GQA: head ``h`` reads kv-group ``h // (H / G)``); a row
    without keys gets some number (its entries are all off the mask). In float32 from a model (prefix sums of a few
    thousand keys: ~1e-6 of their size) — it is a shift (:func:`within_row_spread_of_scores`), exact whatever it is;
    close to the mean, it keeps the sums small."""
    b, n, h, d = rot_q.shape
    kv = rot_k.shape[-2]
    if n == 0 or not bool((cnt > 0).any()):  # no row sees a key: nothing is read
        return rot_q.new_zeros(b, h, n)
    k = rot_k.to(rot_q.dtype)
    pk = torch.cat([k.new_zeros(b, 1, kv, d), k.cumsum(1)], 1)  # b n+1 kv d: Σ of keys before j
    if bool((lo == lo[0]).all()):  # no window: every row's keys start at the same key (a row without any: not read)
        ksum = pk[:, 1:] - pk[:, int(lo[0]) : int(lo[0]) + 1]
    else:
        hi = torch.arange(1, n + 1, device=rot_k.device)
        ksum = pk[:, hi] - pk[:, torch.minimum(lo, hi)]  # b i kv d
    dots = (rot_q.view(b, n, kv, h // kv, d) * ksum[:, :, :, None]).sum(-1)  # b i kv g
    return rearrange(dots, "b i kv g -> b (kv g) i") * (score_scale / cnt.clamp(min=1).to(dots.dtype))


def within_row_spread_of_scores(
    scores: Float[Tensor, "batch head_index query_pos key_pos"],
    rot_q: Float[Tensor, "batch pos head_index d_head"],
    rot_k: Float[Tensor, "batch pos kv_head d_head"],
    score_scale: float,
    *,
    sink: int = 0,
    sliding_window: int | None = None,
    block: int = 64,
    cache: dict | None = None,
) -> tuple[Float[Tensor, "head_index"], Float[Tensor, ""]]:
    """:func:`~posgen_tl.maths.band_stats.within_row_spread` of the logit maps ``scores`` (``W``, e.g. the forward's
    ``hook_attn_scores``; entries off the mask enter no sum, so the model's ``−inf`` there does no harm) under
    ``causal_mask(n, sink=sink, sliding_window=sliding_window)``, ``block`` query rows at a time on the keys those rows
    can see. Each row is first shifted by an estimate ``m̂_i`` of its mean, from prefix sums of the keys in the inputs'
    dtype (:func:`_row_means`): ``Σ_j (w_ij − m̂_i)² − (Σ_j (w_ij − m̂_i))²/cnt_i`` is the exact spread for any shift,
    and with ``m̂`` close to the mean neither sum is large — one pass of sums over a block of the map where the map
    versions take two, and no product to make the map.
    In the maps' precision (float32 from a model), rows summed in float64. ``scores`` is not modified. ``cache``: a
    dict that keeps the block scratch (``batch · head_index · block · pos`` entries) for the next call — a fresh one per
    layer is mapped and zeroed page by page by the kernel (SmolLM2, 4 × 512 tokens: 5.4 MB per layer, ~70 k page
    faults per pass over the model).

    Returns float64 ``([head_index], scalar)`` as :func:`~posgen_tl.maths.band_stats.within_row_spread`."""
    pos, lo, cnt, valid = spread_row_keys(rot_q, rot_k, sink, sliding_window, block)
    b, n, h, _ = rot_q.shape
    if tuple(scores.shape) != (b, h, n, n):
        raise ValueError(f"scores {tuple(scores.shape)} must be [batch, head_index, pos, pos] = {(b, h, n, n)}")
    shift = _row_means(rot_q, rot_k, score_scale, lo, cnt).to(scores.dtype)  # b h i
    weight = valid.double()
    per_row = cnt.clamp(min=1).double()
    ss = torch.zeros(b, h, dtype=torch.float64, device=scores.device)
    size = b * h * min(block, n) * n  # one scratch for every block (a block's maps are written in)
    buf = None if cache is None else cache.get("spread_rows")
    if buf is None or buf.numel() < size or buf.dtype != scores.dtype or buf.device != scores.device:
        buf = scores.new_empty(size)
        if cache is not None:
            cache["spread_rows"] = buf
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        k0 = max(sink, r0 - sliding_window + 1) if sliding_window is not None else sink  # = lo[r0], from Python
        if k0 >= r1:
            continue
        x = buf[: b * h * (r1 - r0) * (r1 - k0)].view(b, h, r1 - r0, r1 - k0)
        torch.sub(scores[:, :, r0:r1, k0:r1], shift[:, :, r0:r1, None], out=x)
        x.tril_(r0 - k0)  # keys j ≤ i
        if sliding_window is not None:
            x.triu_(r0 - k0 - sliding_window + 1)  # keys j ≥ i − window + 1
        dev = x.sum(-1).double()
        sq = torch.linalg.vector_norm(x, dim=-1).double().square()
        ss += ((sq - dev * dev / per_row[r0:r1]) * weight[r0:r1]).sum(-1)
    return ss.sum(0), (cnt * valid).sum().double() * b


def scores_mismatch(
    scores: Float[Tensor, "batch head_index query_pos key_pos"],
    rot_q: Float[Tensor, "batch pos head_index d_head"],
    rot_k: Float[Tensor, "batch pos kv_head d_head"],
    score_scale: float,
    rows: Tensor,
    *,
    sink: int = 0,
    sliding_window: int | None = None,
) -> float:
    """The largest ``|scores − W|`` over the masked entries of query ``rows`` (``W = s·rot_q·rot_kᵀ`` recomputed there,
    GQA grouped), relative to the largest ``|W|`` on them: ``inf`` where a masked entry of ``scores`` is not finite,
    ``nan`` when the rows hold no masked entry (nothing compared)."""
    pos, lo, cnt, _ = spread_row_keys(rot_q, rot_k, sink, sliding_window, 1)
    b, n, h, _ = rot_q.shape
    kv = rot_k.shape[-2]
    r = rows.to(scores.device)
    mask = (pos[None, :] >= lo[r, None]) & (pos[None, :] <= r[:, None])  # rows j
    if not bool(mask.any()):
        return float("nan")
    q = rearrange(rot_q[:, r], "b i (kv g) d -> b kv (g i) d", kv=kv)
    w = (q @ rearrange(rot_k.to(q.dtype), "b j kv d -> b kv d j")) * score_scale
    w = rearrange(w, "b kv (g i) j -> b (kv g) i j", i=len(r))
    diff, scale = masked_difference(scores[:, :, r].to(w.dtype), w, mask)
    if not bool(torch.isfinite(diff)):
        return float("inf")
    return float(diff / scale) if float(scale) > 0 else float(diff)


def masked_difference(a: Tensor, w: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(largest |a − w|, largest |w|)`` over the entries ``mask`` keeps (0-dim tensors; ``mask`` broadcasts against
    ``a`` and ``w``): how far maps ``a`` (the score hook's) lie from ``w`` (W recomputed), the hidden entries (−inf
    there) left out. A NaN or inf on the mask makes the first non-finite."""
    return torch.where(mask, a - w, 0.0).abs().amax(), torch.where(mask, w, 0.0).abs().amax()
