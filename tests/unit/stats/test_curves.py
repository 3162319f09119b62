"""posgen_tl.stats.curves: per-document curves, AUC from p = 0, slope weights, the curve summary."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_fixtures import (
    FRACS,
    clustered_rows,
    curve_per_sequence,
    doc_means,
    loop_bootstrap,
    t_ci,
    trapezoid_auc,
)

from posgen_tl.stats.curves import (
    auc_weights,
    curve_auc,
    curve_summary,
    doc_bootstrap,
    document_units,
    slope_weights,
    unit_summary,
)
from posgen_tl.stats.inference import unit_slopes

#: swap fractions on a 0.001 grid: distinct fractions closer than that (hypothesis found 1 − 1.1e-16 next to 1.0)
#: give a point a weight below the AUC's float resolution, where "raising it raises the AUC" cannot be seen
fracs_st = st.lists(st.integers(1, 1000), min_size=1, max_size=7, unique=True).map(lambda v: [x / 1000 for x in sorted(v)])


def test_weights_of_the_study_grid():
    """The grid p ∈ {0, 2, 5, 10, 20} %: AUC weights all positive; the slope's negative at small p
    (the issue's −2.12, −0.94, +1.02, +4.94)."""
    np.testing.assert_allclose(auc_weights(FRACS), [0.025, 0.04, 0.075, 0.05])
    np.testing.assert_allclose(slope_weights(FRACS), [-2.116, -0.940, 1.019, 4.937], atol=5e-4)
    y = np.random.default_rng(0).normal(size=(5, 4))
    np.testing.assert_allclose(y @ slope_weights(FRACS), unit_slopes([0, *FRACS], np.column_stack([np.zeros(5), y])))
    # more damage at p = 2 % LOWERS the slope but raises the AUC
    bump = np.array([[0.05, 0, 0, 0]])
    assert (bump @ slope_weights(FRACS))[0] < 0 < curve_auc(FRACS, bump)[0]


@settings(max_examples=60, deadline=None)
@given(fracs_st, st.floats(-3, 3), st.floats(-3, 3))
def test_auc_of_constant_and_linear_curves(fr, c, k):
    p = np.asarray(fr)
    # constant c at every p > 0 (ΔNLL(0) = 0 by construction): c·(p_max − p_1/2)
    assert curve_auc(p, np.full((1, p.size), c))[0] == pytest.approx(c * (p[-1] - p[0] / 2), abs=1e-12)
    # linear through the origin: the trapezoid is exact, k·p_max²/2
    assert curve_auc(p, (k * p)[None])[0] == pytest.approx(k * p[-1] ** 2 / 2, abs=1e-12)
    assert np.all(auc_weights(p) > 0)


@settings(max_examples=40, deadline=None)
@given(fracs_st, st.integers(0, 6), st.floats(1e-3, 2.0))
def test_auc_is_monotone(fr, i, bump):
    """Raising ΔNLL at ANY fraction raises the AUC (positive weights); the slope has no such property."""
    p = np.asarray(fr)
    y = np.random.default_rng(len(fr)).normal(size=(1, p.size))
    y2 = y.copy()
    y2[0, i % p.size] += bump
    assert curve_auc(p, y2)[0] > curve_auc(p, y)[0]


def test_document_units_against_independent_aggregation():
    rows = clustered_rows(seed=1, n_docs=6, per_doc=3)
    rows = rows[~((rows["doc"] == 2) & (rows["seq"] % 3 == 0))]  # unequal documents: 2 or 3 sequences
    u = document_units(rows)
    assert u.attrs["fracs"] == list(FRACS)
    for c in ("none", "destroy", "C1"):
        y, doc = curve_per_sequence(rows, c)
        got = u[(u["condition"] == c)]
        auc = got[got["estimator"] == "auc"].set_index("doc")
        np.testing.assert_allclose(auc["value"].to_numpy(), doc_means(trapezoid_auc(y), doc), rtol=1e-12)
        np.testing.assert_array_equal(auc["n_seqs"].to_numpy(), np.bincount(doc))
        for j, f in enumerate(FRACS):
            d = got[(got["estimator"] == "dnll") & (got["frac"] == f)]
            np.testing.assert_allclose(d["value"].to_numpy(), doc_means(y[:, j], doc), rtol=1e-12)
        sl = got[got["estimator"] == "slope"]["value"].to_numpy()
        np.testing.assert_allclose(sl, doc_means(unit_slopes([0, *FRACS], np.column_stack([np.zeros(len(y)), y])), doc))
        g = rows[rows["condition"] == c].groupby("seq")
        dmg = (g["clean_nll"].mean() - g["base_clean_nll"].mean()).to_numpy()
        np.testing.assert_allclose(got[got["estimator"] == "damage"]["value"].to_numpy(),
                                   doc_means(dmg, g["doc"].first().to_numpy()), atol=1e-12)  # fmt: skip


def test_summary_intervals_are_over_documents():
    """MUTATION CHECK at the table: 16 documents × 4 sequences with a strong document effect. The
    summary's bootstrap CI must match an independent DOCUMENT bootstrap (tolerance 6 % of the width,
    Monte Carlo error ≈ 1 %) and be far from a SEQUENCE bootstrap; its t-interval is exact."""
    rows = clustered_rows(seed=2)
    s = curve_summary(rows).set_index(["condition", "estimator", "frac"])
    y, doc = curve_per_sequence(rows, "destroy")
    checks = {("auc", np.nan): trapezoid_auc(y), **{("dnll", f): y[:, j] for j, f in enumerate(FRACS)}}
    for (est, f), per_seq in checks.items():
        row = s.loc[("destroy", est, f)]
        units = doc_means(per_seq, doc)
        lo, hi = loop_bootstrap(units)
        width = hi - lo
        assert row["ci_level"] == 0.95 and "over documents" in row["ci_method"]
        assert abs(row["ci_low"] - lo) < 0.06 * width and abs(row["ci_high"] - hi) < 0.06 * width, (est, f)
        slo, shi = loop_bootstrap(per_seq)  # what resampling sequences would print
        assert abs(row["ci_low"] - slo) + abs(row["ci_high"] - shi) > 0.4 * width, "fixture must discriminate"
        np.testing.assert_allclose([row["t_low"], row["t_high"]], t_ci(units), rtol=1e-10)
        assert row["estimate"] == pytest.approx(units.mean()) and row["n_docs"] == 16 and row["n_seqs"] == 64
        assert "exploratory" in row["label"]


def test_summary_estimate_is_mean_of_document_means():
    rows = clustered_rows(seed=3, n_docs=5, per_doc=4)
    rows = rows[(rows["doc"] != 0) | (rows["seq"] == 0)]  # document 0 has one sequence
    s = unit_summary(document_units(rows), n_boot=500).set_index(["condition", "estimator", "frac"])
    y, doc = curve_per_sequence(rows, "C1")
    assert s.loc[("C1", "dnll", 0.1), "estimate"] == pytest.approx(doc_means(y[:, 2], doc).mean())
    assert s.loc[("C1", "dnll", 0.1), "estimate"] != pytest.approx(y[:, 2].mean())  # not the pooled mean


def test_doc_bootstrap_columns_and_degenerate_input():
    x = np.random.default_rng(0).normal(size=(30, 3))
    lo, hi = doc_bootstrap(x, n_boot=4000, seed=1)
    for j in range(3):
        blo, bhi = loop_bootstrap(x[:, j], n_boot=4000, seed=7)
        assert abs(lo[j] - blo) < 0.1 * (bhi - blo) and abs(hi[j] - bhi) < 0.1 * (bhi - blo)
    assert doc_bootstrap(np.array([[1.5, 2.0]]))[0].tolist() == [1.5, 2.0]
    with pytest.raises(ValueError, match="non-finite"):
        doc_bootstrap(np.array([1.0, np.nan, 2.0]))


def test_bad_rows_raise():
    rows = clustered_rows(seed=4, n_docs=4, per_doc=2)
    with pytest.raises(ValueError, match=r"rows lack column\(s\) \['condition'\].*intervention"):
        document_units(rows.rename(columns={"condition": "intervention"}))
    bad = rows.copy()
    bad.loc[(bad["frac"] == 0) & (bad["seq"] == 3), "delta"] = 0.1
    with pytest.raises(ValueError, match="at p = 0 must be 0 by construction"):
        document_units(bad)
    with pytest.raises(ValueError, match="every sequence needs every frac"):
        document_units(rows[~((rows["seq"] == 5) & (rows["frac"] == 0.1))])
    two = rows.copy()
    two.loc[(two["seq"] == 1) & (two["frac"] == 0.2), "doc"] = 3
    with pytest.raises(ValueError, match="several document ids"):
        document_units(two)
    nan = rows.copy()
    nan.loc[7, "delta"] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        document_units(nan)
    with pytest.raises(ValueError, match="no frac > 0"):
        document_units(rows[rows["frac"] == 0])
    with pytest.raises(ValueError, match="strictly increasing"):
        curve_auc([0.1, 0.05], np.zeros((1, 2)))
    assert isinstance(document_units(rows.drop(columns=["clean_nll"])), pd.DataFrame)  # damage is optional
