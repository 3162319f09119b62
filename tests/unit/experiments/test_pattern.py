"""Tests for the docs/method.md §3 runner (posgen_tl.experiments.pattern) and its figures."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import tiny_models as tm  # noqa: E402
import torch  # noqa: E402

from posgen_tl.experiments.pattern import (  # noqa: E402
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
    from posgen_tl.hooks.capture import probe_hooks

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
    assert ((res.heads["legacy_pattern_score"] >= 0) & (res.heads["legacy_pattern_score"] <= 1)).all()
    assert (res.heads["pred_d3_err_per_sequence"] > 0).all()
    assert res.heads["pred_d3_err_global"].isna().all()  # no reference windows given: no global k̄
    assert (res.heads["blind_d3_err_per_sequence"] > 0).all()
    assert res.bands["rho_within"].between(0, 1).all() and np.isfinite(res.bands["rho_cross"]).all()
    assert set(res.bands["band_group"]) <= {"fast", "middle", "slow"}
    assert (res.heads["kv_group"] == res.heads["head"] // (spec.n_heads // spec.n_kv_heads)).all()
    # band periods follow the layer's frequencies (band 0 fastest = shortest period)
    per = res.bands[(res.bands.layer == 0) & (res.bands.which == "k") & (res.bands.head == 0)]["period"].to_numpy()
    assert np.all(np.diff(per) > 0)


def test_k_mean_is_mean_key_without_sink(native):
    tok = _tokens(3, 16)
    res = feature_pattern(native, tok, layers=[1], sink=1, progress=False)
    from posgen_tl.hooks.stream import capture_qk

    k = capture_qk(native, tok, [1])[1].k[:, 1:].double()
    torch.testing.assert_close(res.k_means[1].double(), k.mean((0, 1)), rtol=1e-5, atol=1e-6)


def test_batch_size_does_not_change_statistics(llama):
    tok = _tokens(5, 24, 100, seed=3)
    a = feature_pattern(llama, tok, batch_size=1, progress=False)
    b = feature_pattern(llama, tok, batch_size=4, progress=False)
    num = [c for c in BAND_COLUMNS if c not in ("model", "twin", "kind", "which", "band_group")]
    np.testing.assert_allclose(a.bands[num].to_numpy(float), b.bands[num].to_numpy(float), rtol=0, atol=1e-10)
    hnum = [c for c in HEAD_COLUMNS if c not in ("model", "twin")]
    np.testing.assert_allclose(a.heads[hnum].to_numpy(float), b.heads[hnum].to_numpy(float), rtol=0, atol=1e-10)


def test_merge_equals_one_pass(native):
    from posgen_tl.io.sampling import Windows

    tok = _tokens(6, 20, seed=5)
    win = Windows(tok, torch.tensor([0, 1, 1, 2, 3, 4]), torch.zeros(6, dtype=torch.long), [f"d{i}" for i in range(5)])
    whole = feature_pattern(native, win, progress=False)
    parts = feature_pattern(native, win.subset([0, 1]), progress=False).merge(
        feature_pattern(native, win.subset([2, 3, 4, 5]), progress=False))
    assert parts.n_tokens == whole.n_tokens
    num = ["energy_share", "offset_ratio", "phase_concentration", "residual_rms", "energy"]
    np.testing.assert_allclose(parts.bands[num].to_numpy(float), whole.bands[num].to_numpy(float), atol=1e-10)
    num += ["rho_within", "rho_cross", "stability"]
    np.testing.assert_allclose(parts.bands[num].to_numpy(float), whole.bands[num].to_numpy(float), atol=1e-10)
    for col in ("legacy_pattern_score", "pred_d3_err_per_sequence", "logit_spread"):
        np.testing.assert_allclose(parts.heads[col], whole.heads[col], atol=1e-10)
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
    np.testing.assert_allclose(k0["rho_within"], 1.0, atol=1e-6)
    np.testing.assert_allclose(k0["rho_cross"], 1.0, atol=1e-6)
    h0 = res.heads[res.heads.layer == 0]
    np.testing.assert_allclose(h0["legacy_pattern_score"], 1.0, atol=1e-6)
    np.testing.assert_allclose(h0["fast_key_stability"], 1.0, atol=1e-6)
    assert (h0["pred_d3_err_per_sequence"] < 1e-4).all()  # constant keys: D3 exact, no predicted error
    # the untouched layer keeps token-dependent keys
    assert (res.heads[res.heads.layer == 1]["legacy_pattern_score"] < 0.9).all()
    assert (res.heads[res.heads.layer == 1]["pred_d3_err_per_sequence"] > 1e-3).all()


def test_twin_differs_from_trained(native):
    tok = _tokens(3, 20)
    tp = feature_pattern_with_twin(native, tok, seed=1, progress=False)
    heads = tp.heads
    assert set(heads["twin"]) == {"trained", "random"}
    assert set(heads["model"]) == {tp.trained.model}
    assert tp.trained.n_tokens == tp.random.n_tokens
    a = heads[heads.twin == "trained"]["pred_d3_err_per_sequence"].to_numpy()
    b = heads[heads.twin == "random"]["pred_d3_err_per_sequence"].to_numpy()
    assert np.abs(a - b).max() > 1e-3
    assert len(tp.bands) == 2 * len(tp.trained.bands)


def test_gemma3_qk_norm_layer_kinds():
    model = tm.hf_gemma3()[0]
    res = feature_pattern(model, _tokens(2, 12, 100), progress=False)
    kinds = res.bands.groupby("layer")["kind"].first().to_dict()
    assert kinds == {0: "local", 1: "local", 2: "global"}
    assert np.isfinite(res.heads["pred_d3_err_per_sequence"]).all()


def _synthetic(pattern: dict[str, np.ndarray], r_within: dict[str, np.ndarray], n_seq=3):
    heads, rows = [], []
    rng = np.random.default_rng(0)
    for twin, ps in pattern.items():
        for h, p in enumerate(ps):
            heads.append(dict(model="m", twin=twin, layer=0, head=h, kv_group=0, pred_d3_err_global=p,
                              pred_d3_err_per_sequence=-p, legacy_pattern_score=p ** 2, expected_bound=0.5 + h,
                              blind_d3_err_global=1.0 + h % 2, blind_d3_err_per_sequence=1.0, logit_spread=2.0 + h))
            noise = rng.normal(size=n_seq)
            noise -= noise.mean()  # averages out over seq
            for s in range(n_seq):
                base = dict(model="m", twin=twin, layer=0, head=h, seq=s, r=0.9, r2=0.8)
                for km in ("global", "per_sequence"):
                    rows.append(dict(base, estimator="D3", k_mean=km, sink_excluded=True,
                                     r_within=r_within[twin][h] + 0.1 * noise[s], d3_err_mean=1.0, d3_bound_mean=5.0))
                    rows.append(dict(base, estimator="D3", k_mean=km, sink_excluded=False, r_within=-5.0,
                                     d3_err_mean=0.0, d3_bound_mean=0.0))
                rows.append(dict(base, estimator="D1", k_mean="none", sink_excluded=True, r_within=-7.0,
                                 d3_err_mean=np.nan, d3_bound_mean=np.nan))
    return pd.DataFrame(heads), pd.DataFrame(rows)


def test_link_to_decomposition_correlations():
    from scipy.stats import spearmanr

    ps_t = np.array([0.1, 0.4, 0.5, 0.8, 0.9])
    ps_r = np.array([0.2, 0.3, 0.6, 0.7, 0.1])
    rw_r = np.array([0.5, 0.1, 0.4, 0.2, 0.3])
    heads, dec = _synthetic({"trained": ps_t, "random": ps_r}, {"trained": 0.2 - 0.5 * ps_t, "random": rw_r})
    merged, summary = link_to_decomposition(heads, dec)
    assert len(merged) == 20  # 10 heads × 2 k̄ kinds
    assert (merged["n_seq"] == 3).all()
    tr = merged[(merged.twin == "trained") & (merged.k_mean == "global")]
    np.testing.assert_allclose(tr["r_within"], 0.2 - 0.5 * ps_t, atol=1e-12)
    np.testing.assert_allclose(tr["pred_d3_err"], ps_t)  # the matching k̄ kind's column
    np.testing.assert_allclose(merged[(merged.twin == "trained") & (merged.k_mean == "per_sequence")]["pred_d3_err"], -ps_t)
    assert set(summary["twin"]) == {"trained", "random"}  # never pooled
    one = lambda t, k, sc: summary[(summary.twin == t) & (summary.k_mean == k) & (summary.score == sc)].iloc[0]  # noqa: E731
    assert one("trained", "global", "pred_d3_err").spearman == pytest.approx(-1.0)
    assert one("trained", "per_sequence", "pred_d3_err").spearman == pytest.approx(1.0)
    want = spearmanr(ps_r, rw_r)
    row = one("random", "global", "pred_d3_err")
    assert row.spearman == pytest.approx(want.statistic) and row.p == pytest.approx(want.pvalue) and row.n_heads == 5
    assert one("trained", "global", "legacy_pattern_score").spearman == pytest.approx(-1.0)
    assert one("trained", "global", "inv_logit_spread").spearman == pytest.approx(1.0)  # 1/σ falls with head index
    assert one("trained", "global", "blind_d3_err").n_heads == 5
    assert np.isnan(one("trained", "per_sequence", "blind_d3_err").spearman)  # constant control: undefined, not 0
    assert set(summary.score) == {"pred_d3_err", "blind_d3_err", "residual_size", "inv_logit_spread", "legacy_pattern_score"}
    with pytest.raises(ValueError):
        link_to_decomposition(heads, dec[dec.estimator == "D1"])


def test_pred_error_global_matches_direct_computation(llama):
    """pred_d3_err_global from the reference k̄, q energies, the logit spread and entry-weighted
    rotation factors, recomputed by hand from captured q/k; ρ forms from the per-sequence sums."""
    from posgen_tl.hooks.edits import reference_key_means
    from posgen_tl.hooks.stream import capture_qk
    from posgen_tl.maths.band_stats import distance_weights
    from posgen_tl.maths.decompose import causal_mask
    from posgen_tl.maths.rho import rho_forms
    from posgen_tl.maths.rope import expand_kv, to_bands

    tok, ref = _tokens(4, 20, 100, seed=7), _tokens(2, 20, 100, seed=8)
    res = feature_pattern(llama, tok, reference=ref, sink=1, progress=False)
    kg = reference_key_means(llama, ref, sink=1, progress=False)
    for layer, c in capture_qk(llama, tok).items():
        rope = c.rope
        zq = to_bands(c.q[:, 1:].double(), rope.rotary_dim, rope.layout)
        zk = to_bands(c.k[:, 1:].double(), rope.rotary_dim, rope.layout)
        kres = (zk - to_bands(kg[layer].double(), rope.rotary_dim, rope.layout)).abs().square().mean((0, 1))
        W = c.logits().double()
        m = causal_mask(20, sink=1)
        rows = m.sum(-1) >= 2
        dev = [(W[:, :, i, m[i]] - W[:, :, i, m[i]].mean(-1, keepdim=True)) for i in range(20) if rows[i]]
        sigma = (sum(d.square().sum((0, 2)) for d in dev) / sum(d.shape[0] * d.shape[2] for d in dev)).sqrt()
        w = distance_weights(rope, 19, sink=1)
        pred = rope.score_scale * rope.attention_scaling**2 * (
            zq.abs().square().mean((0, 1)).sqrt() * expand_kv(kres.sqrt()[None], c.n_heads)[0] * w).sum(-1) / sigma
        got = res.heads[res.heads.layer == layer].sort_values("head")
        np.testing.assert_allclose(got["pred_d3_err_global"], pred.numpy(), rtol=1e-4)
        np.testing.assert_allclose(got["logit_spread"], sigma.numpy(), rtol=1e-4)
        forms = rho_forms(c.k, torch.arange(4), rope.rotary_dim, rope.layout,
                          (torch.arange(20) >= 1).expand(4, -1))
        kb = res.bands[(res.bands.layer == layer) & (res.bands.which == "k")].sort_values(["head", "band"])
        for key in ("rho_within", "rho_cross", "stability"):
            np.testing.assert_allclose(kb[key], forms[key].reshape(-1).numpy(), rtol=1e-6, atol=1e-9)


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
    for stat in ("rho_cross", "offset_ratio", "energy_share"):
        fig = plot_band_heatmaps(tp.bands, which="k", stat=stat)
        ims = [ax.images[0] for ax in fig.axes if ax.images]
        assert len(ims) == 2 and ims[0].get_clim() == ims[1].get_clim()
    assert isinstance(plot_pattern_distribution(tp.heads), Figure)
    heads, dec = _synthetic({"trained": np.linspace(0, 1, 4), "random": np.linspace(1, 0, 4)},
                            {"trained": np.linspace(0, 1, 4), "random": np.ones(4) * 0.3})
    merged, _ = link_to_decomposition(heads, dec)
    fig = plot_pattern_vs_d3(merged)
    assert len(fig.axes[0].collections) == 2
    from posgen_tl.experiments.head_maps import phase_angles_with_twin

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
    assert res.heads["legacy_pattern_score"].between(0, 1).all()
    assert (res.heads["pred_d3_err_per_sequence"] > 0).all()
    assert res.n_tokens == 2 * 63


@pytest.mark.parametrize("stack", [2, 64])
def test_layers_stacked_on_the_head_axis_give_each_layers_statistics(stack):
    """On a GPU the feature statistics accumulate layers stacked on the head axis; forced here on the CPU, every
    band and head row equals the one-layer-at-a-time run's (float rounding), Gemma3's local and global layers
    apart, and the raw states cut back per layer hold the same sums."""
    import numpy as np
    import pandas as pd

    from posgen_tl.experiments.pattern import feature_pattern

    for model in (tm.hf_llama(n_layers=3)[0], tm.hf_gemma3()[0]):
        toks = torch.randint(3, 90, (5, 20), generator=torch.Generator().manual_seed(0))
        one = feature_pattern(model, toks[:3], reference=toks[3:], batch_size=2, progress=False)
        got = feature_pattern(model, toks[:3], reference=toks[3:], batch_size=2, progress=False, stack=stack)
        for a, b in ((one.bands, got.bands), (one.heads, got.heads)):
            assert list(a.columns) == list(b.columns) and len(a) == len(b)
            num = [c for c in a.columns if pd.api.types.is_float_dtype(a[c])]
            pd.testing.assert_frame_equal(a.drop(columns=num), b.drop(columns=num))
            np.testing.assert_allclose(b[num].to_numpy(float), a[num].to_numpy(float), rtol=1e-6, atol=1e-9,
                                       equal_nan=True)
            assert np.isfinite(a[num].to_numpy(float)).mean() > 0.5
        for layer, st in one.states.items():
            assert got.states[layer]["q"]["sum_x"].shape == st["q"]["sum_x"].shape
            torch.testing.assert_close(got.states[layer]["k_seq"]["sum_z"], st["k_seq"]["sum_z"])


def test_layers_given_in_any_order_are_all_accumulated_when_stacked():
    """A ``layers`` option in another order than the stream's: every layer still gets its
    rows when layers are stacked (a stack is closed at the stream's last layer, whatever order the option had)."""
    from posgen_tl.experiments.pattern import feature_pattern

    model = tm.hf_llama(n_layers=3)[0]
    toks = torch.randint(3, 90, (3, 16), generator=torch.Generator().manual_seed(0))
    one = feature_pattern(model, toks, batch_size=2, progress=False, layers=[2, 0])
    got = feature_pattern(model, toks, batch_size=2, progress=False, layers=[2, 0], stack=2)
    assert sorted(got.heads["layer"].unique()) == sorted(one.heads["layer"].unique()) == [0, 2]
    assert len(got.bands) == len(one.bands)


def test_long_rows_spread_block_is_one_and_a_half_d_head_on_the_cpu_and_an_eighth_of_the_rows_on_a_gpu():
    """The block-Gram spread's block (its numbers do not depend on it: test_band_stats) is 1.5·d_head on the CPU; on
    an accelerator an eighth of the rows (fewer kernel launches), never more than the memory cap allows."""
    from posgen_tl.experiments.pattern import SPREAD_ENTRIES, _spread_block
    from posgen_tl.hooks.capture import QKCapture

    def cap(b, n, h, device):
        q = torch.empty(b, n, h, 64, device=device)
        return QKCapture(layer=0, q=q, k=q[:, :, :1], rot_q=q, rot_k=q[:, :, :1], positions=torch.empty(0),
                         rope=None, rot_source="hook")  # type: ignore[arg-type]

    assert _spread_block(cap(1, 2048, 9, "cpu")) == 96
    assert _spread_block(cap(1, 2048, 126, "meta")) == 256
    assert _spread_block(cap(1, 16384, 9, "meta")) == 2048
    capped = _spread_block(cap(4, 16384, 126, "meta"))  # the memory cap binds: [4, 126, block, 2·block] float64
    assert capped == int((SPREAD_ENTRIES // (8 * 4 * 126)) ** 0.5) == 364 and 8 * 4 * 126 * capped**2 <= SPREAD_ENTRIES
    assert _spread_block(cap(1, 400, 9, "meta")) == 50


@pytest.mark.parametrize("n, path", [(96, "rows"), (100, "gram")])
def test_the_spread_on_the_cpu_comes_from_row_blocks_up_to_24_d_head_and_from_gram_sums_beyond(monkeypatch, n, path):
    """On the CPU the logit spread of rows up to 24·d_head tokens is taken from the maps in cache-sized row blocks,
    beyond from block-Gram sums — each equal to within_row_spread on the explicit maps (sink and window kept)."""
    from types import SimpleNamespace

    from posgen_tl.experiments import pattern as P
    from posgen_tl.hooks.capture import QKCapture
    from posgen_tl.maths import band_stats as B
    from posgen_tl.maths.rope import causal_mask, scores_from_rotated

    gen = torch.Generator().manual_seed(n)
    q, k = torch.randn(2, n, 6, 4, generator=gen), torch.randn(2, n, 2, 4, generator=gen) + 3.0
    rope = SimpleNamespace(score_scale=0.5, sliding_window=40)
    c = QKCapture(layer=0, q=q, k=k, rot_q=q, rot_k=k, positions=torch.empty(0), rope=rope,  # type: ignore[arg-type]
                  rot_source="hook")
    took = []
    for name in ("within_row_spread_rows", "within_row_spread_qk"):
        real = getattr(B, name)
        monkeypatch.setattr(P, name, lambda *a, _r=real, _n=name, **kw: took.append(_n) or _r(*a, **kw))
    ss, cnt = P._spread(c, sink=2)
    want, want_cnt = B.within_row_spread(scores_from_rotated(q.double(), k.double(), 0.5),
                                         causal_mask(n, sink=2, sliding_window=40))
    assert took == ["within_row_spread_rows" if path == "rows" else "within_row_spread_qk"]
    assert float(cnt) == float(want_cnt)
    torch.testing.assert_close(ss, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.fixture(scope="module")
def gemma3():
    return tm.hf_gemma3()[0]


@pytest.mark.parametrize("which_model, uses", [("native", False), ("llama", True), ("gemma3", True)])
def test_the_spread_comes_from_the_forwards_score_maps_on_the_cpu_and_equals_the_recomputed_one(
        which_model, uses, request, monkeypatch):
    """On the CPU the logit spread is taken from the forward's own hook_attn_scores where they are W (compared on a
    few rows first), with the same numbers as from the maps recomputed from q and k; scores that differ from W are
    not used (the maps are recomputed: the same numbers again), nor a hook that holds the softmax (the native model's
    hook_attn_scores fires after it); the tiny Gemma3's sliding-window layers (window 4) included."""
    from posgen_tl.experiments import pattern as P
    from posgen_tl.maths import spread as S

    model = request.getfixturevalue(which_model)
    tok = _tokens(4, 20, 50 if which_model == "native" else 100, seed=5)
    n_layers = 3 if which_model == "gemma3" else 2
    took: list[str] = []
    real = S.within_row_spread_of_scores
    monkeypatch.setattr(P, "within_row_spread_of_scores", lambda *a, **kw: took.append("scores") or real(*a, **kw))
    from_scores = feature_pattern(model, tok, sink=1, batch_size=2, progress=False).heads
    assert P._scores_for_spread(model, 20, 0, 1) is uses and took.count("scores") == n_layers * 2 * uses  # × batches
    real_choice = P._scores_for_spread
    monkeypatch.setattr(P, "_scores_for_spread", lambda *a: False)
    took.clear()
    recomputed = feature_pattern(model, tok, sink=1, batch_size=2, progress=False).heads
    assert not took
    monkeypatch.setattr(P, "_scores_for_spread", real_choice)
    monkeypatch.setattr(P, "scores_mismatch", lambda *a, **kw: 1.0)  # as if the hook's maps were not W
    refused = feature_pattern(model, tok, sink=1, batch_size=2, progress=False).heads
    assert not took
    for other in (recomputed, refused):
        np.testing.assert_allclose(from_scores["logit_spread"], other["logit_spread"], rtol=1e-5)
        pd.testing.assert_frame_equal(from_scores.drop(columns=["logit_spread", "pred_d3_err_per_sequence",
                                                                "blind_d3_err_per_sequence", "pred_d3_err_global",
                                                                "blind_d3_err_global"]),
                                      other.drop(columns=["logit_spread", "pred_d3_err_per_sequence",
                                                          "blind_d3_err_per_sequence", "pred_d3_err_global",
                                                          "blind_d3_err_global"]))


def test_the_score_maps_are_read_only_for_whole_forwards_of_rows_up_to_24_d_head_one_layer_at_a_time(llama):
    from posgen_tl.experiments import pattern as P

    d = 16  # the tiny Llama's d_head
    assert P._scores_for_spread(llama, 24 * d, 0, 1)
    assert not P._scores_for_spread(llama, 24 * d + 1, 0, 1)  # longer rows: block-Gram sums, no map
    assert not P._scores_for_spread(llama, 40, 10, 1)  # a forward in chunks has no whole score map
    assert P._scores_for_spread(llama, 40, 40, 1)  # (one chunk of the whole row is a whole forward)
    assert not P._scores_for_spread(llama, 40, 0, 2)  # a stack of layers carries q/k only
