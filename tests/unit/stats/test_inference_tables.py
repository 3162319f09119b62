"""posgen_tl.stats.inference: the label of every p (exact / Monte Carlo) and the legacy
``verdict_table``'s intervals checked at the table against independent DOCUMENT-level computations."""

from __future__ import annotations

import numpy as np
import pytest
from stats_fixtures import doc_means, loop_bootstrap, t_ci

from posgen_tl.stats.inference import Contrast, sign_flip, sign_flip_test, t1_t2_equivalence, tost, verdict_table


def dp_sign_flip(x: np.ndarray) -> float:
    """Exact two-sided sign-flip p for INTEGER data by dynamic programming over the sums (independent)."""
    off = int(np.abs(x).sum())
    counts = np.zeros(2 * off + 1, dtype=object)
    counts[off] = 1
    for v in x.astype(int):
        v = abs(v)
        if v == 0:  # both signs give the same sum
            counts = 2 * counts
            continue
        new = np.zeros_like(counts)
        new[: counts.size - v] += counts[v:]  # sign −: sum s → s − v
        new[v:] += counts[: counts.size - v]  # sign +: sum s → s + v
        counts = new
    sums = np.arange(-off, off + 1)
    return float(counts[np.abs(sums) >= abs(int(x.sum()))].sum() / 2 ** x.size)


@pytest.mark.parametrize("n", [25, 33, 40])
def test_exact_up_to_40_documents_against_dynamic_programming(n):
    x = np.random.default_rng(n + 1).integers(-3, 6, n).astype(float)
    assert 1e-6 < dp_sign_flip(x) < 0.99  # a non-trivial p
    p, kind = sign_flip(x)
    assert kind == f"exact sign-flip (all 2^{n} sign patterns of {n} documents)"
    assert p == pytest.approx(dp_sign_flip(x), rel=1e-12, abs=1e-15)
    assert sign_flip_test(x) == p


def test_monte_carlo_is_labelled_with_its_floor():
    x = np.abs(np.random.default_rng(0).normal(size=41)) + 1
    p, kind = sign_flip(x)
    assert kind == "Monte Carlo sign-flip (20000 draws; floor 1/(20000+1) = 5.0e-05) over 41 documents"
    assert p == pytest.approx(1 / 20001)
    with pytest.raises(ValueError, match="limited to 40"):
        sign_flip(x, exact_max_n=41)


def clustered_contrast(seed=0, sizes=None):
    """16 documents × 4 sequences (or ``sizes``), strong document effect on d and on the damages."""
    rng = np.random.default_rng(seed)
    sizes = sizes or [4] * 16
    doc = np.repeat(np.arange(len(sizes)), sizes)
    d = 0.25 + rng.normal(0, 0.6, len(sizes))[doc] + rng.normal(0, 0.15, doc.size)
    dmg = 0.5 * np.exp(rng.normal(0, 0.4, len(sizes)))[doc] + rng.normal(0, 0.03, doc.size)
    cdm = 0.45 * np.exp(rng.normal(0, 0.4, len(sizes)))[doc] + rng.normal(0, 0.03, doc.size)
    return Contrast("x", "iv", "ctrl", d, np.arange(doc.size), doc, dmg, cdm), doc


def test_legacy_verdict_table_intervals_are_over_documents():
    """MUTATION CHECK (issue #25): resampling sequences instead of documents inside verdict_table
    turns the document CI into a much narrower one on 16 documents × 4 sequences; the table's
    mean_diff, damage and control_damage CIs must match an independent document bootstrap."""
    c, doc = clustered_contrast()
    r = verdict_table([c]).iloc[0]
    for col, vals in (("boot", c.d), ("damage", c.damage), ("control_damage", c.control_damage)):
        lo_col, hi_col = ("boot_lo", "boot_hi") if col == "boot" else (f"{col}_lo", f"{col}_hi")
        units = doc_means(vals, doc)
        lo, hi = loop_bootstrap(units)
        w = hi - lo
        assert abs(r[lo_col] - lo) < 0.06 * w and abs(r[hi_col] - hi) < 0.06 * w, col
        slo, shi = loop_bootstrap(vals)
        assert abs(r[lo_col] - slo) + abs(r[hi_col] - shi) > 0.4 * w, "fixture must discriminate"
    np.testing.assert_allclose([r["t_lo"], r["t_hi"]], t_ci(doc_means(c.d, doc)), rtol=1e-10)
    assert r["p_kind"] == "exact sign-flip (all 2^16 sign patterns of 16 documents)"


def test_legacy_verdict_table_is_on_document_means():
    c, doc = clustered_contrast(seed=1, sizes=[1, 4, 2, 3, 1, 4, 2, 3, 1, 4])
    r = verdict_table([c]).iloc[0]
    assert r["mean_diff"] == pytest.approx(doc_means(c.d, doc).mean())
    assert r["damage"] == pytest.approx(doc_means(c.damage, doc).mean())
    assert r["mean_diff"] != pytest.approx(c.d.mean())


def test_tost_intervals_say_ninety_percent():
    x = np.random.default_rng(0).normal(0, 0.1, 20)
    assert tost(x, 0.5)["ci_level"] == pytest.approx(0.9)
    doc = np.repeat(np.arange(10), 2)
    r = t1_t2_equivalence(x + 1, np.ones(20), doc, 0.5)
    assert r["ci_level"] == pytest.approx(0.9) and r["p_diff_kind"].startswith("exact sign-flip")
    np.testing.assert_allclose([r["lo"], r["hi"]], t_ci(doc_means(x, doc), level=0.9), rtol=1e-10)
