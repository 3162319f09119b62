"""posgen_tl.stats.verdicts: contrast tables, damage equivalence / adjustment, the v2 verdict rule."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps
from stats_fixtures import (
    FRACS,
    brute_holm,
    brute_sign_flip,
    clustered_rows,
    curve_per_sequence,
    doc_means,
    loop_bootstrap,
    t_ci,
    trapezoid_auc,
)
from stats_simdata import CONTROLS, entry_units, family_of

from posgen_tl.stats.curves import document_units
from posgen_tl.stats.inference import holm
from posgen_tl.stats.verdicts import (
    Family,
    FamilyEntry,
    causal_verdict,
    control_draws,
    damage_adjusted_contrast,
    damage_equivalence,
    equivalence,
    family_adjust,
    interaction_contrast,
    tolerance_contrasts,
)

KEYS = ("model", "layers", "condition")


def fixture_units(seed=2, **kw):
    rows = clustered_rows(seed=seed, **kw).assign(model="m", layers="L1-2")
    return rows, document_units(rows, by=KEYS)


# ----------------------------------------------------------------------------- contrast tables


def test_per_fraction_and_auc_intervals_are_over_documents():
    """MUTATION CHECK at the table (16 documents × 4 sequences, strong document effect): every CI
    and p of destroy − none in ``tolerance_contrasts`` equals an independent document-level
    computation (bootstrap within 6 % of its width; t-interval, exact sign-flip p and Holm over the
    fractions exactly) and is far from what resampling sequences would print."""
    rows, units = fixture_units()
    t = tolerance_contrasts(units, family_size=4).set_index(["contrast", "estimator", "frac"])
    yd, doc = curve_per_sequence(rows, "destroy")
    yn, _ = curve_per_sequence(rows, "none")
    d = yd - yn
    stats = {("auc", np.nan): trapezoid_auc(d), **{("dnll", f): d[:, j] for j, f in enumerate(FRACS)}}
    ps = []
    for (est, f), per_seq in stats.items():
        r = t.loc[("destroy − none", est, f)]
        units_d = doc_means(per_seq, doc)
        lo, hi = loop_bootstrap(units_d)
        w = hi - lo
        assert abs(r["ci_low"] - lo) < 0.06 * w and abs(r["ci_high"] - hi) < 0.06 * w, (est, f)
        slo, shi = loop_bootstrap(per_seq)
        assert abs(r["ci_low"] - slo) + abs(r["ci_high"] - shi) > 0.4 * w, "fixture must discriminate"
        np.testing.assert_allclose([r["t_low"], r["t_high"]], t_ci(units_d), rtol=1e-10)
        assert r["p"] == pytest.approx(brute_sign_flip(units_d), abs=1e-12)
        assert r["p_kind"] == "exact sign-flip (all 2^16 sign patterns of 16 documents)"
        assert r["estimate"] == pytest.approx(units_d.mean()) and r["n_docs"] == 16 and r["n_seqs"] == 64
        assert r["ci_level"] == 0.95 and "exploratory" in r["label"]
        if est == "dnll":
            ps.append(r["p"])
    holm_got = [t.loc[("destroy − none", "dnll", f), "p_holm"] for f in FRACS]
    np.testing.assert_allclose(holm_got, brute_holm(ps), rtol=1e-12)
    assert np.isnan(t.loc[("destroy − none", "auc", np.nan), "p_holm"])  # adjusted by the verdict, not here
    assert t.loc[("destroy − none", "auc", np.nan), "mde_alpha"] == pytest.approx(0.05 / 4)


def test_controls_minus_none_are_holm_adjusted_over_controls():
    rows, units = fixture_units(conditions=("none", "destroy", "C1", "C2"), damage={"C2": 0.5})
    t = tolerance_contrasts(units, estimators=("auc",), n_boot=200)
    self_rows = t[t["contrast"].isin(["C1 − none", "C2 − none"])]
    np.testing.assert_allclose(self_rows["p_holm"], brute_holm(self_rows["p"].to_numpy()))
    assert set(t["contrast"]) == {"destroy − none", "destroy − C1", "destroy − C2", "C1 − none", "C2 − none"}


def test_contrasts_without_entry_keys():
    """Tolerance rows of one model (e.g. T1 vs T2): no model/layers columns, any pair of conditions."""
    rows, _ = fixture_units(conditions=("none", "destroy"))
    units = document_units(rows.rename(columns={"condition": "mode"}).replace({"mode": {"none": "T2", "destroy": "T1"}})
                           .rename(columns={"mode": "condition"}), by=("condition",))  # fmt: skip
    t = tolerance_contrasts(units, keys=(), pairs=[("T1", "T2")], n_boot=300).set_index(["estimator", "frac"])
    assert t.loc[("auc", np.nan), "holm_scope"].startswith("none: one AUC test per contrast")
    assert t.loc[("dnll", 0.1), "holm_scope"] == "Holm over the 4 fractions of this contrast"
    assert t.loc[("auc", np.nan), "mde_alpha"] == 0.05


def test_damage_equivalence_against_independent_tost_and_fieller():
    """TOST p from scipy's one-sided t-tests; the 90 % interval = the set of ratios r that a paired
    t-test of x − r·y does not reject at 5 % one-sided on either side (grid scan); damages are on
    document means (a sequence-level mutation changes both)."""
    rows, units = fixture_units(seed=5, damage={"C1": 0.47})
    t = damage_equivalence(units, margin_rel=0.10).set_index("control")
    g = rows[rows["frac"] == 0].groupby(["condition", "seq"])
    dmg = (g["clean_nll"].mean() - g["base_clean_nll"].mean()).unstack(0)
    doc = rows.groupby("seq")["doc"].first().loc[dmg.index].to_numpy()
    x, y = doc_means(dmg["C1"].to_numpy(), doc), doc_means(dmg["destroy"].to_numpy(), doc)
    p_lo = sps.ttest_1samp(x - 0.9 * y, 0, alternative="greater").pvalue
    p_hi = sps.ttest_1samp(x - 1.1 * y, 0, alternative="less").pvalue
    r = t.loc["C1"]
    assert r["p"] == pytest.approx(max(p_lo, p_hi), rel=1e-9) and r["ci_level"] == pytest.approx(0.9)
    grid = np.linspace(0.5, 1.5, 20001)

    def not_rejected(a, b):  # two-sided paired t-test of a − q·b at 10 % (= both one-sided at 5 %), every q
        d = a[None, :] - grid[:, None] * b[None, :]
        t = d.mean(1) / (d.std(1, ddof=1) / np.sqrt(a.size))
        return grid[2 * sps.t.sf(np.abs(t), a.size - 1) >= 0.10]

    keep = not_rejected(x, y)
    assert r["ci_low"] + 1 == pytest.approx(min(keep), abs=1e-4) and r["ci_high"] + 1 == pytest.approx(max(keep), abs=1e-4)
    assert r["estimate"] == pytest.approx(x.mean() / y.mean() - 1)
    keep_s = not_rejected(dmg["C1"].to_numpy(), dmg["destroy"].to_numpy())  # sequences as units: another interval
    assert abs(min(keep_s) - min(keep)) + abs(max(keep_s) - max(keep)) > 0.2 * (max(keep) - min(keep))
    assert r["matched"] == (r["p"] < 0.05) == (0.9 < r["ci_low"] + 1 and r["ci_high"] + 1 < 1.1)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.6, 1.4), st.floats(0.02, 0.5))
def test_tost_match_iff_fieller_inside_margin(seed, ratio, spread):
    rng = np.random.default_rng(seed)
    u = entry_units(rng, ratio={"C1": ratio}, ratio_sd=spread)
    r = damage_equivalence(u, margin_rel=0.10, controls=["C1"]).iloc[0]
    inside = -0.10 < r["ci_low"] and r["ci_high"] < 0.10
    assert r["matched"] == inside


def test_one_and_a_half_times_the_damage_is_not_matched():
    """The issue's simulation: CI overlap called a 1.5× control 'matched' 87 % of the time at n = 32."""
    rng = np.random.default_rng(8)
    matched = [damage_equivalence(entry_units(rng, ratio={"C1": 1.5}), margin_rel=0.10, controls=["C1"])["matched"].iloc[0]
               for _ in range(40)]  # fmt: skip
    assert sum(matched) == 0


def test_damage_adjusted_contrast_against_scipy():
    rng = np.random.default_rng(3)
    u = entry_units(rng, gamma=0.03, ratio={"C2": 0.6}, n_docs=32)
    r = damage_adjusted_contrast(u, controls=["C2"], n_boot=4000).iloc[0]
    w = u.pivot_table(index="doc", columns=["estimator", "condition"], values="value")
    y = (w[("auc", "destroy")] - w[("auc", "C2")]).to_numpy()
    g = (w[("damage", "destroy")] - w[("damage", "C2")]).to_numpy()
    fit = sps.linregress(g, y)
    tc = sps.t.ppf(0.975, 30)
    assert r["estimate"] == pytest.approx(fit.intercept, rel=1e-9)
    np.testing.assert_allclose([r["t_low"], r["t_high"]], [fit.intercept - tc * fit.intercept_stderr,
                                                           fit.intercept + tc * fit.intercept_stderr], rtol=1e-9)  # fmt: skip
    assert r["p"] == pytest.approx(2 * sps.t.sf(abs(fit.intercept / fit.intercept_stderr), 30), rel=1e-6)
    boot = []
    brng = np.random.default_rng(99)
    for _ in range(4000):
        i = brng.integers(0, 32, 32)
        if np.ptp(g[i]) > 0:
            boot.append(sps.linregress(g[i], y[i]).intercept)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    assert abs(r["ci_low"] - lo) < 0.08 * (hi - lo) and abs(r["ci_high"] - hi) < 0.08 * (hi - lo)
    assert r["gap_slope"] == pytest.approx(fit.slope)


# ----------------------------------------------------------------------------- the verdict


def verdict_of(units, **fam):
    fam = dict(dict(margin=0.10, redrawn=False), **fam)
    family = family_of(n_entries=1, n_docs=int(units["doc"].nunique()), **fam)
    units = units.assign(model=family.entries[0].model, layers=family.entries[0].layers)
    return causal_verdict(units, family, n_boot=200)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(CONTROLS + ("none",)), st.floats(-0.02, 0.02),
       st.sampled_from(["tost_or_adjust", "adjust", "tost"]))  # fmt: skip
def test_a_null_never_depends(seed, twin, gamma, rule):
    """destroy identical (AUC and damage, document by document) to ``none`` or to one control: that
    required contrast is exactly 0, so the verdict can never be "depends", whatever the rest."""
    rng = np.random.default_rng(seed)
    u = entry_units(rng, gamma=gamma, delta={"destroy": 0.02, "C1": -0.01})
    src = u[u["condition"] == twin].assign(condition="destroy")
    if twin == "none":
        src.loc[src["estimator"] == "damage", "value"] += 1e-9  # keep a positive destroy damage
    u = pd.concat([u[u["condition"] != "destroy"], src], ignore_index=True)
    v = verdict_of(u, damage_rule=rule)
    assert not v.verdicts["verdict"].iloc[0].startswith("depends")


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(-0.03, 0.03), st.floats(-0.02, 0.02))
def test_iut_p_is_the_max_of_the_required_p(seed, gamma, effect):
    rng = np.random.default_rng(seed)
    v = verdict_of(entry_units(rng, gamma=gamma, delta={"destroy": effect, "C3": -effect}))
    c = v.components
    req = c["p_iut"].dropna()
    counted = c[c["role"].str.startswith("required")]
    assert len(req) == len(counted)
    expect = req.max() if (counted["control"] != "").any() else 1.0
    assert v.verdicts["p"].iloc[0] == pytest.approx(expect)
    wrong_sign = counted[~counted["same_direction"]]
    assert (wrong_sign["p_iut"] == 1.0).all()
    opp = c[c["role"].str.startswith("not counted")]
    assert (opp["moves_by_itself"] & (np.sign(opp["self_estimate"]) != np.sign(c["estimate"].iloc[0]))).all()


def test_control_moving_opposite_is_not_evidence():
    """destroy raises the AUC a little; C1, C3 and C4 LOWER it by themselves (their own effect) so
    destroy − Ck is large — yet only C2 (which does not move) may count, and it equals destroy."""
    rng = np.random.default_rng(21)
    u = entry_units(rng, gamma=0.0, delta={"destroy": 0.004, "C1": -0.01, "C3": -0.015, "C4": -0.01, "C2": 0.004})
    v = verdict_of(u)
    row, comp = v.verdicts.iloc[0], v.components.set_index("control")
    assert row["excluded_controls"] == "C1,C3,C4" and row["counted_controls"] == "C2"
    assert row["verdict"] == "no evidence" and "opposite to destroy: not counted" in row["label"]
    assert comp.loc["C1", "p"] < 1e-6 and np.isnan(comp.loc["C1", "p_iut"])  # significant, yet not counted
    # all four controls moving against destroy: no control left, never "depends"
    u2 = entry_units(rng, gamma=0.0, delta={"destroy": 0.004, **{c: -0.01 for c in CONTROLS}})
    r2 = verdict_of(u2).verdicts.iloc[0]
    assert r2["counted_controls"] == "" and r2["p"] == 1.0 and "no control left" in r2["label"]


def test_planted_effect_depends_and_family_adjustment():
    rng = np.random.default_rng(5)
    fam = family_of(n_entries=4, n_docs=32, redrawn=False)
    effects = [0.012, 0.0, 0.012, 0.0]
    u = pd.concat([entry_units(rng, model=e.model, layers=e.layers, gamma=0.01, delta={"destroy": d}) for e, d in
                   zip(fam.entries, effects)], ignore_index=True)  # fmt: skip
    v = causal_verdict(u, fam, n_boot=200).verdicts
    np.testing.assert_allclose(v["p_holm"], holm(v["p"].to_numpy()))
    assert v["verdict"].tolist() == ["depends", "no evidence", "depends", "no evidence"]
    assert (v["mde_alpha"] == 0.05 / 4).all() and "Holm over the 4 entries" in v["p_adj_method"].iloc[0]
    order = tuple(e.key for e in reversed(fam.entries))
    gate = causal_verdict(u, Family(fam.entries, 0.10, False, order=order), n_boot=200).verdicts
    # fixed sequence starting with a null entry: it stops there, nothing after it can pass
    assert not gate["verdict"].str.startswith("depends").any()
    assert (gate["mde_alpha"] == 0.05).all() and "fixed-sequence" in gate["p_adj_method"].iloc[0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_family_adjustments_are_monotone(p, rnd):
    p = np.asarray(p)
    keys = [f"e{i}" for i in range(p.size)]
    h, _ = family_adjust(p, "holm", keys)
    order = np.argsort(p)
    assert np.all(np.diff(h[order]) >= -1e-15) and np.all(h >= p - 1e-15) and np.all(h <= 1)
    seq = keys.copy()
    rnd.shuffle(seq)
    g, _ = family_adjust(p, seq, keys)
    along = np.array([g[keys.index(k)] for k in seq])
    assert np.all(np.diff(along) >= 0) and np.all(g >= p)


def test_exploratory_below_32_documents():
    rng = np.random.default_rng(2)
    v = verdict_of(entry_units(rng, n_docs=20, gamma=0.01, delta={"destroy": 0.02})).verdicts.iloc[0]
    assert v["verdict"] == "depends (exploratory)" and "20 documents < 32" in v["label"]


def test_interaction_contrast_is_paired():
    rng = np.random.default_rng(4)
    a = entry_units(rng, model="m", layers="A", delta={"destroy": 0.01})
    b = a.assign(layers="B")
    b.loc[(b["condition"] == "destroy") & (b["estimator"] == "auc"), "value"] -= 0.004  # planted difference
    t = interaction_contrast(pd.concat([a, b]), {"model": "m", "layers": "A"}, {"model": "m", "layers": "B"},
                             estimators=("auc",), n_boot=500).iloc[0]  # fmt: skip
    assert t["estimate"] == pytest.approx(0.004) and t["p"] < 1e-6 and t["ci_low"] == pytest.approx(0.004)
    c = b[b["doc"] < 31]
    with pytest.raises(ValueError, match="not on the same documents"):
        interaction_contrast(pd.concat([a, c]), {"model": "m", "layers": "A"}, {"model": "m", "layers": "B"})


def test_equivalence_needs_a_declared_margin():
    doc = np.repeat(np.arange(16), 2)
    x = np.random.default_rng(0).normal(0, 0.01, 32)
    r = equivalence(x, doc=doc, margin=0.05, margin_source="test config").iloc[0]
    assert r["equivalent"] and r["ci_level"] == pytest.approx(0.9) and "90%" in r["ci_method"]
    np.testing.assert_allclose([r["ci_low"], r["ci_high"]], t_ci(doc_means(x, doc), level=0.9), rtol=1e-10)
    with pytest.raises(ValueError, match="margin not declared"):
        equivalence(x, doc=doc, margin=None, margin_source="x")
    with pytest.raises(ValueError, match="margin_source"):
        equivalence(x, doc=doc, margin=0.05, margin_source="")


# ----------------------------------------------------------------------------- bad input


def test_bad_family_input_raises():
    rng = np.random.default_rng(0)
    fam = family_of(n_entries=1, n_docs=32, redrawn=False)
    u = entry_units(rng, model="m0", layers="L0")
    with pytest.raises(ValueError, match="contrast destroy − C3 cannot be formed.*'C3'"):
        causal_verdict(u[u["condition"] != "C3"], fam, n_boot=100)
    with pytest.raises(ValueError, match="damage_margin_rel must be declared"):
        Family(fam.entries, None, False)
    with pytest.raises(ValueError, match="claim_family.damage_margin_rel not declared"):
        Family.from_config(dict(entries=[dict(model="m0", layers="L0", controls=["C1"], n_docs=32)],
                                controls_redrawn_per_document=True))  # fmt: skip
    with pytest.raises(ValueError, match="declared n_docs = 40"):
        causal_verdict(u, Family((FamilyEntry("m0", "L0", CONTROLS, 40),), 0.1, False), n_boot=100)
    with pytest.raises(ValueError, match="not declared in the family"):
        causal_verdict(pd.concat([u, u.assign(layers="L9")]), fam, n_boot=100)
    with pytest.raises(ValueError, match="order must be"):
        Family(fam.entries, 0.1, False, order=("m0 L0", "m0 L0"))
    with pytest.raises(ValueError, match="damage margin not declared"):
        damage_equivalence(u, margin_rel=None)


def test_draws_must_match_the_declaration():
    rng = np.random.default_rng(0)
    u = entry_units(rng, model="m0", layers="L0")
    one = u[["model", "layers", "condition", "doc"]].drop_duplicates().assign(draw=7)
    per_doc = one.assign(draw=one["doc"] + 100)
    redrawn = family_of(n_entries=1, redrawn=True)
    legacy = family_of(n_entries=1, redrawn=False)
    with pytest.raises(ValueError, match="control C1 has 1 distinct draw.*controls_redrawn_per_document=True"):
        causal_verdict(u, redrawn, draws=one, n_boot=100)
    with pytest.raises(ValueError, match="no draws were given"):
        causal_verdict(u, redrawn, n_boot=100)
    with pytest.raises(ValueError, match="controls_redrawn_per_document=False"):
        causal_verdict(u, legacy, draws=per_doc, n_boot=100)
    ok = causal_verdict(u, redrawn, draws=per_doc, n_boot=100).verdicts["label"].iloc[0]
    assert "drawn afresh per document" in ok
    leg = causal_verdict(u, legacy, n_boot=100).verdicts["label"].iloc[0]
    assert "ONE draw each" in leg
    rows = per_doc.assign(frac=0.0)
    assert control_draws(rows).shape[0] == per_doc.shape[0] and control_draws(rows.drop(columns="draw")) is None


def test_three_documents_leave_the_adjusted_contrast_unidentified():
    """Below 4 documents the damage-adjusted contrast has no residual df: the entry gets no verdict
    "depends" (the component says why), instead of an exception in the middle of a report."""
    rng = np.random.default_rng(3)
    v = verdict_of(entry_units(rng, n_docs=3, gamma=0.01, delta={"destroy": 0.5}), damage_rule="adjust")
    row = v.verdicts.iloc[0]
    assert row["verdict"] == "no evidence (exploratory)" and row["p"] == 1.0
    assert "not identified (fewer than 4 documents)" in row["label"]
    adj = v.components[v.components["component"].str.endswith("at equal damage")]
    assert len(adj) == len(CONTROLS) and adj["estimate"].isna().all() and (adj["p_iut"] == 1.0).all()
