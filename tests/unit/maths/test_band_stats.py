"""Tests for posgen_tl.maths.band_stats: per-band streaming statistics and the pattern score."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posgen_tl.maths.band_stats import (
    BandStats,
    band_stats,
    distance_weights,
    fast_band_offset,
    pattern_scores,
    predicted_d3_error,
    stats_frame,
    within_row_spread,
    within_row_spread_qk,
    within_row_spread_rows,
)
from posgen_tl.maths.rope import LayerRope, band_indices

STATE = ("n", "sum_x", "sum_abs2", "sum_unit", "pass_abs2", "n_nonzero")
STATS = ("mean", "energy", "energy_share", "pass_energy_share", "offset_ratio",
         "phase_concentration", "residual_rms")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _coords(m: int, rotary_dim: int, layout: str) -> tuple[int, int]:
    """Band m's coordinates, written out independently of rope.band_indices."""
    return (m, m + rotary_dim // 2) if layout == "half" else (2 * m, 2 * m + 1)


def _assert_stats_close(a: BandStats, b: BandStats, tol: float = 1e-10) -> None:
    for name in STATS:
        torch.testing.assert_close(getattr(a, name)(), getattr(b, name)(), rtol=tol, atol=tol,
                                   equal_nan=True, msg=lambda m: f"{name}: {m}")  # noqa: B023


# ----------------------------------------------------------------------------- offsets / layouts


@pytest.mark.parametrize("layout", ["half", "adjacent"])
def test_offset_detected_in_the_right_band(layout):
    H, d, r, N = 2, 20, 16, 20_000
    offset_bands = {0: [0, 3], 1: [5]}
    x = torch.randn(1, N, H, d, generator=_gen(0), dtype=torch.float64)
    for h, bands in offset_bands.items():
        for m in bands:
            a, b = _coords(m, r, layout)
            x[..., h, a] += 12.0
            x[..., h, b] -= 16.0  # |offset|² = 400 vs noise energy 2
    x[..., r:] += 50.0  # pass-through dims must not leak into any band
    first, second = band_indices(r, layout)
    for m in range(r // 2):
        assert (int(first[m]), int(second[m])) == _coords(m, r, layout)

    rho = band_stats(x, r, layout).offset_ratio()
    for h in range(H):
        on = torch.zeros(r // 2, dtype=torch.bool)
        on[offset_bands[h]] = True
        assert (rho[h, on] > 0.98).all(), rho[h]
        assert (rho[h, ~on] < 0.05).all(), rho[h]
    # Read with the other layout, the offset lands in other bands: indexing matters.
    other = "adjacent" if layout == "half" else "half"
    rho_wrong = band_stats(x, r, other).offset_ratio()
    assert set((rho_wrong[0] > 0.5).nonzero().flatten().tolist()) != {0, 3}


def test_residual_rms_and_mean():
    x = torch.randn(4, 500, 1, 8, generator=_gen(1), dtype=torch.float64)
    s = band_stats(x, 8, "half")
    flat = x.reshape(-1, 1, 8)
    torch.testing.assert_close(s.mean(), flat.mean(0))
    z = torch.complex(flat[..., :4], flat[..., 4:])
    res = (z - z.mean(0)).abs().square().mean(0).sqrt()
    torch.testing.assert_close(s.residual_rms(), res, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s.energy(), z.abs().square().mean(0))


# ----------------------------------------------------------------------------- streaming


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    layout=st.sampled_from(["half", "adjacent"]),
    rotary_dim=st.sampled_from([4, 8]),
    p_mask=st.floats(0.0, 0.9),
    order_seed=st.integers(0, 1000),
)
def test_streaming_merge_equals_batch(seed, sizes, layout, rotary_dim, p_mask, order_seed):
    H, d, P = 3, 8, 7
    g = _gen(seed)
    x = torch.randn(sum(sizes), P, H, d, generator=g, dtype=torch.float64) * 3 + 1
    x[torch.rand(x.shape, generator=g) < 0.2] = 0.0  # exact zeros exercise n_nonzero
    mask = torch.rand(sum(sizes), P, generator=g) >= p_mask
    whole = band_stats(x, rotary_dim, layout, mask)

    parts = []
    for xc, mc in zip(x.split(sizes), mask.split(sizes)):
        parts.append(band_stats(xc, rotary_dim, layout, mc))
    order = torch.randperm(len(parts), generator=_gen(order_seed)).tolist()
    merged = parts[order[0]]
    for i in order[1:]:
        merged = merged.merge(parts[i]) if i % 2 else parts[i].merge(merged)
    sequential = BandStats(H, d, rotary_dim, layout)
    for xc, mc in zip(x.split(sizes), mask.split(sizes)):
        sequential.update(xc, mc)

    for acc in (merged, sequential):
        assert acc.n_tokens == int(mask.sum())
        for key in STATE:
            torch.testing.assert_close(getattr(acc, key), getattr(whole, key), rtol=1e-10, atol=1e-10)
        _assert_stats_close(acc, whole)


def test_merge_leaves_inputs_unchanged_and_checks_shapes():
    a = band_stats(torch.randn(1, 5, 2, 8, generator=_gen(2)), 8, "half")
    b = band_stats(torch.randn(1, 3, 2, 8, generator=_gen(3)), 8, "half")
    before = a.sum_x.clone()
    c = a.merge(b)
    assert c.n_tokens == 8 and a.n_tokens == 5 and b.n_tokens == 3
    torch.testing.assert_close(a.sum_x, before)
    with pytest.raises(ValueError):
        a.merge(band_stats(torch.randn(1, 5, 2, 8), 8, "adjacent"))
    with pytest.raises(ValueError):
        a.update(torch.randn(1, 5, 3, 8))
    with pytest.raises(ValueError):
        a.update(torch.randn(1, 5, 2, 8), torch.ones(1, 4, dtype=torch.bool))


def test_mask_equals_dropping_positions():
    g = _gen(4)
    x = torch.randn(3, 11, 2, 10, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 11, generator=g) > 0.4
    x[~mask] = 1e6  # would dominate every statistic if it were counted
    masked = band_stats(x, 8, "adjacent", mask)
    dropped = band_stats(x[mask][None], 8, "adjacent")
    assert masked.n_tokens == int(mask.sum())
    _assert_stats_close(masked, dropped, tol=1e-12)
    assert masked.energy().max() < 100


# ----------------------------------------------------------------------------- phase / energy


@pytest.mark.parametrize("layout", ["half", "adjacent"])
def test_phase_concentration(layout):
    g, N, r = _gen(5), 5000, 4
    mag = torch.rand(N, generator=g, dtype=torch.float64) * 10 + 0.1
    mag[::7] = 0.0  # zero entries are skipped, not counted as phase 0
    phase_const = torch.polar(mag, torch.full((N,), 0.7, dtype=torch.float64))
    phase_rand = torch.polar(torch.ones(N, dtype=torch.float64),
                             torch.rand(N, generator=g, dtype=torch.float64) * 2 * math.pi)
    x = torch.zeros(1, N, 1, r, dtype=torch.float64)
    for m, z in enumerate([phase_const, phase_rand]):
        a, b = _coords(m, r, layout)
        x[0, :, 0, a], x[0, :, 0, b] = z.real, z.imag
    s = band_stats(x, r, layout)
    pc = s.phase_concentration()[0]
    assert pc[0] == pytest.approx(1.0, abs=1e-12)
    assert pc[1] < 0.05
    assert s.offset_ratio()[0, 0] < 0.9  # varying magnitude: phase-locked yet not invariant
    assert s.n_nonzero[0, 0] == N - len(range(0, N, 7))


def test_energy_share_and_partial_rotary():
    H, d, r = 2, 12, 8
    x = torch.randn(2, 50, H, d, generator=_gen(6), dtype=torch.float64)
    s = band_stats(x, r, "half")
    torch.testing.assert_close(s.energy_share().sum(-1), torch.ones(H, dtype=torch.float64))
    # Exact energies: rotated coords 1 (band energy 2, total 8), pass coords 2 (energy 16).
    y = torch.ones(1, 3, H, d, dtype=torch.float64)
    y[..., r:] = 2.0
    t = band_stats(y, r, "adjacent")
    torch.testing.assert_close(t.energy_share(), torch.full((H, r // 2), 0.25, dtype=torch.float64))
    torch.testing.assert_close(t.pass_energy(), torch.full((H,), 16.0, dtype=torch.float64))
    torch.testing.assert_close(t.pass_energy_share(), torch.full((H,), 16 / 24, dtype=torch.float64))
    full = band_stats(torch.randn(1, 5, H, r, generator=_gen(7)), r, "half")
    assert (full.pass_energy_share() == 0).all()


# ----------------------------------------------------------------------------- pattern score


def _rope(n_bands: int, inv_freq: torch.Tensor | None = None, **kw) -> LayerRope:
    if inv_freq is None:
        inv_freq = 10000.0 ** (-torch.arange(n_bands, dtype=torch.float32) / n_bands)
    return LayerRope(inv_freq=inv_freq, rotary_dim=2 * n_bands, **kw)


def test_distance_weights():
    rope = _rope(3, torch.tensor([math.pi, 0.0, 1e-3]))
    # 3 positions: Δ=0 ×3 (factor 0), Δ=1 ×2, Δ=2 ×1 — weighted by causal-entry count
    w = distance_weights(rope, 2)  # band 0: Δ=1 → 2, Δ=2 → 0
    assert w[0].item() == pytest.approx(4 / 6, abs=1e-6) and w[1] == 0
    assert w[2].item() == pytest.approx((2 * 2 * math.sin(5e-4) + 2 * math.sin(1e-3)) / 6, rel=1e-5)
    # sink=1: the first key column is gone → Δ=0 ×2, Δ=1 ×1
    assert distance_weights(rope, 2, sink=1)[0].item() == pytest.approx(2 / 3, abs=1e-6)
    r2 = _rope(8)
    torch.testing.assert_close(distance_weights(r2, 1000, chunk=7), distance_weights(r2, 1000))
    # brute force over the causal mask
    n, sink = 40, 2
    ii, jj = torch.tril_indices(n, n)
    keep = jj >= sink
    d = (ii - jj)[keep].double()
    brute = (2 * torch.sin(d[:, None] * r2.theta.double() / 2).abs()).mean(0)
    torch.testing.assert_close(distance_weights(r2, n - 1, sink=sink), brute)
    windowed = _rope(8, sliding_window=5)
    keep_w = keep & (ii - jj < 5)
    d = (ii - jj)[keep_w].double()
    brute_w = (2 * torch.sin(d[:, None] * r2.theta.double() / 2).abs()).mean(0)
    torch.testing.assert_close(distance_weights(windowed, n - 1, sink=sink), brute_w)


def test_pattern_score_constant_vs_zero_mean_keys_with_gqa():
    H, G, d, nb, N = 4, 2, 16, 8, 4000
    rope = _rope(nb, score_scale=0.25, attention_scaling=1.2)
    g = _gen(8)
    q = torch.randn(1, N, H, d, generator=g, dtype=torch.float64) + 0.5
    k = torch.empty(1, N, G, d, dtype=torch.float64)
    k[:, :, 0] = torch.randn(d, generator=g, dtype=torch.float64) * 3  # group 0: constant keys
    half = torch.randn(1, N // 2, d, generator=g, dtype=torch.float64)
    k[:, :, 1] = torch.cat([half, -half], dim=1)  # group 1: exactly zero-mean keys
    out = pattern_scores(band_stats(q, 2 * nb, "half"), band_stats(k, 2 * nb, "half"), rope, 256)
    ps = out["legacy_pattern_score"]
    assert ps.shape == (H,) and out["bound_per_band"].shape == (H, nb)
    assert ps[:2].tolist() == pytest.approx([1.0, 1.0], abs=1e-6)  # heads 0, 1 read group 0
    assert ps[2:].tolist() == pytest.approx([0.0, 0.0], abs=1e-9)  # heads 2, 3 read group 1
    assert out["expected_bound"][:2].abs().max() < 1e-5
    torch.testing.assert_close(out["expected_bound"], out["bound_per_band"].sum(-1))
    # expected_bound carries s·a²: doubling s doubles it, the score is unchanged.
    out2 = pattern_scores(band_stats(q, 2 * nb, "half"), band_stats(k, 2 * nb, "half"),
                          _rope(nb, score_scale=0.5, attention_scaling=1.2), 256)
    torch.testing.assert_close(out2["expected_bound"], 2 * out["expected_bound"])
    torch.testing.assert_close(out2["legacy_pattern_score"], ps)
    out3 = pattern_scores(band_stats(q, 2 * nb, "half"), band_stats(k, 2 * nb, "half"),
                          _rope(nb, score_scale=0.25), 256)  # a = 1
    torch.testing.assert_close(out["expected_bound"], 1.2**2 * out3["expected_bound"])


def test_pattern_score_ignores_non_rotating_bands():
    H, nb, N, layout = 1, 6, 3000, "adjacent"
    r = 2 * nb
    g = _gen(9)
    q = torch.randn(1, N, H, r, generator=g, dtype=torch.float64)
    k = torch.randn(r, dtype=torch.float64).expand(1, N, H, r).clone()
    for m in (2, 5):  # token-dependent key variation only in bands 2 and 5
        a, b = _coords(m, r, layout)
        k[..., a] += torch.randn(1, N, H, generator=g, dtype=torch.float64) * 5
        k[..., b] += torch.randn(1, N, H, generator=g, dtype=torch.float64) * 5
    qs, ks = band_stats(q, r, layout), band_stats(k, r, layout)
    inv = 10000.0 ** (-torch.arange(nb, dtype=torch.float32) / nb)
    frozen = inv.clone()
    frozen[[2, 5]] = 0.0
    score_frozen = pattern_scores(qs, ks, _rope(nb, frozen, layout=layout), 128)["legacy_pattern_score"]
    score_rotating = pattern_scores(qs, ks, _rope(nb, inv, layout=layout), 128)["legacy_pattern_score"]
    assert score_frozen.item() == pytest.approx(1.0, abs=1e-6)
    assert score_rotating.item() < 0.9


def test_fast_band_offset_and_frame():
    nb, N = 4, 3000
    x = torch.randn(1, N, 2, 2 * nb, generator=_gen(10), dtype=torch.float64)
    x[..., [0, 1, 4, 5]] += 30.0  # half layout: bands 0 and 1 carry an offset
    s = band_stats(x, 2 * nb, "half")
    fbo = fast_band_offset(s, 2)
    assert fbo.shape == (2,) and (fbo > 0.99).all()
    assert fast_band_offset(s, 4).tolist() == pytest.approx([0.5, 0.5], abs=0.01)
    with pytest.raises(ValueError):
        fast_band_offset(s, 5)

    df = stats_frame(s, layer=3, which="k", model="toy")
    assert list(df.columns) == ["model", "twin", "layer", "which", "head", "band", "energy_share",
                                "offset_ratio", "phase_concentration", "residual_rms", "energy"]
    assert len(df) == 2 * nb and (df.twin == "trained").all() and (df.layer == 3).all()
    row = df[(df["head"] == 1) & (df["band"] == 2)].iloc[0]
    assert row.offset_ratio == pytest.approx(s.offset_ratio()[1, 2].item())
    assert row.energy == pytest.approx(s.energy()[1, 2].item())
    with pytest.raises(ValueError):
        stats_frame(s, layer=0, which="v")


# ----------------------------------------------------------------------------- persistence / memory


def test_state_dict_round_trip():
    g = _gen(11)
    s = band_stats(torch.randn(2, 9, 3, 10, generator=g), 6, "adjacent")
    buf = io.BytesIO()
    sd = s.state_dict()
    torch.save(sd, buf)
    buf.seek(0)
    t = BandStats.from_state_dict(torch.load(buf))
    assert (t.n_heads, t.d_head, t.rotary_dim, t.layout, t.dtype) == (3, 10, 6, "adjacent", torch.float64)
    for key in STATE:
        assert torch.equal(getattr(t, key), getattr(s, key))
    more = torch.randn(1, 4, 3, 10, generator=g)
    s.update(more)
    assert t.n_tokens == 18  # the restored copy is independent of the original
    assert int(sd["n"]) == 18  # ...and so is the saved snapshot
    t.update(more)
    _assert_stats_close(s, t, tol=0)


def test_memory_independent_of_tokens_seen():
    def sizes(acc):
        return {k: (tuple(getattr(acc, k).shape), getattr(acc, k).dtype) for k in STATE}

    one, ten = BandStats(2, 8, 8, "half"), BandStats(2, 8, 8, "half")
    g = _gen(12)
    one.update(torch.randn(1, 3, 2, 8, generator=g))
    for i in range(10):
        ten.update(torch.randn(4, 50 + i, 2, 8, generator=g))
    assert sizes(one) == sizes(ten)
    assert ten.n_tokens == sum(4 * (50 + i) for i in range(10))


# ----------------------------------------------------------------------------- rotation-aware pattern score


def _legacy(q_e, k_e, k_res_e, w):
    """The first landing's score, written from its definition."""
    c = (q_e.sqrt() * k_e.sqrt() * w).sum(-1)
    b = (q_e.sqrt() * k_res_e.sqrt() * w).sum(-1)
    return 1 - b / c


def test_predicted_error_depends_on_rotation_weights_legacy_does_not():
    g = _gen(21)
    q_e, k_e = torch.rand(3, 6, generator=g, dtype=torch.float64) + 0.1, torch.rand(3, 6, generator=g, dtype=torch.float64) + 1
    k_res = k_e * torch.rand(3, 6, generator=g, dtype=torch.float64)
    w = torch.rand(6, generator=g, dtype=torch.float64) + 0.05
    spread = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    base = predicted_d3_error(q_e, k_res, w, spread, scale=0.3)
    assert base["pred_d3_err"].shape == (3,) and base["per_band"].shape == (3, 6)
    torch.testing.assert_close(base["per_band"].sum(-1), base["pred_d3_err"])
    want = 0.3 * (q_e.sqrt() * k_res.sqrt() * w).sum(-1) / spread
    torch.testing.assert_close(base["pred_d3_err"], want)
    # rescaling every w_m: the legacy score is blind to it, the new one is not
    torch.testing.assert_close(_legacy(q_e, k_e, k_res, 3 * w), _legacy(q_e, k_e, k_res, w))
    torch.testing.assert_close(predicted_d3_error(q_e, k_res, 3 * w, spread, 0.3)["pred_d3_err"], 3 * base["pred_d3_err"])
    # a real change of frequencies (faster bands) changes it through distance_weights
    slow, fast = _rope(6), _rope(6, 4 * 10000.0 ** (-torch.arange(6, dtype=torch.float32) / 6))
    a = predicted_d3_error(q_e, k_res, distance_weights(slow, 255), spread)["pred_d3_err"]
    b = predicted_d3_error(q_e, k_res, distance_weights(fast, 255), spread)["pred_d3_err"]
    assert (b > a * 1.05).all()
    # GQA: kv groups expanded to query heads
    two = predicted_d3_error(torch.ones(4, 2, dtype=torch.float64), torch.tensor([[1.0, 0.0], [4.0, 0.0]]),
                             torch.ones(2), torch.ones(4))["pred_d3_err"]
    assert two.tolist() == pytest.approx([1.0, 1.0, 2.0, 2.0])


def test_within_row_spread():
    g = _gen(22)
    W = torch.randn(2, 3, 6, 6, generator=g, dtype=torch.float64) + torch.randn(2, 3, 6, 1, generator=g, dtype=torch.float64) * 50
    mask = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    mask[:, 0] = False
    ss, n = within_row_spread(W, mask)
    want, cnt = torch.zeros(3, dtype=torch.float64), 0
    for i in range(2, 6):  # rows with >= 2 masked entries: keys 1..i
        row = W[:, :, i, 1 : i + 1]
        want += (row - row.mean(-1, keepdim=True)).square().sum((0, 2))
        cnt += 2 * i
    torch.testing.assert_close(ss, want)
    assert float(n) == cnt


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 2), n=st.integers(1, 40), kv=st.integers(1, 3), g=st.integers(1, 3), d=st.integers(1, 6),
       sink=st.integers(0, 3), win=st.one_of(st.none(), st.integers(1, 12)), block=st.integers(1, 9),
       shift=st.sampled_from([0.0, 40.0]), seed=st.integers(0, 2**16))
def test_within_row_spread_qk_equals_the_map_version(b, n, kv, g, d, sink, win, block, shift, seed):
    """The block-Gram spread equals within_row_spread on the explicit maps for any mask, block size
    and GQA grouping — including keys with a large common offset (big row means, small spreads)."""
    from posgen_tl.maths.rope import causal_mask, scores_from_rotated

    gen = _gen(seed)
    q = torch.randn(b, n, kv * g, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, n, kv, d, generator=gen, dtype=torch.float64) + shift
    want, cnt = within_row_spread(scores_from_rotated(q, k, 0.7), causal_mask(n, sink=sink, sliding_window=win))
    got, got_cnt = within_row_spread_qk(q, k, 0.7, sink=sink, sliding_window=win, block=block)
    assert float(got_cnt) == float(cnt)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * float(want.abs().max().clamp(min=1)))


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 2), n=st.integers(1, 40), kv=st.integers(1, 3), g=st.integers(1, 3), d=st.integers(1, 6),
       sink=st.integers(0, 3), win=st.one_of(st.none(), st.integers(1, 12)), block=st.integers(1, 9),
       shift=st.sampled_from([0.0, 40.0]), seed=st.integers(0, 2**16))
def test_within_row_spread_in_row_blocks_equals_the_map_version(b, n, kv, g, d, sink, win, block, shift, seed):
    """The spread from the maps a block of query rows at a time, on the keys the block's rows see, equals
    within_row_spread on the whole explicit maps for any mask, block size and GQA grouping (float64 inputs: to
    rounding; a large common key offset included), and float32 inputs give the float32 map version's."""
    from posgen_tl.maths.rope import causal_mask, scores_from_rotated

    gen = _gen(seed)
    q = torch.randn(b, n, kv * g, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, n, kv, d, generator=gen, dtype=torch.float64) + shift
    mask = causal_mask(n, sink=sink, sliding_window=win)
    want, cnt = within_row_spread(scores_from_rotated(q, k, 0.7), mask)
    got, got_cnt = within_row_spread_rows(q, k, 0.7, sink=sink, sliding_window=win, block=block)
    assert float(got_cnt) == float(cnt)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * float(want.abs().max().clamp(min=1)))
    got32, _ = within_row_spread_rows(q.float(), k.float(), 0.7, sink=sink, sliding_window=win, block=block)
    want32, _ = within_row_spread(scores_from_rotated(q.float(), k.float(), 0.7), mask)
    torch.testing.assert_close(got32, want32, rtol=1e-3, atol=1e-3 * float(want32.abs().max().clamp(min=1)))


@pytest.mark.parametrize("sink,win", [(0, None), (1, None), (1, 100)])
@pytest.mark.parametrize("shift", [0.0, 40.0])
def test_within_row_spread_in_row_blocks_is_float32_exact_on_model_sized_heads(sink, win, shift):
    """From float32 q/k of a model's size (d_head 64, GQA 3:1, 300 tokens, blocks of 37 rows) the spread is within
    1e-6 (relative) of the float64 maps' — measured ≤ 1e-7, also with a common key offset 40× the keys' spread, where
    the one-pass Σw² − (Σw)²/cnt in float32 is off by 1.7e-5 (measured: the reason for the two passes)."""
    from posgen_tl.maths.rope import causal_mask, scores_from_rotated

    gen = _gen(7)
    q = torch.randn(2, 300, 6, 64, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 300, 2, 64, generator=gen, dtype=torch.float64) + shift
    want, _ = within_row_spread(scores_from_rotated(q, k, 0.125), causal_mask(300, sink=sink, sliding_window=win))
    got, _ = within_row_spread_rows(q.float(), k.float(), 0.125, sink=sink, sliding_window=win, block=37)
    assert got.dtype == torch.float64
    assert float(((got - want).abs() / want).max()) < 1e-6


def test_within_row_spread_qk_rejects_bad_shapes():
    with pytest.raises(ValueError, match="kv heads"):
        within_row_spread_qk(torch.zeros(1, 4, 3, 2), torch.zeros(1, 4, 2, 2), 1.0)
    with pytest.raises(ValueError, match="same batch, pos and d_head"):
        within_row_spread_qk(torch.zeros(1, 4, 2, 2), torch.zeros(1, 5, 1, 2), 1.0)


def _head_maps(fast: bool, seed: int):
    """q random; keys = constant + token-dependent noise in the 2 FASTEST or the 2 SLOWEST bands."""
    nb, n, d = 8, 96, 16
    rope = _rope(nb, score_scale=0.25)
    g = _gen(seed)
    q = torch.randn(2, n, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(d, generator=g, dtype=torch.float64).expand(2, n, 1, d).clone()
    for m in ((0, 1) if fast else (nb - 2, nb - 1)):
        for c in _coords(m, d, "half"):
            k[..., c] += torch.randn(2, n, 1, generator=g, dtype=torch.float64) * 2
    return rope, q, k


def test_predicted_error_ranks_fast_band_key_noise_worse_and_d3_agrees():
    from posgen_tl.maths.decompose import causal_mask, d3_split, within_row_r

    out = {}
    for fast in (True, False):
        rope, q, k = _head_maps(fast, seed=23)
        pos = torch.arange(q.shape[1]).expand(2, -1)
        ks, qs = band_stats(k, 16, "half"), band_stats(q, 16, "half")
        sp = d3_split(q, k, ks.mean(), pos, rope)
        mask = causal_mask(q.shape[1], sink=1)
        ss, n = within_row_spread(sp.W, mask)
        w = distance_weights(rope, q.shape[1] - 1, sink=1)
        pred = predicted_d3_error(qs.energy(), ks.residual_rms() ** 2, w, (ss / n).sqrt(),
                                  rope.score_scale * rope.attention_scaling**2)["pred_d3_err"].item()
        r = within_row_r(sp.W, sp.f + sp.g, mask).mean().item()
        out[fast] = (pred, r)
    (pf, rf), (ps, rs) = out[True], out[False]
    assert pf > 3 * ps  # fast-band key noise predicted much worse …
    assert rf < rs  # … and D3 really fits worse there
