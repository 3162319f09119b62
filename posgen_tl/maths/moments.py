"""Score moments for the decomposition runner: every r, R² and within-row r of D1/D2/D3 from
per-row sums, without materialising fitted maps (used by :mod:`posgen_tl.experiments.decomposition`).

* :class:`Geometry` — a mask (causal, sink, window) with its counts and the D1/D2 least-squares solve
  (:mod:`posgen_tl.maths.additive`: O(n) per map through the band's structure);
* :class:`Target` — one batch of logit maps, centred and masked in place, with its row/column/diagonal sums;
* ``_fit_*`` / ``d3_moments`` — moments (Σx, Σy per row; Σx², Σy², Σxy split by rows) of each approximation, the
  fits' from x's row, column and distance sums alone;
* :class:`Sums` / :func:`fit_moments_many` — those O(n) sums of many captures, their D1/D2 fits solved together;
* :func:`moment_sums` / :func:`scores_of_sums` — a few sums per map of those moments, then Pearson r, R² and
  within-row r from them (of a whole run's maps in one call; :func:`scores` both at once);
* :func:`streamed_moments` — the same sums and moments from query-row blocks of the maps (one pass; extra memory
  O(maps · block · n) instead of O(maps · n²)), for long sequences.

Pure tensor maths (no model); the experiment that uses it is :mod:`posgen_tl.experiments.decomposition`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from jaxtyping import Float
from torch import Tensor

from posgen_tl.maths.additive import (
    DIRECT_MAX,
    DIRECT_MAX_GPU,
    Band,
    Direct,
    band,
    col_sums_a,
    direct,
    prefix_sums,
    row_sums_a,
    row_sums_c,
    solve_many,
)
from posgen_tl.maths.decompose import causal_mask, normal_system

_RIDGE, _REFINE = 1e-6, 3  # fit_additive's defaults

# ----------------------------------------------------------------------------- masks and fit operators


@dataclass
class Geometry:
    """One scoring mask (``j ∈ [max(sink, i−w+1), i]``) and everything derived from it, O(n) but the mask."""

    n: int
    sink: int
    window: int | None
    device: torch.device
    band: Band  # the mask's runs and counts: the structured D1/D2 solve
    cnt: Tensor  # float64 [i] entries per row
    ncol: Tensor  # float64 [j]
    ndiag: Tensor  # float64 [d]
    amask: Tensor  # float64 [d]: distances in use
    ops: dict  # three_axis -> dense P [p, p] float64, only for a one-key window (else empty)
    direct: dict = field(default_factory=dict)  # three_axis -> additive.Direct (or None), built on first use (n ≤ DIRECT_MAX)
    weights: tuple[Tensor, ...] = ()  # :func:`_row_weights`, made on first use

    def mask_rows(self, rows: Tensor) -> Tensor:
        """The mask's query ``rows``, bool ``[rows, key_pos]`` (the whole ``[n, n]`` mask is never kept: 268 MB at
        16 384 tokens)."""
        j = torch.arange(self.n, device=self.device)
        r = rows.to(self.device)
        return (j[None, :] >= self.band.lo.to(self.device)[r, None]) & (j[None, :] <= r[:, None])

    def solve(self, rhs: Tensor, three_axis: bool) -> Tensor:
        """The fit's parameters ``[maps, p]`` from ``rhs = Xᵀx`` (min-norm least squares): up to
        :data:`posgen_tl.maths.additive.DIRECT_MAX` tokens (:data:`~posgen_tl.maths.additive.DIRECT_MAX_GPU` on a GPU)
        by the direct Schur solve (its operators built once per mask and kept), beyond by conjugate gradients (O(n)
        memory); both to the same stated tolerance."""
        return solve_fits([(self, rhs, three_axis)])[0]

    def direct_op(self, three_axis: bool) -> Direct | None:
        """The direct operator of this mask and design (built on first use up to the device's limit), else None."""
        limit = DIRECT_MAX if self.device.type == "cpu" else DIRECT_MAX_GPU
        if self.n <= limit and three_axis not in self.direct:
            try:
                self.direct[three_axis] = direct(self.band, three_axis, self.device)
            except torch.linalg.LinAlgError:  # not positive definite after all: conjugate gradients alone
                self.direct[three_axis] = None
        return self.direct.get(three_axis)


def solve_fits(items: Sequence[tuple[Geometry, Tensor, bool]], floors: Sequence[Tensor | None] | None = None,
               ) -> list[Tensor]:
    """:meth:`Geometry.solve` of several ``(geometry, rhs, three_axis)`` fits, the structured ones through
    :func:`~posgen_tl.maths.additive.solve_many` (one device read for all their first convergence tests; ``floors``:
    each right-hand side's rounding level, as there)."""
    out: list[Tensor | None] = [None] * len(items)
    structured = [i for i, (g, _, _) in enumerate(items) if g.band.structured]
    for i, (g, rhs, three_axis) in enumerate(items):
        if not g.band.structured:
            out[i] = rhs @ g.ops[three_axis].T
    sols = solve_many([(items[i][0].band, items[i][1], items[i][2], items[i][0].direct_op(items[i][2]))
                       for i in structured], floors=None if floors is None else [floors[i] for i in structured])
    for i, x in zip(structured, sols):
        out[i] = x
    return [x for x in out if x is not None]


_GEOMS: dict[tuple, Geometry] = {}


def _dense_ops(mask: Tensor) -> dict:
    """``fit_additive``'s ridge solve plus refinement folded into one matrix per design (dense: O(n²) memory)."""
    ops = {}
    for three in (True, False):
        xtx, factor = normal_system(mask, three, _RIDGE)
        m_inv = torch.cholesky_inverse(factor)
        e = torch.eye(m_inv.shape[0], dtype=m_inv.dtype) - m_inv @ xtx
        p = m_inv
        for _ in range(_REFINE):  # β_{t+1} = β_t + M(r − Aβ_t)  ⇒  β = Σ_t E^t M r
            p = m_inv + e @ p
        ops[three] = p
    return ops


def geometry(n: int, sink: int, window: int | None, device: torch.device | str = "cpu") -> Geometry:
    """Mask ``j ∈ [max(sink, i−w+1), i]`` with its counts (LRU-cached, on ``device``)."""
    key = (n, sink, window, str(device))
    if key in _GEOMS:
        return _GEOMS[key]
    bd = band(n, sink, window, device)
    ops = {} if bd.structured else {k: v.to(device) for k, v in
                                    _dense_ops(causal_mask(n, sink=sink, sliding_window=window)).items()}
    g = Geometry(n, sink, window, torch.device(device), bd, bd.cnt, bd.ncol, bd.ndiag, (bd.ndiag > 0).double(), ops)
    if len(_GEOMS) >= 6:
        _GEOMS.pop(next(iter(_GEOMS)))
    _GEOMS[key] = g
    return g


# ----------------------------------------------------------------------------- moments → scores


@dataclass
class _Moments:
    """Masked sums of a target x and an approximation y on one mask: ``sx``, ``sy`` per row (float64 ``[maps,
    query_pos]``); ``sxx``, ``syy``, ``sxy`` split by rows (float64 ``[maps, 2]``: the sum over the rows with at least
    two entries — those the within-row r uses —, then over the other rows; :func:`split_rows`)."""

    sx: Tensor
    sy: Tensor
    sxx: Tensor
    syy: Tensor
    sxy: Tensor
    xmax: Tensor  # [maps] a magnitude of x, ≥ max |x| (for the degeneracy test)
    ymax: Tensor


def split_rows(v: Float[Tensor, "*maps query_pos"], g: Geometry) -> Float[Tensor, "*maps 2"]:
    """Per-row sums ``v`` → ``[Σ over rows with ≥ 2 entries of mask g, Σ over the other rows]`` (float64)."""
    ok = _row_weights(g)[0].to(v.dtype)
    return torch.stack([(v * ok).sum(-1), (v * (1 - ok)).sum(-1)], -1)


def _row_weights(g: Geometry) -> tuple[Tensor, ...]:
    """``(ok, ok/cnt, Σ cnt, Σ cnt·ok)`` of mask ``g`` (float64 ``[i]``, ``[i]``, ``[]``, ``[]``; ``ok``: ≥ 2 entries)."""
    if not g.weights:  # made once per geometry
        ok = (g.cnt >= 2).double()
        g.weights = (ok, ok / g.cnt.clamp(min=1), g.cnt.sum(), (g.cnt * ok).sum())
    return g.weights


#: the rows of :func:`moment_sums`: totals over the mask, within-row sums (rows with ≥ 2 entries), magnitudes
SUM_ROWS = ("sx", "sy", "sxx", "syy", "sxy", "wx", "wy", "wxy", "xmax", "ymax")


def moment_sums(m: _Moments, g: Geometry) -> Float[Tensor, "10 maps"]:
    """What :func:`scores_of_sums` needs of moments ``m`` on mask ``g``, per map (float64 ``[10, maps]``, rows
    :data:`SUM_ROWS`): a few numbers per map, so the scores of a whole run are computed in one call at its end."""
    _, oc, _, _ = _row_weights(g)
    q = torch.stack([m.sxx, m.syy, m.sxy])  # 3 maps 2
    within = (torch.stack([m.sx * m.sx, m.sy * m.sy, m.sx * m.sy]) * oc).sum(-1)  # row by row: any number of maps
    return torch.cat([torch.stack([m.sx, m.sy]).sum(-1), q.sum(-1), q[..., 0] - within,
                      torch.stack([m.xmax, m.ymax]).double()])


def scores_of_sums(s: Float[Tensor, "10 maps"], g: Geometry) -> dict[str, Tensor]:
    """r, R², within-row r (float64 ``[maps]`` each) from :func:`moment_sums` on mask ``g`` (maps of many moments
    side by side), with :mod:`posgen_tl.maths.decompose`'s NaN rules."""
    _, _, n, nw = _row_weights(g)
    sx, sy, sxx, syy, sxy, wx, wy, wxy, xmax, ymax = s.unbind(0)
    vx = sxx - sx * sx / n
    vy = syy - sy * sy / n
    cov = sxy - sx * sy / n

    def degen(ss: Tensor, ref: Tensor, cnt: Tensor) -> Tensor:
        return ss <= cnt * (1e-12 * ref) ** 2

    r = torch.where(degen(vx, xmax, n) | degen(vy, ymax, n) | (n < 2), torch.nan, cov / (vx * vy).sqrt())
    ssres = sxx - 2 * sxy + syy
    r2 = torch.where(degen(vx, xmax, n) | (n < 2), torch.nan, 1 - ssres / vx)  # one entry: no variance to explain
    rw = torch.where(degen(wx, xmax, nw) | degen(wy, ymax, nw) | (nw < 2), torch.nan, wxy / (wx * wy).sqrt())
    return {"r": r, "r2": r2, "r_within": rw}


def scores(m: _Moments, g: Geometry) -> dict[str, Tensor]:
    """r, R², within-row r of moments ``m`` on mask ``g`` (:func:`scores_of_sums` of :func:`moment_sums`)."""
    return scores_of_sums(moment_sums(m, g), g)


def _rowsq(x: Tensor) -> Tensor:
    """``Σ_j x[..., i, j]²`` → float64 ``[maps, query_pos]`` (one float32 reduction pass, no temporary)."""
    return torch.linalg.vector_norm(x, dim=-1).double().square()


def row_scale(sq: Tensor, mu: Tensor) -> Tensor:
    """``max_i ‖row_i‖₂ + |μ|`` → float64 ``[maps]``: a magnitude ≥ ``max |x + μ|`` for the degeneracy
    test (between ``max |x|`` and ``√n·max |x|``; costs nothing once the row sums of squares exist)."""
    return sq.amax(-1).sqrt() + mu.double().abs()


def _mask_(x: Tensor, g: Geometry) -> Tensor:
    """Zero the off-mask entries of ``x [maps, i, j]`` in place (``g.sink`` must be 0)."""
    x.tril_()
    if g.window is not None:
        x.triu_(-(g.window - 1))
    return x


class _RowSums:
    """Per-row sums of a masked target: ``sx``, ``sxx`` (float64 ``[maps, n]``), column and diagonal sums and its
    first columns."""

    n: int
    device: torch.device
    sx: Tensor
    sxx: Tensor
    col: Tensor
    diag: Tensor
    xmax: Tensor  # [maps] ≥ max |x + μ| (the degeneracy test's magnitude)

    def sink_cols(self, sink: int) -> Tensor:  # pragma: no cover - each subclass has its own
        raise NotImplementedError

    def head(self, h: int) -> Tensor:  # pragma: no cover - each subclass has its own
        """x (sink-kept mask) on its first ``h`` query rows and keys, float64 ``[maps, h, h]``."""
        raise NotImplementedError

    def moments_x(self, sink: int) -> tuple[Tensor, Tensor]:
        """Row sums ``Σx``, ``Σx²`` over the mask with the first ``sink`` keys excluded."""
        if sink == 0:
            return self.sx, self.sxx
        s = self.sink_cols(sink).double()
        return self.sx - s.sum(-1), self.sxx - (s * s).sum(-1)

    def sums_on(self, g: Geometry) -> tuple[Tensor, Tensor, Tensor]:
        """``(Σx per row, per key column, per distance)`` on mask ``g`` (float64 ``[maps, n]`` each): the sink-kept
        sums less the first ``g.sink`` keys."""
        n, s = self.n, g.sink
        sx, _ = self.moments_x(s)
        if not s:
            return sx, self.col, self.diag
        cols = self.sink_cols(s).double()
        diag, col = self.diag.clone(), self.col.clone()
        for c in range(s):  # entry (i, c) sits on diagonal d = i − c
            diag[:, : n - c] -= cols[:, c:, c]
        col[:, :s] = 0.0
        return sx, col, diag


class Target(_RowSums):
    """The shifted, masked logit maps of one (batch, layer) and their sink-kept row sums.

    ``x = (W − μ)·mask₀`` (``μ`` a per-map shift, the masked mean of the bound rows; any
    constant works, it only keeps the moments from cancelling) lives in the right half of a
    zero-padded ``[maps, n, 2n]`` buffer so that ``view[m, i, e] = x[m, i, i − (n−1−e)]`` is a
    strided VIEW (no copy). The buffer is kept in ``cache`` and reused across the layers of
    one run (its left half stays zero). :meth:`of_product` lets a product write ``W − μ`` there
    itself (no map of W, no pass to shift it).
    """

    def __init__(self, W: Float[Tensor, "maps query_pos key_pos"], g0: Geometry, mu: Tensor, cache: dict) -> None:
        x = self._slot(cache, W.shape[0], W.shape[-1], W.dtype, W.device)
        torch.sub(W, mu[:, None, None], out=x)
        self._finish(x, g0, mu)

    @classmethod
    def of_product(cls, write: Callable[[Tensor], object], shape: tuple[int, int], g0: Geometry, mu: Tensor,
                   cache: dict, dtype: torch.dtype, device: torch.device) -> Target:
        """The target whose ``W − μ`` ``write(x)`` writes into ``x`` (``[maps, n, n]`` of ``shape = (maps, n)``, a
        strided view of the buffer: rows ``2n`` apart), e.g. a product whose operands carry the shift."""
        t = cls.__new__(cls)
        x = cls._slot(cache, *shape, dtype, device)
        write(x)
        t._finish(x, g0, mu)
        return t

    @staticmethod
    def _slot(cache: dict, nm: int, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The right half ``[maps, n, n]`` of the run's ``[maps, n, 2n]`` buffer (made anew when its shape, dtype
        or device differ; its left half zero)."""
        buf = cache.get("buf")
        if buf is None or buf.shape != (nm, n, 2 * n) or buf.device != device or buf.dtype != dtype:
            cache.pop("buf", None)  # freed before its successor is made
            buf = cache["buf"] = torch.zeros(nm, n, 2 * n, dtype=dtype, device=device)
        return buf[..., n:]

    def _finish(self, x: Tensor, g0: Geometry, mu: Tensor) -> None:
        """Mask ``x`` (holding ``W − μ``) in place and take its sums."""
        nm, n = x.shape[0], x.shape[-1]
        _mask_(x, g0)
        self.mu, self.x, self.n, self.device = mu, x, n, x.device
        self.view = x.as_strided((nm, n, n), (2 * n * n, 2 * n + 1, 1), x.storage_offset() - n + 1)  # e = n−1−d
        self.sx = x.sum(-1).double()
        self.sxx = _rowsq(x)
        self.col = x.sum(-2).double()
        self.diag = self.view.sum(-2).double().flip(-1)  # [maps, d]
        self.xmax = row_scale(self.sxx, mu)

    def sink_cols(self, sink: int) -> Tensor:
        return self.x[..., :sink]

    def head(self, h: int) -> Tensor:
        """x on its first ``h`` rows and keys, float64 ``[maps, h, h]``."""
        return self.x[:, :h, :h].double()


def _head_rows(g: Geometry) -> int:
    """How many leading query rows of mask ``g`` hold fewer than two entries (the within-row r leaves them out; a
    band's row counts never decrease, so they are the first rows): rows ``0 … sink`` (``i − sink + 1 < 2``), or every
    row of a one-key window — from the mask's numbers, not its counts (on a GPU a read of them waits for the queue)."""
    return g.n if g.window == 1 else min(g.sink + 1, g.n)


#: a fit's right-hand side ``Xᵀ(x − mean)`` no larger than this times the norm of what it was centred from (the sums
#: and ``mean`` × the counts) is float64 rounding: its map's sums are an additive map's (one entry, a constant map)
RHS_ROUNDING = 1e-13


def _fit_rhs(sums: tuple[Tensor, Tensor, Tensor], g: Geometry, three_axis: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean, rhs, floor)``: the map's masked mean, the right-hand side ``Xᵀ(x − mean)`` of its D1 (``three_axis``)
    or D2 fit on mask ``g`` from ``sums`` (:meth:`_RowSums.sums_on`, float64) and its rounding level ``[maps, 1]``
    (:data:`RHS_ROUNDING`)."""
    sx, col, diag = sums
    mean = sx.sum(-1) / g.cnt.sum()
    m = mean[:, None]
    parts = [diag - m * g.ndiag] + ([sx - m * g.cnt] if three_axis else []) + [col - m * g.ncol]
    mags = [diag.abs() + m.abs() * g.ndiag] + ([sx.abs() + m.abs() * g.cnt] if three_axis else [])
    mags.append(col.abs() + m.abs() * g.ncol)
    floor = RHS_ROUNDING * torch.cat(mags, dim=-1).norm(dim=-1, keepdim=True)
    return mean, torch.cat(parts, dim=-1), floor


def _fit_params(n: int, mean: Tensor, beta: Tensor, three_axis: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(mean, a, b, c)`` from the fit's parameters ``beta`` (``b = 0`` for D2)."""
    a, c_ = beta[:, :n], beta[:, -n:]
    b = beta[:, n : 2 * n] if three_axis else torch.zeros_like(a)
    return mean, a, b, c_


def _fit_moments(t: _RowSums, g: Geometry, fit: tuple, sums: tuple[Tensor, Tensor, Tensor]) -> _Moments:
    """Moments of x and of the fitted map ``mean + a[i−j] + b[i] + c[j]`` on mask ``g``.

    Every sum over the mask of x times the fit is one of x's row, column or distance sums (``sums``,
    :meth:`_RowSums.sums_on`) times a parameter, and ``Σ a[i−j]·c[j]`` a column sum of ``a`` times ``c``: no
    map-sized product. The few leading rows with fewer than two entries (:func:`_head_rows`) are summed apart,
    from their entries."""
    dev = t.device
    mean, a, b, c_ = fit
    sx, col, diag = sums
    _, sxx = t.moments_x(g.sink)
    mi = mean[:, None] + b
    pa = prefix_sums(a)  # once for the row and the column sums of a
    a1, a2 = row_sums_a(g.band, a, pa), row_sums_a(g.band, a * a)
    c1, c2 = row_sums_c(g.band, c_), row_sums_c(g.band, c_ * c_)
    sy = g.cnt * mi + a1 + c1
    syy_rows = g.cnt * mi * mi + a2 + c2 + 2 * mi * (a1 + c1)  # all but Σ_j 2·a[i−j]·c[j]
    syy_all = syy_rows.sum(-1) + 2 * (c_ * col_sums_a(g.band, a, pa)).sum(-1)
    sxy_all = (mi * sx).sum(-1) + (c_ * col).sum(-1) + (a * diag).sum(-1)
    h = _head_rows(g)
    rows = torch.arange(h, device=dev)
    m = g.mask_rows(rows)[:, :h].double()  # [h, h]: entries of the head rows (keys j ≤ i < h)
    d = (rows[:, None] - rows[None, :]).clamp(min=0)
    y_h = (mi[:, :h, None] + a[:, d] + c_[:, None, :h]) * m
    x_h = t.head(h) * m
    rest_yy, rest_xy = (y_h * y_h).sum((-1, -2)), (x_h * y_h).sum((-1, -2))
    syy = torch.stack([syy_all - rest_yy, rest_yy], -1)
    sxy = torch.stack([sxy_all - rest_xy, rest_xy], -1)
    ymax = mean.abs() + b.abs().amax(-1) + a.abs().amax(-1) + c_.abs().amax(-1)
    return _Moments(sx, sy, split_rows(sxx, g), syy, sxy, t.xmax, ymax)


def _fits(t: _RowSums, geoms: dict[int, Geometry]) -> tuple[dict[tuple[int, str], tuple], dict[int, tuple]]:
    """D1 and D2 on every mask: ``(fits, sums)`` — the parameters per (sink, estimator) and x's sums per mask."""
    keys = [(s, est) for s in geoms for est in ("D1", "D2")]  # solved together: one device read for all four
    sums = {s: t.sums_on(g) for s, g in geoms.items()}
    rhs = {k: _fit_rhs(sums[k[0]], geoms[k[0]], k[1] == "D1") for k in keys}
    betas = solve_fits([(geoms[k[0]], rhs[k][1], k[1] == "D1") for k in keys], floors=[rhs[k][2] for k in keys])
    return {k: _fit_params(t.n, rhs[k][0], beta, k[1] == "D1") for k, beta in zip(keys, betas)}, sums


def all_fit_moments(t: _RowSums, geoms: dict[int, Geometry]) -> dict[tuple[int, str], _Moments]:
    """D1 and D2 on every mask (``geoms``: ``{sink: Geometry}``), keyed ``(sink, estimator)``."""
    fits, sums = _fits(t, geoms)
    return {k: _fit_moments(t, geoms[k[0]], fit, sums[k[0]]) for k, fit in fits.items()}


class Sums(_RowSums):
    """The O(n)-per-map part of a target that its D1/D2 fits and their moments need (:func:`sums_of`): row sums of x
    and x², column and distance sums, the first ``keep`` columns of every row, the degeneracy magnitude — float64,
    detached from the maps, so that the fits of many (batch, layer) captures are solved together
    (:func:`fit_moments_many`)."""

    def __init__(self, n: int, device: torch.device, sx: Tensor, sxx: Tensor, col: Tensor, diag: Tensor, first: Tensor,
                 xmax: Tensor) -> None:
        self.n, self.device = n, device
        self.sx, self.sxx, self.col, self.diag, self.first, self.xmax = sx, sxx, col, diag, first, xmax

    def sink_cols(self, sink: int) -> Tensor:
        return self.first[..., :sink]

    def head(self, h: int) -> Tensor:
        return self.first[:, :h, :h]


def fit_columns(geoms: Mapping[int, Geometry]) -> int:
    """How many leading columns of x the fits on ``geoms`` read: the excluded sink keys and the head rows' entries."""
    return max([max(geoms), *(_head_rows(g) for g in geoms.values())])


def sums_of(t: _RowSums, keep: int) -> Sums:
    """``t``'s :class:`Sums` with its first ``keep`` columns (:func:`fit_columns`)."""
    first = t.sink_cols(keep).to(torch.float64, copy=True)
    return Sums(t.n, t.device, t.sx, t.sxx, t.col, t.diag, first, t.xmax)


def join_sums(parts: Sequence[Sums]) -> Sums:
    """The :class:`Sums` of several captures (same ``n``) as one, their maps side by side."""
    if len(parts) == 1:
        return parts[0]
    return Sums(parts[0].n, parts[0].device, *(torch.cat([getattr(p, f) for p in parts])
                                               for f in ("sx", "sxx", "col", "diag", "first", "xmax")))


def fit_moments_many(parts: Sequence[Sums], geoms: dict[int, Geometry]) -> list[dict[tuple[int, str], _Moments]]:
    """:func:`all_fit_moments` of several captures' :class:`Sums` (same ``n``, same masks), their fits solved in ONE
    call on their maps side by side (:func:`join_sums`) — the same numbers; each step of the solve costs the same few
    operations for any number of maps, so one call for many layers replaces one per layer. Returns each part's
    moments."""
    whole = all_fit_moments(join_sums(parts), geoms)
    if len(parts) == 1:
        return [whole]
    sizes = [p.sx.shape[0] for p in parts]
    out: list[dict[tuple[int, str], _Moments]] = [{} for _ in parts]
    for key, m in whole.items():
        pieces = [getattr(m, f.name).split(sizes) for f in dataclasses.fields(_Moments)]
        for i, d in enumerate(out):
            d[key] = _Moments(*(p[i] for p in pieces))
    return out


def d3_split(t: _RowSums, sy: Tensor, syy: Tensor, sxy: Tensor, ycols: dict[int, Tensor], ymax: Tensor,
              geoms: dict[int, Geometry]) -> dict[int, _Moments]:
    """The D3 moments per mask from the sink-kept row sums of y (``ycols``: y's first columns per sink, float64)."""
    out = {}
    for s, g in geoms.items():
        sx, sxx = t.moments_x(s)
        if s:
            yc, xc = ycols[s], t.sink_cols(s).double()
            sy_s, syy_s, sxy_s = sy - yc.sum(-1), syy - (yc * yc).sum(-1), sxy - (xc * yc).sum(-1)
        else:
            sy_s, syy_s, sxy_s = sy, syy, sxy
        sxx_s, syy_s, sxy_s = split_rows(torch.stack([sxx, syy_s, sxy_s]), g).unbind(0)  # three in one pass
        out[s] = _Moments(sx, sy_s, sxx_s, syy_s, sxy_s, t.xmax, ymax)
    return out


def d3_moments(t: Target, y: Tensor, geoms: dict[int, Geometry], shifted: bool = False) -> dict[int, _Moments]:
    """Moments of x and the D3 approximation ``y = f + g`` (float32 ``[maps, i, j]``; OVERWRITTEN: it
    ends holding ``x·(y − μ)``, so ``Σxy`` needs no map-sized temporary) on each mask of ``geoms``
    (``{sink: Geometry}``; sink 0 among them). ``shifted``: ``y`` holds ``f + g − μ`` already (the shift carried
    by its product's operands)."""
    _mask_(y if shifted else y.sub_(t.mu[:, None, None]), geoms[0])
    sy, syy = y.sum(-1).double(), _rowsq(y)
    ycols = {s: y[..., :s].to(torch.float64, copy=True) for s in geoms if s}  # a copy: y is overwritten below
    sxy = y.mul_(t.x).sum(-1).double()
    return d3_split(t, sy, syy, sxy, ycols, row_scale(syy, t.mu), geoms)


# ----------------------------------------------------------------------------- query-row blocks (long sequences)


class RowStats(_RowSums):
    """What the D1/D2 fits and the scores need of the shifted, masked target ``x = (W − μ)·mask₀``, accumulated
    over query-row blocks: per-row ``Σx``, ``Σx²`` (float64 ``[maps, n]``), column and diagonal sums, and the first
    ``keep`` columns of every row — the interface of :class:`Target` without its ``[maps, n, 2n]`` buffer."""

    def __init__(self, nm: int, n: int, mu: Tensor, keep: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        def z(*shape: int) -> Tensor:
            return torch.zeros(*shape, dtype=torch.float64, device=device)

        self.n, self.mu, self.device = n, mu, device
        self.sx, self.sxx, self.col, self.diag = z(nm, n), z(nm, n), z(nm, n), z(nm, n)
        self.first = torch.zeros(nm, n, keep, dtype=dtype, device=device)
        self.xmax = z(nm)

    def add(self, x: Tensor, view: Tensor, r0: int) -> None:
        """Rows ``r0 …`` of x on their first keys (``[maps, block, keys]``: every key of the mask, ``j ≤ i``) and
        their diagonal view (``view[m, i, e] = x[m, i, i − (keys−1−e)]``, distances ``keys − 1 … 0``)."""
        r1, kw = r0 + x.shape[1], x.shape[-1]
        self.sx[:, r0:r1] = x.sum(-1).double()
        self.sxx[:, r0:r1] = _rowsq(x)
        self.col[:, :kw] += x.sum(-2).double()
        self.diag[:, :kw] += view.sum(-2).double().flip(-1)
        kk = min(self.first.shape[-1], kw)  # the keys beyond kw are outside the mask on these rows: 0
        self.first[:, r0:r1, :kk] = x[..., :kk]

    def finish(self) -> RowStats:
        """After the last block: the magnitude of x for the degeneracy test (as :class:`Target`'s)."""
        self.xmax = row_scale(self.sxx, self.mu)
        return self

    def sink_cols(self, sink: int) -> Tensor:
        return self.first[..., :sink]

    def head(self, h: int) -> Tensor:
        return self.first[:, :h, :h].double()


def _block_rows(rows: Tensor, g0: Geometry, mu: Tensor, buf: Tensor, r0: int) -> tuple[Tensor, Tensor]:
    """``x`` of query rows ``r0 … r0 + block − 1`` on keys ``0 … kw − 1`` (``rows``: ``W`` there, ``[maps, block, kw]``,
    ``kw ≥ r0 + block``: every key the causal mask keeps) shifted and masked into the right half of ``buf``
    (``[maps, ≥ block, 2n]``, left half zero), and its diagonal view ``[maps, block, kw]`` (distances ``kw − 1 … 0``)."""
    nm, blk, kw = rows.shape
    n = buf.shape[-1] // 2
    x = buf[:, :blk, n : n + kw]
    torch.sub(rows, mu[:, None, None], out=x)
    _mask_block_(x, g0, r0)
    view = buf.as_strided((nm, blk, kw), (buf.stride(0), 2 * n + 1, 1), buf.storage_offset() + r0 + 1 + n - kw)
    return x, view


def _mask_block_(x: Tensor, g0: Geometry, r0: int) -> Tensor:
    """Zero the entries of query rows ``r0 …`` (``x [maps, block, n]``) outside the sink-kept mask, in place."""
    x.tril_(r0)  # j ≤ i
    if g0.window is not None:
        x.triu_(r0 - (g0.window - 1))
    return x


def streamed_moments(
    w_rows: Callable[[int, int, int], Tensor], y_rows: Mapping[str, Callable[[int, int, int], Tensor]], *, n: int,
    nm: int, mu: Tensor, geoms: dict[int, Geometry], block: int, device: torch.device, cache: dict | None = None,
) -> tuple[RowStats, dict[str, dict[int, _Moments]]]:
    """What :func:`all_fit_moments` needs of x and, per k̄ kind, the moments of :func:`d3_moments`, from query-row blocks:
    ``w_rows(r0, r1, kw)`` gives the logit map's rows ``r0 … r1 − 1`` on keys ``0 … kw − 1`` (``[maps, r1 − r0, ≥ kw]``,
    float32; ``kw = r1``: the masks are causal, so a block never needs a later key — a block's products cost its share
    of the lower triangle, not of the square) and ``y_rows[kind](r0, r1, kw)`` the D3 approximation's. ONE pass over the
    rows (the fits need only x's row, column and distance sums); the extra memory is O(maps · block · n), and a block
    small enough stays in the processor's cache through its several passes. Equal to the whole-map functions up to
    float32 summation order. ``cache``: a dict that keeps the block buffer for the next call (its left half stays zero;
    what its right half holds beyond a block's keys is never read).

    Returns ``(x's row, column and distance sums — the input of all_fit_moments / sums_of —, {kind: D3 moments by
    sink})``."""
    g0, sinks = geoms[0], list(geoms)
    keep, ys = fit_columns(geoms), max(sinks)  # sink columns and the head rows' entries; y's sink columns
    first = w_rows(0, min(block, n), min(block, n))[..., : min(block, n)]  # its dtype sizes the buffers
    dtype = first.dtype
    shape = (nm, min(block, n), 2 * n)
    buf = None if cache is None else cache.get("rows")
    if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype or buf.device != torch.device(device):
        buf = torch.zeros(shape, dtype=dtype, device=device)
        if cache is not None:
            cache["rows"] = buf
    st = RowStats(nm, n, mu, keep, device, dtype)
    acc = {k: {m: torch.zeros(nm, n, dtype=torch.float64, device=device) for m in ("sy", "syy", "sxy")}
           for k in y_rows}
    ycols = {k: torch.zeros(nm, n, ys, dtype=torch.float64, device=device) for k in y_rows}
    for r0 in range(0, n, block):
        r1 = min(r0 + block, n)
        rows = first if r0 == 0 else w_rows(r0, r1, r1)[..., :r1]  # the first block computed once
        x, view = _block_rows(rows, g0, mu, buf, r0)
        st.add(x, view, r0)
        for k, fn in y_rows.items():
            y = _mask_block_(fn(r0, r1, r1)[..., :r1].sub_(mu[:, None, None]), g0, r0)
            acc[k]["sy"][:, r0:r1], acc[k]["syy"][:, r0:r1] = y.sum(-1).double(), _rowsq(y)
            kk = min(ys, r1)
            ycols[k][:, r0:r1, :kk] = y[..., :kk].double()
            acc[k]["sxy"][:, r0:r1] = y.mul_(x).sum(-1).double()
    st.finish()
    d3 = {k: d3_split(st, a["sy"], a["syy"], a["sxy"], {s: ycols[k][..., :s] for s in sinks if s},
                       row_scale(a["syy"], mu), geoms) for k, a in acc.items()}
    return st, d3
