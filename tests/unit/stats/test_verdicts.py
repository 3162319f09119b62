"""posgen_tl.stats.verdicts: contrast tables, interaction and equivalence, family adjustment."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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
from stats_simdata import entry_units

from posgen_tl.stats.curves import document_units
from posgen_tl.stats.verdicts import equivalence, family_adjust, interaction_contrast, tolerance_contrasts

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


# ----------------------------------------------------------------------------- the verdict


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


