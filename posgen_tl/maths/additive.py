"""The D1/D2 additive least squares on a band mask, solved through its structure (docs/method.md §2).

The fits ``W[i, j] ≈ a[i − j] + b[i] + c[j]`` (D1; D2 without ``b``) are scored on masks of one family: key
``j`` of query ``i`` is in the mask when ``max(sink, i − w + 1) ≤ j ≤ i`` (causal, an optional sink of the
first keys excluded, an optional sliding window ``w``). For such a mask every row, column and diagonal is one
contiguous run, so the normal matrix ``XᵀX`` applied to a parameter vector is a few prefix sums: O(n) time and
memory per map (:func:`gram_matvec`), where the dense ``[3n, 3n]`` operator costs O(n²) memory and O(n³) to
build (with its factor and the D2 operator, 3.5 GB at 2 048 tokens; the ``[3n, 3n]`` matrix alone is 4.8 GB at
8 192 and 19 GB at 16 384).

:func:`solve` finds the minimum-norm least-squares parameters by conjugate gradients preconditioned with the
diagonal (the entry counts; 15–30 iterations whatever ``n``), then removes the exact null space of the design
(:func:`null_basis`: the constant shifts between axes and the linear trend ``t·(i − j) − t·i + t·j``), so the
parameters equal the dense pseudo-inverse solution, not only the fitted map (a test compares both with the
dense solve, the parameters to 1e-10 of their size). A window of one key (only the diagonal) has a larger null
space and is left to the dense solve.

Pure float64 tensor maths; every function takes a :class:`Band` from :func:`band` or :func:`band_of_mask`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

__all__ = ["Band", "DIRECT_MAX", "DIRECT_MAX_GPU", "Direct", "band", "band_of_mask", "col_sums_a", "direct", "gram_matvec", "gram_diagonal", "null_basis", "prefix_sums",
           "solve_many", "solve", "row_sums_a", "row_sums_c"]  # fmt: skip

#: relative residual ‖XᵀXβ − r‖ / ‖r‖ at which :func:`solve` stops (float64 rounding sits near 1e-15)
RTOL = 1e-12
MAX_ITER = 2000


@dataclass(frozen=True)
class Band:
    """The mask ``{(i, j): lo[i] ≤ j ≤ i}`` with ``lo[i] = max(sink, i − window + 1)`` and its counts.

    Attributes:
        n, sink, window: the mask's size, its excluded first keys and its window (``None``: none).
        lo: ``[query_pos]`` long, first key of each row (a row with ``cnt = 0`` holds no entry).
        hi: ``[key_pos]`` long, last query row of each key column.
        cnt: ``[query_pos]`` float64 entries per row; ``ncol``: ``[key_pos]`` per column;
        ndiag: ``[delta]`` per distance ``d = i − j``.
    """

    n: int
    sink: int
    window: int | None
    lo: Int[Tensor, "query_pos"]
    hi: Int[Tensor, "key_pos"]
    cnt: Float[Tensor, "query_pos"]
    ncol: Float[Tensor, "key_pos"]
    ndiag: Float[Tensor, "delta"]

    @property
    def structured(self) -> bool:
        """Whether :func:`solve` applies (a window of one key has a larger null space: the dense solve)."""
        return self.window is None or self.window >= 2


def band(n: int, sink: int = 0, window: int | None = None, device: torch.device | str = "cpu") -> Band:
    """The band mask of ``n`` positions with ``sink`` first keys excluded and an optional sliding ``window``."""
    if n < 1 or not 0 <= sink < max(n, 1) or (window is not None and window < 1):
        raise ValueError(f"a band mask needs n ≥ 1, 0 ≤ sink < n and window ≥ 1 (got n={n}, sink={sink}, "
                         f"window={window})")
    i = torch.arange(n, device=device)
    w = n if window is None else min(int(window), n)
    lo = (i - (w - 1)).clamp(min=sink)
    cnt = (i - lo + 1).clamp(min=0).double()
    hi = (i + w - 1).clamp(max=n - 1)
    ncol = ((hi - i + 1) * (i >= sink)).double()
    ndiag = ((n - i - sink).clamp(min=0) * (i <= w - 1)).double()
    return Band(n, int(sink), None if window is None else int(window), lo, hi, cnt, ncol, ndiag)


def band_of_mask(mask: Bool[Tensor, "query_pos key_pos"]) -> Band | None:
    """The :class:`Band` equal to ``mask``, or ``None`` when the mask is not one (then only the dense solve
    fits it). Costs one comparison of ``n²`` entries."""
    n = mask.shape[-1]
    m = mask.to(torch.bool)
    if not bool(m.any()):
        return None
    cols = m.any(0).nonzero()
    sink = int(cols[0]) if len(cols) else 0
    width = int(m.sum(-1).max())
    window = None if width >= n - sink else width
    b = band(n, sink, window, m.device)
    i = torch.arange(n, device=m.device)
    want = (i[None, :] >= b.lo[:, None]) & (i[None, :] <= i[:, None])
    return b if torch.equal(want, m) else None


def prefix_sums(x: Tensor) -> Tensor:
    """``[..., n + 1]`` with ``out[..., k] = Σ_{t < k} x[..., t]`` (the cumulative sum written after a zero: no padded
    copy)."""
    out = x.new_empty(*x.shape[:-1], x.shape[-1] + 1)
    out[..., 0] = 0
    torch.cumsum(x, -1, out=out[..., 1:])
    return out


def row_sums_a(bd: Band, a: Float[Tensor, "*maps delta"], pa: Tensor | None = None) -> Float[Tensor, "*maps query_pos"]:
    """``Σ_{j ∈ row i} a[i − j]`` (distances ``0 … i − lo[i]``; 0 for an empty row). ``pa``: ``prefix_sums(a)`` where the
    caller has it (the same numbers)."""
    pa = prefix_sums(a) if pa is None else pa
    if bd.window is None:  # lo = sink: a slice of the prefix sums (a gather costs 5× more on the CPU)
        return torch.nn.functional.pad(pa[..., 1 : bd.n - bd.sink + 1], (bd.sink, 0))
    k = (torch.arange(bd.n, device=a.device) - bd.lo + 1).clamp(min=0)
    return pa[..., k]


def row_sums_c(bd: Band, c: Float[Tensor, "*maps key_pos"], pc: Tensor | None = None) -> Float[Tensor, "*maps query_pos"]:
    """``Σ_{j ∈ row i} c[j]`` (keys ``lo[i] … i``; 0 for an empty row). ``pc``: ``prefix_sums(c)`` where the caller has
    it."""
    pc = prefix_sums(c) if pc is None else pc
    if bd.window is None:  # lo = sink
        return (pc[..., 1:] - pc[..., bd.sink : bd.sink + 1]) * (bd.cnt > 0)
    i = torch.arange(bd.n, device=c.device)
    return (pc[..., i + 1] - pc[..., bd.lo.clamp(max=bd.n)]) * (bd.cnt > 0)


def col_sums_a(bd: Band, a: Float[Tensor, "*maps delta"], pa: Tensor | None = None) -> Float[Tensor, "*maps key_pos"]:
    """``Σ_{i ∈ column j} a[i − j]`` (distances ``0 … hi[j] − j``; 0 for a column the mask leaves out). ``pa``:
    ``prefix_sums(a)`` where the caller has it."""
    n = bd.n
    j = torch.arange(n, device=a.device)
    pa = prefix_sums(a) if pa is None else pa
    sums = pa[..., 1:].flip(-1) if bd.window is None else pa[..., bd.hi.to(a.device) - j + 1]  # hi = n − 1: flipped
    return sums * (j >= bd.sink)


def _distance_sums(bd: Band, pb: Tensor | None, pc: Tensor) -> Tensor:
    """``B·y`` of the normal matrix (:func:`_dense_blocks`) for ``y = [(b,) c]`` from their prefix sums ``pb = prefix_sums(b)``
    (None for D2) and ``pc = prefix_sums(c)``: per distance ``d``, the sum of ``b[i] + c[j]`` over the mask's entries
    ``i − j = d`` (rows ``d + sink … n − 1`` without a window), float64 ``[maps, delta]``. O(n) per map (a window's
    runs by gathers, a causal band's by flips and slices)."""
    n, s = bd.n, bd.sink
    i = torch.arange(n, device=pc.device)
    used_d = bd.ndiag > 0
    # distance d: rows i ∈ [d + s, n − 1], keys j = i − d ∈ [s, n − 1 − d]
    cs = pc[..., 1:].flip(-1) if bd.window is None else pc[..., (n - i).clamp(min=0)]
    out = cs - pc[..., s : s + 1]
    if pb is not None:
        if bd.window is None:
            shifted = pb[..., s:n] if s else pb[..., :n]  # pb[d + s] (d + s ≥ n only where the distance is unused)
            shifted = torch.nn.functional.pad(shifted, (0, n - shifted.shape[-1]))
        else:
            shifted = pb[..., (i + s).clamp(max=n)]
        out = out + (pb[..., n : n + 1] - shifted)
    return out * used_d


def _key_row_sums(bd: Band, pb: Tensor) -> Tensor:
    """``Σ_{i ∈ column j} b[i]`` (rows ``j … hi[j]``; 0 for a column the mask leaves out) from ``pb = prefix_sums(b)``,
    float64 ``[maps, key_pos]``."""
    i = torch.arange(bd.n, device=pb.device)
    hi = pb[..., bd.n : bd.n + 1] if bd.window is None else pb[..., bd.hi + 1]  # hi = n − 1 without a window
    return (hi - pb[..., : bd.n]) * (i >= bd.sink)


def gram_diagonal(bd: Band, three_axis: bool) -> Float[Tensor, "param"]:
    """The diagonal of ``XᵀX`` (entry counts per distance, row and column), parameters ``[a, (b,) c]``."""
    return torch.cat([bd.ndiag] + ([bd.cnt] if three_axis else []) + [bd.ncol])


def gram_matvec(bd: Band, beta: Float[Tensor, "maps param"], three_axis: bool) -> Float[Tensor, "maps param"]:
    """``β ↦ XᵀX β`` for each row of ``beta`` (parameters ``[a_0…a_{n−1}, (b_0…b_{n−1},) c_0…c_{n−1}]``), O(n)
    per map: the distance, row and column sums of the map ``a[i − j] + b[i] + c[j]`` on the band."""
    n = bd.n
    a, c = beta[..., :n], beta[..., -n:]
    b = beta[..., n : 2 * n] if three_axis else None
    pa, pb, pc = prefix_sums(a), None if b is None else prefix_sums(b), prefix_sums(c)  # each once
    out_a = bd.ndiag * a + _distance_sums(bd, pb, pc)
    out_c = bd.ncol * c + col_sums_a(bd, a, pa)
    if b is None or pb is None:
        return torch.cat([out_a, out_c], -1)
    out_b = bd.cnt * b + row_sums_a(bd, a, pa) + row_sums_c(bd, c, pc)
    return torch.cat([out_a, out_b, out_c + _key_row_sums(bd, pb)], -1)


def null_basis(bd: Band, three_axis: bool) -> Float[Tensor, "param k"]:
    """Vectors spanning the null space of the design on the used parameters (``Xv = 0``): D1 ``(1, −1, 0)``,
    ``(1, 0, −1)`` and the trend ``(d, −i, j)``; D2 ``(1, −1)``; zero on parameters no entry uses."""
    n = bd.n
    used = (gram_diagonal(bd, three_axis) > 0).double()
    one, zero = torch.ones(n, dtype=torch.float64, device=used.device), torch.zeros(n, dtype=torch.float64,
                                                                                     device=used.device)
    if three_axis:
        t = torch.arange(n, dtype=torch.float64, device=used.device)
        vs = [torch.cat([one, -one, zero]), torch.cat([one, zero, -one]), torch.cat([t, -t, t])]
    else:
        vs = [torch.cat([one, -one])]
    return torch.stack(vs, -1) * used[:, None]


_NULL_Q: dict[tuple, Tensor] = {}


def _null_q(bd: Band, three_axis: bool, device: torch.device) -> Tensor:
    """An orthonormal basis ``[param, k]`` of the design's null space on the used parameters (kept per band)."""
    key = (bd.n, bd.sink, bd.window, three_axis, str(device))
    if key not in _NULL_Q:
        u, sv, _ = torch.linalg.svd(null_basis(bd, three_axis).to(device), full_matrices=False)
        if len(_NULL_Q) >= 16:
            _NULL_Q.pop(next(iter(_NULL_Q)))
        _NULL_Q[key] = u[:, sv > 1e-12 * sv.max()] if len(sv) and float(sv.max()) > 0 else u[:, :0]
    return _NULL_Q[key]


def _dense_blocks(bd: Band, three_axis: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(B, C)`` of ``XᵀX = [[diag(ndiag), B], [Bᵀ, C]]`` (float64): ``B`` ``[delta, y]`` couples the distance
    parameters with ``y = [(b,) c]``; ``C`` ``[y, y]`` is ``[[diag(cnt), mask], [maskᵀ, diag(ncol)]]`` (D1) or
    ``diag(ncol)`` (D2). Built from the band's runs, O(n²) memory."""
    n = bd.n
    i = torch.arange(n, device=device)
    lo = bd.lo.to(device)
    dd, jj = i[:, None], i[None, :]
    inside = (jj >= lo[:, None]) & (jj <= i[:, None])  # the mask [i, j]
    rows = (dd + jj).clamp(max=n - 1)
    a_k = ((dd + jj < n) & (lo[rows] <= jj)).double()  # [d, j]: (j + d, j) in the mask
    if not three_axis:
        return a_k, torch.diag(bd.ncol.to(device))
    a_q = ((jj - dd >= lo[None, :]) & (dd <= jj)).double()  # [d, i]: (i, i − d) in the mask
    m = inside.double()
    c = torch.cat([torch.cat([torch.diag(bd.cnt.to(device)), m], -1), torch.cat([m.T, torch.diag(bd.ncol.to(device))], -1)])
    return torch.cat([a_q, a_k], -1), c


@dataclass(frozen=True)
class Direct:
    """A direct solve of one band's design for n up to :data:`DIRECT_MAX` (:func:`direct`): the distance
    parameters eliminated (their block of ``XᵀX`` is diagonal), the Schur complement ``S`` on ``y = [(b,) c]``
    made invertible on its null space (``S + σ·VVᵀ``, ``V`` the null space's ``y`` part) and inverted once.
    For a right-hand side in the range of ``XᵀX`` this gives an exact solution in ONE matrix product of
    ``[maps, y] × [y, y]`` (float64) and the coupling block's products ``Bᵀ·a``, ``B·y`` as prefix sums (O(n) per map,
    :func:`_distance_sums`; as dense products they cost twice the inverse's) — the per-mask cost that conjugate
    gradients pay in ~17 steps of small operations. Memory O(n²): 8·(2n)² bytes for D1 (8.4 MB at n = 512)."""

    three_axis: bool
    band: Band
    inv_a: Tensor  # [delta] 1/ndiag (0 where unused)
    p: Tensor  # [y, y] (S + σVVᵀ)⁻¹ on the used y (0 elsewhere)

    def apply(self, r: Tensor) -> Tensor:
        """A solution β of ``XᵀXβ = r`` for ``r`` in its range (``[maps, param]`` float64)."""
        bd, n = self.band, self.inv_a.shape[-1]
        ra, ry = r[..., :n], r[..., n:]
        a = ra * self.inv_a
        pa = prefix_sums(a)
        bta = torch.cat([row_sums_a(bd, a, pa), col_sums_a(bd, a, pa)], -1) if self.three_axis else col_sums_a(bd, a, pa)
        y = (ry - bta) @ self.p
        by = _distance_sums(bd, prefix_sums(y[..., :n]) if self.three_axis else None, prefix_sums(y[..., -n:]))
        return torch.cat([(ra - by) * self.inv_a, y], -1)


#: the largest ``n`` whose solve is direct (:class:`Direct`; beyond it conjugate gradients, O(n) memory): at 1 024 tokens
#: the direct step saves little (`benchmarks/bench_fits.py`: 18 vs 25 ms for 36 D1 maps) for a 0.6 s build per mask
DIRECT_MAX = 768
#: the same limit on a GPU, where the O(n³) build takes milliseconds and conjugate gradients pay a host
#: synchronisation per step: direct up to 2 048 tokens (operators 0.4 GB per mask there), beyond it O(n) memory
DIRECT_MAX_GPU = 2048


def direct(bd: Band, three_axis: bool, device: torch.device | str = "cpu") -> Direct:
    """The :class:`Direct` solver of ``bd``'s D1 (``three_axis``) or D2 design (one-time: O(n³) float64)."""
    dev = torch.device(device)
    n = bd.n
    if bd.lo.device != dev:  # the operator's coupling products read the band's runs where they run
        bd = dataclasses.replace(bd, **{f: getattr(bd, f).to(dev) for f in ("lo", "hi", "cnt", "ncol", "ndiag")})
    bmat, c = _dense_blocks(bd, three_axis, dev)
    nd = bd.ndiag
    inv_a = torch.where(nd > 0, 1.0 / nd.clamp(min=1.0), 0.0)
    s = c - (bmat.T * inv_a) @ bmat
    used = gram_diagonal(bd, three_axis)[n:] > 0
    vy = _null_q(bd, three_axis, dev)[n:]
    u, sv, _ = torch.linalg.svd(vy, full_matrices=False)
    v = u[:, sv > 1e-12 * sv.max()] if len(sv) and float(sv.max()) > 0 else u[:, :0]
    sub = used.nonzero().squeeze(-1)
    s_u = s[sub][:, sub] + c.diagonal()[sub].mean() * (v[sub] @ v[sub].T)  # σ: a count, > 0
    p = torch.zeros_like(s)
    p[sub[:, None], sub[None, :]] = torch.cholesky_inverse(torch.linalg.cholesky(s_u))
    return Direct(three_axis, bd, inv_a, p)


def solve(bd: Band, rhs: Float[Tensor, "maps param"], three_axis: bool, *, rtol: float = RTOL,
          max_iter: int = MAX_ITER, direct_op: Direct | None = None) -> Float[Tensor, "maps param"]:
    """The minimum-norm solution of ``XᵀX β = rhs`` for each row of ``rhs`` (``rhs = Xᵀy``: the distance, row
    and column sums of a centred map), float64 ``[maps, param]``; parameters no entry uses are 0. The part of
    ``rhs`` along the design's null space (zero for exact sums, rounding for float32 ones) is dropped first: it
    cannot change the fitted map.

    Raises:
        ValueError: a one-key window (use the dense solve) or a ``rhs`` of the wrong width.
        RuntimeError: conjugate gradients did not reach ``rtol`` in ``max_iter`` steps (never a silent answer)."""
    return solve_many([(bd, rhs, three_axis, direct_op)], rtol=rtol, max_iter=max_iter)[0]


def solve_many(systems: Sequence[tuple[Band, Tensor, bool, Direct | None]], *, rtol: float = RTOL,
               max_iter: int = MAX_ITER, floors: Sequence[Tensor | None] | None = None,
               ) -> list[Float[Tensor, "maps param"]]:
    """:func:`solve` of several ``(band, rhs, three_axis, direct_op)`` systems — the same numbers — whose first
    convergence test (after the direct step, where there is one) is read from the device in ONE synchronisation: on a
    GPU each read waits for the queue, and with direct operators it is usually the only one. ``floors``: per system,
    ``None`` or the rounding level of each map's right-hand side (float64 ``[maps, 1]``): a map whose consistent
    right-hand side is no larger is solved by 0 (its sums are those of an additive map: the fit is its mean), and a
    residual at that level counts as converged — relative to a right-hand side of pure rounding, ``rtol`` cannot be
    reached."""
    fl = list(floors) if floors is not None else [None] * len(systems)
    states = [_cg_start(bd, rhs, three_axis, direct_op, f) for (bd, rhs, three_axis, direct_op), f in zip(systems, fl)]
    done = torch.stack([st.converged(rtol) for st in states]).tolist() if states else []
    return [st.x_final() if ok else st.iterate(rtol, max_iter) for st, ok in zip(states, done)]


class _CG:
    """The state of one preconditioned conjugate-gradient solve of :func:`solve_many` (see :func:`solve`)."""

    def __init__(self, bd: Band, three_axis: bool, q: Tensor, inv: Tensor, r: Tensor, x: Tensor, scale: Tensor,
                 live: Tensor) -> None:
        self.bd, self.three_axis, self.q, self.inv = bd, three_axis, q, inv
        self.qt = q.T.contiguous()  # qᵀ row-major: the projection's product is 1.5× faster from it on the CPU
        self.r, self.x, self.scale, self.live = r, x, scale, live
        self.floor = torch.zeros_like(scale)  # the rounding level of the right-hand side (:func:`solve_many`)

    def consistent(self, v: Tensor) -> Tensor:  # the part orthogonal to the null space
        if v.ndim != 2:
            return v - (v @ self.q) @ self.q.T
        return torch.addmm(v, v @ self.q, self.qt, alpha=-1)  # one pass for the rank-k update and the difference

    def converged(self, rtol: float) -> Tensor:
        return self._done(self.r, rtol).all()

    def _done(self, r: Tensor, rtol: float) -> Tensor:  # [maps, 1]: within the tolerance, or nothing to solve
        return (r.norm(dim=-1, keepdim=True) <= torch.maximum(rtol * self.scale, self.floor)) | ~self.live

    def x_final(self) -> Tensor:
        return self.consistent(self.x)

    def iterate(self, rtol: float, max_iter: int) -> Tensor:
        """Conjugate gradients from the state (its first convergence test already failed)."""
        bd, three_axis, r, x = self.bd, self.three_axis, self.r, self.x
        z = r * self.inv
        d = z.clone()
        rz = (r * z).sum(-1, keepdim=True)
        for step in range(max_iter + 1):
            if step and bool(self._done(r, rtol).all()):
                break
            if step == max_iter:
                worst = float((r.norm(dim=-1, keepdim=True) / self.scale.clamp(min=1e-300)).max())
                raise RuntimeError(f"the structured D1/D2 solve did not converge on the band n={bd.n}, sink={bd.sink}, "
                                   f"window={bd.window}: relative residual {worst:.2e} after {max_iter} steps (> {rtol:g})")
            ad = gram_matvec(bd, d, three_axis)
            dad = (d * ad).sum(-1, keepdim=True)
            alpha = torch.where(dad > 0, rz / dad.clamp(min=1e-300), 0.0)
            x = x + alpha * d
            r = self.consistent(r - alpha * ad)
            z = r * self.inv
            rz_new = (r * z).sum(-1, keepdim=True)
            d = z + torch.where(rz > 0, rz_new / rz.clamp(min=1e-300), 0.0) * d
            rz = rz_new
        return self.consistent(x)


def _cg_start(bd: Band, rhs: Tensor, three_axis: bool, direct_op: Direct | None, floor: Tensor | None = None) -> _CG:
    """The checked inputs of one :func:`solve`, the consistent residual and, with ``direct_op``, its direct step."""
    if not bd.structured:
        raise ValueError("a one-key window leaves more of the additive design unidentified: use the dense solve "
                         "(posgen_tl.maths.decompose.normal_system)")
    p = (3 if three_axis else 2) * bd.n
    if rhs.shape[-1] != p:
        raise ValueError(f"rhs has {rhs.shape[-1]} parameters; the {'D1' if three_axis else 'D2'} design of "
                         f"{bd.n} positions has {p}")
    rhs = rhs.double()
    dg = gram_diagonal(bd, three_axis).to(rhs.device)
    inv = torch.where(dg > 0, 1.0 / dg.clamp(min=1.0), 0.0)
    st = _CG(bd, three_axis, _null_q(bd, three_axis, rhs.device), inv, rhs, rhs, rhs, rhs)  # orthonormal null space
    # Xᵀy is orthogonal to the null space; sums taken in float32 are so only to rounding, and conjugate gradients
    # on a singular system would walk off along that rounding: keep the consistent part (every step)
    r = st.consistent(rhs * (dg > 0))
    st.scale = r.norm(dim=-1, keepdim=True)
    st.floor = torch.zeros_like(st.scale) if floor is None else floor.to(st.scale).reshape(-1, 1)
    st.live = st.scale > st.floor
    r.mul_(st.live)  # a right-hand side of rounding: solved by 0 (in place: r is this function's own)
    st.x = torch.zeros_like(r)
    if direct_op is not None:  # one direct step (residual ~1e-15); conjugate gradients go on if it left more than rtol
        st.x = direct_op.apply(r)
        r = st.consistent(r - gram_matvec(bd, st.x, three_axis))
    st.r = r
    return st
