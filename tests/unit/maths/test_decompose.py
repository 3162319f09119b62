"""Tests of posgen_tl.maths.decompose: additive fits (D1/D2), the D3 split and bound, scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from posgen_tl.maths.decompose import (
    ESTIMATORS,
    causal_mask,
    d3_bound,
    d3_logits,
    d3_split,
    d3_terms,
    fit_additive,
    pearson_r,
    r_squared,
    score_maps,
    sequence_key_mean,
    within_row_r,
)
from posgen_tl.maths.rope import (
    LayerRope,
    expand_kv,
    relative_rotation_matrix,
    rotate,
    scores_from_prerotation,
    scores_from_rotated,
)

FAST = settings(max_examples=25, deadline=None)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/maths/conftest.py


def additive_map(a, b, c):
    n = c.shape[-1]
    i = torch.arange(n)
    d = (i[:, None] - i[None, :]).clamp(min=0)
    out = a[..., d] + c[..., None, :]
    return out if b is None else out + b[..., :, None]


def dense_fit(W, mask, three_axis):
    """Reference: explicit design matrix over masked entries, pinv least squares."""
    n = W.shape[-1]
    ii, jj = mask.nonzero(as_tuple=True)
    cols = [torch.nn.functional.one_hot(ii - jj, n)]
    if three_axis:
        cols.append(torch.nn.functional.one_hot(ii, n))
    cols.append(torch.nn.functional.one_hot(jj, n))
    X = torch.cat(cols, dim=-1).double()
    y = W[ii, jj].double()
    y = y - y.mean()
    beta = torch.linalg.pinv(X) @ y
    return X @ beta + W[ii, jj].double().mean()


# ----------------------------------------------------------------------------- mask


def test_causal_mask_matches_definition():
    n, sink, w = 9, 2, 4
    m = causal_mask(n, sink=sink, sliding_window=w)
    for i in range(n):
        for j in range(n):
            assert bool(m[i, j]) == (j <= i and j >= sink and i - j < w)
    assert not m[:sink].any()
    assert torch.equal(causal_mask(n), torch.ones(n, n, dtype=torch.bool).tril())
    assert ESTIMATORS == ("D1", "D2", "D3")


# ----------------------------------------------------------------------------- D1 / D2


@FAST
@given(
    n=st.integers(5, 40),
    sink=st.integers(0, 3),
    window=st.one_of(st.none(), st.integers(1, 40)),
    seed=st.integers(0, 2**31 - 1),
)
def test_d1_recovers_exact_additive_map(n, sink, window, seed):
    g = torch.Generator().manual_seed(seed)
    a, b, c = torch.randn(3, 2, n, generator=g, dtype=torch.float64)
    W = additive_map(a, b, c) + 3.0
    mask = causal_mask(n, sink=sink, sliding_window=window)
    fit = fit_additive(W, mask, three_axis=True)
    assert fit.fitted.shape == (2, n, n) and fit.a.shape == (2, n) and fit.b.shape == (2, n)
    assert fit.fitted.dtype == torch.float64
    r = pearson_r(W, fit.fitted, mask)
    assert (r >= 1 - 1e-9).all(), r
    torch.testing.assert_close(fit.fitted[:, mask], W[:, mask], atol=1e-9, rtol=0)
    assert (fit.fitted[:, ~mask] == 0).all()
    # parameters no masked entry uses are exactly 0
    used_delta = torch.zeros(n, dtype=torch.bool)
    ii, jj = mask.nonzero(as_tuple=True)
    used_delta[ii - jj] = True
    assert (fit.a[:, ~used_delta] == 0).all()
    assert (fit.b[:, ~mask.any(-1)] == 0).all()
    assert (fit.c[:, ~mask.any(-2)] == 0).all()


def test_d2_exact_on_two_axis_map_but_not_with_row_term():
    n = 30
    g = torch.Generator().manual_seed(0)
    a, b, c = torch.randn(3, n, generator=g, dtype=torch.float64)
    mask = causal_mask(n)
    two = additive_map(a, None, c)
    fit2 = fit_additive(two, mask, three_axis=False)
    assert fit2.b is None
    assert pearson_r(two, fit2.fitted, mask) >= 1 - 1e-9
    # a strong query-row term b[i] cannot be expressed by a[i−j] + c[j] (a row constant would
    # need a[d] + c[i−d] constant in d for every i); D1 still fits it exactly.
    three = additive_map(a, 5 * b, c)
    r2_axis = pearson_r(three, fit_additive(three, mask, three_axis=False).fitted, mask)
    r3_axis = pearson_r(three, fit_additive(three, mask, three_axis=True).fitted, mask)
    assert r3_axis >= 1 - 1e-9
    assert r2_axis < 0.9, r2_axis


@pytest.mark.parametrize("three_axis", [True, False])
@pytest.mark.parametrize("n,sink,window", [(5, 0, None), (9, 1, None), (12, 2, 5), (12, 0, 1), (7, 6, None)])
def test_fit_matches_dense_least_squares(three_axis, n, sink, window):
    g = torch.Generator().manual_seed(n * 10 + sink)
    W = torch.randn(3, n, n, generator=g, dtype=torch.float64)
    W[0] += torch.randn(n, generator=g, dtype=torch.float64)[:, None] * 3  # some structure
    mask = causal_mask(n, sink=sink, sliding_window=window)
    fit = fit_additive(W, mask, three_axis=three_axis)
    for t in range(3):
        ref = dense_fit(W[t], mask, three_axis)
        torch.testing.assert_close(fit.fitted[t][mask], ref, atol=1e-6, rtol=0)


def test_fit_ignores_off_mask_entries_and_float32_input():
    n = 16
    mask = causal_mask(n, sink=1)
    W = torch.randn(2, n, n)
    W2 = W.clone()
    W2[:, ~mask] = float("-inf")
    f1, f2 = fit_additive(W, mask), fit_additive(W2, mask)
    assert f1.fitted.dtype == torch.float64
    torch.testing.assert_close(f1.fitted, f2.fitted, atol=0, rtol=0)
    with pytest.raises(ValueError):
        fit_additive(W, torch.ones(n, n, dtype=torch.bool))  # not causal


def test_pure_noise_scores_are_small():
    # Projection of i.i.d. noise onto the (3N − 4)-dim centred D1 subspace: E r² ≈ (3N−4)/(n−1)
    # ≈ 0.090 for N=64 (n = 2080 entries), r ≈ 0.30 with sd ≈ 0.016 per map. Within-row, the
    # row terms drop out of both sides: r² ≈ (2N−3)/(n−N) ≈ 0.062, r ≈ 0.25.
    n = 64
    g = torch.Generator().manual_seed(1)
    W = torch.randn(8, n, n, generator=g, dtype=torch.float64)
    mask = causal_mask(n)
    fit = fit_additive(W, mask)
    s = score_maps(W, fit.fitted, mask)
    entries = n * (n + 1) / 2
    expected_r = math.sqrt((3 * n - 4) / (entries - 1))
    expected_within = math.sqrt((2 * n - 3) / (entries - n))
    assert abs(s["r"].mean() - expected_r) < 0.05, s["r"]
    assert (s["r"] < 0.45).all()
    assert abs(s["r_within"].mean() - expected_within) < 0.05, s["r_within"]
    assert (s["r_within"] < s["r"] + 0.05).all()
    torch.testing.assert_close(s["r2"], s["r"] ** 2, atol=1e-9, rtol=0)  # LS fit: R² = r²


@pytest.mark.filterwarnings("ignore")
def test_fit_scales_to_long_maps():
    n = 512
    W = torch.randn(4, 9, n, n)
    fit = fit_additive(W, causal_mask(n, sink=1))
    assert fit.fitted.shape == (4, 9, n, n)
    assert fit.a.shape == fit.b.shape == fit.c.shape == (4, 9, n)
    assert fit.mean.shape == (4, 9)
    assert torch.isfinite(fit.fitted).all()


# ----------------------------------------------------------------------------- scores


def test_scores_match_numpy_scipy():
    n = 20
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, n, n))
    y = 0.5 * x + rng.normal(size=(3, n, n))
    mask = causal_mask(n, sink=2)
    mnp = mask.numpy()
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    r, r2, rw = pearson_r(tx, ty, mask), r_squared(tx, ty, mask), within_row_r(tx, ty, mask)
    for t in range(3):
        xs, ys = x[t][mnp], y[t][mnp]
        assert r[t].item() == pytest.approx(stats.pearsonr(xs, ys)[0], abs=1e-12)
        assert r2[t].item() == pytest.approx(1 - ((xs - ys) ** 2).sum() / ((xs - xs.mean()) ** 2).sum(), abs=1e-12)
        xr, yr = [], []
        for i in range(n):
            row = mnp[i]
            if row.sum() >= 2:
                xr.append(x[t, i, row] - x[t, i, row].mean())
                yr.append(y[t, i, row] - y[t, i, row].mean())
        assert rw[t].item() == pytest.approx(stats.pearsonr(np.concatenate(xr), np.concatenate(yr))[0], abs=1e-12)


def test_within_row_r_invariant_to_row_constants():
    n = 15
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, n, n, generator=g, dtype=torch.float64)
    y = x + torch.randn(2, n, n, generator=g, dtype=torch.float64)
    mask = causal_mask(n, sliding_window=6)
    base = within_row_r(x, y, mask)
    x2 = x + 10 * torch.randn(2, n, 1, generator=g, dtype=torch.float64)
    y2 = y + 10 * torch.randn(2, n, 1, generator=g, dtype=torch.float64)
    torch.testing.assert_close(within_row_r(x2, y2, mask), base, atol=1e-12, rtol=0)
    assert (pearson_r(x2, y2, mask) - pearson_r(x, y, mask)).abs().min() > 1e-3  # plain r is not
    torch.testing.assert_close(within_row_r(x, x2, mask), torch.ones(2, dtype=torch.float64))


def test_constant_inputs_give_nan():
    n = 10
    mask = causal_mask(n)
    x = torch.randn(n, n, dtype=torch.float64)
    const = torch.full((n, n), 0.1, dtype=torch.float32)  # 0.1 not exact: rounding residue
    assert torch.isnan(pearson_r(const, x, mask))
    assert torch.isnan(pearson_r(x, const, mask))
    assert torch.isnan(r_squared(const, x, mask))
    assert torch.isfinite(r_squared(x, const, mask))
    rows = torch.randn(n, 1, dtype=torch.float64).expand(n, n) * 1e3 + 0.1  # row constants
    assert torch.isnan(within_row_r(rows, x, mask))
    assert torch.isfinite(pearson_r(rows, x, mask))
    s = score_maps(torch.stack([x, const.double()]), torch.stack([x, x]), mask)
    assert s["r"][0] == pytest.approx(1.0) and torch.isnan(s["r"][1])


# ----------------------------------------------------------------------------- D3


def make_rope(n_bands, layout, extra, scaling, score_scale, inv_freq=None, position_scale=1.0):
    if inv_freq is None:
        inv_freq = 10000 ** (-torch.arange(n_bands) / max(n_bands, 1))
    return LayerRope(
        inv_freq=torch.as_tensor(inv_freq, dtype=torch.float32),
        rotary_dim=2 * n_bands,
        layout=layout,
        attention_scaling=scaling,
        score_scale=score_scale,
        position_scale=position_scale,
    ), 2 * n_bands + extra


def qk(batch, pos, heads, kv_heads, d_head, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, pos, heads, d_head, generator=g, dtype=torch.float64)
    k = torch.randn(batch, pos, kv_heads, d_head, generator=g, dtype=torch.float64)
    km = torch.randn(kv_heads, d_head, generator=g, dtype=torch.float64)
    return q, k, km


@pytest.mark.parametrize("layout", ["half", "adjacent"])
def test_d3_W_equals_model_scores(layout):
    rope, d = make_rope(4, layout, 3, 1.2, 0.3)
    q, k, km = qk(2, 13, 4, 2, d, 0)
    pos = torch.arange(13).expand(2, 13)
    sp = d3_split(q, k, km, pos, rope)
    assert sp.W.shape == sp.f.shape == sp.g.shape == (2, 4, 13, 13)
    torch.testing.assert_close(sp.W, scores_from_prerotation(q, k, pos, rope), atol=1e-9, rtol=0)
    # rotate() computes cos/sin in float32 as the model does, so agreement is float32-level
    ref = scores_from_rotated(rotate(q, pos, rope), rotate(k, pos, rope), rope.score_scale)
    torch.testing.assert_close(sp.W, ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
    # kv heads expanded beforehand give the same maps
    sp2 = d3_split(q, expand_kv(k, 4), expand_kv(km, 4), pos, rope)
    torch.testing.assert_close(sp2.f, sp.f, atol=0, rtol=0)
    # the split is not trivially exact for generic keys
    assert (sp.W - sp.f - sp.g).abs().max() > 1e-2


@pytest.mark.parametrize("layout", ["half", "adjacent"])
@pytest.mark.parametrize("delta0", [0, 5])
@pytest.mark.parametrize("terms", [("f",), ("g",), ("W",), ("g", "f"), ("f", "g", "W")])
def test_d3_terms_computes_only_what_is_asked_and_equals_the_split(layout, delta0, terms):
    """Each map d3_terms returns is d3_split's bit for bit (pass-through dims, kv heads, Δ0 included); f is checked
    against a dense rotation of k̄ (s·q_iᵀΛR_{j−i}k̄), independent of the band picture."""
    rope, d = make_rope(3, layout, 2, 1.2, 0.4)
    q, k, km = qk(2, 9, 4, 2, d, 3)
    pos = torch.arange(9).expand(2, 9)
    got = d3_terms(q, k, km, pos, rope, delta0, terms=terms)
    assert list(got) == list(terms)
    full = d3_split(q, k, km, pos, rope, delta0)
    for t in terms:
        torch.testing.assert_close(got[t], getattr(full, t), atol=0, rtol=0)
    if "f" in terms:
        lam = torch.ones(d, dtype=torch.float64)
        lam[: rope.rotary_dim] = rope.attention_scaling**2
        kb = expand_kv(km[None, None], 4)[0, 0]  # [head, d]
        want = torch.stack([torch.stack([torch.einsum("bhd,de,he->bh", q[:, i] * lam,
                                                      relative_rotation_matrix(j - i, rope, d), kb)
                                         for j in range(9)], -1) for i in range(9)], -2) * rope.score_scale
        torch.testing.assert_close(got["f"], want, atol=1e-5 * want.abs().max().item(), rtol=0)  # float32 angles


@pytest.mark.parametrize("terms", [(), ("f", "f"), ("W", "h"), "gf"])
def test_d3_terms_refuses_unknown_or_repeated_terms(terms):
    rope, d = make_rope(2, "half", 0, 1.0, 0.5)
    q, k, km = qk(1, 4, 2, 2, d, 0)
    with pytest.raises(ValueError, match="distinct names of W, f, g"):
        d3_terms(q, k, km, torch.arange(4).expand(1, 4), rope, terms=terms)


#: a random RoPE layer (bands, layout, extra dims, scaling, score scale, frequencies, position scale,
#: permuted pairs) and a sequence length, shared by the property tests below
RANDOM_LAYER = dict(
    n_bands=st.integers(1, 4),
    layout=st.sampled_from(["half", "adjacent"]),
    extra=st.integers(0, 3),
    scaling=st.sampled_from([1.0, 1.2]),
    score_scale=st.floats(0.05, 3.0),
    freqs=st.lists(st.floats(0.0, 3.0, width=32), min_size=4, max_size=4),
    position_scale=st.sampled_from([1.0, 2.0]),
    permute=st.booleans(),
    pos=st.integers(1, 12),
)


@FAST
@given(
    **RANDOM_LAYER,
    seed=st.integers(0, 2**31 - 1),
)
def test_d3_remainder_within_bound(n_bands, layout, extra, scaling, score_scale, freqs, position_scale, permute, pos, seed):
    rope, d = make_rope(n_bands, layout, extra, scaling, score_scale, freqs[:n_bands], position_scale)
    q, k, km = qk(2, pos, 2, 1, d, seed)
    g = torch.Generator().manual_seed(seed)
    if permute:
        positions = torch.stack([torch.randperm(pos, generator=g) * 3 for _ in range(2)])
    else:
        positions = torch.arange(pos).expand(2, pos)
    sp = d3_split(q, k, km, positions, rope)
    bound = d3_bound(q, k, km, positions, rope)
    assert bound.shape == sp.W.shape
    assert ((sp.W - sp.f - sp.g).abs() <= bound + 1e-9).all()
    torch.testing.assert_close(sp.W, scores_from_prerotation(q, k, positions, rope), atol=1e-9, rtol=0)


def test_d3_keys_equal_mean_give_zero_semantic_term():
    rope, d = make_rope(3, "adjacent", 2, 1.2, 0.5)
    q, _, km = qk(2, 9, 3, 3, d, 5)
    k = km.expand(2, 9, 3, d).clone()
    pos = torch.arange(9).expand(2, 9)
    sp = d3_split(q, k, km, pos, rope)
    assert (sp.g == 0).all()
    torch.testing.assert_close(sp.W, sp.f, atol=1e-12, rtol=0)
    assert (d3_bound(q, k, km, pos, rope) == 0).all()


@pytest.mark.parametrize("layout", ["half", "adjacent"])
def test_d3_exact_when_residual_lives_in_static_bands(layout):
    n_bands, static = 4, [1, 3]
    inv = 10000 ** (-torch.arange(n_bands) / n_bands)
    inv[static] = 0.0
    rope, d = make_rope(n_bands, layout, 1, 1.2, 0.7, inv)
    q, k, km = qk(1, 11, 2, 2, d, 6)
    # keys equal to the mean in every rotating band; free in static bands and pass dims
    band_of_dim = torch.arange(2 * n_bands) % n_bands if layout == "half" else torch.arange(2 * n_bands) // 2
    rotating = torch.isin(band_of_dim, torch.tensor(static), invert=True)
    k[..., : 2 * n_bands][..., rotating] = km[:, : 2 * n_bands][:, rotating]
    pos = torch.arange(11)[None]
    sp = d3_split(q, k, km, pos, rope)
    torch.testing.assert_close(sp.W, sp.f + sp.g, atol=1e-12, rtol=0)
    assert sp.g.abs().max() > 1e-2  # keys really vary
    assert d3_bound(q, k, km, pos, rope).abs().max() < 1e-12


def test_d3_positional_term_depends_on_distance_only():
    # power-of-two frequencies: float32 angles p·θ are exact, so Toeplitz structure is exact
    rope, d = make_rope(3, "half", 2, 1.0, 0.4, [1.0, 0.25, 0.0625])
    q, k, km = qk(1, 10, 2, 2, d, 7)
    q[:] = q[:, :1]  # the same query at every position
    pos = torch.arange(10)[None]
    f = d3_split(q, k, km, pos, rope).f
    torch.testing.assert_close(f[..., 1:, 1:], f[..., :-1, :-1], atol=1e-12, rtol=0)
    k2 = torch.randn_like(k)
    torch.testing.assert_close(d3_split(q, k2, km, pos, rope).f, f, atol=0, rtol=0)


def test_d3_bound_rows_and_chunking():
    rope, d = make_rope(4, "half", 0, 1.2, 0.3)
    q, k, km = qk(2, 16, 2, 1, d, 8)
    pos = torch.arange(16).expand(2, 16)
    full = d3_bound(q, k, km, pos, rope)
    rows = torch.tensor([0, 5, 15])
    torch.testing.assert_close(d3_bound(q, k, km, pos, rope, rows=rows), full[:, :, rows], atol=1e-12, rtol=0)
    tiny = d3_bound(q, k, km, pos, rope, max_chunk_bytes=1)  # one row per chunk
    torch.testing.assert_close(tiny, full, atol=1e-12, rtol=0)
    assert (full[..., torch.arange(16), torch.arange(16)] == 0).all()  # zero distance, zero bound


def test_d3_bound_rows_does_not_depend_on_its_row_chunk():
    """The bound on the checked rows equals d3_bound's on those rows whatever the rows per step (8 on the CPU, all of
    them on a GPU: fewer launches) — one sequence per batch row, GQA, per-sequence k̄ too."""
    from posgen_tl.maths.decompose import d3_bound_rows
    from posgen_tl.maths.rope import angles, to_bands

    rope, d = make_rope(4, "half", 2, 1.2, 0.3)
    q, k, km = qk(2, 20, 4, 2, d, 5)
    pos = torch.arange(20).expand(2, 20)
    rows = torch.tensor([0, 3, 7, 8, 13, 19])
    qn = to_bands(q[:, rows], rope.rotary_dim, rope.layout).abs()
    phi = angles(pos, rope).double()
    want = d3_bound(q, k, km, pos, rope, rows=rows) / (rope.score_scale * rope.attention_scaling**2)
    want = want * (torch.arange(20)[None, :] <= rows[:, None])  # d3_bound_rows: the causal part only
    for k_mean in (km, km[None].expand(2, -1, -1) + 0.1):
        got = {ch: d3_bound_rows(qn, k, k_mean, phi, rows, rope, chunk=ch) for ch in (1, 4, 8, len(rows))}
        for ch in got:
            torch.testing.assert_close(got[ch], got[8], atol=0, rtol=0)
        if k_mean is km:
            torch.testing.assert_close(got[len(rows)].reshape(want.shape), want, atol=1e-12, rtol=1e-12)
    pos2 = torch.stack([torch.arange(20), torch.arange(20) * 3 + 7])  # positions of their own per sequence
    phi2 = angles(pos2, rope).double()
    want2 = d3_bound(q, k, km, pos2, rope, rows=rows) / (rope.score_scale * rope.attention_scaling**2)
    want2 = want2 * (torch.arange(20)[None, :] <= rows[:, None])
    for ch in (1, 4, len(rows)):  # the scratch tables hold a chunk's rows for every sequence
        got2 = d3_bound_rows(qn, k, km, phi2, rows, rope, chunk=ch, shared=False)
        torch.testing.assert_close(got2.reshape(want2.shape), want2, atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------- D3 at a reference offset Δ0


def test_d3_delta0_zero_is_d3():
    rope, d = make_rope(4, "half", 2, 1.2, 0.3)
    q, k, km = qk(2, 12, 4, 2, d, 11)
    pos = torch.arange(12).expand(2, 12)
    sp = d3_split(q, k, km, pos, rope)
    sp0 = d3_split(q, k, km, pos, rope, delta0=0)
    for a, b in ((sp.W, sp0.W), (sp.f, sp0.f), (sp.g, sp0.g)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    y = d3_logits(q, k, km, pos, rope)
    assert y.dtype == torch.float64 and y.shape == (2, 4, 12, 12)
    torch.testing.assert_close(y, sp.f + sp.g, atol=0, rtol=0)
    torch.testing.assert_close(d3_bound(q, k, km, pos, rope, delta0=0), d3_bound(q, k, km, pos, rope), atol=0, rtol=0)


@pytest.mark.parametrize("layout", ["half", "adjacent"])
@pytest.mark.parametrize("delta0", [0, 1, 7, 1000])
def test_d3_delta0_matches_dense_rotation(layout, delta0):
    """g_Δ0 = s·q_iᵀ R_{−Δ0}(k_j − k̄) with a dense rotation matrix (a² on rotary dims); f, W unchanged."""
    rope, d = make_rope(3, layout, 2, 1.2, 0.4)
    q, k, km = qk(2, 9, 4, 2, d, 12)
    pos = torch.arange(9).expand(2, 9)
    sp = d3_split(q, k, km, pos, rope, delta0=delta0)
    base = d3_split(q, k, km, pos, rope)
    torch.testing.assert_close(sp.W, base.W, atol=0, rtol=0)
    torch.testing.assert_close(sp.f, base.f, atol=0, rtol=0)
    R = relative_rotation_matrix(-delta0, rope, d)  # [d, d], identity on pass dims
    lam = torch.ones(d, dtype=torch.float64)
    lam[: rope.rotary_dim] = rope.attention_scaling**2
    diff = expand_kv(k, 4) - expand_kv(km, 4)[None, None]
    want = rope.score_scale * torch.einsum("bihd,de,bjhe->bhij", q * lam, R, diff)
    torch.testing.assert_close(sp.g, want, atol=1e-5, rtol=1e-5)
    if delta0:
        assert (sp.g - base.g).abs().max() > 1e-3  # Δ0 really changes g


@FAST
@given(
    **RANDOM_LAYER,
    delta0=st.integers(-50, 5000),
    per_seq=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_d3_delta0_remainder_within_bound(n_bands, layout, extra, scaling, score_scale, freqs, position_scale,
                                          permute, pos, delta0, per_seq, seed):
    rope, d = make_rope(n_bands, layout, extra, scaling, score_scale, freqs[:n_bands], position_scale)
    q, k, km = qk(2, pos, 2, 1, d, seed)
    g = torch.Generator().manual_seed(seed)
    if per_seq:
        km = torch.randn(2, 1, d, generator=g, dtype=torch.float64)
    if permute:
        positions = torch.stack([torch.randperm(pos, generator=g) * 3 for _ in range(2)])
    else:
        positions = torch.arange(pos).expand(2, pos)
    sp = d3_split(q, k, km, positions, rope, delta0=delta0)
    bound = d3_bound(q, k, km, positions, rope, delta0=delta0)
    assert ((sp.W - sp.f - sp.g).abs() <= bound + 1e-9 * (1 + sp.W.abs() + sp.f.abs() + sp.g.abs())).all()
    torch.testing.assert_close(sp.W, scores_from_prerotation(q, k, positions, rope), atol=1e-9, rtol=0)


@pytest.mark.parametrize("delta0", [0, 3, 1000])
def test_d3_delta0_exact_when_keys_equal_mean(delta0):
    """keys := k̄ everywhere → g_Δ0 = 0, W = f exactly and the bound is 0, for any Δ0 (global and per-sequence k̄)."""
    rope, d = make_rope(3, "adjacent", 2, 1.2, 0.5)
    q, _, km = qk(2, 9, 4, 2, d, 5)
    pos = torch.arange(9).expand(2, 9)
    for kbar, k in ((km, km.expand(2, 9, 2, d).clone()),
                    (torch.stack([km, 2 * km]), torch.stack([km, 2 * km])[:, None].expand(2, 9, 2, d).clone())):
        sp = d3_split(q, k, kbar, pos, rope, delta0=delta0)
        assert (sp.g == 0).all()
        torch.testing.assert_close(sp.W, d3_logits(q, k, kbar, pos, rope, delta0=delta0), atol=1e-12, rtol=0)
        assert (d3_bound(q, k, kbar, pos, rope, delta0=delta0) == 0).all()


def test_d3_delta0_bound_is_zero_at_distance_delta0():
    """At i − j = Δ0 the remainder and its bound vanish (the semantic term is exact there)."""
    rope, d = make_rope(3, "half", 0, 1.0, 0.5, [1.0, 0.25, 0.0625])
    q, k, km = qk(1, 12, 2, 2, d, 9)
    pos = torch.arange(12)[None]
    sp = d3_split(q, k, km, pos, rope, delta0=4)
    b = d3_bound(q, k, km, pos, rope, delta0=4)
    i = torch.arange(4, 12)
    torch.testing.assert_close((sp.W - sp.f - sp.g)[..., i, i - 4], torch.zeros(1, 2, 8, dtype=torch.float64),
                               atol=1e-12, rtol=0)
    assert b[..., i, i - 4].abs().max() < 1e-12 and b[..., i, i].min() > 0


def test_per_sequence_k_mean_is_each_sequences_own_mean():
    rope, d = make_rope(3, "half", 2, 1.0, 0.5)
    q, k, _ = qk(3, 10, 4, 2, d, 13)
    km = sequence_key_mean(k, sink=1)
    assert km.shape == (3, 2, d) and km.dtype == torch.float64
    for b in range(3):
        torch.testing.assert_close(km[b], k[b, 1:].mean(0), atol=1e-12, rtol=0)
    pos = torch.arange(10).expand(3, 10)
    sp = d3_split(q, k, km, pos, rope)
    for b in range(3):  # batched k̄ = running the split per sequence with its own k̄
        one = d3_split(q[b : b + 1], k[b : b + 1], km[b], pos[b : b + 1], rope)
        torch.testing.assert_close(sp.f[b : b + 1], one.f, atol=1e-12, rtol=0)
        torch.testing.assert_close(sp.g[b : b + 1], one.g, atol=1e-12, rtol=0)
    with pytest.raises(ValueError):
        d3_split(q, k, km[:2], pos, rope)
    with pytest.raises(ValueError):
        sequence_key_mean(k, sink=10)
