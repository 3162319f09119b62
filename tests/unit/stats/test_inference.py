"""Tests of posgen_tl.stats.inference: the docs/method.md §8 statistics and verdict rule (pure, no model)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from posgen_tl.stats.inference import (
    bootstrap_ci,
    cluster_means,
    holm,
    mde,
    per_sequence_slopes,
    sign_flip_test,
    t_interval,
    tost,
    unit_slopes,
)

RESULTS = Path(__file__).resolve().parents[3] / "results" / "v1"


# ----------------------------------------------------------------------------- sign-flip test


def brute_force_p(x: np.ndarray) -> float:
    """Two-sided sign-flip p over all 2^n patterns by itertools (ties: within 1e-9·Σ|x|)."""
    x = np.asarray(x, float)
    t = abs(x.sum())
    tol = 1e-9 * np.abs(x).sum()
    patterns = itertools.product((1, -1), repeat=x.size)
    hits = sum(abs(sum(s * v for s, v in zip(signs, x))) >= t - tol for signs in patterns)
    return hits / 2**x.size


values = st.one_of(
    st.lists(st.floats(-5, 5, allow_nan=False, allow_infinity=False), min_size=3, max_size=10),
    st.lists(st.integers(-3, 3).map(float), min_size=3, max_size=10),  # many exact ties
)


@settings(max_examples=80, deadline=None)
@given(values)
def test_sign_flip_exact_equals_brute_force(x):
    assert sign_flip_test(x) == pytest.approx(brute_force_p(np.array(x)), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_sign_flip_exact_with_clusters_equals_brute_force(data):
    n = data.draw(st.integers(3, 10))
    x = data.draw(st.lists(st.floats(-5, 5, allow_nan=False), min_size=n, max_size=n))
    labels = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    means = pd.Series(x).groupby(pd.Series(labels)).mean().to_numpy()  # independent of cluster_means
    assert sign_flip_test(x, clusters=labels) == pytest.approx(brute_force_p(means), abs=1e-12)


def test_sign_flip_exact_properties():
    rng = np.random.default_rng(3)
    x = rng.normal(0.4, 1.0, size=16)
    p = sign_flip_test(x)
    assert p == pytest.approx(brute_force_p(x))  # 65 536 patterns, even split 8 + 8
    assert (p * 2**16) == pytest.approx(round(p * 2**16))  # a multiple of 2^-n
    assert sign_flip_test(np.abs(x) + 1) == pytest.approx(2 / 2**16)  # only identity and all-flip
    assert sign_flip_test(np.zeros(5)) == 1.0
    assert sign_flip_test(np.array([1.0, -1.0, 2.0, -2.0])) == 1.0  # T = 0
    # n = 17 (uneven halves 8 + 9) against a numpy enumeration of all 131 072 patterns
    z = rng.normal(0.2, 1.0, size=17)
    signs = 1 - 2 * ((np.arange(2**17)[:, None] >> np.arange(17)) & 1)
    brute = np.mean(np.abs(signs @ z) >= abs(z.sum()) - 1e-9 * np.abs(z).sum())
    assert sign_flip_test(z) == pytest.approx(brute, abs=1e-12)
    with pytest.raises(ValueError, match="limited to 40"):
        sign_flip_test(rng.normal(size=41), exact_max_n=50)
    # documents are the units: repeating each value inside its document changes nothing
    assert sign_flip_test(np.repeat(x, 3), clusters=np.repeat(np.arange(16), 3)) == pytest.approx(p)


def test_sign_flip_monte_carlo_matches_exact():
    rng = np.random.default_rng(5)
    x = rng.normal(0.35, 1.0, size=12)
    exact = sign_flip_test(x)
    n_mc = 20_000
    mc = sign_flip_test(x, exact_max_n=0, n_mc=n_mc, seed=1)
    assert 0.02 < exact < 0.5  # a non-trivial p, so the check is informative
    assert abs(mc - exact) < 4 * math.sqrt(exact * (1 - exact) / n_mc) + 2 / n_mc
    assert mc == sign_flip_test(x, exact_max_n=0, n_mc=n_mc, seed=1)  # seeded
    # n = 22 is exact by default (docs/method.md §8 v2: exact up to 40 units); with exact_max_n = 20 it takes
    # the Monte Carlo path, which agrees with the exact enumeration (2^11 · 2^11)
    y = rng.normal(0.3, 1.0, size=22)
    exact22 = sign_flip_test(y)
    assert exact22 == sign_flip_test(y, exact_max_n=22) and (exact22 * 2**22) == pytest.approx(round(exact22 * 2**22))
    mc22 = sign_flip_test(y, exact_max_n=20)
    assert abs(mc22 - exact22) < 4 * math.sqrt(exact22 * (1 - exact22) / 20_000) + 2 / 20_000
    assert (mc22 * 20_001) == pytest.approx(round(mc22 * 20_001))  # (1 + count) / (1 + n_mc)
    assert sign_flip_test(np.abs(y) + 1, n_mc=999, exact_max_n=20) == pytest.approx(1 / 1000)  # never 0
    assert sign_flip_test(np.abs(y) + 1) == pytest.approx(2 / 2**22)  # exact: identity and all-flip


# ----------------------------------------------------------------------------- intervals


def test_cluster_means():
    m, ids = cluster_means([1.0, 2.0, 3.0, 5.0], ["b", "a", "b", "a"])
    assert ids.tolist() == ["a", "b"] and m.tolist() == [3.5, 2.0]
    m, ids = cluster_means([1.0, 2.0])
    assert m.tolist() == [1.0, 2.0] and ids.tolist() == [0, 1]
    with pytest.raises(ValueError, match="one label per value"):
        cluster_means([1.0, 2.0], [0])


def test_bootstrap_ci_document_level():
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 1.0, size=40)
    plain = bootstrap_ci(x, seed=4)
    # one value per cluster: same resampling as the plain bootstrap
    assert bootstrap_ci(x, clusters=np.arange(40), seed=4) == pytest.approx(plain)
    # each document repeated 5 times: resampling documents gives the original CI, while a
    # sequence-level bootstrap of the repeated values is too narrow by ≈ √5
    rep, docs = np.repeat(x, 5), np.repeat(np.arange(40), 5)
    assert bootstrap_ci(rep, clusters=docs, seed=4) == pytest.approx(plain)
    m, lo, hi = bootstrap_ci(rep, seed=4)
    assert (hi - lo) < 0.6 * (plain[2] - plain[1])
    # coverage of the pooled mean with unequal cluster sizes, and bounded memory for big n_boot
    sizes = rng.integers(1, 6, size=30)
    v = rng.normal(size=sizes.sum())
    m, lo, hi = bootstrap_ci(v, clusters=np.repeat(np.arange(30), sizes), n_boot=60_000)
    assert m == pytest.approx(v.mean()) and lo < m < hi
    assert bootstrap_ci([2.0]) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="non-finite"):
        bootstrap_ci([1.0, np.inf])


def test_t_interval():
    x = np.array([1.0, 2.0, 4.0, 7.0])
    m, lo, hi = t_interval(x)
    h = sps.t.ppf(0.975, 3) * x.std(ddof=1) / 2
    assert (m, lo, hi) == pytest.approx((3.5, 3.5 - h, 3.5 + h))
    assert t_interval(np.repeat(x, 2), clusters=np.repeat([0, 1, 2, 3], 2)) == pytest.approx((m, lo, hi))
    with pytest.raises(ValueError, match="at least 2 units"):
        t_interval([1.0, 2.0], clusters=[0, 0])


# ----------------------------------------------------------------------------- Holm


def test_holm_textbook_example():
    p = np.array([0.01, 0.04, 0.03, 0.005])
    # sorted 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 → max(0.06, 0.04) = 0.06
    np.testing.assert_allclose(holm(p), [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_allclose(holm([0.5, np.nan, 0.01]), [0.5, np.nan, 0.02])
    assert holm([0.9, 0.8]).tolist() == [1.0, 1.0]  # clipped at 1
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        holm([0.1, 1.2])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.floats(0, 1), st.just(float("nan"))), min_size=1, max_size=12),
    st.floats(0.001, 0.5),
)
def test_holm_properties(p, alpha):
    p = np.array(p)
    adj = holm(p)
    ok = ~np.isnan(p)
    assert np.array_equal(np.isnan(adj), ~ok)
    q, a = p[ok], adj[ok]
    assert np.all(a >= q - 1e-15) and np.all(a <= 1)
    assert (a < alpha).sum() <= (q < alpha).sum()  # never rejects more than unadjusted
    order = np.argsort(q, kind="mergesort")
    assert np.all(np.diff(a[order]) >= 0)  # monotone along the sorted raw p
    # the step-down procedure itself: reject H_(i) iff p_(j) < alpha / (m − j + 1) for all j ≤ i
    m = q.size
    ok_steps = np.cumprod([q[order][j] * (m - j) < alpha for j in range(m)]).astype(bool)
    expect = np.zeros(m, bool)
    expect[order] = ok_steps
    assert np.array_equal(a < alpha, expect)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(0, 1), st.just(float("nan"))), min_size=1, max_size=10), st.integers(0, 5))
def test_holm_over_a_larger_declared_family(p, extra):
    """``m=``: members that were not tested still count — the step-down multipliers start at m, so every
    adjusted p is at least the plain Holm one, and equals it when m is the tested count."""
    p = np.array(p)
    n_ok = int((~np.isnan(p)).sum())
    m = n_ok + extra
    if n_ok == 0:
        assert np.isnan(holm(p, m=m)).all()
        return
    big, plain = holm(p, m=m), holm(p)
    ok = ~np.isnan(p)
    assert np.array_equal(np.isnan(big), ~ok) and np.all(big[ok] >= plain[ok] - 1e-15)
    np.testing.assert_array_equal(holm(p, m=n_ok), plain)
    q = p[ok]
    order = np.argsort(q, kind="mergesort")
    expect = np.minimum(1, np.maximum.accumulate([(m - j) * q[order][j] for j in range(q.size)]))
    np.testing.assert_allclose(big[ok][order], expect)
    if n_ok > 1:
        with pytest.raises(ValueError, match="cannot hold"):
            holm(p, m=n_ok - 1)


# ----------------------------------------------------------------------------- TOST, MDE


def test_tost():
    rng = np.random.default_rng(2)
    d = rng.normal(0.0, 0.1, size=30)
    res = tost(d, 0.5)
    assert res["equivalent"] and res["p"] < 0.05 and -0.5 < res["lo"] < res["hi"] < 0.5
    shifted = tost(d + 1.0, 0.5)  # shifted by 2 · margin
    assert not shifted["equivalent"] and shifted["p"] > 0.5
    tight = tost(d, 0.01)  # a margin smaller than the noise: not equivalent either
    assert not tight["equivalent"]
    # equivalent ⇔ the 1 − 2α t-interval lies inside the margin
    for shift in np.linspace(-0.6, 0.6, 25):
        r = tost(d + shift, 0.3)
        assert r["equivalent"] == (-0.3 < r["lo"] and r["hi"] < 0.3)
    m, lo, hi = t_interval(d, alpha=0.10)
    assert (res["mean"], res["lo"], res["hi"]) == pytest.approx((m, lo, hi))
    with pytest.raises(ValueError, match="margin"):
        tost(d, 0.0)


@pytest.mark.parametrize(("sd", "n"), [(1.0, 8), (0.45, 16), (2.0, 64), (1.0, 3)])
def test_mde_matches_noncentral_t_power(sd, n):
    delta = mde(sd, n)
    df, tc = n - 1, sps.t.ppf(0.975, n - 1)
    ncp = delta * math.sqrt(n) / sd
    power = sps.nct.sf(tc, df, ncp) + np.nan_to_num(sps.nct.cdf(-tc, df, ncp))  # lower tail ≈ 0 (scipy NaNs)
    assert power == pytest.approx(0.8, abs=1e-2)
    approx = (tc + sps.t.ppf(0.8, df)) * sd / math.sqrt(n)
    assert delta == pytest.approx(approx, rel=0.15 if n > 3 else 0.5)
    assert mde(sd, n, power=0.9) > delta and mde(sd, 4 * n) < delta


def test_mde_by_simulation():
    """Independent of scipy.nct: simulated t-tests at the MDE reject ≈ 80 % of the time."""
    rng = np.random.default_rng(7)
    n, sd = 10, 1.0
    x = rng.normal(mde(sd, n), sd, size=(40_000, n))
    t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))
    assert np.mean(np.abs(t) > sps.t.ppf(0.975, n - 1)) == pytest.approx(0.8, abs=0.01)
    assert mde(0.0, 10) == 0.0
    with pytest.raises(ValueError):
        mde(1.0, 1)


def test_unit_slopes():
    rng = np.random.default_rng(1)
    p = np.array([0.0, 0.02, 0.05, 0.1, 0.2])
    y = rng.normal(size=(6, p.size))
    expect = [np.polyfit(p, row, 1)[0] for row in y]
    np.testing.assert_allclose(unit_slopes(p, y), expect, rtol=1e-10)
    with pytest.raises(ValueError, match="distinct p"):
        unit_slopes([1.0, 1.0], np.ones((2, 2)))
    with pytest.raises(ValueError):
        unit_slopes(p, y[:, :3])


# ----------------------------------------------------------------------------- verdict rule


def simulate(rng, effect, n_docs=16, per_doc=2, sd_doc=1.0, sd_seq=0.5):
    """Per-sequence differences with a document random effect (strong clustering)."""
    doc = np.repeat(np.arange(n_docs), per_doc)
    d = effect + rng.normal(0, sd_doc, n_docs)[doc] + rng.laplace(0, sd_seq / math.sqrt(2), doc.size)
    return d, doc


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="non-finite"):
        sign_flip_test([1.0, np.nan, 2.0])


def test_per_sequence_slopes_average_seeds():
    rows = pd.DataFrame(
        [dict(seq=s, frac=f, seed=k, delta=(s + 1) * f + 0.01 * k)
         for s in range(3) for f in (0, 0.1, 0.2) for k in (0, 1)]
    )
    sl = per_sequence_slopes(rows)
    np.testing.assert_allclose(sl.to_numpy(), [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="lack some frac"):
        per_sequence_slopes(rows[~((rows["seq"] == 1) & (rows["frac"] == 0.2))])


def test_sign_flip_calibrated_under_clustered_null():
    """5000 null datasets (16 documents × 2 sequences, strong document effect): the exact
    document-level test rejects at 5 % within 3 standard errors (≈ 0.009) of 5 %; treating the
    32 sequences as independent units would reject ≈ 14 % of the time."""
    rng = np.random.default_rng(1)
    n_sim = 5000
    p_doc, p_seq = np.empty(n_sim), []
    for i in range(n_sim):
        d, doc = simulate(rng, 0.0)
        p_doc[i] = sign_flip_test(d, clusters=doc)
        if i < 500:
            p_seq.append(sign_flip_test(d, n_mc=200, seed=i))
    assert abs(np.mean(p_doc < 0.05) - 0.05) <= 3 * math.sqrt(0.05 * 0.95 / n_sim)
    assert np.mean(np.array(p_seq) < 0.05) > 0.08
