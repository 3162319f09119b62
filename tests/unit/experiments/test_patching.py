"""The patching study (posgen_tl.experiments.patching, docs/method.md §9): its tables agree with the per-document
rows they summarise, an interrupted run continues to the same numbers, a result survives save/load, the figure
shows what it says, bad options are named."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tiny_models as tm
import torch
from matplotlib.patches import Rectangle

from posgen_tl.experiments import patching as pe
from posgen_tl.plot.patching import plot_patching_heatmap
from posgen_tl.stats.inference import ratio_ci

OPTS = dict(n_seq=5, seq_len=24, target_len=6, quantities=("rot_q", "pos_term"), directions=("denoising", "noising"),
            layers=(1, 2), n_ref=3, n_perm=2000, batch_size=2, progress=False)


@pytest.fixture(scope="module")
def sharp():
    """A tiny Llama whose attention is sharp (W_Q × 8) and output not uniform (unembedding × 10), so that the
    swaps do measurable damage."""
    torch.manual_seed(0)
    return tm.sharpened(tm.hf_llama(n_layers=3)[0])


@pytest.fixture(scope="module")
def result(sharp):
    return pe.run(sharp, corpus=tm.token_corpus(14), **OPTS)


def test_tables_summarise_the_document_rows(result):
    u, h = result["units"], result["heads"]
    # every document × (rot_q, pos_term, its random-k̄ control) × direction × (2 layers × 4 heads + 2 whole layers)
    assert len(u) == 5 * 3 * 2 * (2 * 4 + 2)
    assert len(h) == 3 * 2 * 2 * 4 and set(h["layer"]) == {1, 2}
    assert set(h["quantity"]) == {"rot_q", "pos_term", "pos_term" + pe.RANDOM}
    f, r = (h[h["quantity"] == q].set_index(["direction", "layer", "head"])["effect"] for q in ("pos_term",
                                                                                              "pos_term" + pe.RANDOM))
    assert not np.allclose(f.to_numpy(), r.loc[f.index].to_numpy())  # another k̄, another patch
    row = h[(h["quantity"] == "pos_term") & (h["direction"] == "denoising") & (h["layer"] == 2) & (h["head"] == 1)]
    g = u[(u["quantity"] == "pos_term") & (u["direction"] == "denoising") & (u["level"] == "head")
          & (u["layer"] == 2) & (u["head"] == 1)].sort_values("doc")
    effect = (g["corrupted_nll"] - g["nll"]).to_numpy()
    damage = (g["corrupted_nll"] - g["clean_nll"]).to_numpy()
    assert row["effect"].iloc[0] == pytest.approx(effect.mean(), rel=1e-9)
    if result.meta["damage"]["swaps"]["detected"]:
        assert row["recovery"].iloc[0] == pytest.approx(effect.mean() / damage.mean(), rel=1e-9)
    else:  # no detectable damage: recovery undefined everywhere, never a number
        assert h["recovery"].isna().all() and h["recovery_low"].isna().all()
    # noising: the effect is patched − clean
    nz = u[(u["direction"] == "noising") & (u["level"] == "head")]
    hn = h[h["direction"] == "noising"].set_index(["quantity", "layer", "head"])["effect"]
    means = (nz["nll"] - nz["clean_nll"]).groupby([nz["quantity"], nz["layer"], nz["head"]]).mean()
    pd.testing.assert_series_equal(hn.sort_index(), means.sort_index(), check_names=False, rtol=1e-9)
    assert (h["p_fwe"].between(0, 1)).all() and h["p_kind"].iloc[0] == "exact sign-flip max-T (2^5)"
    assert result.meta["damage"]["swaps"]["mean"] > 0  # the swaps did damage on this model
    assert set(u["corruption"]) == {"swaps"} and set(h["corruption"]) == {"swaps"}


def test_recovery_is_a_ratio_of_means_with_a_bootstrap_interval_and_undefined_without_damage():
    rng = np.random.default_rng(0)
    dmg = rng.normal(1.0, 0.2, 20)
    eff = 0.3 * dmg + rng.normal(0, 0.02, 20)
    r, lo, hi = ratio_ci(eff, dmg, seed=0)
    assert r == pytest.approx(eff.mean() / dmg.mean()) and lo < r < hi and hi - lo < 0.1
    assert all(np.isnan(ratio_ci(eff, rng.normal(0, 1, 20), seed=0)))  # damage's interval holds 0


def test_the_random_twins_damage_is_shown_beside_and_gets_no_map(result):
    tw = result["twin"]
    assert len(tw) == 5 and np.isfinite(tw["damage"]).all()
    d = result.meta["twin_damage"]["swaps"]
    assert d["mean"] == pytest.approx(tw["damage"].mean(), rel=1e-9)
    # a fresh init barely uses positions: far less damage than the (sharpened) trained stand-in
    assert abs(d["mean"]) < abs(result.meta["damage"]["swaps"]["mean"])
    sec = pe.render(result)
    assert f"on the random-init twin the same corruption did {d['mean']:.3g} nats" in sec.verdict
    assert all("twin" not in cap for _, cap in sec.figures)


def test_a_given_twin_is_the_one_measured_and_none_runs_without_one(sharp, result):
    """The report hands every experiment its one shared twin (a callable): the sweep measures THAT model — the same
    numbers as the twin it would build itself (same seed), another model's numbers when another is given — and runs
    no twin at all when told not to."""
    from posgen_tl.io.models import random_twin

    opts = {**OPTS, "quantities": ("rot_q",), "directions": ("denoising",), "layers": (2,)}
    built = []

    def shared():
        built.append(1)
        return random_twin(sharp, 0)

    same = pe.run(sharp, corpus=tm.token_corpus(14), twin=shared, **opts)
    assert built == [1]
    pd.testing.assert_frame_equal(same["twin"], result["twin"], check_exact=True)
    other = pe.run(sharp, corpus=tm.token_corpus(14), twin=random_twin(sharp, 7), **opts)
    assert not np.allclose(other["twin"]["damage"].to_numpy(), result["twin"]["damage"].to_numpy())
    assert other.meta["twin_damage"]["swaps"]["mean"] == pytest.approx(other["twin"]["damage"].mean(), rel=1e-9)
    none = pe.run(sharp, corpus=tm.token_corpus(14), twin=False, **opts)
    assert "twin" not in none.tables and none.meta["twin_damage"] is None
    assert "random-init twin" not in pe.render(none).verdict


def test_the_corrupted_and_clean_runs_are_the_baselines_of_every_row(result):
    u = result["units"]
    per_doc = u.groupby("doc")[["clean_nll", "corrupted_nll"]].nunique()
    assert (per_doc == 1).all().all()  # one clean and one corrupted value per document, whatever was patched


def test_an_interrupted_run_continues_to_the_same_numbers(sharp, tmp_path, monkeypatch, capsys):
    kw = {**OPTS, "quantities": ("rot_q",), "directions": ("denoising",)}
    whole = pe.run(sharp, corpus=tm.token_corpus(14), **kw)
    real, calls = pe._batch_rows, {"n": 0}

    def dies_on_the_second(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(pe, "_batch_rows", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        pe.run(sharp, corpus=tm.token_corpus(14), checkpoint=tmp_path / "ck", **kw)
    assert len(list((tmp_path / "ck").glob("batch_*.csv"))) == 1
    calls["n"] = 0
    monkeypatch.setattr(pe, "_batch_rows", lambda *a, **k: (calls.__setitem__("n", calls["n"] + 1), real(*a, **k))[1])
    capsys.readouterr()
    resumed = pe.run(sharp, corpus=tm.token_corpus(14), checkpoint=tmp_path / "ck", **{**kw, "progress": True})
    assert calls["n"] == 2  # batches 2 and 3 of 3; the first came from the checkpoint
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    # the bar starts at the kept batch, says so, and ends at 3 of 3 (never "0/3" after a resume)
    assert any("patching batches:  33%" in b and "1/3" in b and "resumed: 1 kept" in b for b in bar), bar
    assert not any(" 0/3 " in b for b in bar) and any("3/3" in b for b in bar)
    for name in ("heads", "layers", "units"):
        pd.testing.assert_frame_equal(resumed[name], whole[name], check_exact=False, rtol=1e-9, atol=1e-12)
    # the resumed run records and says that part of it was kept (its wall time is its own only)
    assert resumed.meta["kept_batches"] == 1 and whole.meta["kept_batches"] == 0
    assert "Resumed: 1 batches were kept from an earlier, interrupted run" in pe.render(resumed).paragraphs[0]
    assert "Resumed" not in pe.render(whole).paragraphs[0]
    with pytest.raises(ValueError, match="another patching design"):
        pe.run(sharp, corpus=tm.token_corpus(14), checkpoint=tmp_path / "ck", **{**kw, "frac": 0.3})


def test_save_load_render_round_trip(result, tmp_path):
    pe.save(result, tmp_path)
    back = pe.load(tmp_path)
    for name in result.tables:
        pd.testing.assert_frame_equal(back[name], result[name], check_dtype=False, check_exact=False, rtol=1e-12)
    sec = pe.render(back)
    # one figure per patched quantity (rot_q; pos_term with its control), its maps in both directions
    assert len(sec.figures) == 2 and "random-k̄ control" in sec.figures[1][1]
    d = result.meta["damage"]["swaps"]
    assert sec.verdict.startswith("with 5 documents the smallest family-wise p a head can reach is 2/2^5 = 0.0625 > "
                                  "α = 0.05: no head can be significant at this n; T2 swaps (p = 0.2, seed 0) raised "
                                  f"the target NLL by {d['mean']:.3g} nats")
    assert "positional term f — denoising: " in sec.verdict and ", noising: " in sec.verdict
    assert "heads significantly do part of the damage alone" in sec.verdict and "heads significantly account for " \
        "part of the damage" in sec.verdict and "; with a random k̄ (control): " in sec.verdict
    assert sec.verdict.endswith("significance: family-wise α = 0.05 over each map's heads (max-T sign-flip over "
                                "documents).")
    # the pages' headline: one map per corruption (f, denoising), "k of H heads", the strongest head's recovery
    (f,) = sec.findings
    top = result["heads"][(result["heads"]["quantity"] == "pos_term") & (result["heads"]["direction"] == "denoising")]
    best = top.sort_values("effect").iloc[-1]
    assert f.verdict == f"{int((top['significant'] & (top['effect'] > 0)).sum())} of 8 heads" and f.p == best["p_fwe"]
    assert f.effect == (best["recovery"] if d["detected"] else best["effect"]) and "not adjusted" in f.note
    top = pe.ranked(result["heads"], k=3)
    assert list(top.columns[:4]) == ["patched", "direction", "layer", "head"] and len(top) == 6 * 3
    assert "positional term f with a random k̄ (control)" in set(top["patched"])
    first = top.iloc[0]
    best = result["heads"][(result["heads"]["quantity"] == "rot_q") & (result["heads"]["direction"] == "denoising")]
    assert first["effect (nats)"] == pytest.approx(best["effect"].max())


def test_the_headline_shows_the_strongest_significant_head_beside_the_count():
    """"k of H heads" stands beside a head of those k (the strongest significant one, its p below α), not beside a
    stronger head that is not significant; with none significant, the strongest head, and the note says so."""
    rows = [dict(layer=0, head=0, effect=0.9, recovery=0.6, significant=False, p_fwe=0.17),
            dict(layer=1, head=1, effect=0.4, recovery=0.25, significant=True, p_fwe=0.0005),
            dict(layer=2, head=2, effect=0.2, recovery=0.12, significant=True, p_fwe=0.03),
            dict(layer=3, head=0, effect=-0.5, recovery=-0.3, significant=True, p_fwe=0.001)]
    heads = pd.DataFrame([dict(r, corruption="swaps", quantity="pos_term", direction="denoising", recovery_low=0.0,
                               recovery_high=1.0, ci_low=0.0, ci_high=1.0) for r in rows])
    meta = {"damage": {"swaps": {"detected": True, "ci_high": 0.3}}, "corruption": {"swaps": "T2 swaps"}, "n_docs": 32,
            "p_kind": "exact"}
    (f,) = pe.headline_findings(heads, meta, 0.05)
    assert f.verdict == "2 of 4 heads" and f.effect == 0.25 and f.p == 0.0005
    assert "strongest significant head L1H1" in f.note
    (f,) = pe.headline_findings(heads.assign(significant=False), meta, 0.05)
    assert f.verdict == "0 of 4 heads" and f.effect == 0.6 and f.p == 0.17
    assert "strongest head (none significant) L0H0" in f.note


def test_heatmap_shows_a_fixed_scale_and_outlines_the_significant_heads():
    heads = pd.DataFrame([dict(layer=la, head=h, recovery=(la - h) / 2, effect=0.01 * (la - h), significant=(la, h) in
                               {(0, 1), (2, 0)}) for la in range(3) for h in range(4)])
    fig = plot_patching_heatmap(heads, n_layers=4, title="t")
    ax = fig.axes[0]
    im = ax.images[0]
    assert im.get_clim() == (-1.0, 1.0)  # fixed scale, whatever the data's range
    arr = np.ma.filled(im.get_array().astype(float), np.nan)
    assert arr.shape == (3, 4) and not np.isnan(arr).any()  # one row per patched layer
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2"] and "3 of 4 layers" in ax.get_ylabel()
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert sorted((b.get_y() + 0.5, b.get_x() + 0.5) for b in boxes) == [(0.0, 1.0), (2.0, 0.0)]
    assert "normalised recovery" in fig.axes[1].get_ylabel()
    # no damage: recovery undefined everywhere → the effect in nats on its own symmetric scale, labelled so
    fig2 = plot_patching_heatmap(heads.assign(recovery=np.nan), n_layers=3)
    assert fig2.axes[0].images[0].get_clim() == (-0.03, 0.03) and "recovery undefined" in fig2.axes[1].get_ylabel()


@pytest.mark.parametrize("kw, match", [
    (dict(n_seq=2), "at least 3"), (dict(corruption="scramble"), "corruption"), (dict(quantities=("v",)), "quantities"),
    (dict(corruption="swaps,swaps"), "distinct"), (dict(corruption="gap,"), None), (dict(corruption=","), "corruption"),
    (dict(directions=("sideways",)), "directions"), (dict(frac=0.7), "frac"), (dict(test_alpha=1.5), "test_alpha"),
])
def test_bad_options_are_named(kw, match):
    if match is None:  # a trailing comma is only spacing
        assert pe.Config(**kw).corruptions() == ("gap",)
        return
    with pytest.raises(ValueError, match=match):
        pe.Config(**kw)


def test_random_means_keep_each_heads_norm_and_change_its_direction():
    km = {3: torch.randn(2, 16, dtype=torch.float32)}
    r = pe.random_means(km, seed=0)[3]
    torch.testing.assert_close(r.norm(dim=-1), km[3].norm(dim=-1))
    assert (torch.nn.functional.cosine_similarity(r, km[3], dim=-1).abs() < 0.9).all()
    assert torch.equal(r, pe.random_means(km, seed=0)[3]) and not torch.equal(r, pe.random_means(km, seed=1)[3])


def test_taxonomy_link_uses_the_layer_as_the_unit():
    rng = np.random.default_rng(0)
    heads, labels = [], []
    for layer in range(8):
        for h in range(6):
            kind = "positional" if h < 2 else "symbolic" if h < 5 else "mixed"
            eff = (0.1 if kind == "positional" else 0.0) + rng.normal(0, 0.01)
            heads.append(dict(quantity="pos_term", direction="denoising", layer=layer, head=h, effect=eff))
            labels.append(dict(twin="trained", layer=layer, head=h, label=kind))
            labels.append(dict(twin="random", layer=layer, head=h, label="symbolic"))  # the twin's rows: ignored
    link = pe.taxonomy_link(pd.DataFrame(heads), pd.DataFrame(labels))
    r = link.iloc[0]
    assert r["n_layers"] == 8 and r["estimate"] == pytest.approx(0.1, abs=0.01) and r["p"] == pytest.approx(2 / 256)
    assert r["p_kind"] == "exact sign-flip (all 2^8 sign patterns of 8 layers)" and r["ci_low"] > 0.09
    few = pe.taxonomy_link(pd.DataFrame(heads)[lambda d: d["layer"] < 2], pd.DataFrame(labels))
    assert few.iloc[0]["n_layers"] == 2 and np.isnan(few.iloc[0]["p"])  # 2 layers: no test
    with pytest.raises(ValueError, match="label"):
        pe.taxonomy_link(pd.DataFrame(heads), pd.DataFrame(labels).drop(columns="label"))
    with pytest.raises(ValueError, match="not a file"):
        pe.Config(taxonomy="/nonexistent/heads.csv")


def test_gap_corruption_defaults_to_the_trained_context():
    c = pe.corruption_of(pe.Config(corruption="gap"), n_ctx=2048)
    assert c.gap == 2048 and "gap of 2048" in str(c)
    assert "null control" in str(pe.corruption_of(pe.Config(corruption="shift"), 2048))
    two = pe.Config(corruption="swaps, gap")
    assert list(pe.corruptions_of(two, 2048)) == ["swaps", "gap"] and pe.corruption_of(two, 2048, "gap").gap == 2048
    with pytest.raises(ValueError, match="2 corruptions"):
        pe.corruption_of(two, 2048)
    with pytest.raises(ValueError, match="not among"):
        pe.corruption_of(two, 2048, "shift")


def test_several_corruptions_sweep_the_same_windows_and_equal_their_single_runs(sharp):
    """swaps,shift in one run = each alone (same windows, one shared clean run); the null shift does no damage, so
    its recovery is undefined and its maps show effects in nats; per-corruption tables and sentences."""
    kw = {**OPTS, "quantities": ("rot_q",), "directions": ("denoising",), "n_seq": 4}
    both = pe.run(sharp, corpus=tm.token_corpus(14), corruption="swaps,shift", **kw)
    for c in ("swaps", "shift"):
        alone = pe.run(sharp, corpus=tm.token_corpus(14), corruption=c, **kw)
        for name in ("heads", "layers", "baselines", "twin"):
            pd.testing.assert_frame_equal(both[name][both[name]["corruption"] == c].reset_index(drop=True),
                                          alone[name], check_exact=False, rtol=1e-9, atol=1e-12)
        assert both.meta["damage"][c] == alone.meta["damage"][c]
    assert list(both.meta["corruption"]) == ["swaps", "shift"] and list(dict.fromkeys(both["heads"]["corruption"])) \
        == ["swaps", "shift"]
    sh = both.meta["damage"]["shift"]
    assert abs(sh["mean"]) < 1e-5 and not sh["detected"]
    assert both["heads"].loc[both["heads"]["corruption"] == "shift", "recovery"].isna().all()
    sec = pe.render(both)
    assert len(sec.figures) == 2 and [cap.split("(")[1].split(")")[0] for _, cap in sec.figures] == ["swaps", "shift"]
    assert "uniform shift by 1000 (null control) raised the target NLL by" in sec.verdict
    assert "no damage distinguishable from 0, so no recovery is defined" in sec.verdict
    top = pe.ranked(both["heads"], k=2)
    assert top.columns[0] == "corruption" and list(top["corruption"]) == ["swaps"] * 2 + ["shift"] * 2


def test_several_maps_share_one_colour_scale():
    from posgen_tl.plot.patching import plot_patching_maps

    a = pd.DataFrame([dict(layer=la, head=h, recovery=np.nan, effect=0.01 * (la - h), significant=False)
                      for la in range(3) for h in range(2)])
    fig = plot_patching_maps({"left": a, "right": a.assign(effect=a["effect"] * 5)}, n_layers=3, ncols=2)
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == ["left", "right"]
    assert {ax.images[0].get_clim() for ax in panels} == {(-0.1, 0.1)}  # the larger map's range, shared
    assert "recovery undefined" in fig.axes[-1].get_ylabel()
    with pytest.raises(ValueError, match="no map"):
        plot_patching_maps({})


def test_a_result_saved_before_several_corruptions_still_loads_and_renders(result, tmp_path):
    """The old layout (no corruption column; meta corruption a string, damage of the one corruption) is upgraded on
    load and in render to today's, with the same numbers."""
    old_tables = {k: v.drop(columns="corruption") for k, v in result.tables.items()}
    m = dict(result.meta)
    d = m["damage"]["swaps"]
    m.update(corruption=m["corruption"]["swaps"], damage={k: d[k] for k in ("mean", "ci_low", "ci_high")},
             damage_detected=d["detected"], twin_damage={k: m["twin_damage"]["swaps"][k]
                                                          for k in ("mean", "ci_low", "ci_high")})
    old = pe.Result(old_tables, result.config, m)
    pe.save(old, tmp_path)
    back = pe.load(tmp_path)
    assert back.meta["damage"] == result.meta["damage"] and back.meta["corruption"] == result.meta["corruption"]
    pd.testing.assert_frame_equal(back["heads"], result["heads"], check_dtype=False, rtol=1e-12)
    assert pe.render(old).verdict == pe.render(result).verdict
    assert pe.upgrade(result) is result  # today's Results unchanged


def test_a_study_recomputes_its_statistics_from_its_kept_rows(sharp, tmp_path):
    """restat: the same numbers from the kept units (no forward), the run's provenance kept, the recomputation
    recorded, and a resumed run's kept batches said on its page."""
    import json

    from posgen_tl.experiments import registry

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, text in enumerate(tm.token_corpus(14)):
        (docs / f"d{i:02d}.txt").write_text(text)
    opts = {k: v for k, v in OPTS.items() if k != "progress"}
    cfg = pe.Config(**{**opts, "quantities": ("rot_q",), "directions": ("denoising",)}, corpus=str(docs))
    out = tmp_path / "study"
    registry.run_study("patching", cfg, out, model=sharp, command="posgen-tl study patching …")
    before = json.loads((out / "patching.json").read_text())
    heads = pd.read_csv(out / "patching_heads.csv")
    md = registry.restat_study("patching", out, command="python scripts/restat.py patching study --kept-batches 1",
                               kept_batches=1)
    after = json.loads((out / "patching.json").read_text())
    pd.testing.assert_frame_equal(pd.read_csv(out / "patching_heads.csv"), heads, check_exact=False, rtol=1e-12)
    assert {k: after[k] for k in ("command", "git_commit", "wall_seconds", "config")} == \
        {k: before[k] for k in ("command", "git_commit", "wall_seconds", "config")}
    assert after["restat"]["command"].endswith("--kept-batches 1") and after["results"]["meta"]["kept_batches"] == 1
    text = md.read_text()
    assert "- statistics recomputed from the kept rows: `python scripts/restat.py patching study --kept-batches 1`" \
        in text and "Resumed: 1 batches were kept from an earlier, interrupted run" in text
    with pytest.raises(ValueError, match="keeps no per-document rows"):
        registry.restat_study("exactness", out, command="x")


def test_the_report_route_measures_the_twin_of_the_experiments_own_seed(sharp, tmp_path):
    """Through the report's route (registry.inputs with the run's shared twin), a patching config with seed 3 in a run
    of seed 0 measures the seed-3 twin: the same table as a run that builds its own twin from its config."""
    from posgen_tl.experiments import registry
    from posgen_tl.report.context import Context, OutFolder

    opts = {**OPTS, "quantities": ("rot_q",), "directions": ("denoising",), "layers": (2,), "seed": 3}
    ctx = Context(sharp, OutFolder(tmp_path), "tiny", seed=0)
    kw = registry.inputs("patching", twin=ctx.twin)
    routed = pe.run(sharp, corpus=tm.token_corpus(14), **kw, **opts)
    own = pe.run(sharp, corpus=tm.token_corpus(14), **opts)
    pd.testing.assert_frame_equal(routed["twin"], own["twin"], check_exact=True)
    assert set(ctx._twins) == {3}  # the run's own seed-0 twin was never needed
