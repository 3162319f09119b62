"""The logit maps of one capture for the decomposition's scoring (:mod:`posgen_tl.engine.decompose_scores`): W and
D3's ``f + g`` as products of the capture's q/k (grouped by kv-head: keys never repeated per query head), and their
moments — whole maps (:func:`whole_moments`, a GPU's path up to 2 048 tokens) or query-row blocks
(:func:`block_moments`). Each map's shift μ is carried by the products' operands (a column of the queries, a row of
ones in the keys), so no pass over a map applies it. Tensor code on captures; the maths of the moments is
:mod:`posgen_tl.maths.moments`.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from posgen_tl.hooks.capture import QKCapture
from posgen_tl.maths.decompose import kbar_batched
from posgen_tl.maths.factored import factored_sums
from posgen_tl.maths.moments import (
    Geometry,
    RowStats,
    Sums,
    Target,
    d3_moments,
    d3_split,
    fit_columns,
    row_scale,
    streamed_moments,
)
from posgen_tl.maths.rope import rotate

__all__ = ["block_moments", "d3_map", "factored_moments", "map_buffer", "query_operand", "row_maps", "whole_moments"]


def query_operand(c: QKCapture, mu: Tensor | None = None) -> Tensor:
    """``[s·R_i q_i | s·Λq_i]`` grouped by kv-head, ``[b, kv, (g i), 2·d_head]`` float32 (``Λ = a²`` on rotary dims).

    ``mu`` (``[(b kv g)]``, each map's shift): ``[s·R_i q_i | −μ | s·Λq_i]``, ``2·d_head + 1`` wide — a product with
    keys that carry a 1 in that row gives the map minus ``μ`` (W − μ from ``[R_j k_j | 1]`` and the first
    ``d_head + 1`` columns, :func:`_w_into`; ``f + g − μ`` from :func:`_k_y` with ``shift``): the shift costs no pass
    over the maps."""
    rope, kv = c.rope, c.k.shape[-2]
    b, n, h, d = c.q.shape
    lam = torch.ones(d, device=c.q.device)
    lam[: rope.rotary_dim] = rope.attention_scaling**2
    e = 0 if mu is None else 1  # the shift's column, between the halves
    out = torch.empty(b, kv, h // kv, n, 2 * d + e, device=c.q.device)  # written in place in its final layout:
    o = out.permute(0, 3, 1, 2, 4)  # b i kv g 2d — no concatenated copy, no rearranged copy (the same bits)
    torch.mul(c.rot_q.reshape(b, n, kv, h // kv, d), rope.score_scale, out=o[..., :d])
    torch.mul(c.q.reshape(b, n, kv, h // kv, d), lam, out=o[..., d + e :]).mul_(rope.score_scale)
    if mu is not None:
        out[..., d] = -mu.to(out).view(b, kv, h // kv, 1)  # map (b kv g)'s −μ on each of its rows i
    return out.view(b, kv, h // kv * n, 2 * d + e)


_GROUPED = "b kv (g i) j -> (b kv g) i j"


def map_buffer(cache: dict | None, c: QKCapture) -> Tensor | None:
    """The run's one map-sized float32 scratch ``[b, kv, (g i), j]`` (W, then each ``f + g``), kept in
    ``cache`` and reused across layers and batches: a fresh map per product costs page faults and,
    with glibc, heap growth with the number of batches. ``None`` without a cache."""
    if cache is None:
        return None
    b, n, kv = c.k.shape[:3]
    return _scratch(cache, "map", (b, kv, c.q.shape[2] // kv * n, n), torch.float32, c.q.device)


def _scratch(cache: dict, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The run's scratch ``name`` of ``shape`` (kept in ``cache``, made anew when its shape, dtype or device differ)."""
    buf = cache.get(name)
    if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype or buf.device != device:
        cache.pop(name, None)  # freed before its successor is made
        buf = cache[name] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def _k_y(c: QKCapture, k_mean: Tensor, shift: bool = False) -> Tensor:
    """``[R_j k̄ | k_j − k̄]`` float32 ``[b, key_pos, kv, 2·d_head]``: the key side of :func:`d3_map` (``shift``:
    ``[R_j k̄ | 1 | k_j − k̄]``, ``2·d_head + 1`` wide, for :func:`query_operand`'s queries with the shift)."""
    b, n, kv = c.k.shape[:3]
    kbar = kbar_batched(k_mean.to(c.k.device, torch.float32), b, kv)  # b kv d
    rot_kbar = rotate(kbar[:, None].expand(b, n, *kbar.shape[1:]), c.positions, c.rope)
    ones = [rot_kbar.new_ones(b, n, kv, 1)] if shift else []
    return torch.cat([rot_kbar, *ones, c.k - kbar[:, None]], dim=-1)


def _w_into(c: QKCapture, qs: Tensor, x: Tensor) -> None:
    """Write ``W − μ`` (``qs``: :func:`query_operand` with the shift) into ``x`` (float32 ``[(b kv g), i, j]``, rows
    possibly strided, as :meth:`posgen_tl.maths.moments.Target.of_product` gives it) as ONE product per kv-group."""
    b, n, kv, d = c.rot_k.shape
    keys = torch.cat([rearrange(c.rot_k, "b j kv d -> b kv d j"), c.rot_k.new_ones(b, kv, 1, n)], dim=-2)
    torch.bmm(qs[..., : d + 1].reshape(b * kv, -1, d + 1), keys.reshape(b * kv, d + 1, n),
              out=x.view(b * kv, -1, n))


def d3_map(c: QKCapture, q2: Tensor, k_mean: Tensor, cache: dict | None = None) -> Tensor:
    """``f + g`` of :func:`d3_split` as ONE matmul of width ``2·d_head``: ``q2 · [R_j k̄ | k_j − k̄]`` (with the
    shift's column in ``q2``, :func:`query_operand` given ``mu``: ``f + g − μ``).

    ``k_mean``: ``[kv_head, d_head]`` (global) or ``[batch, kv_head, d_head]`` (per sequence).
    Returns float32 ``[(batch head_index), query_pos, key_pos]``, grouped by kv-head (no repeat); written
    into the run's map buffer when ``cache`` is given (W must be consumed by then).
    """
    keys = rearrange(_k_y(c, k_mean, shift=q2.shape[-1] % 2 == 1), "b j kv d -> b kv d j")
    return rearrange(torch.matmul(q2, keys, out=map_buffer(cache, c)), _GROUPED, i=c.k.shape[1])


def row_maps(c: QKCapture, q2: Tensor, k_mean: Tensor | None = None, out: Tensor | None = None) -> Any:
    """``(r0, r1, kw) ↦`` query rows ``r0 … r1 − 1`` of W (``k_mean`` None) or of ``f + g``
    (:func:`d3_map`) on keys ``0 … kw − 1``, float32 ``[(batch head_index), r1 − r0, kw]``: the maps a row block at a
    time. ``out``: a flat float32 scratch of at least ``maps · rows · kw`` entries that every block is written into
    (each block's width differs: fresh tensors of a hundred sizes fragment the heap — 1 × 4 096 tokens peaked
    600 MB higher), overwritten by the next call."""
    b, n, kv = c.k.shape[:3]
    d = c.q.shape[-1]
    q5 = q2.view(b, kv, c.q.shape[2] // kv, n, 2 * d)
    keys = rearrange(c.rot_k if k_mean is None else _k_y(c, k_mean), "b j kv d -> b kv j d").contiguous()  # once
    q5 = q5[..., :d] if k_mean is None else q5

    def rows(r0: int, r1: int, kw: int) -> Tensor:
        part = q5[:, :, :, r0:r1].reshape(b, kv, -1, q5.shape[-1])
        dst = None if out is None else out[: part.shape[2] * kw * b * kv].view(b, kv, part.shape[2], kw)
        return rearrange(torch.matmul(part, keys[:, :, :kw].mT, out=dst), _GROUPED, i=r1 - r0)  # keys: a view

    return rows


def block_moments(c: QKCapture, w: Tensor | None, kbars: dict[str, Tensor], geoms: dict[int, Geometry], mu: Tensor,
                  block: int, cache: dict) -> tuple[RowStats, dict[str, dict[int, Any]]]:
    """:func:`~posgen_tl.maths.moments.streamed_moments` of a capture: W's rows from ``w`` (the score hook's maps, a
    view) or recomputed, ``f + g`` of each k̄ of ``kbars`` recomputed, ``block`` query rows at a time (the CPU's path,
    and a GPU's beyond :data:`~posgen_tl.engine.decompose_scores.STREAM_ABOVE` tokens); ``mu``: each map's shift.
    Returns ``(x's row, column and distance sums, {kind: {sink: D3 moments}})``."""
    n = c.k.shape[1]
    q2 = query_operand(c)
    size = (c.q.shape[0] * c.n_heads * min(block, n) * n,)

    def scratch(name: str) -> Tensor:  # one per run and role, reused by every block, layer and batch
        return _scratch(cache, name, size, q2.dtype, c.q.device)

    w_rows = (lambda r0, r1, kw: w[:, r0:r1, :kw]) if w is not None else row_maps(c, q2, out=scratch("w_rows"))
    y = scratch("y_rows")
    return streamed_moments(w_rows, {k: row_maps(c, q2, kb, out=y) for k, kb in kbars.items()}, n=n,
                            nm=c.q.shape[0] * c.n_heads, mu=mu, geoms=geoms, block=block, device=c.q.device,
                            cache=cache)


def whole_moments(c: QKCapture, w: Tensor | None, kbars: dict[str, Tensor], mu: Tensor, geoms: dict[int, Geometry],
                  cache: dict) -> tuple[Target, dict[str, dict[int, Any]]]:
    """The target and, per k̄ of ``kbars``, the D3 moments of a capture's WHOLE maps (a GPU's path up to
    :data:`~posgen_tl.engine.decompose_scores.STREAM_ABOVE` tokens): ``W − μ`` written by its product into the target's
    buffer (or shifted from ``w``, the score hook's maps), each ``f + g − μ`` by its product into the run's map buffer —
    the shift ``μ`` (``[(batch head_index)]``, float32) carried by the operands (:func:`query_operand`), no pass over
    the maps to apply it.
    Returns ``(target, {kind: {sink: moments}})``."""
    n = c.k.shape[1]
    qs = query_operand(c, mu)
    if w is None:
        t = Target.of_product(lambda x: _w_into(c, qs, x), (c.q.shape[0] * c.n_heads, n), geoms[0], mu, cache,
                              qs.dtype, c.q.device)
    else:
        t = Target(w, geoms[0], mu, cache)
    d3 = {}
    for kind, kbar in kbars.items():
        y = d3_map(c, qs, kbar, cache)  # in the run's map buffer: overwritten by the next kind's
        d3[kind] = d3_moments(t, y, geoms, shifted=True)
        del y
    return t, d3


def factored_moments(c: QKCapture, kbars: dict[str, Tensor], mu: Tensor, geoms: dict[int, Geometry],
                     chunk: int = 0) -> tuple[Sums, dict[str, dict[int, Any]]]:
    """What :func:`whole_moments` gives, from the maps' factors alone (:func:`posgen_tl.maths.factored.factored_sums`):
    ``W − μ = [s·R_i q_i | −μ]·[R_j k_j | 1]`` and each ``f + g − μ = [s·R_i q_i | −μ | s·Λq_i]·[R_j k̄ | 1 | k_j − k̄]``
    (:func:`query_operand`, :func:`_k_y`) in float64, no ``n × n`` map ever made: time ``O(n·d_head²)`` and memory
    ``O(n·d_head)`` per head instead of ``O(n²·d_head)`` and ``O(n²)``. ``mu``: each map's shift ``[(batch
    head_index)]``; ``chunk``: the factored sums' chunk (0: their default). A GPU's path from 1 024 tokens (float64 products
    are cheap there); a CPU keeps the maps' float32 row blocks (:func:`~posgen_tl.engine.decompose_scores.use_factored`
    says what was measured there).
    Returns ``(x's row, column and distance sums — the input of all_fit_moments —, {kind: {sink: D3 moments}})``."""
    b, n, kv, d = c.rot_k.shape
    g = c.q.shape[2] // kv
    rope, dev = c.rope, c.q.device
    s = rope.score_scale
    lam = torch.ones(d, dtype=torch.float64, device=dev)
    lam[: rope.rotary_dim] = rope.attention_scaling**2

    def grouped(v: Tensor) -> Tensor:  # b n (kv g) d -> b kv g n d, a view
        return v.view(b, n, kv, g, v.shape[-1]).permute(0, 2, 3, 1, 4)

    # the queries [s·R_i q_i | −μ | s·Λq_i], written in place (each part one pass, float64): W − μ reads the first
    # d + 1 columns, every f + g − μ all of them
    q = torch.empty(b, kv, g, n, 2 * d + 1, dtype=torch.float64, device=dev)
    torch.mul(grouped(c.rot_q), torch.full((d,), s, dtype=torch.float64, device=dev), out=q[..., :d])  # in float64
    q[..., d] = -rearrange(mu.to(dev, torch.float64), "(b kv g) -> b kv g 1", b=b, kv=kv)
    torch.mul(grouped(c.q), lam * s, out=q[..., d + 1 :])
    ones = torch.ones(b, kv, n, 1, dtype=torch.float64, device=dev)
    kt = rearrange(c.rot_k.double(), "b n kv d -> b kv n d")
    partners = {}
    for kind, kbar in kbars.items():
        kb = kbar_batched(kbar.to(dev, torch.float64), b, kv)  # b kv d
        rot_kb = rotate(kb[:, None].expand(b, n, kv, d), c.positions, rope)  # b n kv d (float64)
        partners[kind] = torch.cat([rearrange(rot_kb, "b n kv d -> b kv n d"), ones,
                                    rearrange(c.k.double() - kb[:, None], "b n kv d -> b kv n d")], -1)
    keep = fit_columns(geoms)
    xs, ys = factored_sums(q, torch.cat([kt, ones], -1), partners, window=geoms[0].window, keep=keep, chunk=chunk)
    assert xs.col is not None and xs.diag is not None
    m = mu.to(c.q.device, torch.float64)
    stats = Sums(n, c.q.device, xs.s, xs.ss, xs.col, xs.diag, xs.cols, row_scale(xs.ss, m))
    d3 = {}
    for kind, y in ys.items():
        assert y.sxy is not None
        ycols = {s_: y.cols[..., :s_] for s_ in geoms if s_}
        d3[kind] = d3_split(stats, y.s, y.ss, y.sxy, ycols, row_scale(y.ss, m), geoms)
    return stats, d3
