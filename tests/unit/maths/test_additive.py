"""The structured D1/D2 least squares (posgen_tl.maths.additive) against the dense normal equations.

Stated tolerance (docs/performance.md): the parameters equal the dense minimum-norm (pseudo-inverse) solution to
1e-9 of their size and the fitted maps the dense ridge solve's to 1e-9 of the map's size, on every band mask.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posgen_tl.maths.additive import band, band_of_mask, direct, gram_diagonal, gram_matvec, null_basis, solve
from posgen_tl.maths.decompose import causal_mask, fit_additive, normal_system
from posgen_tl.maths.moments import geometry

bands = st.tuples(st.integers(1, 40), st.integers(0, 3), st.one_of(st.none(), st.integers(2, 45)), st.booleans())


def _dense_min_norm(mask: torch.Tensor, rhs: torch.Tensor, three: bool) -> torch.Tensor:
    xtx, _ = normal_system(mask, three, 1e-6)
    return rhs @ torch.linalg.pinv(xtx, hermitian=True, rtol=1e-10).T


@settings(max_examples=60, deadline=None)
@given(bands, st.integers(0, 2**31 - 1))
def test_the_structured_normal_matrix_is_the_dense_one(case, seed):
    n, sink, window, three = case
    sink = min(sink, n - 1)
    mask = causal_mask(n, sink=sink, sliding_window=window)
    bd = band_of_mask(mask)
    assert bd is not None and torch.equal(bd.cnt, band(n, sink, window).cnt)
    xtx, _ = normal_system(mask, three, 1e-6)
    beta = torch.randn(3, xtx.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    assert torch.allclose(gram_matvec(bd, beta, three), beta @ xtx, rtol=0, atol=1e-10 * n)
    assert torch.equal(gram_diagonal(bd, three), xtx.diagonal())
    nb = null_basis(bd, three)
    assert (xtx @ nb).abs().max() < 1e-9  # the basis really is null


@settings(max_examples=60, deadline=None)
@given(bands, st.integers(0, 2**31 - 1))
def test_the_solve_is_the_dense_minimum_norm_solution(case, seed):
    n, sink, window, three = case
    sink = min(sink, n - 1)
    mask = causal_mask(n, sink=sink, sliding_window=window)
    bd = band_of_mask(mask)
    assert bd is not None
    xtx, _ = normal_system(mask, three, 1e-6)
    g = torch.Generator().manual_seed(seed)
    rhs = torch.randn(4, xtx.shape[0], dtype=torch.float64, generator=g) @ xtx  # Xᵀy of some map: in range
    got = solve(bd, rhs, three)
    want = _dense_min_norm(mask, rhs, three)
    assert (got - want).abs().max() <= 1e-9 * want.abs().max().clamp(min=1.0)
    # an rhs off the range by float32-like rounding: the consistent part's solution, not a walk along the null space
    noisy = rhs + 1e-7 * rhs.abs().max() * torch.randn(rhs.shape, dtype=torch.float64, generator=g) * (xtx.diagonal() > 0)
    got_noisy = solve(bd, noisy, three)
    assert (got_noisy @ null_basis(bd, three)).abs().max() < 1e-8 * got_noisy.abs().max().clamp(min=1.0)
    want_noisy = _dense_min_norm(mask, noisy, three)  # the pseudo-inverse ignores the null-space part too
    assert (got_noisy - want_noisy).abs().max() <= 1e-9 * want_noisy.abs().max().clamp(min=1.0)


@settings(max_examples=60, deadline=None)
@given(bands, st.integers(0, 2**31 - 1))
def test_the_direct_solve_is_the_dense_minimum_norm_solution(case, seed):
    """The direct (Schur complement) route gives the pseudo-inverse solution in ONE step: conjugate gradients, which
    would go on from a residual above the tolerance, are not needed (max_iter=0 refuses any step)."""
    n, sink, window, three = case
    sink = min(sink, n - 1)
    mask = causal_mask(n, sink=sink, sliding_window=window)
    bd = band_of_mask(mask)
    assert bd is not None
    if not bd.structured:
        return
    xtx, _ = normal_system(mask, three, 1e-6)
    g = torch.Generator().manual_seed(seed)
    rhs = torch.randn(4, xtx.shape[0], dtype=torch.float64, generator=g) @ xtx
    op = direct(bd, three)
    got = solve(bd, rhs, three, direct_op=op, max_iter=0)
    want = _dense_min_norm(mask, rhs, three)
    assert (got - want).abs().max() <= 1e-9 * want.abs().max().clamp(min=1.0)
    noisy = rhs + 1e-7 * rhs.abs().max() * torch.randn(rhs.shape, dtype=torch.float64, generator=g) * (xtx.diagonal() > 0)
    want_noisy = _dense_min_norm(mask, noisy, three)
    got_noisy = solve(bd, noisy, three, direct_op=op, max_iter=0)
    assert (got_noisy - want_noisy).abs().max() <= 1e-9 * want_noisy.abs().max().clamp(min=1.0)


@settings(max_examples=60, deadline=None)
@given(bands, st.integers(0, 2**31 - 1))
def test_the_coupling_block_as_prefix_sums_is_the_dense_block(case, seed):
    """The direct solve applies the normal matrix's coupling block ``B`` (distances × rows/keys) as prefix sums, O(n)
    per map: ``Bᵀa`` and ``B·y`` equal the products with the dense block on every band (sink, window, D1 and D2)."""
    from posgen_tl.maths.additive import _dense_blocks, _distance_sums, col_sums_a, prefix_sums, row_sums_a

    n, sink, window, three = case
    sink = min(sink, n - 1)
    bd = band(n, sink, window)
    bmat, _ = _dense_blocks(bd, three, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(3, n, dtype=torch.float64, generator=g)
    y = torch.randn(3, bmat.shape[1], dtype=torch.float64, generator=g)
    bta = torch.cat([row_sums_a(bd, a), col_sums_a(bd, a)], -1) if three else col_sums_a(bd, a)
    torch.testing.assert_close(bta, a @ bmat, rtol=0, atol=1e-12 * n)
    by = _distance_sums(bd, prefix_sums(y[:, :n]) if three else None, prefix_sums(y[:, -n:]))
    torch.testing.assert_close(by, y @ bmat.T, rtol=0, atol=1e-12 * n)


def test_the_scoring_geometry_solves_directly_up_to_direct_max_and_by_gradients_beyond():
    from posgen_tl.maths.additive import DIRECT_MAX

    short, long_ = geometry(64, 1, None), geometry(DIRECT_MAX + 1, 1, None)
    for g in (short, long_):
        rhs = torch.randn(3, 3 * g.n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        rhs = gram_matvec(g.band, rhs, True)
        beta = g.solve(rhs, True)
        assert (gram_matvec(g.band, beta, True) - rhs).abs().max() <= 1e-9 * rhs.abs().max()
    assert short.direct.get(True) is not None and not long_.direct  # the O(n²) operator only where n ≤ DIRECT_MAX


@pytest.mark.parametrize(("n", "sink", "window"), [(24, 0, None), (40, 1, None), (48, 1, 9), (30, 2, 2)])
@pytest.mark.parametrize("three", [True, False])
def test_fit_additive_gives_the_dense_fit(n, sink, window, three):
    mask = causal_mask(n, sink=sink, sliding_window=window)
    W = torch.randn(5, n, n, generator=torch.Generator().manual_seed(n))
    fast, dense = fit_additive(W, mask, three), fit_additive(W, mask, three, dense=True)
    assert (fast.fitted - dense.fitted).abs().max() <= 1e-9 * W.abs().max()
    for name in ("a", "b", "c"):
        x, y = getattr(fast, name), getattr(dense, name)
        assert (x is None) == (y is None)
        if x is not None:
            assert (x - y).abs().max() <= 1e-8 * y.abs().max().clamp(min=1.0)


@pytest.mark.parametrize(("n", "sink", "window"), [(9, 0, None), (12, 2, None), (15, 1, 4), (10, 3, 1)])
def test_a_geometry_gives_its_masks_rows(n, sink, window):
    rows = torch.tensor([0, 1, n // 2, n - 1])
    want = causal_mask(n, sink=sink, sliding_window=window)[rows]
    assert torch.equal(geometry(n, sink, window).mask_rows(rows), want)


def test_masks_outside_the_band_family_keep_the_dense_solve():
    holey = causal_mask(12)
    holey[7, 3] = False
    assert band_of_mask(holey) is None
    assert band_of_mask(torch.zeros(5, 5, dtype=torch.bool)) is None
    one_key = causal_mask(10, sliding_window=1)  # only the diagonal: a larger null space
    bd = band_of_mask(one_key)
    assert bd is not None and not bd.structured
    with pytest.raises(ValueError, match="one-key window"):
        solve(bd, torch.zeros(1, 30, dtype=torch.float64), True)
    W = torch.randn(2, 10, 10)
    assert torch.equal(fit_additive(W, one_key).fitted, fit_additive(W, one_key, dense=True).fitted)


def test_bad_widths_and_no_convergence_are_refused_by_name():
    bd = band(16)
    with pytest.raises(ValueError, match="has 47 parameters"):
        solve(bd, torch.zeros(1, 47, dtype=torch.float64), True)
    rhs = torch.randn(1, 48, dtype=torch.float64) @ normal_system(causal_mask(16), True, 1e-6)[0]
    with pytest.raises(RuntimeError, match="did not converge on the band n=16"):
        solve(bd, rhs, True, max_iter=2)


def test_a_long_mask_costs_no_operator_of_size_n_squared():
    """The scoring geometry of 16 384 tokens keeps O(n) numbers — no operator, no [n, n] mask (the dense operators
    were 2 × [3n, 3n] float64: 28 GB; the boolean mask 268 MB) — and its fit solves 36 maps at once."""
    n = 16_384
    g = geometry(n, 1, None)
    tensors = [v for v in vars(g).values() if isinstance(v, torch.Tensor)] + [g.band.lo, g.band.hi]
    assert not g.ops and max(t.numel() for t in tensors) == n
    rhs = torch.randn(36, 3 * n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rhs = rhs * (gram_diagonal(g.band, True) > 0)  # nothing on the parameters no entry uses (a_{n−1}, b_0, c_0)
    beta = g.solve(rhs, True)  # a random right-hand side: the hardest for conjugate gradients
    res = rhs - gram_matvec(g.band, beta, True)
    q, _ = torch.linalg.qr(null_basis(g.band, True))
    assert (res - (res @ q) @ q.T).abs().max() <= 1e-8 * rhs.abs().max()  # only the inconsistent part is left


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 12), sink=st.integers(0, 1), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_scores_of_many_moments_summed_side_by_side_equal_each_alone_and_the_maps_own(n, sink, sizes, seed):
    """The decomposition scores a whole run at its end: ``moment_sums`` of several moments concatenated, then ONE
    ``scores_of_sums`` call, gives each moments' own ``scores`` to the bit — r, R² and within-row r, NaN where a
    map is degenerate (a constant map included here) — and those equal ``score_maps`` on the explicit maps."""
    import dataclasses as dc

    from posgen_tl.maths.decompose import score_maps
    from posgen_tl.maths.moments import SUM_ROWS, _Moments, moment_sums, scores, scores_of_sums, split_rows

    g = geometry(n, sink, None)
    gen = torch.Generator().manual_seed(seed)
    mask = causal_mask(n, sink=sink)
    maps = []

    def moments(k: int) -> _Moments:
        x, y = (torch.randn(k, n, n, generator=gen, dtype=torch.float64) for _ in range(2))
        y[0] = 0.5  # a constant approximation: its r is NaN
        maps.append((x, y))
        m = mask.double()
        xm, ym = x * m, y * m
        return _Moments(sx=xm.sum(-1), sy=ym.sum(-1), sxx=split_rows((xm * x).sum(-1), g),
                        syy=split_rows((ym * y).sum(-1), g), sxy=split_rows((xm * y).sum(-1), g),
                        xmax=x.abs().amax((1, 2)), ymax=y.abs().amax((1, 2)))

    ms = [moments(k) for k in sizes]
    sums = [moment_sums(m, g) for m in ms]
    assert [tuple(s.shape) for s in sums] == [(len(SUM_ROWS), k) for k in sizes]
    together = {key: v.split(sizes) for key, v in scores_of_sums(torch.cat(sums, 1), g).items()}
    assert set(together) == {"r", "r2", "r_within"}
    for i, (m, (x, y)) in enumerate(zip(ms, maps)):
        alone, direct_ = scores(m, g), score_maps(x, y, mask)
        for key in alone:
            torch.testing.assert_close(together[key][i], alone[key], equal_nan=True, rtol=0, atol=0)
            torch.testing.assert_close(alone[key], direct_[key], equal_nan=True, rtol=1e-9, atol=1e-9)
        assert torch.isnan(together["r"][i][0])
    assert [f.name for f in dc.fields(_Moments)] == ["sx", "sy", "sxx", "syy", "sxy", "xmax", "ymax"]


def test_solving_several_fits_together_gives_each_fits_solution_with_one_host_read(monkeypatch):
    """``solve_many``: the D1 and D2 fits of two masks (with direct operators) and one by conjugate gradients alone
    give exactly ``solve``'s numbers; with direct operators only, ONE value is read from the device for all their
    convergence tests (on a GPU each read waits for the queue)."""
    from posgen_tl.maths.additive import solve_many

    gen = torch.Generator().manual_seed(3)
    systems = []
    for n, sink, win in ((24, 0, None), (24, 1, None), (20, 1, 6)):
        bd = band(n, sink, win)
        for three in (True, False):
            rhs = gram_matvec(bd, torch.randn(5, (3 if three else 2) * n, dtype=torch.float64, generator=gen), three)
            systems.append((bd, rhs, three, direct(bd, three)))
    want = [solve(bd, rhs, three, direct_op=op) for bd, rhs, three, op in systems]
    cg = [(bd, rhs, three, None) for bd, rhs, three, _ in systems[:2]]
    for got, exp in zip(solve_many(systems) + solve_many(cg), want + want[:2]):
        torch.testing.assert_close(got, exp, atol=1e-9 * float(exp.abs().max()), rtol=0)
    for got, exp in zip(solve_many(systems), want):
        assert torch.equal(got, exp)  # the same operations in the same order
    reads = []
    for name in ("tolist", "item", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name: reads.append(_name) or _real(self, *a))
    solve_many(systems)
    assert reads == ["tolist"]


@pytest.mark.parametrize("direct_step", [False, True])
def test_a_right_hand_side_of_rounding_is_solved_by_zero_and_a_real_one_as_without_a_floor(direct_step):
    """With a floor (the rounding level of each right-hand side), a map whose consistent right-hand side is no larger
    is solved by 0 at once — relative to pure rounding (a one-entry mask's centred sums, ~1e-31) the relative tolerance
    cannot be reached, and conjugate gradients used to walk until MAX_ITER and raise —, while a real right-hand side
    beside it gets the same solution as with no floor."""
    from posgen_tl.maths.additive import solve_many

    bd = band(4, 3)  # sink 3 of 4 positions: one entry, (3, 3)
    op = direct(bd, True) if direct_step else None
    noise = torch.tensor([[-2.2e-16, 1.1e-16] + [0.0] * 9 + [2.2e-16]], dtype=torch.float64) * 1e-15
    got = solve_many([(bd, noise, True, op)], floors=[torch.tensor([[1e-13]], dtype=torch.float64)])[0]
    assert torch.equal(got, torch.zeros_like(got))
    bd = band(12, 1)
    op = direct(bd, True) if direct_step else None
    rhs = gram_matvec(bd, torch.randn(2, 36, dtype=torch.float64, generator=torch.Generator().manual_seed(0)), True)
    rhs = torch.cat([rhs, noise.new_zeros(1, 36)])
    floors = [torch.tensor([[1e-13], [1e-13], [1e-13]], dtype=torch.float64)]
    with_floor = solve_many([(bd, rhs, True, op)], floors=floors)[0]
    torch.testing.assert_close(with_floor, solve(bd, rhs, True, direct_op=op), rtol=1e-10, atol=1e-12)
    assert torch.equal(with_floor[2], torch.zeros(36, dtype=torch.float64))
    assert with_floor[:2].abs().max() > 0.1
