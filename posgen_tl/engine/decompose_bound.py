"""The decomposition's D3 bound check (docs/method.md §2): on a few query rows of every (batch, layer) capture, the mean
|W − f − g|, the mean of its bound and the fraction of entries within the bound, for each k̄ kind — and W itself on
those rows (its mean shifts the maps; :func:`posgen_tl.engine.decompose_scores._hook_w` compares it with the score
hook's). Used by :mod:`posgen_tl.engine.decompose_scores`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange
from torch import Tensor

from posgen_tl.hooks.capture import QKCapture
from posgen_tl.maths.decompose import band_bound_rows, kbar_batched
from posgen_tl.maths.moments import Geometry
from posgen_tl.maths.precision import full_precision_products
from posgen_tl.maths.rope import angles, to_bands

__all__ = ["BOUND_TABLE_BYTES", "bound_chunk", "bound_checks", "bound_rtol"]

_BOUND_RTOL = 1e-10  # float64 inputs: rounding allowance in the bound check (relative to the summands' magnitude)


def bound_rtol(dtype: torch.dtype, d_head: int) -> float:
    """The rounding allowance ``ε`` of the D3 bound check (:func:`bound_checks`) computed in ``dtype``, relative to the
    magnitude ``M`` of the summands: :data:`_BOUND_RTOL` in float64; in float32 ``(5·d_head + 16)·u`` with ``u = 2⁻²⁴``
    — ``|W − f − g|`` is one dot product of ``N = 2·r + (d_head − r)`` terms whose operands carry a few roundings each
    and whose absolute values sum to at most ``2M`` (error ≤ ``(2N + 12)·u·M``), the bound a sum of ``r/2`` bands
    (≤ ``(r/2 + 4)·u·M``): together at most ``(4.5·d_head + 16)·u·M``. SmolLM2 (``d_head`` 64): 2.0e-5."""
    if dtype == torch.float64:
        return _BOUND_RTOL
    return (5 * d_head + 16) * 2.0**-24


def bound_checks(c: QKCapture, k_means: dict[str, Tensor], rows: Tensor, geoms: dict[int, Geometry],
                  rows_list: Sequence[int] | None = None, cache: dict | None = None,
                  ) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """D3 check on query ``rows`` for each k̄ of ``k_means`` (``{kind: [kv_head, d_head] or [batch, kv_head,
    d_head]}``): ``(checks, mu, w)`` — ``checks[kind]``: mean |W − f − g|, mean bound (as :func:`d3_bound`) and
    fraction of entries within the bound over the masked entries of ``rows`` per mask of ``geoms`` (float64 ``[3,
    (batch head_index), sink]``, :data:`BOUND_COLUMNS` in order, the masks in ``geoms``' order); ``mu``: the mean of
    W there (float64 ``[(batch head_index), sink]``); ``w``: W itself on ``rows`` (``[(batch head_index), rows,
    key_pos]``, in the check's precision).

    In float32 (float64 for float64 captures): the captured q/k are the model's float32 (or rounder) values, and every
    product below is a dot product of at most ``2·d_head`` terms, so float32 carries them to ~1e-7 of their magnitude —
    as the D3 maps scored beside them (:func:`~posgen_tl.engine.decompose_maps.block_moments`, float32 products); the
    phase differences of the bound are formed in float64 (an angle difference of two float32 angles is exact there);
    the means sum each row's masked entries (at most key_pos of them, as the maps' row sums) in the check's precision
    and the rows in float64 (on a CPU whose products keep float32; else all of them in float64). Via real matmuls on
    ``(Re, Im)`` band coordinates, per kv-group (GQA: keys never repeated per query head) and on the checked query rows only; what
    does not depend on k̄ (the queries' and keys' bands, the phasors, W) is computed once for every kind. ``W − f −
    g`` is ONE product, ``s·a²·Re Σ_m q_m·conj((k_m − k̄_m)·(e^{iφ_j} − e^{iφ_i}))·e^{iφ_i}`` written as ``[R_i q |
    q]·[R_j(k − k̄); −(k − k̄)]`` (the unrotated dims cancel exactly), not the difference of three maps. An entry holds
    when ``|W − f − g| ≤ bound + ε·M`` with ``ε`` = :func:`bound_rtol` and ``M = s·a²·Σ_m |q_m|·(|k_m| + |k̄_m| + |k_m
    − k̄_m|)`` (+ the unrotated dims' ``s·Σ|q|·(|k| + |k̄| + |k − k̄|)``), the magnitude of the summands of W, f and g,
    which bounds ``|W| + |f| + |g|``: rounding where the bound is 0 (``j = i``). The bound only on ``j ≤ i``
    (:func:`posgen_tl.maths.decompose.band_bound_rows`). ``rows_list``: ``rows`` as a host list (spares a read from
    the device); ``cache``: a dict that keeps the phasors of the last positions and rope for the next layers of the
    batch, and the bound's ``2|sin((φ_i − φ_j)/2)|`` tables for every layer of a run with the same positions.
    """
    rope, r = c.rope, c.rope.rotary_dim
    b, n, kv = c.k.shape[:3]
    dt = torch.float64 if c.q.dtype == torch.float64 else torch.float32
    q, k = c.q[:, rows].to(dt), c.k.to(dt)  # b r h d, b n kv d
    zq, zk = to_bands(q, r, rope.layout), to_bands(k, r, rope.layout)
    phi, e = _phases(c, cache, dt)
    s, sa2 = rope.score_scale, rope.score_scale * rope.attention_scaling**2
    eps = bound_rtol(dt, q.shape[-1])

    def re_q(z: Tensor) -> Tensor:  # query side of Re(x·conj(y)) = [xr, xi]·[yr, yi], grouped by kv-head
        return rearrange(torch.view_as_real(z), "b i (kv g) m two -> b kv (g i) (m two)", kv=kv)

    def re_k(z: Tensor) -> Tensor:  # key side
        return rearrange(torch.view_as_real(z), "b j kv m two -> b kv (m two) j")

    def heads(x: Tensor) -> Tensor:  # b kv (g i) j -> (b kv g) i j: query head h = kv·G + g
        return rearrange(x, "b kv (g i) j -> (b kv g) i j", i=len(rows))

    qr = re_q(zq * e[:, rows] * sa2)
    qn = _cabs(zq)  # b r h m
    q_mag = rearrange(qn * sa2, "b i (kv g) m -> b kv (g i) m", kv=kv)
    k_abs = _cabs(zk)  # b n kv m
    w = qr @ re_k(zk * e)
    qp = kp = None
    if q.shape[-1] > r:  # the unrotated dims: in W; they cancel exactly in W − f − g
        qp = rearrange(q[..., r:] * s, "b i (kv g) d -> b kv (g i) d", kv=kv)
        kp = rearrange(k[..., r:], "b j kv d -> b kv d j")
        w = w + qp @ kp
        q_mag = torch.cat([q_mag, qp.abs()], -1)
    w = heads(w)
    shared = True if c.positions.shape[0] == 1 or c.positions.stride(0) == 0 else None  # the stream's own positions
    m, cnt = _row_masks(rows, geoms, cache, dt)
    tables = _bound_tables(c, rows, dt, cache)

    # masked means over (rows, keys) on every mask, float64 [maps, sinks]. On a CPU whose products keep float32: each
    # row's masked sums in the check's precision (one product per row, the masks its columns), the rows summed in
    # float64 — no float64 copy of the entries (SmolLM2, 4 × 512 tokens, 32 rows: 3× faster). Else (a GPU's float32
    # products may round to TF32, as may a CPU's where the user allowed it) one float64 product.
    if c.q.device.type == "cpu" and full_precision_products(dt):
        def means(x: Tensor) -> Tensor:
            return torch.bmm(x.transpose(0, 1), m).double().sum(0) / cnt
    else:
        flat = m.permute(2, 0, 1).reshape(m.shape[-1], -1).double()  # [sinks, (rows key_pos)]

        def means(x: Tensor) -> Tensor:
            return (x.reshape(x.shape[0], -1).double() @ flat.T) / cnt

    mu = means(w)
    qe = torch.cat([qr, re_q(zq * sa2)], -1)  # [R_i q | q]·s·a²
    out: dict[str, Tensor] = {}
    for kind, k_mean in k_means.items():
        kb = kbar_batched(k_mean.to(q.device, dt), b, kv)  # b kv d
        zb = to_bands(kb, r, rope.layout)[:, None]  # b 1 kv m
        zd = zk - zb
        err = heads(qe @ torch.cat([re_k(zd * e), -re_k(zd)], -2)).abs_()
        kn = _cabs(zd)
        k_mag = rearrange(k_abs + _cabs(zb) + kn, "b j kv m -> b kv m j")
        if kp is not None:
            kbp = kb[..., r:, None]  # b kv dp 1
            k_mag = torch.cat([k_mag, kp.abs() + kbp.abs() + (kp - kbp).abs()], -2)
        bound = band_bound_rows(qn * sa2, kn, phi, rows, bound_chunk(c, len(rows)), rows_list=rows_list, shared=shared,
                                tables=tables)
        thr = torch.baddbmm(bound.reshape(b * kv, -1, n), q_mag.reshape(b * kv, -1, q_mag.shape[-1]),
                            k_mag.reshape(b * kv, k_mag.shape[-2], n), alpha=eps)
        holds = (err <= thr.reshape(err.shape)).to(dt)
        out[kind] = torch.stack([means(err), means(bound), means(holds)])
    return out, mu, w


def _cabs(z: Tensor) -> Tensor:
    """``|z|`` of a complex tensor as ``√(Re² + Im²)`` (twice as fast as ``z.abs()``'s ``hypot`` on the CPU; the values
    here are far from overflow)."""
    return (z.real.square() + z.imag.square()).sqrt()


def _phases(c: QKCapture, cache: dict | None, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """``(φ, e^{iφ})`` of the capture's positions: float64 ``[b, pos, band]`` (the model's float32 angles) and the
    phasors ``[b, pos, 1, band]``, complex of ``dtype`` (from float64: each part rounded once); kept in ``cache`` while
    the positions and rope are the same objects (the layers of one batch)."""
    hit = None if cache is None else cache.get("phases")
    if (hit is not None and hit[0] is c.positions and hit[1] is c.rope and hit[2].device == c.q.device
            and hit[4] == dtype):
        return hit[2], hit[3]
    phi = angles(c.positions.to(c.q.device), c.rope).double()  # b pos m
    e = torch.polar(torch.ones_like(phi), phi)[:, :, None, :]  # b pos 1 m
    e = e if dtype == torch.float64 else e.to(torch.complex64)
    if cache is not None:
        cache["phases"] = (c.positions, c.rope, phi, e, dtype)
    return phi, e


#: the bound's sin tables are kept for a run's next layers up to this many bytes
BOUND_TABLE_BYTES = 64 * 2**20


def _bound_tables(c: QKCapture, rows: Tensor, dtype: torch.dtype, cache: dict | None) -> dict | None:
    """The dict :func:`~posgen_tl.maths.decompose.band_bound_rows` fills with its ``2|sin((φ_i − φ_j)/2)|`` tables
    (they depend on the positions, the rope and the rows only) and reuses: one per run in ``cache`` while the positions,
    rope and rows are the same objects and the tables stay within :data:`BOUND_TABLE_BYTES` (about ``rows · key_pos ·
    band / 2`` entries); ``None`` (no reuse) beyond, or without a cache."""
    if cache is None:
        return None
    b, n = (c.positions.shape[0] if c.positions.ndim > 1 else 1), c.positions.shape[-1]
    shared = c.positions.ndim == 1 or c.positions.shape[0] == 1 or c.positions.stride(0) == 0
    size = (1 if shared else b) * len(rows) * n * c.rope.n_bands * torch.finfo(dtype).bits // 16
    if size > BOUND_TABLE_BYTES:
        return None
    hit = cache.get("bound_tables")
    if hit is not None and hit[0] is c.positions and hit[1] is c.rope and hit[2] is rows and hit[3] == dtype:
        return hit[4]
    tables: dict = {}
    cache["bound_tables"] = (c.positions, c.rope, rows, dtype, tables)
    return tables


def _row_masks(rows: Tensor, geoms: dict[int, Geometry], cache: dict | None, dtype: torch.dtype = torch.float64,
               ) -> tuple[Tensor, Tensor]:
    """The masks of ``geoms`` on query ``rows`` as the columns of one product per row, ``[rows, key_pos, sink]`` in
    ``dtype`` (0/1), and their entry counts float64 ``[sink]``; kept in ``cache`` while the rows, geometries and dtype
    are the same (a whole run)."""
    hit = None if cache is None else cache.get("row_masks")
    if hit is not None and hit[0] is rows and hit[4] == dtype and len(hit[1]) == len(geoms) and all(
            a is b for a, b in zip(hit[1], geoms.values())):
        return hit[2], hit[3]
    m = torch.stack([geo.mask_rows(rows) for geo in geoms.values()], -1)  # rows key_pos sink
    cnt = m.sum((0, 1)).double()
    m = m.to(dtype)
    if cache is not None:
        cache["row_masks"] = (rows, list(geoms.values()), m, cnt, dtype)
    return m, cnt


def bound_chunk(c: QKCapture, n_rows: int) -> int:
    """Query rows per step of :func:`band_bound_rows` (the numbers do not depend on it): 8 on the CPU; on a GPU, where a
    step costs its launches, as many as keep the step's ``[batch, kv_head, rows, key_pos, band]`` float64 scratch
    within 2²⁷ entries (1 GiB)."""
    if c.q.device.type == "cpu":
        return 8
    b, n, kv = c.k.shape[:3]
    return max(8, min(n_rows, 2**27 // max(1, b * kv * n * c.rope.n_bands)))
