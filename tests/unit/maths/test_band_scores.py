"""Tests of posgen_tl.maths.band_scores: each RoPE band's region scores from 2 × 2 key moments equal the scores of the
band's own logit maps (``region_logit_scores`` of ``band_logits``, itself tested against the row-by-row definition)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posgen_tl.maths.band_scores import band_region_scores
from posgen_tl.maths.rope import LayerRope
from posgen_tl.maths.taxonomy import band_logits, region_logit_scores

FIELDS = ("pos", "sym", "null", "null_var", "weight", "n_used", "n_excluded")


def _rope(r: int, layout: str, scale: float = 0.3) -> LayerRope:
    return LayerRope(inv_freq=1.0 / 50.0 ** (torch.arange(0, r, 2).float() / r), rotary_dim=r, layout=layout,
                     score_scale=scale)


def _inputs(seed, n_perm, n_q, heads, kv, n_k, r, extra, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    rq = torch.randn(n_perm + 1, n_q, heads, r + extra, generator=g, dtype=dtype)
    rk = torch.randn(n_perm + 1, n_k, kv, r + extra, generator=g, dtype=dtype)
    perm = torch.stack([torch.randperm(n_k, generator=g) for _ in range(n_perm)])
    null = torch.stack([torch.randperm(n_k, generator=g) for _ in range(n_perm)])
    w = torch.rand(heads, n_q, generator=g, dtype=torch.float64)
    return rq, rk, perm, null, w


def _by_maps(rq, rk, rope, perm, null, w, min_std):
    """The reference: every band's [rows × keys] logit map, scored as a head's."""
    bl = band_logits(rq, rk, rope)  # [variant, head, band, q, L]
    return region_logit_scores(bl[0], bl[1:], perm, w[:, None, :].expand(-1, bl.shape[2], -1), min_std=min_std,
                               null_perm=null)


@pytest.mark.parametrize("layout, heads, kv, extra", [("half", 4, 4, 0), ("adjacent", 4, 2, 6), ("half", 3, 1, 2)])
def test_band_scores_equal_those_of_the_band_maps(layout, heads, kv, extra):
    """GQA, pass-through dims (which no band holds), both pair layouts; a row whose query has nothing in band 0 and a
    band whose keys do not vary over the region are excluded on the side where they occur, as by the maps."""
    rope = _rope(8, layout)
    rq, rk, perm, null, w = _inputs(3, 4, 6, heads, kv, 9, 8, extra)
    zero_band0 = [0, 1] if layout == "adjacent" else [0, 4]
    rq[0, 2, 1, zero_band0] = 0.0  # clean row 2, head 1: band 0 constant (excluded under every permutation)
    const_band3 = [6, 7] if layout == "adjacent" else [3, 7]
    rk[2, :, 0, const_band3] = rk[2, :1, 0, const_band3]  # permutation 1's keys of kv head 0: band 3 constant
    got = band_region_scores(rq, rk, rope, perm, null, w, min_std=1e-3)
    want = _by_maps(rq, rk, rope, perm, null, w, 1e-3)
    for f in FIELDS:
        assert getattr(got, f).shape == (heads, 4), f
        torch.testing.assert_close(getattr(got, f), getattr(want, f), atol=1e-12, rtol=1e-12, msg=f)
    assert float(got.n_excluded[1, 0]) >= 4  # the clean row, under all 4 permutations
    assert float(got.n_excluded[0, 3]) >= 6  # every row of permutation 1 in that band
    s = got.finalize()
    assert torch.isfinite(s["positional"]).all() and torch.isfinite(s["null_sd"]).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n_perm=st.integers(1, 4), n_q=st.integers(1, 6), n_k=st.integers(3, 12),
       bands=st.integers(1, 4), scale=st.floats(0.05, 3.0))
def test_band_scores_equal_the_maps_for_any_sizes(seed, n_perm, n_q, n_k, bands, scale):
    rope = _rope(2 * bands, "half", scale)
    rq, rk, perm, null, w = _inputs(seed, n_perm, n_q, 2, 1, n_k, 2 * bands, 1)
    got = band_region_scores(rq, rk, rope, perm, null, w, min_std=1e-6)
    want = _by_maps(rq, rk, rope, perm, null, w, 1e-6)
    for f in FIELDS:
        torch.testing.assert_close(getattr(got, f), getattr(want, f), atol=1e-10, rtol=1e-10, msg=f)


def test_float32_inputs_are_scored_in_float64():
    """float32 rotated q/k (what a float32 model gives) are scored in float64: the maps' own float32 scoring of the same
    inputs differs only by its float32 rounding, and the float64 maps of those inputs agree to float64's."""
    rope = _rope(8, "half")
    rq, rk, perm, null, w = _inputs(5, 3, 8, 4, 2, 16, 8, 0, dtype=torch.float32)
    got = band_region_scores(rq, rk, rope, perm, null, w, min_std=1e-4)
    assert got.pos.dtype == torch.float64
    exact = _by_maps(rq.double(), rk.double(), rope, perm, null, w, 1e-4)
    rounded = _by_maps(rq, rk, rope, perm, null, w, 1e-4)
    for f in ("pos", "sym", "null", "null_var"):
        torch.testing.assert_close(getattr(got, f), getattr(exact, f), atol=1e-11, rtol=1e-11, msg=f)
        torch.testing.assert_close(getattr(got, f), getattr(rounded, f), atol=1e-5, rtol=1e-5, msg=f)


def test_mismatched_inputs_are_refused_by_name():
    rope = _rope(8, "half")
    rq, rk, perm, null, w = _inputs(0, 2, 4, 2, 2, 6, 8, 0)
    with pytest.raises(ValueError, match="variant per permutation"):
        band_region_scores(rq[:2], rk[:2], rope, perm, null, w, min_std=1e-6)
    with pytest.raises(ValueError, match="null_perm"):
        band_region_scores(rq, rk, rope, perm, null[:1], w, min_std=1e-6)
    with pytest.raises(ValueError, match="weights"):
        band_region_scores(rq, rk, rope, perm, null, w[:, :2], min_std=1e-6)
    bad = perm.clone()
    bad[0, 0] = bad[0, 1]
    with pytest.raises(ValueError, match="permutation"):
        band_region_scores(rq, rk, rope, bad, null, w, min_std=1e-6)
    with pytest.raises(ValueError, match="permutation"):
        band_region_scores(rq, rk, rope, perm, bad, w, min_std=1e-6)
    with pytest.raises(ValueError, match="at least 3 keys"):
        band_region_scores(rq, rk[:, :2], rope, perm[:, :2].argsort(-1), null[:, :2].argsort(-1), w, min_std=1e-6)
