"""Sums over a banded causal mask of maps given by their factors, ``x[i, j] = a_i · b_j``, without the maps.

The decomposition's scores (:mod:`posgen_tl.maths.moments`) need, of the shifted logit map ``x = W − μ`` and of each
D3 approximation ``y = f + g − μ``, a few sums per query row, key column and distance over the mask ``j ∈ [i − w + 1,
i]`` (``w``: a sliding window, else every earlier key): ``Σ_j x``, ``Σ_j x²``, ``Σ_j x·y``, ``Σ_i x``, ``Σ_{i − j = d}
x``, and the first few columns. Both maps are bilinear in the captured queries and keys — rank ``p ≈ d_head`` for W,
``≈ 2·d_head`` for ``f + g`` — so those sums never need the ``n × n`` maps:

* the mask is cut into chunks of ``C`` query rows and ``C`` keys; a (row chunk, key chunk) pair that the mask covers
  whole contributes through the key chunk's **states** — the Gram matrices ``Σ_j b_j b_jᵀ``, ``Σ_j b_j b'_jᵀ`` and the
  sums ``Σ_j b_j`` (a column of ones beside the keys) — since ``Σ_j (a·b_j)² = aᵀ(Σ_j b_j b_jᵀ)a``, ``Σ_j
  (a·b_j)(a'·b'_j) = aᵀ(Σ_j b_j b'_jᵀ)a'`` and ``Σ_j a·b_j = a·Σ_j b_j``; the states of the chunks a row chunk sees
  are ONE product of the chunks' own with a 0/1 band over the chunk axis (every earlier chunk, or those inside a
  window), and the target's Gram matrices with every partner's come from one product of the queries;
* the pairs the mask covers in part (the diagonal chunk, and at a window's edge one or two chunks) are computed as
  explicit ``C × C`` blocks and masked; the column sums come from the blocks and from the row chunks' sums;
* the distance sums ``Σ_i x[i, i − d]`` are a cross-correlation of the factors along positions (an FFT of length
  ``2n``, summed over the factor's width).

Time ``O(n·(C·p + p²))`` per map instead of ``O(n²·p)``; memory ``O(n·(C + p) + (n/C)·p²)`` per map instead of
``O(n²)``. Everything in float64 (the states' quadratic forms cancel: ``a·b`` is centred, far smaller than
``|a|·|b|``), which makes the sums more exact than float32 maps. Grouped-query attention: the keys' factors and states
are per kv-head, shared by the query heads of a group. Pure tensor maths; the decomposition's use is
:func:`posgen_tl.engine.decompose_maps.factored_moments`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

__all__ = ["FactorSums", "chunk_size", "factored_sums", "largest_entries", "row_entries"]


@dataclass
class FactorSums:
    """The sums of one map family (``maps = batch · kv_head · group``, in that order), float64: per query row
    ``s`` (``Σ_j x``), ``ss`` (``Σ_j x²``) and ``sxy`` (``Σ_j x·y`` with the family's partner x, only for a
    partner family), per key column ``col`` and per distance ``diag`` (only for the target x), and the map's first
    ``cols.shape[-1]`` columns ``cols`` (masked)."""

    s: Tensor  # [maps, n]
    ss: Tensor  # [maps, n]
    cols: Tensor  # [maps, n, keep]
    sxy: Tensor | None = None  # [maps, n]
    col: Tensor | None = None  # [maps, n]
    diag: Tensor | None = None  # [maps, n]


def chunk_size(n: int, p: int) -> int:
    """Rows and keys per chunk: about half the factors' width ``p`` — the largest power of two ≤ ``p/2``, between 16
    and 256 —, at most ``n``. The explicit blocks' passes cost ``∝ n·C``, the states' ``∝ (n/C)·p²``: counted for
    SmolLM2 at 4 × 2 048 tokens (``p = 129``), one layer reads and writes 5.45, 5.15, 5.57 and 6.91 GB at ``C`` = 32,
    64, 128 and 256."""
    c = 16
    while 2 * c <= min(256, p // 2):
        c *= 2
    return max(1, min(c, n))


def row_entries(n: int, p: int, p2: int, partners: int, group: int = 1) -> int:
    """About how many float32-sized entries :func:`factored_sums` and its caller
    (:func:`posgen_tl.engine.decompose_maps.factored_moments`) hold at once per query row of a map, for a target of
    width ``p`` and ``partners`` partners of width ``p2`` sharing one query factor, ``group`` query heads per kv-head —
    the measure a caller budgets memory by (an ``n × n`` map holds ``n``). Their peak is the states' product: the
    float64 queries and their chunked copy (``2·p2``), the product's row (``w_k = p + 1 + partners·(p2 + 1)``) and
    the chunks' states (``p·w_k / (group·C)``), with the keys (``(w_k + p + partners·p2) / group``); 10 % above that
    for the caller's rotated k̄ (measured: SmolLM2, 8 × 512 … 1 × 4 096 tokens, 1 942 entries per row where this
    gives 2 004)."""
    c = chunk_size(n, max(p, p2))
    wk = p + 1 + partners * (p2 + 1)
    f64 = 2 * p2 + max(wk + p * wk / (group * c), 2 * c) + (wk + p + partners * p2) / group
    return int(2 * 1.1 * f64) + 1


def largest_entries(n: int, p: int, p2: int, partners: int, group: int = 1) -> int:
    """About how many float32-sized entries per query row of a map the LARGEST single tensor of :func:`factored_sums`
    holds (the measure :func:`posgen_tl.hooks.stacking.stack_size` budgets by, as a logit map's ``n`` for the maps):
    the states' product's row (``w_k = p + 1 + partners·(p2 + 1)`` float64 entries), or the chunks' states where a
    kv-head has one query head (``p·w_k / (group·C)``), or the queries (``p2``) or a block's row (``C``) — whichever is
    largest (measured: SmolLM2, 4 × 512 and 1 × 2 048 tokens, 652 entries per row, as this gives; :func:`row_entries`
    is the peak of all of them together, about three times as many)."""
    c = chunk_size(n, max(p, p2))
    wk = p + 1 + partners * (p2 + 1)
    return 2 * max(wk, -(-p * wk // (group * c)), p2, c)


def _offsets(n_chunks: int, c: int, window: int | None) -> tuple[list[int], int]:
    """``(explicit, last_state)``: the key-chunk offsets (row chunk − key chunk) computed as masked blocks, and the
    last offset that the mask covers whole for every row of a chunk (states for offsets ``1 … last_state``; 0: none)."""
    if window is None or window >= n_chunks * c + c:
        return [0], n_chunks - 1
    last = window // c - 1  # oC + C − 1 ≤ w − 1: every entry of the pair inside the window
    far = (window + c - 2) // c  # oC − (C − 1) ≤ w − 1: some entry inside
    explicit = [0] + [o for o in range(max(1, last + 1), far + 1) if o < n_chunks]
    return explicit, max(0, min(last, n_chunks - 1))


def _block_mask(o: int, c: int, window: int | None, device: torch.device) -> Tensor:
    """Which entries of a (row chunk, key chunk ``o`` chunks earlier) block the mask keeps, float64 ``[C, C]``."""
    il = torch.arange(c, device=device)[:, None]
    jl = torch.arange(c, device=device)[None, :]
    d = o * c + il - jl  # i − j
    keep = d >= 0
    if window is not None:
        keep &= d <= window - 1
    return keep.double()


#: up to this many chunks the running sums over chunks are ONE product with a 0/1 band (one pass over the states);
#: beyond, a cumulative sum (its time linear, not quadratic, in the number of chunks)
BAND_UP_TO = 256


def _band(nc: int, last: int, device: torch.device) -> Tensor | None:
    """``T[r, k] = 1`` where row chunk ``r`` sees key chunk ``k`` whole (``1 ≤ r − k ≤ last``), float64 ``[nc, nc]``,
    for :func:`_band_sum` — None beyond :data:`BAND_UP_TO` chunks."""
    if nc > BAND_UP_TO:
        return None
    d = torch.arange(nc, device=device)
    d = d[:, None] - d[None, :]
    return ((d >= 1) & (d <= last)).double()


def _band_sum(v: Tensor, last: int, t: Tensor | None, reverse: bool = False) -> Tensor:
    """Per chunk ``r`` of ``v``'s chunk axis (dim 2 of ``[B, K, nc, …]``), ``Σ v[k]`` over ``1 ≤ r − k ≤ last`` —
    the key chunks row chunk ``r`` sees whole (every earlier chunk, or those inside a window) —, or with ``reverse``
    per key chunk ``k`` the sum over the row chunks ``r`` that see it whole; ``t``: :func:`_band` (None: cumulative
    sums). Same shape as ``v``."""
    if t is not None:
        return ((t.mT if reverse else t) @ v.flatten(3)).view(v.shape)
    if reverse:
        return _band_sum(v.flip(2), last, None).flip(2)
    nc = v.shape[2]
    cs = v.cumsum(2)
    out = torch.zeros_like(v)
    out[:, :, 1:] = cs[:, :, :-1]
    if last < nc - 1:
        out[:, :, last + 1 :] -= cs[:, :, : nc - last - 1]
    return out


def _states(keys: Tensor, other: Tensor, last: int, t: Tensor | None) -> Tensor:
    """Per row chunk, ``Σ keys_j other_jᵀ`` over the key chunks it sees whole (``[B, K, nc, c, p] × [B, K, nc, c,
    p'] → [B, K, nc, p, p']``): the chunks' Gram matrices, summed by :func:`_band_sum`."""
    return _band_sum(keys.mT @ other, last, t)


def _diag_sums(a: Tensor, b: Tensor, window: int | None) -> Tensor:
    """``Σ_i a_i · b_{i − d}`` for ``d = 0 … n − 1`` (``a`` ``[B, K, G, n, p]``, ``b`` ``[B, K, n, p]``; 0 beyond a
    window) as an FFT cross-correlation, float64 ``[B, K, G, n]``."""
    n = a.shape[-2]
    fa = torch.fft.rfft(a, 2 * n, dim=-2)  # B K G f p
    fb = torch.fft.rfft(b, 2 * n, dim=-2)[:, :, None]  # B K 1 f p
    prod = (fa * fb.conj()).sum(-1)
    out = torch.fft.irfft(prod, 2 * n, dim=-1)[..., :n]
    if window is not None and window < n:
        out[..., window:] = 0.0
    return out


def _chunked(v: Tensor, nc: int, c: int) -> Tensor:
    """Positions axis (−2) zero-padded to ``nc·c`` and cut into chunks: ``[..., n, p] → [..., nc, c, p]``."""
    n = v.shape[-2]
    if nc * c != n:
        v = torch.nn.functional.pad(v, (0, 0, 0, nc * c - n))
    return v.reshape(*v.shape[:-2], nc, c, v.shape[-1])


def factored_sums(
    q: Float[Tensor, "batch kv group pos width"],
    b: Float[Tensor, "batch kv pos p"],
    partners: Mapping[str, Tensor],
    *,
    window: int | None,
    keep: int,
    chunk: int = 0,
) -> tuple[FactorSums, dict[str, FactorSums]]:
    """The mask's sums of the target ``x[i, j] = a_i · b_j`` and of each partner ``y[i, j] = a'_i · b'_j``
    (``partners``: ``{name: b' [batch, kv, pos, p']}``) on ``j ∈ [i − w + 1, i]`` (``window`` ``w``; None: ``j ≤ i``),
    without the maps (the module's method; ``chunk``: rows per chunk, 0: :func:`chunk_size`). The query factors are
    the leading columns of ONE tensor ``q``: ``a = q[..., :p]``, ``a' = q[..., :p']`` (``p ≤ p' ≤ width``), so the
    target's and the partners' share every pass over the queries. Maps are ``(batch kv group)`` in that order.

    Returns ``(x's sums: s, ss, col, diag, cols — its first ``keep`` columns —, {name: the partner's s, ss, sxy =
    Σ_j x·y, cols}``), float64 ``[maps, n]`` (cols ``[maps, n, keep]``).
    """
    if q.ndim != 5 or b.ndim != 4 or q.shape[:2] != b.shape[:2] or q.shape[-2] != b.shape[-2] \
            or b.shape[-1] > q.shape[-1]:
        raise ValueError(f"factors must be q [batch, kv, group, pos, width] and b [batch, kv, pos, p ≤ width] alike; "
                         f"got {tuple(q.shape)} and {tuple(b.shape)}")
    B, K, G, n, width = q.shape
    p = b.shape[-1]
    if window is not None and window < 1:
        raise ValueError(f"window must be ≥ 1 or None, got {window}")
    for name, pb in partners.items():
        if pb.shape[:-1] != b.shape[:-1] or not p <= pb.shape[-1] <= width:
            raise ValueError(f"partner {name!r}: keys {tuple(pb.shape)}, need [batch, kv, pos, p'] with {p} ≤ p' ≤ "
                             f"{width} (the queries' width)")
    c = chunk or chunk_size(n, max([p, *(pb.shape[-1] for pb in partners.values())]))
    nc = -(-n // c)
    fam = [b, *partners.values()]
    # first what needs the queries in their own layout (their copies freed before the chunks' are made)
    diag = _diag_sums(q[..., :p], b, window).reshape(B * K * G, n)
    cols = _first_columns(q, fam, keep, window)
    per_row, col = _chunk_sums(q, fam, c, window)

    def per_map(v: Tensor) -> Tensor:  # [B, K, nc, (G c)] -> [(B K G), n]
        return v.view(B, K, nc, G, c).permute(0, 1, 3, 2, 4).reshape(B * K * G, nc * c)[:, :n]

    xs = FactorSums(per_map(per_row[0]), per_map(per_row[1]), cols[:, :, 0], col=per_map(col), diag=diag)
    ys = {name: FactorSums(per_map(per_row[2 + 3 * f]), per_map(per_row[3 + 3 * f]), cols[:, :, f + 1],
                           sxy=per_map(per_row[4 + 3 * f]))
          for f, name in enumerate(partners)}
    return xs, ys


def _first_columns(q: Tensor, fam: list[Tensor], keep: int, window: int | None) -> Tensor:
    """Each family's map's first ``keep`` columns, masked (0 past ``n``), ``[(B K G), n, F, keep]`` for the
    families' keys ``fam`` (``[B, K, n, p_f]``): ONE product of the queries with every family's first keys."""
    B, K, G, n, width = q.shape
    kk = min(keep, n)
    if not kk:
        return q.new_zeros(B * K * G, n, len(fam), keep)
    first = torch.cat([torch.nn.functional.pad(v[:, :, :kk], (0, width - v.shape[-1])) for v in fam],
                      2)  # B K (F kk) width
    fv = q @ first[:, :, None].mT  # B K G n (F kk)
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(kk, device=q.device)[None, :]
    ok = j <= i
    if window is not None:
        ok &= i - j <= window - 1
    fv = (fv.view(*fv.shape[:-1], len(fam), kk) * ok[:, None]).reshape(B * K * G, n, len(fam), kk)
    return torch.nn.functional.pad(fv, (0, keep - kk)) if kk < keep else fv


def _chunk_sums(q: Tensor, fam: list[Tensor], c: int, window: int | None) -> tuple[list[Tensor], Tensor]:
    """The per-row sums of every family and the target's column sums by chunks of ``c`` (the module's method):
    ``([Σx, Σx², then per partner Σy, Σy², Σx·y], Σ_i x)``, each ``[B, K, nc, (G c)]`` (row chunks of every head)."""
    B, K, G, n, width = q.shape
    nc = -(-n // c)
    explicit, last = _offsets(nc, c, window)
    p = fam[0].shape[-1]
    # [B, K, G, n, width] -> [B, K, nc, (G c), width]: a row chunk of every head, ONE copy of the queries
    Q = _chunked(q, nc, c).permute(0, 1, 3, 2, 4, 5).reshape(B, K, nc, G * c, width)
    A = Q[..., :p]  # a view
    # the keys side by side, each with a column of ones (its chunk's sum comes with its Gram matrix): [b | 1 | b' | 1
    # | …], zero past the last position, chunked [B, K, nc, c, width_k]
    at, parts = [0], [fam[0], fam[0].new_ones(*fam[0].shape[:-1], 1)]
    for pb in fam[1:]:
        at.append(at[-1] + parts[-2].shape[-1] + 1)
        parts += [pb, parts[1]]
    Kc = _chunked(torch.cat(parts, -1), nc, c)
    Bk = Kc[..., :p]
    fc = [(Q[..., : pb.shape[-1]], Kc[..., o : o + pb.shape[-1] + 1], o) for pb, o in zip(fam[1:], at[1:])]
    sums = [A.new_zeros(B, K, nc, G * c) for _ in range(2 + 3 * len(fc))]  # Σx, Σx², per partner Σy, Σy², Σx·y
    col = A.new_zeros(B, K, nc, G, c)
    for o in explicit:  # the blocks the mask covers in part: computed and masked
        if o < nc:
            _explicit_blocks(A, Bk, fc, _block_mask(o, c, window, q.device), o, sums, col)
    if last >= 1:  # the key chunks the mask covers whole: through their states
        t = _band(nc, last, q.device)
        # ONE product of the target's queries with [Σ b bᵀ | Σ b | Σ b b'ᵀ | Σ b' | …]: Σx², Σx and each Σx·y
        out = A @ _states(Bk, Kc, last, t)  # B K nc (G c) width_k
        sums[0] += out[..., p]
        sums[1] += _dot(out[..., :p], A)
        for f, (pa, _, o) in enumerate(fc):
            sums[4 + 3 * f] += _dot(out[..., o : o + pa.shape[-1]], pa)  # Σ_j x·y = a·(Σ_j b_j b'_jᵀ)·a'
        del out
        for f, (pa, pk, _) in enumerate(fc):
            outy = pa @ _states(pk[..., :-1], pk, last, t)  # [Σ b' b'ᵀ | Σ b']
            sums[2 + 3 * f] += outy[..., -1]
            sums[3 + 3 * f] += _dot(outy[..., :-1], pa)
            del outy
        # columns: key j times the sum of the rows that see its chunk whole (per head), from the chunks' row sums
        rows = _band_sum(A.reshape(B, K, nc, G, c, p).sum(-2), last, t, reverse=True)  # B K nc G p: per key chunk
        col += (Bk @ rows.mT).mT  # B K nc G c
    return sums, col.flatten(-2)


def _explicit_blocks(A: Tensor, Bk: Tensor, fc: list[tuple[Tensor, Tensor, int]], m: Tensor, o: int,
                     sums: list[Tensor], col: Tensor) -> None:
    """Add the masked blocks of row chunks ``o …`` against the key chunks ``o`` earlier (``m``: :func:`_block_mask`)
    to ``sums`` and ``col`` (:func:`_chunk_sums`' accumulators, in place)."""
    nc, c = Bk.shape[2], Bk.shape[3]
    g = A.shape[3] // c

    def block(qq: Tensor, k: Tensor) -> Tensor:  # B K (nc − o) (G c) c
        out = qq[:, :, o:] @ k[:, :, : nc - o].mT
        return out.view(*out.shape[:3], g, c, c).mul_(m).view(out.shape)

    xb = block(A, Bk)
    sums[0][:, :, o:] += xb.sum(-1)
    sums[1][:, :, o:] += _rowsq(xb)
    col[:, :, : nc - o] += xb.view(*xb.shape[:3], g, c, c).sum(-2)  # the keys' chunks are o earlier
    for f, (pa, pk, _) in enumerate(fc):
        yb = block(pa, pk[..., :-1])
        sums[2 + 3 * f][:, :, o:] += yb.sum(-1)
        sums[3 + 3 * f][:, :, o:] += _rowsq(yb)
        sums[4 + 3 * f][:, :, o:] += _dot(yb, xb)
        del yb


def _rowsq(x: Tensor) -> Tensor:
    """``Σ_j x[..., j]²`` (one reduction pass, no squared copy)."""
    return torch.linalg.vector_norm(x, dim=-1).square_()


def _dot(x: Tensor, y: Tensor) -> Tensor:
    """``Σ_j x[..., j]·y[..., j]`` → ``[...]`` as a batched product of a row and a column (no map of the products; a
    slice along the last axis is read in place)."""
    return (x.unsqueeze(-2) @ y.unsqueeze(-1))[..., 0, 0]
