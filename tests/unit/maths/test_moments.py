"""The decomposition's scores from row, column and distance sums (posgen_tl.maths.moments) against the maps.

Every r, R² and within-row r that :mod:`posgen_tl.maths.moments` computes without a fitted map must equal
:func:`posgen_tl.maths.decompose.score_maps` on the explicit maps — the D1/D2 fits of the dense ridge solve
(:func:`~posgen_tl.maths.decompose.fit_additive`) and any D3 approximation — on every band mask (sink, sliding
window, a window of one key), whole or a block of query rows at a time.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posgen_tl.maths.decompose import causal_mask, fit_additive, score_maps
from posgen_tl.maths.moments import (
    Target,
    all_fit_moments,
    d3_moments,
    fit_columns,
    fit_moments_many,
    geometry,
    scores,
    streamed_moments,
    sums_of,
)

MAPS = 3
masks = st.tuples(st.integers(2, 24), st.integers(0, 3), st.one_of(st.none(), st.integers(1, 30)))


def _maps(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target W (with a row, a column and a distance effect, so that the fits explain part of it) and an
    approximation y, float64 ``[maps, n, n]``."""
    gen = torch.Generator().manual_seed(seed)
    i = torch.arange(n, dtype=torch.float64)
    effect = torch.sin(i[:, None] - i[None, :]) + 0.3 * i[:, None] - 0.2 * i[None, :]
    w = effect + torch.randn(MAPS, n, n, generator=gen, dtype=torch.float64)
    return w, effect + torch.randn(MAPS, n, n, generator=gen, dtype=torch.float64)


def _assert_scores(got: dict, want: dict, what: str) -> None:
    for key in ("r", "r2", "r_within"):
        torch.testing.assert_close(got[key], want[key], atol=1e-8, rtol=1e-8, equal_nan=True, msg=f"{what} {key}")


@settings(max_examples=50, deadline=None)
@given(masks, st.integers(0, 2**31 - 1))
def test_scores_from_sums_equal_the_scores_of_the_maps(case, seed):
    """D1, D2 (fits solved through the mask's structure, or densely for a one-key window) and D3 scored from sums
    equal ``score_maps`` on the explicit maps, on the sink-kept and the sink-excluded mask."""
    n, sink, window = case
    sink = min(sink, n - 1)
    w, y = _maps(n, seed)
    geoms = {s: geometry(n, s, window) for s in sorted({0, sink})}
    t = Target(w.clone(), geoms[0], torch.full((MAPS,), 0.25, dtype=torch.float64), {})
    fits, d3 = all_fit_moments(t, geoms), d3_moments(t, y.clone(), geoms)
    for s, g in geoms.items():
        m = causal_mask(n, sink=s, sliding_window=window)
        for est, three in (("D1", True), ("D2", False)):
            _assert_scores(scores(fits[(s, est)], g), score_maps(w, fit_additive(w, m, three).fitted, m),
                           f"{est} n={n} sink={s} window={window}")
        _assert_scores(scores(d3[s], g), score_maps(w, y, m), f"D3 n={n} sink={s} window={window}")


@settings(max_examples=30, deadline=None)
@given(masks, st.integers(1, 30), st.integers(0, 2**31 - 1))
def test_a_block_of_query_rows_at_a_time_gives_the_whole_maps_scores(case, block, seed):
    """:func:`streamed_moments` (one pass over row blocks, any block size, a one-row last block included) scores as
    the whole maps do, for two approximations at once."""
    n, sink, window = case
    sink = min(sink, n - 1)
    w, y = _maps(n, seed)
    geoms = {s: geometry(n, s, window) for s in sorted({0, sink})}
    mu = torch.full((MAPS,), -0.5, dtype=torch.float64)
    t = Target(w.clone(), geoms[0], mu, {})
    whole_fits, whole_d3 = all_fit_moments(t, geoms), d3_moments(t, y.clone(), geoms)
    asked = []
    stats, d3 = streamed_moments(lambda r0, r1, kw: asked.append((r0, r1, kw)) or w[:, r0:r1, :kw].clone(),
                                 {"a": lambda r0, r1, kw: y[:, r0:r1].clone(),  # wider than asked: cut
                                  "b": lambda r0, r1, kw: 2 * y[:, r0:r1, :kw]},
                                n=n, nm=MAPS, mu=mu, geoms=geoms, block=block, device=torch.device("cpu"))
    # each block once, on the keys the causal mask can keep (j ≤ i < r1): never the square
    assert asked == [(r0, min(r0 + block, n), min(r0 + block, n)) for r0 in range(0, n, block)]
    fits = all_fit_moments(stats, geoms)
    for s, g in geoms.items():
        for est in ("D1", "D2"):
            _assert_scores(scores(fits[(s, est)], g), scores(whole_fits[(s, est)], g), f"{est} sink={s} block={block}")
        _assert_scores(scores(d3["a"][s], g), scores(whole_d3[s], g), f"D3 sink={s} block={block}")
        scaled = score_maps(w, 2 * y, causal_mask(n, sink=s, sliding_window=window))
        _assert_scores(scores(d3["b"][s], g), scaled, f"D3 (2y) sink={s} block={block}")


@settings(max_examples=20, deadline=None)
@given(masks, st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_the_fits_of_several_captures_solved_together_equal_each_alone(case, sizes, seed):
    """:func:`fit_moments_many` (the D1/D2 fits of several captures' sums side by side, ONE solve) scores each
    capture as :func:`all_fit_moments` of that capture alone does (to the solver's stated tolerance)."""
    n, sink, window = case
    sink = min(sink, n - 1)
    geoms = {s: geometry(n, s, window) for s in sorted({0, sink})}
    targets = []
    for i, maps in enumerate(sizes):
        w = _maps(n, seed + i)[0][:1].expand(maps, n, n) * torch.linspace(0.5, 2.0, maps, dtype=torch.float64)[:, None,
                                                                                                              None]
        targets.append(Target(w.contiguous(), geoms[0], torch.full((maps,), 0.1 * i, dtype=torch.float64), {}))
    together = fit_moments_many([sums_of(t, fit_columns(geoms)) for t in targets], geoms)
    assert len(together) == len(targets)
    for t, got in zip(targets, together):
        alone = all_fit_moments(t, geoms)
        assert set(got) == set(alone)
        for key, m in alone.items():
            _assert_scores(scores(got[key], geoms[key[0]]), scores(m, geoms[key[0]]), f"{key} n={n} sizes={sizes}")


@settings(deadline=None)  # a one-key window builds the dense operators: 0.7 s on a loaded 2-core machine
@given(masks)
def test_the_head_rows_are_the_rows_with_fewer_than_two_entries(case):
    """The rows summed apart (fewer than two entries) are counted from the mask's numbers; they are the mask's own."""
    from posgen_tl.maths.moments import _head_rows

    n, sink, window = case
    g = geometry(n, min(sink, n - 1), window)
    h = _head_rows(g)
    assert (g.cnt[:h] < 2).all() and (g.cnt[h:] >= 2).all()


def test_a_one_entry_mask_is_scored_without_iterating():
    """A mask of one entry (4 positions, 3 sink keys excluded: only (3, 3)): its centred sums are rounding and its
    fits are the mean — scored (NaN: no variance) at once; the case hypothesis found once made the solve raise after
    2 000 steps."""
    w, _ = _maps(4, 28896)
    geoms = {s: geometry(4, s, None) for s in (0, 3)}
    t = Target(w.clone(), geoms[0], torch.full((MAPS,), 0.25, dtype=torch.float64), {})
    fits = all_fit_moments(t, geoms)
    for est in ("D1", "D2"):
        got = scores(fits[(3, est)], geoms[3])
        assert torch.isnan(got["r"]).all() and torch.isnan(got["r2"]).all()
        _assert_scores(got, score_maps(w, fit_additive(w, causal_mask(4, sink=3), est == "D1").fitted,
                                       causal_mask(4, sink=3)), est)
