"""Tests for posgen_tl.maths.spread: the within-row logit spread from maps that are already there (the score hook's),
and the comparison that decides whether they are W."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posgen_tl.maths.band_stats import within_row_spread
from posgen_tl.maths.rope import causal_mask, scores_from_rotated
from posgen_tl.maths.spread import scores_mismatch, within_row_spread_of_scores


def _qk(seed: int, b: int, n: int, kv: int, g: int, d: int, shift: float = 0.0,
        dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, kv * g, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, n, kv, d, generator=gen, dtype=torch.float64) + shift
    return q.to(dtype), k.to(dtype)


def _model_scores(q: torch.Tensor, k: torch.Tensor, s: float, mask: torch.Tensor) -> torch.Tensor:
    """W as a model's score hook holds it: −inf where the model's mask hides a key (sink keys stay: the model sees
    them; the spread's mask drops them)."""
    return scores_from_rotated(q, k, s).masked_fill(~mask, -math.inf)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 2), n=st.integers(1, 40), kv=st.integers(1, 3), g=st.integers(1, 3), d=st.integers(1, 6),
       sink=st.integers(0, 3), win=st.one_of(st.none(), st.integers(1, 12)), block=st.integers(1, 9),
       shift=st.sampled_from([0.0, 40.0]), seed=st.integers(0, 2**16))
def test_the_spread_of_given_maps_equals_the_map_version(b, n, kv, g, d, sink, win, block, shift, seed):
    """From the maps W (−inf where the model hides a key), a block of query rows at a time, the spread equals
    within_row_spread on the explicit maps for any mask, block size and GQA grouping (float64: to rounding; keys with
    a large common offset included), and the maps are not modified."""
    q, k = _qk(seed, b, n, kv, g, d, shift)
    scores = _model_scores(q, k, 0.7, causal_mask(n, sliding_window=win))
    before = scores.clone()
    want, cnt = within_row_spread(scores_from_rotated(q, k, 0.7), causal_mask(n, sink=sink, sliding_window=win))
    got, got_cnt = within_row_spread_of_scores(scores, q, k, 0.7, sink=sink, sliding_window=win, block=block)
    assert float(got_cnt) == float(cnt)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * float(want.abs().max().clamp(min=1)))
    assert torch.equal(scores, before)


@pytest.mark.parametrize("sink,win", [(0, None), (1, None), (1, 100)])
@pytest.mark.parametrize("shift", [0.0, 40.0])
def test_the_spread_of_float32_maps_is_exact_on_model_sized_heads(sink, win, shift):
    """Float32 maps of a model's size (d_head 64, GQA 3:1, 300 tokens, blocks of 37 rows) give the spread of the float64
    maps within 1e-6 (relative), also with a common key offset 40× the keys' spread — the one-pass sums run on rows
    shifted by their mean, so nothing large cancels."""
    q, k = _qk(7, 2, 300, 2, 3, 64, shift)
    want, _ = within_row_spread(scores_from_rotated(q, k, 0.125), causal_mask(300, sink=sink, sliding_window=win))
    q32, k32 = q.float(), k.float()
    scores = _model_scores(q32, k32, 0.125, causal_mask(300, sliding_window=win))
    got, _ = within_row_spread_of_scores(scores, q32, k32, 0.125, sink=sink, sliding_window=win, block=37)
    assert got.dtype == torch.float64
    assert float(((got - want).abs() / want).max()) < 1e-6


def test_the_spread_reads_only_the_masked_entries():
    """Entries off the mask (the sink's keys, later keys, keys beyond the window) may hold anything: the same spread."""
    q, k = _qk(3, 2, 30, 2, 2, 4)
    mask = causal_mask(30, sink=2, sliding_window=9)
    w = scores_from_rotated(q, k, 0.5)
    want, _ = within_row_spread_of_scores(w.masked_fill(~mask, 0.0), q, k, 0.5, sink=2, sliding_window=9, block=4)
    got, _ = within_row_spread_of_scores(w.masked_fill(~mask, 1e30), q, k, 0.5, sink=2, sliding_window=9, block=4)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_spread_of_maps_refuses_maps_of_another_shape():
    q, k = _qk(0, 1, 8, 1, 2, 4)
    with pytest.raises(ValueError, match=r"scores \(1, 2, 8, 7\) must be \[batch, head_index, pos, pos\]"):
        within_row_spread_of_scores(torch.zeros(1, 2, 8, 7, dtype=torch.float64), q, k, 1.0)


def test_scores_mismatch_measures_the_largest_difference_on_the_checked_rows_relative_to_w():
    """0 for W itself; a changed entry on a checked row is reported relative to the largest |W| there, one on an
    unchecked row or off the mask is not seen; a non-finite masked entry is inf; no masked entry: nan."""
    q, k = _qk(5, 2, 20, 2, 3, 8)
    mask = causal_mask(20, sliding_window=6)
    w = _model_scores(q, k, 0.3, mask)
    rows = torch.tensor([0, 9, 19])
    assert scores_mismatch(w, q, k, 0.3, rows, sink=1, sliding_window=6) == 0.0
    ref = float(scores_from_rotated(q, k, 0.3)[:, :, rows].masked_fill(~causal_mask(20, sink=1, sliding_window=6)[rows],
                                                                        0.0).abs().max())
    bad = w.clone()
    bad[1, 4, 9, 7] += 0.25  # row 9, key 7: inside the window, after the sink
    assert scores_mismatch(bad, q, k, 0.3, rows, sink=1, sliding_window=6) == pytest.approx(0.25 / ref, rel=1e-12)
    elsewhere = w.clone()
    elsewhere[0, 0, 8, 5] += 1.0  # an unchecked row
    elsewhere[0, 0, 9, 2] = 7.0  # a key beyond the window
    elsewhere[0, 0, 19, 0] = 7.0  # the sink's key
    assert scores_mismatch(elsewhere, q, k, 0.3, rows, sink=1, sliding_window=6) == 0.0
    nan = w.clone()
    nan[0, 2, 19, 18] = math.nan
    assert scores_mismatch(nan, q, k, 0.3, rows, sink=1, sliding_window=6) == math.inf
    assert math.isnan(scores_mismatch(w, q, k, 0.3, torch.tensor([0]), sink=1))  # row 0 sees no key after the sink


@pytest.mark.parametrize("offset", [0.0, 0.3, -5.0])
def test_the_spread_of_maps_is_exact_for_any_row_shift(monkeypatch, offset):
    """The rows are shifted by an estimate of their mean; Σ(w − m̂)² − (Σ(w − m̂))²/cnt is the spread for ANY shift m̂,
    so a shift away from the mean (or none) gives the same numbers in float64."""
    from posgen_tl.maths import spread

    q, k = _qk(11, 2, 25, 1, 3, 5, shift=2.0)
    mask = causal_mask(25, sink=1, sliding_window=7)
    want, _ = within_row_spread(scores_from_rotated(q, k, 0.4), mask)
    real = spread._row_means
    monkeypatch.setattr(spread, "_row_means", lambda *a: real(*a) * (offset != 0.0) + offset)
    got, _ = within_row_spread_of_scores(_model_scores(q, k, 0.4, causal_mask(25, sliding_window=7)), q, k, 0.4,
                                         sink=1, sliding_window=7, block=6)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_the_spread_of_maps_keeps_its_scratch_in_the_cache_for_the_next_call():
    """With a cache dict the block scratch is made once and reused by the next call (the same storage), with the same
    numbers as without one; a larger call makes a larger scratch."""
    q, k = _qk(2, 2, 30, 2, 2, 4, dtype=torch.float32)
    scores = _model_scores(q, k, 0.5, causal_mask(30))
    cache: dict = {}
    first = within_row_spread_of_scores(scores, q, k, 0.5, sink=1, block=8, cache=cache)
    buf = cache["spread_rows"]
    assert buf.numel() == 2 * 4 * 8 * 30 and buf.dtype == torch.float32
    again = within_row_spread_of_scores(scores, q, k, 0.5, sink=1, block=8, cache=cache)
    assert cache["spread_rows"].data_ptr() == buf.data_ptr()
    plain = within_row_spread_of_scores(scores, q, k, 0.5, sink=1, block=8)
    for a in (again, plain):
        assert torch.equal(a[0], first[0]) and torch.equal(a[1], first[1])
    within_row_spread_of_scores(scores, q, k, 0.5, sink=1, block=16, cache=cache)
    assert cache["spread_rows"].numel() == 2 * 4 * 16 * 30


def test_masked_difference_reads_only_the_kept_entries():
    from posgen_tl.maths.spread import masked_difference

    w = torch.tensor([[1.0, -3.0], [2.0, 5.0]])
    a = torch.tensor([[1.5, -math.inf], [2.0, 5.25]])
    mask = torch.tensor([[True, False], [True, True]])
    err, scale = masked_difference(a, w, mask)
    assert float(err) == 0.5 and float(scale) == 5.0  # the hidden −inf and the hidden −3 are not read
    a[1, 0] = math.nan
    assert math.isnan(float(masked_difference(a, w, mask)[0]))
