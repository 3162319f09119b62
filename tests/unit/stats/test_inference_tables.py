"""posgen_tl.stats.inference: the label of every p (exact / Monte Carlo) and the level of every interval."""

from __future__ import annotations

import numpy as np
import pytest
from stats_fixtures import doc_means, t_ci

from posgen_tl.stats.inference import sign_flip, sign_flip_test, tost


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


def test_tost_intervals_say_ninety_percent():
    x = np.random.default_rng(0).normal(0, 0.1, 20)
    assert tost(x, 0.5)["ci_level"] == pytest.approx(0.9)
    doc = np.repeat(np.arange(10), 2)
    r = tost(x, 0.5, clusters=doc)
    assert r["ci_level"] == pytest.approx(0.9)
    np.testing.assert_allclose([r["lo"], r["hi"]], t_ci(doc_means(x, doc), level=0.9), rtol=1e-10)
