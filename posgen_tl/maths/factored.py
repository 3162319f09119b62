"""Sums over a banded causal mask of maps given by their factors, ``x[i, j] = a_i · b_j``, without the maps.

The decomposition's scores (:mod:`posgen_tl.maths.moments`) need, of the shifted logit map ``x = W − μ`` and of each
D3 approximation ``y = f + g − μ``, a few sums per query row, key column and distance over the mask ``j ∈ [i − w + 1,
i]`` (``w``: a sliding window, else every earlier key): ``Σ_j x``, ``Σ_j x²``, ``Σ_j x·y``, ``Σ_i x``, ``Σ_{i − j = d}
x``, and the first few columns. Both maps are bilinear in the captured queries and keys — rank ``p ≈ d_head`` for W,
``≈ 2·d_head`` for ``f + g`` — so those sums never need the ``n × n`` maps:

* the mask is cut into chunks of ``C`` query rows and ``C`` keys; a (row chunk, key chunk) pair that the mask covers
  whole contributes through the key chunk's **states** — ``Σ_j b_j`` and the Gram matrices ``Σ_j b_j b_jᵀ``,
  ``Σ_j b_j b'_jᵀ`` — since ``Σ_j (a·b_j)² = aᵀ(Σ_j b_j b_jᵀ)a`` and ``Σ_j (a·b_j)(a'·b'_j) = aᵀ(Σ_j b_j b'_jᵀ)a'``;
  the states of the chunks a row chunk sees are a running sum over chunks (a difference of two for a window);
* the pairs the mask covers in part (the diagonal chunk, and at a window's edge one or two chunks) are computed as
  explicit ``C × C`` blocks and masked;
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

__all__ = ["FactorSums", "chunk_size", "factored_sums", "row_entries"]


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
    SmolLM2 at 4 × 2 048 tokens (``p = 129``), one layer reads and writes 7.6, 7.0, 7.2 and 8.5 GB at ``C`` = 32, 64,
    128 and 256."""
    c = 16
    while 2 * c <= min(256, p // 2):
        c *= 2
    return max(1, min(c, n))


def row_entries(n: int, p: int, p2: int, partners: int) -> int:
    """About how many float32-sized entries :func:`factored_sums` holds at once per query row of a map (its float64
    factors, their chunked copies, the FFT's spectra, the blocks and the states' products), for a target of width
    ``p`` and ``partners`` partners of width ``p2`` sharing one query factor — the measure a caller budgets memory by
    (an ``n × n`` map holds ``n``)."""
    c = chunk_size(n, max(p, p2))
    return 2 * (6 * p + 4 * p2 + partners * (p2 + 2 * c) + 2 * c)


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


def _states(keys: Tensor, other: Tensor, last: int) -> Tensor:
    """Per row chunk ``c``, ``Σ keys_j other_jᵀ`` over the key chunks ``c − last … c − 1`` that it sees whole (``[B, K,
    nc, c, p] × [B, K, nc, c, p'] → [B, K, nc, p, p']``; ``last ≥ nc − 1``: every earlier chunk). Shifted by one chunk
    with a copy of the states, not of the rows: a slice of the rows would be copied by every product it enters."""
    g = keys.mT @ other
    cs = torch.cat([torch.zeros_like(g[:, :, :1]), g[:, :, :-1]], 2).cumsum_(2)  # exclusive running sum
    nc = cs.shape[2]
    if last < nc - 1:
        cs[:, :, last:] -= cs[:, :, : nc - last].clone()
    return cs


def _windowed_prefix(v: Tensor, window: int | None) -> Tensor:
    """``Σ_{j ∈ [i − w + 1, i]} v_j`` per position ``i`` along dim −2 (``w`` = ``window``; None: ``j ≤ i``)."""
    out = v.cumsum(-2)
    n = v.shape[-2]
    if window is not None and window < n:
        out[..., window:, :] -= out[..., : n - window, :].clone()
    return out


def _windowed_suffix(v: Tensor, window: int | None) -> Tensor:
    """``Σ_{i ∈ [j, j + w − 1]} v_i`` per position ``j`` along dim −2."""
    return _windowed_prefix(v.flip(-2), window).flip(-2)


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
    explicit, last = _offsets(nc, c, window)
    dev = q.device
    a = q[..., :p]

    # linear sums from running sums over positions (no chunks): row i · Σ of its keys, key j · Σ of its rows
    sx = torch.einsum("bkgnp,bknp->bkgn", a, _windowed_prefix(b, window))
    col = torch.einsum("bkgnp,bknp->bkgn", _windowed_suffix(a, window), b)

    # [B, K, G, n, width] -> [B, K, nc, (G c), width]: a row chunk of every head, ONE copy of the queries
    Q = _chunked(q, nc, c).permute(0, 1, 3, 2, 4, 5).reshape(B, K, nc, G * c, width)
    A, Bk = Q[..., :p], _chunked(b, nc, c)  # B K nc (G c) p (a view), B K nc c p
    fc = {name: (Q[..., : pb.shape[-1]], _chunked(pb, nc, c)) for name, pb in partners.items()}
    sxx = A.new_zeros(B, K, nc, G * c)
    acc = {name: (sxx.clone(), sxx.clone()) for name in partners}  # Σy², Σx·y per row
    for o in explicit:  # the blocks the mask covers in part: computed and masked
        if o >= nc:
            continue
        m = _block_mask(o, c, window, dev)

        def block(qq: Tensor, k: Tensor, o: int = o, m: Tensor = m) -> Tensor:  # rows of chunks o…, keys o earlier
            out = qq[:, :, o:] @ k[:, :, : nc - o].mT  # B K (nc − o) (G c) c
            return out.view(*out.shape[:3], G, c, c).mul_(m).view(out.shape)

        xb = block(A, Bk)
        sxx[:, :, o:] += _rowsq(xb)
        for name, (pa, pb) in fc.items():
            yb = block(pa, pb)
            ss_, sxy_ = acc[name]
            ss_[:, :, o:] += _rowsq(yb)
            sxy_[:, :, o:] += yb.mul_(xb).sum(-1)
    if last >= 1:  # the key chunks the mask covers whole: through their states
        def form(q: Tensor, st: Tensor, r: Tensor) -> Tensor:  # q_i · st · r_i per row
            return _rowdot((q @ st).unsqueeze(-2), r).squeeze(-1)

        sxx += form(A, _states(Bk, Bk, last), A)
        for name, (pa, pb) in fc.items():
            ss_, sxy_ = acc[name]
            ss_ += form(pa, _states(pb, pb, last), pa)
            sxy_ += form(A, _states(Bk, pb, last), pa)  # Σ_j x·y = a·(Σ_j b_j b'_jᵀ)·[a | e]

    def per_map(v: Tensor) -> Tensor:  # [B, K, nc, (G c)] -> [(B K G), n]
        return v.view(B, K, nc, G, c).permute(0, 1, 3, 2, 4).reshape(B * K * G, nc * c)[:, :n]

    def flat(v: Tensor) -> Tensor:  # [B, K, G, n] -> [(B K G), n]
        return v.reshape(B * K * G, n)

    def first(fa: Tensor, fb: Tensor) -> Tensor:  # the map's first `keep` columns, masked: [(B K G), n, keep]
        kk = min(keep, n)
        v = fa @ fb[:, :, None, :kk].mT  # B K G n kk
        i = torch.arange(n, device=dev)[:, None]
        j = torch.arange(kk, device=dev)[None, :]
        ok = j <= i
        if window is not None:
            ok &= i - j <= window - 1
        v = (v * ok).reshape(B * K * G, n, kk)
        return torch.nn.functional.pad(v, (0, keep - kk)) if kk < keep else v

    xs = FactorSums(flat(sx), per_map(sxx), first(a, b), col=flat(col),
                    diag=_diag_sums(a, b, window).reshape(B * K * G, n))
    ys = {name: FactorSums(flat(torch.einsum("bkgnp,bknp->bkgn", q[..., : pb.shape[-1]], _windowed_prefix(pb, window))),
                           per_map(acc[name][0]), first(q[..., : pb.shape[-1]], pb), sxy=per_map(acc[name][1]))
          for name, pb in partners.items()}
    return xs, ys


def _rowsq(x: Tensor) -> Tensor:
    """``Σ_j x[..., j]²`` (one reduction pass, no squared copy)."""
    return torch.linalg.vector_norm(x, dim=-1).square_()


def _rowdot(x: Tensor, y: Tensor) -> Tensor:
    """``Σ_j x[..., r, j]·y[..., j]`` → ``[..., r]`` as a batched matrix–vector product (no map of the products)."""
    return (x @ y.unsqueeze(-1)).squeeze(-1)
