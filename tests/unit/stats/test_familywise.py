"""The max-T sign-flip test: family-wise error ≤ α under a null with dependent tests, exact p by enumeration,
a planted effect found, degenerate tests never significant."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posgen_tl.stats.familywise import maxt_signflip
from posgen_tl.stats.inference import sign_flip


def _null(rng, n, m, rho=0.6):
    """Per-document effects symmetric about 0, correlated across tests (heads of one document)."""
    shared = rng.normal(size=(n, 1))
    return rho * shared + np.sqrt(1 - rho**2) * rng.normal(size=(n, m))


def test_familywise_error_at_most_alpha_under_a_dependent_null():
    rng = np.random.default_rng(0)
    hits = sum(bool((maxt_signflip(_null(rng, 10, 30), seed=i)["p_fwe"] <= 0.05).any()) for i in range(300))
    # 300 data sets: the family-wise error rate must not exceed 5 % (binomial 99 % bound ≈ 0.083)
    assert hits / 300 <= 0.083, hits
    # while per-test p-values without adjustment would find something in most data sets (the test compares)
    raw = sum(any(sign_flip(col)[0] <= 0.05 for col in _null(rng, 10, 30).T) for _ in range(60))
    assert raw / 60 > 0.3


def test_planted_effect_found_and_null_heads_not():
    rng = np.random.default_rng(1)
    x = _null(rng, 24, 40, rho=0.3)
    x[:, 7] += 1.5  # one head carries an effect of 1.5 sd
    r = maxt_signflip(x, n_perm=5000)
    assert r["p_fwe"][7] <= 0.01 and "Monte Carlo" in r["p_kind"]
    assert (np.delete(r["p_fwe"], 7) > 0.05).mean() >= 0.95


def test_exact_enumeration_matches_single_test_sign_flip_for_one_column():
    rng = np.random.default_rng(2)
    x = rng.normal(0.4, 1.0, size=(9, 1))
    r = maxt_signflip(x)
    assert r["p_kind"] == "exact sign-flip max-T (2^9)"
    # one test: max-T is the studentised sign-flip test; its p ≥ 1/2^9 and matches a brute-force count
    signs = np.array([[1 if (k >> i) & 1 else -1 for i in range(9)] for k in range(2**9)], dtype=float)
    xs = signs * x[:, 0]
    t = xs.mean(1) / (xs.std(1, ddof=1) / 3)
    t0 = x.mean() / (x.std(ddof=1) / 3)
    assert r["p_fwe"][0] == pytest.approx((np.abs(t) >= abs(t0) - 1e-12).mean())


@settings(max_examples=30, deadline=None)
@given(st.integers(3, 12), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_constant_columns_are_never_significant_and_p_in_range(n, m, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, m))
    x[:, 0] = 0.0  # a head a patch did not move (the null corruption; layer 0's semantic term)
    r = maxt_signflip(x, n_perm=500)
    assert r["t"][0] == 0 and r["p_fwe"][0] == 1.0
    assert ((r["p_fwe"] > 0) & (r["p_fwe"] <= 1)).all()


def test_bad_input_named():
    with pytest.raises(ValueError, match="at least 3"):
        maxt_signflip(np.ones((2, 3)))
    with pytest.raises(ValueError, match="NaN"):
        maxt_signflip(np.array([[1.0, np.nan]] * 4))
    with pytest.raises(ValueError, match="n_docs, n_tests"):
        maxt_signflip(np.ones(5))
