"""Tests of posgen_tl.maths.perturb: T1/T2/T3 perturbations and the read-out statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from posgen_tl.maths.perturb import (
    adjacent_swap_permutation,
    apply_permutation,
    capped_scores,
    inverse_permutation,
    nll_from_logits,
    position_ids_for_permutation,
    row_nll,
    span_mean,
    word_units,
)
from posgen_tl.maths.rope import LayerRope, relative_rotation_matrix, rotate, scores_from_rotated
from posgen_tl.stats.inference import bootstrap_ci, slope_ci


def make_rope(layout="half", rotary_dim=8, base=100.0, scaling=1.0, score_scale=0.3) -> LayerRope:
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return LayerRope(
        inv_freq=inv, rotary_dim=rotary_dim, layout=layout,
        attention_scaling=scaling, score_scale=score_scale,
    )


def is_perm(p: torch.Tensor) -> bool:
    return torch.equal(p.sort().values, torch.arange(p.shape[0]))


# ----------------------------------------------------------------------------- T1


def test_frac_zero_is_identity():
    for units in (None, torch.arange(50) // 3):
        p = adjacent_swap_permutation(50, 0.0, start=1, stop=40, units=units)
        assert torch.equal(p, torch.arange(50))


@pytest.mark.parametrize("frac", [0.01, 0.05, 0.1, 0.2])
def test_moved_fraction_and_window(frac):
    n, start, stop = 1000, 1, 937
    p = adjacent_swap_permutation(n, frac, start=start, stop=stop, seed=3)
    assert is_perm(p)
    moved = p != torch.arange(n)
    assert not moved[:start].any() and not moved[stop:].any()
    L = stop - start
    k = round(frac * (L - 1))
    assert int(moved.sum()) == 2 * k
    assert abs(moved.float().sum().item() / L - 2 * frac) < 2.0 / L
    # every move is an adjacent transposition
    d = p - torch.arange(n)
    assert set(d.unique().tolist()) <= {-1, 0, 1}
    assert torch.equal(p[p], torch.arange(n))  # involution: disjoint swaps


def test_deterministic_per_seed():
    a = adjacent_swap_permutation(300, 0.1, start=1, stop=250, seed=7)
    b = adjacent_swap_permutation(300, 0.1, start=1, stop=250, seed=7)
    c = adjacent_swap_permutation(300, 0.1, start=1, stop=250, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_swaps_spread_uniformly():
    # every adjacent pair of the window gets swapped sometimes (sampling is not biased to one end)
    hits = torch.zeros(40)
    for seed in range(200):
        p = adjacent_swap_permutation(40, 0.2, seed=seed)
        hits += (p != torch.arange(40)).float()
    assert hits.min() > 0.5 * hits.mean()


def test_invalid_arguments():
    with pytest.raises(ValueError, match="frac"):
        adjacent_swap_permutation(10, 1.5)
    with pytest.raises(ValueError, match="frac"):
        adjacent_swap_permutation(10, -0.1)
    with pytest.raises(ValueError, match="window"):
        adjacent_swap_permutation(10, 0.1, start=5, stop=5)
    with pytest.raises(ValueError, match="window"):
        adjacent_swap_permutation(10, 0.1, start=0, stop=11)
    with pytest.raises(ValueError, match="units"):
        adjacent_swap_permutation(10, 0.1, units=torch.zeros(9, dtype=torch.long))
    with pytest.warns(UserWarning):
        p = adjacent_swap_permutation(10, 1.0)
    assert int((p != torch.arange(10)).sum()) == 10


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4), min_size=2, max_size=25),
    frac=st.floats(0.0, 0.5),
    seed=st.integers(0, 10_000),
    data=st.data(),
)
def test_word_level_keeps_words_contiguous(lengths, frac, seed, data):
    units = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = units.shape[0]
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    p = adjacent_swap_permutation(n, frac, start=start, stop=stop, seed=seed, units=units)
    assert is_perm(p)
    assert torch.equal(p[:start], torch.arange(start)) and torch.equal(p[stop:], torch.arange(stop, n))
    # in-window words (runs cut at the window edges) stay contiguous and internally ordered
    w = p[start:stop]
    u = units[w]
    words = [start] + [t for t in range(start + 1, stop) if units[t] != units[t - 1]]
    n_words = len(words)
    seen = []
    for i in range(w.shape[0]):
        if i == 0 or u[i] != u[i - 1] or w[i] != w[i - 1] + 1:
            seen.append(int(w[i]))
        else:
            assert w[i] == w[i - 1] + 1
    assert sorted(seen) == words  # each word appears exactly once, as one run from its first token
    k = round(frac * (n_words - 1)) if n_words > 1 else 0
    # number of words that moved = 2k (disjoint swaps)
    order = [words.index(s) for s in seen]
    assert sum(o != i for i, o in enumerate(order)) == 2 * min(k, n_words // 2)


def test_word_units():
    toks = ["<s>", "Hello", ",", "Ġworld", "Ġun", "believ", "able", "Ċ", "▁x", " y", "z"]
    u = word_units(toks, special_tokens=["<s>"])
    assert u.tolist() == [0, 1, 1, 2, 3, 3, 3, 4, 5, 6, 6]
    assert word_units(["a", "b"]).tolist() == [0, 0]


def test_permutation_helpers():
    p = adjacent_swap_permutation(20, 0.3, start=2, stop=18, seed=1)
    inv = inverse_permutation(p)
    assert torch.equal(p[inv], torch.arange(20)) and torch.equal(inv[p], torch.arange(20))
    toks = torch.arange(100, 140).reshape(2, 20)
    new = apply_permutation(toks, p)
    assert torch.equal(new[:, inv], toks)  # token at old t sits at new inv[t]
    assert torch.equal(position_ids_for_permutation(p), inv)


# ----------------------------------------------------------------------------- T2 == T1


@pytest.mark.parametrize("layout", ["half", "adjacent"])
@pytest.mark.parametrize("d_head", [8, 12])
@pytest.mark.parametrize("kind", ["swaps", "random"])
def test_t2_equals_t1_permuted_back(layout, d_head, kind):
    torch.manual_seed(0)
    rope = make_rope(layout, rotary_dim=8, scaling=1.3)
    b, n, h = 2, 24, 3
    q = torch.randn(b, n, h, d_head, dtype=torch.float64)
    k = torch.randn(b, n, h, d_head, dtype=torch.float64)
    if kind == "swaps":  # an involution: perm == perm_inv
        perm = adjacent_swap_permutation(n, 0.3, start=1, stop=16, seed=5)
    else:  # not an involution, so perm and perm_inv cannot be confused
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
        assert not torch.equal(perm, inverse_permutation(perm))
    assert not torch.equal(perm, torch.arange(n))
    inv = inverse_permutation(perm)
    ar = torch.arange(n)
    s = rope.score_scale
    t1 = scores_from_rotated(rotate(q[:, perm], ar, rope), rotate(k[:, perm], ar, rope), s)
    pos_ids = position_ids_for_permutation(perm)
    t2 = scores_from_rotated(rotate(q, pos_ids, rope), rotate(k, pos_ids, rope), s)
    torch.testing.assert_close(t2, t1[..., inv, :][..., :, inv], rtol=0, atol=1e-10)
    # and it is not trivially true: unpermuted T1 differs
    assert (t2 - t1).abs().max() > 1e-3


# ----------------------------------------------------------------------------- T3


def _causal(n):
    i = torch.arange(n)
    return i[None, :] > i[:, None]


@pytest.mark.parametrize("layout", ["half", "adjacent"])
def test_capped_scores_large_cap_is_normal(layout):
    torch.manual_seed(1)
    rope = make_rope(layout, rotary_dim=8, scaling=1.1)
    b, n, h, d = 2, 16, 2, 10
    q, k = torch.randn(b, n, h, d), torch.randn(b, n, h, d)
    ar = torch.arange(n)
    ref = scores_from_rotated(rotate(q, ar, rope), rotate(k, ar, rope), rope.score_scale)
    ref = ref.masked_fill(_causal(n), float("-inf"))
    for cap in (n - 1, n + 5):
        assert torch.equal(capped_scores(q, k, rope, cap), ref)


@pytest.mark.parametrize("layout", ["half", "adjacent"])
def test_capped_scores_small_cap(layout):
    torch.manual_seed(2)
    rope = make_rope(layout, rotary_dim=8, scaling=1.2)
    b, n, h, d, cap = 1, 14, 2, 10, 4
    q = torch.randn(b, n, h, d, dtype=torch.float64)
    k = torch.randn(b, n, h, d, dtype=torch.float64)
    w = capped_scores(q, k, rope, cap)
    ar = torch.arange(n)
    normal = scores_from_rotated(rotate(q, ar, rope), rotate(k, ar, rope), rope.score_scale)
    a2, s, r = rope.attention_scaling**2, rope.score_scale, rope.rotary_dim
    for i in range(n):
        for j in range(n):
            if j > i:
                assert w[0, 0, i, j] == float("-inf")
                continue
            dist = min(i - j, cap)
            R = relative_rotation_matrix(-dist, rope, d)  # q_iᵀ R_{j−i} k_j with j − i = −d
            R = R.clone()
            R[:r, :r] *= a2
            direct = s * torch.einsum("hd,de,he->h", q[0, i], R, k[0, j])
            # angles are float32 (as in the model), so agreement is to ~1e-7 relative
            torch.testing.assert_close(w[0, :, i, j], direct, rtol=1e-5, atol=1e-5)
            if i - j <= cap:
                torch.testing.assert_close(w[0, :, i, j], normal[0, :, i, j], rtol=0, atol=1e-12)
            else:  # beyond the cap the logit equals the value at distance cap
                assert (w[0, :, i, j] - normal[0, :, i, j]).abs().max() > 1e-6
                torch.testing.assert_close(
                    w[0, :, i, j],
                    scores_from_rotated(
                        rotate(q[:, i : i + 1], torch.tensor([cap]), rope),
                        rotate(k[:, j : j + 1], torch.tensor([0]), rope), s,
                    )[0, :, 0, 0],
                )


def test_capped_scores_positions_and_window():
    torch.manual_seed(3)
    rope = make_rope()
    q, k = torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8)
    pos = torch.arange(10)[None] + 100  # shift invariance of relative logits
    torch.testing.assert_close(capped_scores(q, k, rope, 3, pos), capped_scores(q, k, rope, 3), atol=1e-4, rtol=1e-4)
    rope_w = LayerRope(inv_freq=rope.inv_freq, rotary_dim=8, sliding_window=4, score_scale=0.3)
    w = capped_scores(q, k, rope_w, 2)
    assert torch.isinf(w[0, 0, 9, 5]) and torch.isfinite(w[0, 0, 9, 6])


# ----------------------------------------------------------------------------- read-out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nll_matches_cross_entropy(dtype):
    torch.manual_seed(4)
    b, n, v = 3, 9, 50
    logits = (torch.randn(b, n, v) * 3).to(dtype)
    tokens = torch.randint(0, v, (b, n))
    ref = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, v), tokens[:, 1:].reshape(-1), reduction="none"
    ).reshape(b, n - 1)
    for chunk_bytes in (1, 4 * v * b * 2, 2**30):  # 1 position per chunk, 2, all at once
        out = nll_from_logits(logits, tokens, max_chunk_bytes=chunk_bytes)
        assert out.dtype == torch.float32 and out.shape == (b, n - 1)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_row_nll_scores_each_row_against_its_own_target(dtype):
    g = torch.Generator().manual_seed(3)
    b, n, v = 3, 5, 40
    logits = (torch.randn(b, n, v, generator=g) * 4).to(dtype)
    targets = torch.randint(0, v, (b, n), generator=g)
    want = -torch.log_softmax(logits.to(torch.promote_types(dtype, torch.float32)), -1).gather(-1, targets[..., None])[..., 0]
    # nll_from_logits predicts the token after each row: the same rows padded by one, their targets shifted by one
    shifted = nll_from_logits(torch.cat([logits, logits[:, :1]], 1), torch.cat([targets[:, :1], targets], 1))
    for chunk_bytes in (1, 2**30):
        got = row_nll(logits, targets, max_chunk_bytes=chunk_bytes)
        assert got.dtype == want.dtype and got.shape == (b, n)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        assert torch.equal(got, shifted)  # the same operations as nll_from_logits, bit for bit
    with pytest.raises(ValueError, match="targets shape"):
        row_nll(logits, targets[:, 1:])


def test_span_mean():
    nll = torch.arange(12.0).reshape(2, 6)  # predicts tokens 1..6 of a 7-token sequence
    torch.testing.assert_close(span_mean(nll, 5), nll[:, 4:].mean(-1))  # tokens 5, 6
    torch.testing.assert_close(span_mean(nll, 1, 3), nll[:, 0:2].mean(-1))
    torch.testing.assert_close(span_mean(nll, 1, 3, coords="nll"), nll[:, 1:3].mean(-1))
    with pytest.raises(ValueError):
        span_mean(nll, 0, 3)


def test_bootstrap_ci():
    rng = np.random.default_rng(0)
    x = rng.normal(1.5, 2.0, size=5000)
    mean, lo, hi = bootstrap_ci(x)
    assert lo < mean < hi and lo < 1.5 < hi
    se = x.std() / np.sqrt(x.size)
    assert 3.4 * se < hi - lo < 4.5 * se  # ≈ 2·1.96·se for a 95% interval
    m2, lo2, hi2 = bootstrap_ci(torch.tensor(x), seed=0)
    assert (m2, lo2, hi2) == pytest.approx((mean, lo, hi))
    # paired: y = x + 0.1 + small noise -> CI of the difference is tight around −0.1
    y = x + 0.1 + rng.normal(0, 0.01, size=x.size)
    md, lod, hid = bootstrap_ci(x, paired_with=y)
    assert lod < -0.1 < hid and hid - lod < 0.002
    with pytest.raises(ValueError):
        bootstrap_ci(np.array([1.0, np.nan]))


def test_slope_ci():
    p = np.array([0.0, 0.01, 0.02, 0.05, 0.1, 0.2])
    y = 0.8 * p[None, :] + np.arange(7.0)[:, None]  # per-unit offsets, same slope
    slope, lo, hi = slope_ci(p, y)
    assert slope == pytest.approx(0.8) and lo == pytest.approx(0.8) and hi == pytest.approx(0.8)
    rng = np.random.default_rng(1)
    yn = 0.8 * p[None, :] + rng.normal(0, 0.05, size=(200, p.size))
    s2, lo2, hi2 = slope_ci(p, yn, seed=2)
    assert lo2 < s2 < hi2 and lo2 < 0.8 < hi2
