"""The within-row logit spread ``σ(W)`` of a head (docs/method.md §3): ``Σ_ij (W_ij − mean_i W)²`` over the mask's
rows, the denominator of the feature statistics' predicted D3 error
(:func:`posgen_tl.maths.band_stats.predicted_d3_error`). Four routes to the same sums: the explicit maps
(:func:`within_row_spread`), block-Gram sums without a map (:func:`within_row_spread_qk`, long rows), the maps a
block of query rows at a time (:func:`within_row_spread_rows`, the CPU's up to a few thousand tokens) and given logits —
the forward's own — a block at a time (:func:`within_row_spread_of_w`). Pure tensor functions."""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Bool, Float
from torch import Tensor

__all__ = ["within_row_spread", "within_row_spread_of_w", "within_row_spread_qk", "within_row_spread_rows"]


def within_row_spread(
    W: Float[Tensor, "batch head_index query_pos key_pos"], mask: Bool[Tensor, "query_pos key_pos"]
) -> tuple[Float[Tensor, "head_index"], Float[Tensor, ""]]:
    """Mergeable sums of the within-row logit spread: ``(Σ (W_ij − mean_i W)², n_entries)``.

    Sums over the batch and every row with ``>= 2`` masked entries (row means over the mask);
    ``σ(W) = sqrt(ss / n)`` is the head's within-row logit spread (softmax ignores row
    constants). Returns float64 ``([head_index], scalar)``; float32 maps are summed per row in
    float32 (two-pass: deviations from the row mean first, so no cancellation), rows in float64.
    """
    mask = mask.to(device=W.device, dtype=torch.bool)
    mask = mask & (mask.sum(-1, keepdim=True) >= 2)
    dt = torch.float64 if W.dtype == torch.float64 else torch.float32
    mf = mask.to(dt)
    cnt = mf.sum(-1).clamp(min=1)
    x = W.to(dt) * mf  # a fresh buffer: W is never modified
    mean = x.sum(-1, keepdim=True) / cnt[:, None]
    x.addcmul_(mean, mf, value=-1)  # two-pass: deviations from the row mean, zero off the mask
    ss = x.square_().sum(-1).double().sum((0, 2))
    return ss, mask.double().sum() * W.shape[0]


def _spread_rows(rot_q: Tensor, rot_k: Tensor, sink: int, sliding_window: int | None,
                 block: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The checked inputs of the spread functions and each query row's keys: ``(pos, lo, cnt, valid)`` ``[pos]`` —
    row ``i`` sees keys ``lo[i] … i`` (``cnt`` of them) and counts when it has at least two."""
    if rot_q.ndim != 4 or rot_k.ndim != 4 or rot_q.shape[:2] != rot_k.shape[:2] or rot_q.shape[-1] != rot_k.shape[-1]:
        raise ValueError(f"rot_q {tuple(rot_q.shape)} and rot_k {tuple(rot_k.shape)} must be [batch, pos, heads, d_head] "
                         "with the same batch, pos and d_head")
    h, kv = rot_q.shape[2], rot_k.shape[2]
    if h % kv:
        raise ValueError(f"{h} query heads are not a multiple of {kv} kv heads")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    pos = torch.arange(rot_q.shape[1], device=rot_q.device)
    lo = (pos - sliding_window + 1 if sliding_window is not None else torch.zeros_like(pos)).clamp(min=sink)
    cnt = (pos - lo + 1).clamp(min=0)
    return pos, lo, cnt, cnt >= 2


def within_row_spread_qk(
    rot_q: Float[Tensor, "batch pos head_index d_head"],
    rot_k: Float[Tensor, "batch pos kv_head d_head"],
    score_scale: float,
    *,
    sink: int = 0,
    sliding_window: int | None = None,
    block: int = 32,
) -> tuple[Float[Tensor, "head_index"], Float[Tensor, ""]]:
    """:func:`within_row_spread` of ``W = s·rot_q·rot_kᵀ`` under ``causal_mask(n, sink=, sliding_window=)``,
    without building the ``n × n`` maps.

    Per query row ``Σ_j (W_ij − mean)² = Σ_j W_ij² − (Σ_j W_ij)²/cnt`` with
    ``Σ_j W_ij² = s²·q_iᵀ (Σ_j k_j k_jᵀ) q_i``: the key blocks every row of a query block sees
    enter through block prefix sums of ``k`` and ``k kᵀ`` (``d × d`` per block); only the
    ≤ 2 partial key blocks at each end of a row's range are scored explicitly. Cost per row
    ``O(d² + block·d)`` instead of ``O(n·d)``. In float64, with keys centred by their sequence mean
    (a row constant: the spread is unchanged, the cancellation smaller). GQA: head ``h`` reads
    kv-group ``h // (H / G)``. Returns float64 ``([head_index], scalar)`` as :func:`within_row_spread`.
    """
    pos, lo, cnt, valid = _spread_rows(rot_q, rot_k, sink, sliding_window, block)
    b, n, h, d = rot_q.shape
    kv = rot_k.shape[-2]
    dev = rot_q.device
    q = rearrange(rot_q.double(), "b i (kv g) d -> b kv g i d", kv=kv)
    k = rot_k.double()
    k = rearrange(k - k.mean(1, keepdim=True), "b j kv d -> b kv j d")
    nb = -(-n // block)
    kp = torch.nn.functional.pad(k, (0, 0, 0, nb * block - n)).reshape(b, kv, nb, block, d)
    zero1, zero2 = k.new_zeros(b, kv, 1, d), k.new_zeros(b, kv, 1, d, d)
    p1 = torch.cat([zero1, kp.sum(3).cumsum(2)], 2)  # b kv nb+1 d: Σ of keys before block t
    p2 = torch.cat([zero2, torch.einsum("bkxjd,bkxje->bkxde", kp, kp).cumsum(2)], 2)  # b kv nb+1 d d

    def first_key(i: int) -> int:  # = lo[i], in Python: no device-to-host copy per block on a GPU
        return max(sink, i - sliding_window + 1) if sliding_window is not None else sink

    ss = torch.zeros(b, kv, q.shape[2], dtype=torch.float64, device=dev)
    for t in range(nb):
        i0, i1 = t * block, min(n, (t + 1) * block)
        qi = q[:, :, :, i0:i1]  # b kv g r d
        s1 = torch.zeros(qi.shape[:-1], dtype=torch.float64, device=dev)
        s2 = torch.zeros_like(s1)
        a_min, a_max = first_key(i0), first_key(i1 - 1)  # lo is non-decreasing: every row sees [a_max, i0]
        f0, f1 = -(-a_max // block), (i0 + 1) // block  # whole key blocks inside [a_max, i0]
        spans = [(a_min, i1)]
        if f0 < f1:
            ksum, gram = p1[:, :, f1] - p1[:, :, f0], p2[:, :, f1] - p2[:, :, f0]  # b kv d, b kv d d
            s1 += torch.einsum("bkgrd,bkd->bkgr", qi, ksum)
            s2 += (torch.einsum("bkgrd,bkde->bkgre", qi, gram) * qi).sum(-1)
            spans = [(a_min, f0 * block), (f1 * block, i1)]
        for e0, e1 in spans:
            if e1 <= e0:
                continue
            j = torch.arange(e0, e1, device=dev)
            m = ((j[None, :] >= lo[i0:i1, None]) & (j[None, :] <= pos[i0:i1, None])).double()  # r e
            w = torch.einsum("bkgrd,bked->bkgre", qi, k[:, :, e0:e1]) * m
            s1 += w.sum(-1)
            s2 += (w * w).sum(-1)
        s1, s2 = s1 * score_scale, s2 * score_scale**2
        c = cnt[i0:i1].clamp(min=1).double()
        ss += ((s2 - s1 * s1 / c) * valid[i0:i1].double()).sum(-1)
    return rearrange(ss.sum(0), "kv g -> (kv g)"), (cnt * valid).sum().double() * b


def within_row_spread_rows(
    rot_q: Float[Tensor, "batch pos head_index d_head"],
    rot_k: Float[Tensor, "batch pos kv_head d_head"],
    score_scale: float,
    *,
    sink: int = 0,
    sliding_window: int | None = None,
    block: int = 64,
) -> tuple[Float[Tensor, "head_index"], Float[Tensor, ""]]:
    """:func:`within_row_spread` of ``W = s·rot_q·rot_kᵀ`` under ``causal_mask(n, sink=, sliding_window=)``, the maps
    built ``block`` query rows at a time on the keys those rows can see (``lo[first row] … last row``): a block costs
    its share of the band, not of the square, and its few passes stay in the processor's cache. Within a block the
    steps of :func:`within_row_spread` on the explicit maps, in the inputs' precision (float32 from a model, as
    :func:`within_row_spread` on ``c.logits()``): the entries off the mask zeroed, each row's mean over its mask, the
    deviations from it (zero off the mask again) and the sum of their squares — two passes, no cancellation; rows
    summed in float64, ``s²`` applied in float64 at the end. GQA: head ``h`` reads kv-group ``h // (H / G)``. Returns
    float64 ``([head_index], scalar)`` as :func:`within_row_spread`."""
    pos, lo, cnt, valid = _spread_rows(rot_q, rot_k, sink, sliding_window, block)
    b, n, h, d = rot_q.shape
    kv = rot_k.shape[-2]
    g = h // kv
    q = rearrange(rot_q, "b i (kv g) d -> b kv g i d", kv=kv)
    k = rearrange(rot_k.to(rot_q.dtype), "b j kv d -> b kv j d")
    weight = valid.to(q.dtype)
    per_row = cnt.clamp(min=1).to(q.dtype)
    ss = torch.zeros(b, kv, g, dtype=torch.float64, device=rot_q.device)
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        k0 = max(sink, r0 - sliding_window + 1) if sliding_window is not None else sink  # = lo[r0], from Python
        if k0 >= r1:
            continue
        w = (q[:, :, :, r0:r1].reshape(b, kv, -1, d) @ k[:, :, k0:r1].mT).view(b, kv, g, r1 - r0, r1 - k0)
        m = None
        if sliding_window is None:  # every row sees keys sink … i: zero j > i (the block's keys start at the sink)
            w.tril_(r0 - k0)
        else:
            j = pos[k0:r1]
            m = ((j[None, :] >= lo[r0:r1, None]) & (j[None, :] <= pos[r0:r1, None])).to(q.dtype)
            w.mul_(m)
        w.sub_((w.sum(-1) / per_row[r0:r1])[..., None])  # deviations from each row's mean
        if m is None:  # (the mean was subtracted off the mask too: zeroed again)
            w.tril_(r0 - k0)
        else:
            w.mul_(m)
        ss += (torch.linalg.vector_norm(w, dim=-1).square_() * weight[r0:r1]).double().sum(-1)
    return rearrange(ss.sum(0), "kv g -> (kv g)") * score_scale**2, (cnt * valid).sum().double() * b


def within_row_spread_of_w(
    w: Float[Tensor, "batch head_index query_pos key_pos"],
    *,
    sink: int = 0,
    sliding_window: int | None = None,
    block: int = 64,
    out: Tensor | None = None,
) -> tuple[Float[Tensor, "head_index"], Float[Tensor, ""]]:
    """:func:`within_row_spread` of given logits ``w`` (the forward's own, e.g. ``hook_attn_scores``: only the
    entries of ``causal_mask(n, sink=, sliding_window=)`` are read, whatever the others hold — −inf included) — the
    steps of :func:`within_row_spread_rows` without its products: ``block`` query rows at a time on the keys they see,
    each block copied (``w`` is never written), the entries off the mask zeroed, each row's mean over its mask taken,
    the deviations from it (zero off the mask again) squared and summed — two passes, no cancellation; in ``w``'s
    precision, rows summed in float64. ``out``: a flat scratch of at least ``batch · heads · block · n`` entries of
    ``w``'s dtype the blocks are copied into (else one is made). Returns float64 ``([head_index], scalar)`` as
    :func:`within_row_spread`."""
    if w.ndim != 4 or w.shape[-1] != w.shape[-2]:
        raise ValueError(f"w {tuple(w.shape)} must be [batch, head_index, query_pos, key_pos] with as many keys as "
                         "queries")
    b, h, n, _ = w.shape
    pos, lo, cnt, valid = _spread_rows(w.new_empty(b, n, 1, 1), w.new_empty(b, n, 1, 1), sink, sliding_window, block)
    need = b * h * min(block, n) * n
    buf = out if out is not None and out.numel() >= need and out.dtype == w.dtype else w.new_empty(need)
    per_row, weight = cnt.clamp(min=1).to(w.dtype), valid.to(w.dtype)
    ss = torch.zeros(b, h, dtype=torch.float64, device=w.device)

    def mask_(x: Tensor, r0: int, k0: int) -> None:  # j ≤ i and, with a window, j ≥ i − window + 1 (block coordinates)
        x.tril_(r0 - k0)
        if sliding_window is not None:
            x.triu_(r0 - k0 - sliding_window + 1)

    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        k0 = max(sink, r0 - sliding_window + 1) if sliding_window is not None else sink  # = lo[r0], from Python
        if k0 >= r1:
            continue
        src = w[:, :, r0:r1, k0:r1]
        x = buf[: src.numel()].view(src.shape)
        x.copy_(src)
        mask_(x, r0, k0)  # (zeroes, never multiplies: a hidden −inf becomes 0, not NaN)
        x.sub_((x.sum(-1) / per_row[r0:r1])[..., None])  # deviations from each row's mean
        mask_(x, r0, k0)  # (the mean was subtracted off the mask too: zeroed again)
        ss += (torch.linalg.vector_norm(x, dim=-1).square_() * weight[r0:r1]).double().sum(-1)
    return ss.sum(0), (cnt * valid).sum().double() * b
