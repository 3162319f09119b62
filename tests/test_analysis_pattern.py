"""Tests for the METHOD §3 runner (posgen_tl.analysis.pattern) and its figures."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import tiny_models as tm  # noqa: E402
from posgen_tl.analysis.pattern import (  # noqa: E402
    BAND_COLUMNS,
    HEAD_COLUMNS,
    PatternResult,
    feature_pattern,
    feature_pattern_with_twin,
    link_to_decomposition,
)


def _tokens(n_seq=5, n_pos=24, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n_seq, n_pos), generator=g)


@pytest.fixture(scope="module")
def native():
    return tm.native()


@pytest.fixture(scope="module")
def llama():
    return tm.hf_llama()[0]


@pytest.mark.parametrize("which_model", ["native", "llama"])
def test_frames_columns_and_sizes(which_model, request):
    model = request.getfixturevalue(which_model)
    vocab = 50 if which_model == "native" else 100
    tok = _tokens(4, 20, vocab)
    res = feature_pattern(model, tok, sink=2, batch_size=3, progress=False)
    from posgen_tl.capture import probe_hooks

    spec, _ = probe_hooks(model)
    nb = spec.layer(0).rotary_dim // 2
    assert list(res.bands.columns) == BAND_COLUMNS
    assert list(res.heads.columns) == HEAD_COLUMNS
    assert len(res.bands) == spec.n_layers * (spec.n_heads + spec.n_kv_heads) * nb
    assert len(res.heads) == spec.n_layers * spec.n_heads
    assert set(res.bands["which"]) == {"q", "k"}
    assert res.n_tokens == 4 * (20 - 2)  # sink positions excluded
    assert set(res.k_means) == set(range(spec.n_layers))
    assert tuple(res.k_means[0].shape) == (spec.n_kv_heads, spec.d_head)
    assert ((res.heads["pattern_score"] >= 0) & (res.heads["pattern_score"] <= 1)).all()
    assert (res.heads["kv_group"] == res.heads["head"] // (spec.n_heads // spec.n_kv_heads)).all()
    # band periods follow the layer's frequencies (band 0 fastest = shortest period)
    per = res.bands[(res.bands.layer == 0) & (res.bands.which == "k") & (res.bands.head == 0)]["period"].to_numpy()
    assert np.all(np.diff(per) > 0)


def test_k_mean_is_mean_key_without_sink(native):
    tok = _tokens(3, 16)
    res = feature_pattern(native, tok, layers=[1], sink=1, progress=False)
    from posgen_tl.capture import capture_qk

    k = capture_qk(native, tok, [1])[1].k[:, 1:].double()
    torch.testing.assert_close(res.k_means[1].double(), k.mean((0, 1)), rtol=1e-5, atol=1e-6)


def test_batch_size_does_not_change_statistics(llama):
    tok = _tokens(5, 24, 100, seed=3)
    a = feature_pattern(llama, tok, batch_size=1, progress=False)
    b = feature_pattern(llama, tok, batch_size=4, progress=False)
    num = [c for c in BAND_COLUMNS if c not in ("model", "twin", "kind", "which")]
    np.testing.assert_allclose(a.bands[num].to_numpy(float), b.bands[num].to_numpy(float), rtol=0, atol=1e-10)
    hnum = [c for c in HEAD_COLUMNS if c not in ("model", "twin")]
    np.testing.assert_allclose(a.heads[hnum].to_numpy(float), b.heads[hnum].to_numpy(float), rtol=0, atol=1e-10)


def test_merge_equals_one_pass(native):
    tok = _tokens(6, 20, seed=5)
    whole = feature_pattern(native, tok, progress=False)
    parts = feature_pattern(native, tok[:2], progress=False).merge(feature_pattern(native, tok[2:], progress=False))
    assert parts.n_tokens == whole.n_tokens
    num = ["energy_share", "offset_ratio", "phase_concentration", "residual_rms", "energy"]
    np.testing.assert_allclose(parts.bands[num].to_numpy(float), whole.bands[num].to_numpy(float), atol=1e-10)
    np.testing.assert_allclose(parts.heads["pattern_score"], whole.heads["pattern_score"], atol=1e-10)
    rebuilt = PatternResult.from_states(whole.states, whole.ropes, max_distance=whole.max_distance,
                                        model=whole.model, twin=whole.twin)
    pd.testing.assert_frame_equal(rebuilt.heads, whole.heads)


def test_constant_keys_give_full_offset_and_pattern_one():
    model = tm.native(seed=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layers.0.") and "attn._original_component.k." in name:
                if name.endswith("weight"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) + 0.5)
    res = feature_pattern(model, _tokens(3, 20), progress=False)
    k0 = res.bands[(res.bands.layer == 0) & (res.bands.which == "k")]
    np.testing.assert_allclose(k0["offset_ratio"], 1.0, atol=1e-6)
    np.testing.assert_allclose(k0["phase_concentration"], 1.0, atol=1e-6)
    assert (k0["residual_rms"] < 1e-6).all()
    h0 = res.heads[res.heads.layer == 0]
    np.testing.assert_allclose(h0["pattern_score"], 1.0, atol=1e-6)
    np.testing.assert_allclose(h0["fast_key_offset"], 1.0, atol=1e-6)
    # the untouched layer keeps token-dependent keys
    assert (res.heads[res.heads.layer == 1]["pattern_score"] < 0.9).all()


def test_twin_differs_from_trained(native):
    tok = _tokens(3, 20)
    tp = feature_pattern_with_twin(native, tok, seed=1, progress=False)
    heads = tp.heads
    assert set(heads["twin"]) == {"trained", "random"}
    assert set(heads["model"]) == {tp.trained.model}
    assert tp.trained.n_tokens == tp.random.n_tokens
    a = heads[heads.twin == "trained"]["pattern_score"].to_numpy()
    b = heads[heads.twin == "random"]["pattern_score"].to_numpy()
    assert np.abs(a - b).max() > 1e-3
    assert len(tp.bands) == 2 * len(tp.trained.bands)


def test_gemma3_qk_norm_layer_kinds():
    model = tm.hf_gemma3()[0]
    res = feature_pattern(model, _tokens(2, 12, 100), progress=False)
    kinds = res.bands.groupby("layer")["kind"].first().to_dict()
    assert kinds == {0: "local", 1: "local", 2: "global"}
    assert np.isfinite(res.heads["pattern_score"]).all()


def _synthetic(pattern: dict[str, np.ndarray], r_within: dict[str, np.ndarray], n_seq=3):
    heads, rows = [], []
    rng = np.random.default_rng(0)
    for twin, ps in pattern.items():
        for h, p in enumerate(ps):
            heads.append(dict(model="m", twin=twin, layer=0, head=h, kv_group=0, pattern_score=p,
                              expected_bound=0.5 + h, fast_key_offset=p, key_energy_centroid=1.0))
            noise = rng.normal(size=n_seq)
            noise -= noise.mean()  # averages out over seq
            for s in range(n_seq):
                base = dict(model="m", twin=twin, layer=0, head=h, seq=s, r=0.9, r2=0.8)
                rows.append(dict(base, estimator="D3", sink_excluded=True, r_within=r_within[twin][h] + 0.1 * noise[s],
                                 d3_err_mean=2 * (0.5 + h) + 0.01 * noise[s], d3_bound_mean=5.0))
                rows.append(dict(base, estimator="D3", sink_excluded=False, r_within=-5.0, d3_err_mean=0.0,
                                 d3_bound_mean=0.0))
                rows.append(dict(base, estimator="D1", sink_excluded=True, r_within=-7.0, d3_err_mean=np.nan,
                                 d3_bound_mean=np.nan))
    return pd.DataFrame(heads), pd.DataFrame(rows)


def test_link_to_decomposition_correlations():
    ps_t = np.array([0.1, 0.4, 0.5, 0.8, 0.9])
    ps_r = np.array([0.2, 0.3, 0.6, 0.7, 0.1])
    rw_r = np.array([0.5, 0.1, 0.4, 0.2, 0.3])
    heads, dec = _synthetic({"trained": ps_t, "random": ps_r}, {"trained": 0.2 + 0.5 * ps_t, "random": rw_r})
    merged, summary = link_to_decomposition(heads, dec)
    assert len(merged) == 10
    assert (merged["n_seq"] == 3).all()
    np.testing.assert_allclose(merged.loc[merged.twin == "trained", "r_within"], 0.2 + 0.5 * ps_t, atol=1e-12)
    assert summary["trained"]["pearson_pattern_r_within"] == pytest.approx(1.0)
    assert summary["trained"]["spearman_pattern_r_within"] == pytest.approx(1.0)
    assert summary["random"]["pearson_pattern_r_within"] == pytest.approx(np.corrcoef(ps_r, rw_r)[0, 1])
    from scipy.stats import spearmanr

    assert summary["random"]["spearman_pattern_r_within"] == pytest.approx(spearmanr(ps_r, rw_r)[0])
    assert summary["trained"]["pearson_bound_err"] == pytest.approx(1.0, abs=1e-6)
    assert summary["trained"]["err_over_bound_median"] == pytest.approx(2.0, abs=1e-3)
    assert summary["all"]["n_heads"] == 10
    with pytest.raises(ValueError):
        link_to_decomposition(heads, dec[dec.estimator == "D1"])


def test_figures(native):
    from matplotlib.figure import Figure

    from posgen_tl.plot.pattern import (
        plot_band_heatmaps,
        plot_pattern_distribution,
        plot_pattern_vs_d3,
        plot_phase_histogram,
    )

    tok = _tokens(3, 20)
    tp = feature_pattern_with_twin(native, tok, seed=1, progress=False)
    for stat in ("offset_ratio", "energy_share"):
        fig = plot_band_heatmaps(tp.bands, which="k", stat=stat)
        ims = [ax.images[0] for ax in fig.axes if ax.images]
        assert len(ims) == 2 and ims[0].get_clim() == ims[1].get_clim()
    assert isinstance(plot_pattern_distribution(tp.heads), Figure)
    heads, dec = _synthetic({"trained": np.linspace(0, 1, 4), "random": np.linspace(1, 0, 4)},
                            {"trained": np.linspace(0, 1, 4), "random": np.ones(4) * 0.3})
    merged, _ = link_to_decomposition(heads, dec)
    fig = plot_pattern_vs_d3(merged)
    assert len(fig.axes[0].collections) == 2
    from posgen_tl.analysis.head import phase_angles_with_twin

    fig = plot_phase_histogram(phase_angles_with_twin(native, tok[:2], layer=0, head=0, band=0, twin=tm.native(seed=1)))
    assert len(fig.axes) == 2 and all(len(ax.patches) == 36 for ax in fig.axes)


@pytest.mark.real
def test_real_smollm2_ranges(smollm2, smollm2_tokens):
    res = feature_pattern(smollm2, smollm2_tokens, layers=[0, 10, 29], progress=False)
    b = res.bands
    assert set(b["layer"]) == {0, 10, 29}
    assert b["offset_ratio"].between(0, 1).all()
    assert b["phase_concentration"].between(0, 1).all()
    sums = b.groupby(["layer", "which", "head"])["energy_share"].sum()
    np.testing.assert_allclose(sums.to_numpy(), 1.0, atol=1e-9)
    assert len(res.heads) == 3 * 9
    assert res.heads["pattern_score"].between(0, 1).all()
    assert res.n_tokens == 2 * 63
