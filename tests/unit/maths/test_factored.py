"""Sums of masked bilinear maps from their factors (posgen_tl.maths.factored) against the explicit maps.

Every sum :func:`~posgen_tl.maths.factored.factored_sums` computes without a map — per row ``Σx``, ``Σx²``,
``Σx·y``, per column, per distance, the first columns — must equal the same sum of the explicit masked map ``a_i ·
b_j`` on every band mask (every earlier key, sliding windows narrower and wider than a chunk, a one-key window), any
chunk (a chunk that does not divide the positions, one longer than them), grouped-query heads; and the decomposition's
moments from the factors must score as those of the maps.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from profiled import peak_bytes

from posgen_tl.maths import factored
from posgen_tl.maths.decompose import causal_mask, score_maps
from posgen_tl.maths.factored import chunk_size, factored_sums, largest_entries, row_entries
from posgen_tl.maths.moments import Sums, d3_split, geometry, row_scale, scores

shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 40), st.integers(1, 9),
                   st.integers(1, 12))


def _explicit(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked map ``a_i · b_j``, float64 ``[(batch kv group), n, n]``."""
    x = torch.einsum("bkgip,bkjp->bkgij", a, b) * mask.double()
    return x.reshape(-1, *x.shape[-2:])


def _diags(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.diagonal(x, -d, -2, -1).sum(-1) for d in range(x.shape[-1])], -1)


@settings(max_examples=80, deadline=None)
@given(shapes, st.one_of(st.none(), st.integers(1, 45)), st.sampled_from([0, 1, 3, 4, 7, 16, 64]),
       st.integers(0, 4), st.integers(0, 2**31 - 1))
def test_factored_sums_equal_the_sums_of_the_explicit_maps(shape, window, chunk, keep, seed):
    b_, kv, g, n, p, p2 = shape
    gen = torch.Generator().manual_seed(seed)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    a, b = r(b_, kv, g, n, p), r(b_, kv, n, p)
    e, pb = r(b_, kv, g, n, p2), r(b_, kv, n, p + p2)
    pa = torch.cat([a, e], -1)
    xs, ys = factored_sums(pa, b, {"y": pb, "z": b + 1.0}, window=window, keep=keep, chunk=chunk)
    mask = causal_mask(n, sink=0, sliding_window=window)
    x, y = _explicit(a, b, mask), _explicit(pa, pb, mask)
    scale = 1e-11 * (1 + x.abs().amax() * n)
    want = {"s": x.sum(-1), "ss": (x * x).sum(-1), "col": x.sum(-2), "diag": _diags(x)}
    for key, v in want.items():
        torch.testing.assert_close(getattr(xs, key), v, atol=float(scale * (1 + v.abs().amax())), rtol=1e-10,
                                   msg=key)
    pad = torch.nn.functional.pad(x, (0, max(0, keep - n)))[..., :keep]
    torch.testing.assert_close(xs.cols, pad, atol=1e-12, rtol=1e-12)
    z = _explicit(a, b + 1.0, mask)  # a partner without an extension: the target's own queries
    for name, yv in (("y", y), ("z", z)):
        yy = ys[name]
        for key, v in {"s": yv.sum(-1), "ss": (yv * yv).sum(-1), "sxy": (x * yv).sum(-1)}.items():
            torch.testing.assert_close(getattr(yy, key), v, atol=float(scale * (1 + v.abs().amax())), rtol=1e-10,
                                       msg=f"{name} {key}")
        torch.testing.assert_close(yy.cols, torch.nn.functional.pad(yv, (0, max(0, keep - n)))[..., :keep])
        assert yy.col is None and yy.diag is None  # only what is asked is computed
    assert xs.sxy is None


@pytest.mark.parametrize("band_up_to", [256, 0])
def test_the_chunked_sums_see_every_block_the_mask_keeps(band_up_to, monkeypatch):
    """Many chunks and a window that ends inside a chunk (the blocks computed explicitly AND the states are both
    in use): a sum that dropped one block, or counted one twice, would differ by that block's sum — with the running
    sums over chunks as a band product and as cumulative sums (``BAND_UP_TO``)."""
    monkeypatch.setattr(factored, "BAND_UP_TO", band_up_to)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(1, 2, 2, 50, 4, generator=gen, dtype=torch.float64)
    b = torch.randn(1, 2, 50, 4, generator=gen, dtype=torch.float64) + 1.0  # a non-zero mean: each block counts
    for window, chunk in ((None, 4), (13, 4), (12, 4), (9, 8), (3, 8), (1, 4)):
        xs, _ = factored_sums(torch.cat([a, a], -1), b, {}, window=window, keep=0, chunk=chunk)  # a: the first 4
        x = _explicit(a, b, causal_mask(50, sink=0, sliding_window=window))
        torch.testing.assert_close(xs.s, x.sum(-1), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(xs.ss, (x * x).sum(-1), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(xs.col, x.sum(-2), atol=1e-10, rtol=1e-10)
        e = torch.randn(1, 2, 2, 50, 3, generator=gen, dtype=torch.float64)
        pb = torch.randn(1, 2, 50, 7, generator=gen, dtype=torch.float64) - 0.5
        _, ys = factored_sums(torch.cat([a, e, a[..., :1]], -1), b, {"y": pb}, window=window, keep=0, chunk=chunk)
        y = _explicit(torch.cat([a, e], -1), pb, causal_mask(50, sink=0, sliding_window=window))
        for key, v in {"s": y.sum(-1), "ss": (y * y).sum(-1), "sxy": (x * y).sum(-1)}.items():
            torch.testing.assert_close(getattr(ys["y"], key), v, atol=1e-10, rtol=1e-10, msg=key)


def test_bad_factors_are_refused_by_name():
    q = torch.zeros(1, 2, 1, 5, 3, dtype=torch.float64)
    b = torch.zeros(1, 2, 5, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="factors"):
        factored_sums(q, torch.zeros(1, 3, 5, 3, dtype=torch.float64), {}, window=None, keep=0)
    with pytest.raises(ValueError, match="factors"):  # keys wider than the queries
        factored_sums(q, torch.zeros(1, 2, 5, 4, dtype=torch.float64), {}, window=None, keep=0)
    with pytest.raises(ValueError, match="window"):
        factored_sums(q, b, {}, window=0, keep=0)
    with pytest.raises(ValueError, match="partner 'y'"):  # a partner narrower than the target
        factored_sums(q, b, {"y": b[..., :2]}, window=None, keep=0)


def test_chunk_size_follows_the_factors_width():
    assert chunk_size(2048, 129) == 64 and chunk_size(2048, 65) == 32 and chunk_size(2048, 8) == 16
    assert chunk_size(10, 129) == 10 and chunk_size(16384, 513) == 256 and chunk_size(16384, 256) == 128


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 30), st.integers(0, 3), st.one_of(st.none(), st.integers(1, 32)), st.integers(0, 2**31 - 1))
def test_moments_from_factors_score_as_the_maps(n, sink, window, seed):
    """D3's r, R², within-row r from the factored sums (through :class:`Sums` and :func:`d3_split`, as the
    decomposition uses them) equal ``score_maps`` of the explicit maps on the sink-kept and sink-excluded masks."""
    sink = min(sink, n - 1)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(1, 1, 3, n, 5, generator=gen, dtype=torch.float64)
    b = torch.randn(1, 1, n, 5, generator=gen, dtype=torch.float64)
    e = 0.3 * torch.randn(1, 1, 3, n, 2, generator=gen, dtype=torch.float64)
    pa = torch.cat([a, e], -1)
    pb = torch.cat([b, torch.randn(1, 1, n, 2, generator=gen, dtype=torch.float64)], -1)
    geoms = {s: geometry(n, s, window) for s in sorted({0, sink})}
    keep = max(geoms)
    xs, ys = factored_sums(pa, b, {"y": pb}, window=window, keep=max(keep, 1), chunk=4)
    mu = torch.zeros(3, dtype=torch.float64)
    st_ = Sums(n, a.device, xs.s, xs.ss, xs.col, xs.diag, xs.cols, row_scale(xs.ss, mu))
    y = ys["y"]
    d3 = d3_split(st_, y.s, y.ss, y.sxy, {s: y.cols[..., :s] for s in geoms if s}, row_scale(y.ss, mu), geoms)
    for s, g in geoms.items():
        m = causal_mask(n, sink=s, sliding_window=window)
        want = score_maps(_explicit(a, b, m), _explicit(pa, pb, m), m)
        got = scores(d3[s], g)
        for key in ("r", "r2", "r_within"):
            torch.testing.assert_close(got[key], want[key].reshape(-1), atol=1e-8, rtol=1e-8, equal_nan=True,
                                       msg=f"sink {s} {key}")


@pytest.mark.parametrize("group", [1, 3, 4])
def test_row_entries_bounds_the_memory_the_factored_sums_hold(group):
    """What the factors and the sums really hold is within what :func:`row_entries` says they hold at their peak, and
    their largest tensor within :func:`largest_entries` (the measure layers are stacked by) — each not far below it
    (a measure 3× too high would stack a third of the layers it could)."""
    B, K, n, d = 2, 2, 256, 32
    p, p2 = d + 1, 2 * d + 1

    def run() -> None:
        q = torch.randn(B, K, group, n, p2, dtype=torch.float64)
        b = torch.randn(B, K, n, p, dtype=torch.float64)
        partners = {k: torch.randn(B, K, n, p2, dtype=torch.float64) for k in ("u", "v")}
        factored_sums(q, b, partners, window=None, keep=2)

    peak, largest = peak_bytes(run)
    rows = B * K * group * n
    budget = row_entries(n, p, p2, 2, group) * 4 * rows
    assert 0.6 * budget <= peak <= budget, (peak, budget)
    one = largest_entries(n, p, p2, 2, group) * 4 * rows
    assert 0.6 * one <= largest <= one, (largest, one)
    assert 2 * largest <= peak  # the peak is several tensors at once: a stack's budget is per tensor
