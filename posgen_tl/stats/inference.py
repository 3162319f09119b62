"""Statistics for every verdict the library prints (docs/method.md §8), as pure functions.

numpy / scipy / pandas only — never a model, never torch (tensors are accepted wherever an
array is and converted with ``numpy``).

The unit is the SEQUENCE, clustered by DOCUMENT: wherever ``clusters`` is given, values are
grouped by document and the document is the unit that is resampled (bootstrap) or flipped
(sign-flip test), so correlated sequences of one document never count as independent.

- tests and intervals: :func:`sign_flip` / :func:`sign_flip_test` (paired permutation test, exact up
  to 40 units, else Monte Carlo; :func:`sign_flip` also returns the LABEL of its p), :func:`bootstrap_ci`
  (document-level percentile bootstrap), :func:`t_interval`, :func:`holm`, :func:`tost`,
  :func:`mde`; slopes: :func:`unit_slopes`, :func:`slope_ci`;
- one-line findings: :func:`paired_finding`, :func:`rank_correlation`;
- :data:`EQUIVARIANCE_NOTE`, to be printed wherever T1 and T2 are compared.

The verdict rules live beside their estimands: the causal test's intersection–union rule at common damage in
:mod:`posgen_tl.stats.dose`, contrast tables and equivalence (TOST at a declared margin) in
:mod:`posgen_tl.stats.verdicts`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import pandas as pd
from scipy import optimize
from scipy import stats as sps

__all__ = [
    "EQUIVARIANCE_NOTE",
    "bootstrap_ci",
    "ratio_ci",
    "cluster_means",
    "holm",
    "mde",
    "paired_finding",
    "rank_correlation",
    "per_sequence_slopes",
    "P_KIND_EXACT",
    "P_KIND_MC",
    "sign_flip",
    "sign_flip_test",
    "slope_ci",
    "t_interval",
    "tost",
    "unit_slopes",
]

EQUIVARIANCE_NOTE = (
    "Equivariance (docs/method.md §4): a RoPE model whose logits depend on position ids only through "
    "i − j is exactly equivariant to permuting tokens AND their ids together. T1 (tokens "
    "transposed) and T2 (the same swaps applied to the position ids only) therefore differ ONLY "
    "in the causal order among context tokens (who may attend to whom), and T2 alone creates "
    "negative relative distances never seen in training. T1 − T2 measures the causal-order "
    "effect, not 'tokens vs ids'; 'alike' needs an equivalence test (TOST with a stated margin), "
    "never 'the CI contains 0'."
)

#: relative tolerance for ties in the sign-flip test: |T*| counts as ≥ |T| when
#: |T*| ≥ |T| − _TIE_RTOL · Σ|x| (absorbs float rounding of sums of the same numbers).
_TIE_RTOL = 1e-9
_EXACT_LIMIT = 40  # 2 · 2^20 partial sums at most (≈ 0.1 s)
_CHUNK = 2**22  # entries per block of random indices / signs (≈ 32 MiB of int64)


# ----------------------------------------------------------------------------- helpers


def as_1d(x: Any, name: str) -> np.ndarray:
    """Float64 1-D array of ``x`` (array, list, pandas, or a CPU/GPU tensor)."""
    if hasattr(x, "detach"):  # torch tensor, without importing torch
        x = x.detach().cpu().double().numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim > 1 and sum(s > 1 for s in arr.shape) <= 1:  # [n, 1], [1, n] ...
        arr = arr.ravel()
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def check_finite(x: np.ndarray, name: str) -> None:
    if not np.all(np.isfinite(x)):
        bad = np.flatnonzero(~np.isfinite(x))
        raise ValueError(f"{name} has {bad.size} non-finite value(s) (NaN/inf) at positions {bad[:10].tolist()}")


def check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


def cluster_labels(clusters: Any, n: int, name: str = "clusters") -> np.ndarray:
    lab = np.asarray(clusters.detach().cpu().numpy() if hasattr(clusters, "detach") else clusters)
    if lab.ndim != 1 or lab.shape[0] != n:
        raise ValueError(f"{name} must be 1-D with one label per value ({n}), got shape {lab.shape}")
    if lab.dtype.kind == "f" and not np.all(np.isfinite(lab)):
        raise ValueError(f"{name} has NaN/inf labels")
    return lab


# ----------------------------------------------------------------------------- clusters


def cluster_means(values: Any, clusters: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``values`` within each cluster (document).

    Args:
        values: ``[n]`` numbers.
        clusters: ``[n]`` cluster label per value (any sortable labels), or ``None`` (every
            value is its own cluster).

    Returns:
        ``(means [n_clusters], ids [n_clusters])``: the per-cluster means, in the order of the
        SORTED unique cluster ids (``ids``). Without ``clusters``: ``(values, arange(n))``.
    """
    x = as_1d(values, "values")
    if clusters is None:
        return x.copy(), np.arange(x.size)
    ids, inv = np.unique(cluster_labels(clusters, x.size), return_inverse=True)
    counts = np.bincount(inv, minlength=ids.size)
    return np.bincount(inv, weights=x, minlength=ids.size) / counts, ids


def _units(values: Any, clusters: Any, name: str) -> np.ndarray:
    x = as_1d(values, name)
    if x.size == 0:
        raise ValueError(f"{name} is empty")
    check_finite(x, name)
    return cluster_means(x, clusters)[0]


# ----------------------------------------------------------------------------- sign-flip test


def _sorted_subset_sums(x: np.ndarray) -> np.ndarray:
    """``Σ s_i x_i`` for all ``2^m`` sign patterns ``s ∈ {±1}^m``, SORTED ascending (``[2^m]``).

    Built by doubling: the sorted sums of ``x[:k]`` shifted by ``∓|x_k|`` are two sorted runs, merged
    by a stable (run-detecting) sort, so each step is linear; memory ``2^m`` floats."""
    sums = np.zeros(1)
    for v in np.abs(x):  # {Σ s_i x_i} = {Σ s_i |x_i|} as multisets
        sums = np.sort(np.concatenate([sums - v, sums + v]), kind="stable")
    return sums


#: ``p_kind`` label of an exact sign-flip p (``{n}``: the number of flipped units).
P_KIND_EXACT = "exact sign-flip (all 2^{n} sign patterns of {n} {unit})"
#: ``p_kind`` label of a Monte Carlo sign-flip p.
P_KIND_MC = "Monte Carlo sign-flip ({draws} draws; floor 1/({draws}+1) = {floor:.1e}) over {n} {unit}"


def sign_flip(
    d: Any, *, clusters: Any = None, n_mc: int = 20_000, seed: int = 0, exact_max_n: int = _EXACT_LIMIT,
    unit: str = "documents",
) -> tuple[float, str]:
    """Two-sided paired sign-flip (permutation) test of ``mean(d) = 0``, with the KIND of its p.

    Under the null each unit's difference is symmetric about 0, so its sign is arbitrary. The
    statistic is ``T = Σ_u x_u`` over units (equivalently their mean), ``x_u`` = ``d`` itself, or
    with ``clusters`` the mean of ``d`` within each cluster (document): documents are the units
    that flip. The p-value is the fraction of sign patterns with ``|T*| ≥ |T|`` (ties count,
    within 1e-9·Σ_u |x_u|; the identity pattern is included, so p > 0).

    - ``n_units ≤ exact_max_n`` (default 40): EXACT over all ``2^n`` patterns by meet in the middle
      (sorted sums of the two halves' ``2^(n/2)`` patterns, counted with one ``searchsorted``;
      the null distribution is symmetric, so ``#{|T*| ≥ t} = 2·#{T* ≥ t}``): ≈ 0.1 s at n = 40;
    - otherwise ``n_mc`` seeded Monte Carlo patterns (``numpy.random.default_rng(seed)``), and
      ``p = (1 + #{|T*| ≥ |T|}) / (1 + n_mc)`` (a valid p-value, never below the floor ``1/(1+n_mc)``).

    ``unit``: what the flipped units are, as the label names them (default ``"documents"``; e.g. ``"layers"``).

    Returns:
        ``(p, p_kind)``: the two-sided p in ``(0, 1]`` (all-zero ``d`` gives 1) and its label,
        :data:`P_KIND_EXACT` or :data:`P_KIND_MC` filled in (e.g. ``"exact sign-flip (all 2^39
        sign patterns of 39 documents)"``).

    Raises:
        ValueError: empty or non-finite ``d``, ``clusters`` of the wrong length, ``n_mc < 1``,
            ``exact_max_n`` above 40.
    """
    if exact_max_n > _EXACT_LIMIT:
        raise ValueError(f"exact enumeration is limited to {_EXACT_LIMIT} units, got exact_max_n={exact_max_n}")
    x = _units(d, clusters, "d")
    n = x.size
    exact = n <= exact_max_n
    if not exact and n_mc < 1:
        raise ValueError(f"n_mc must be >= 1, got {n_mc}")
    kind = (P_KIND_EXACT.format(n=n, unit=unit) if exact else
            P_KIND_MC.format(draws=n_mc, floor=1 / (n_mc + 1), n=n, unit=unit))
    scale = float(np.abs(x).sum())
    thr = abs(float(x.sum())) - _TIE_RTOL * scale
    if thr <= 0.0:  # T = 0 (or all zero): every pattern is at least as extreme
        return 1.0, kind
    if exact:
        h = n // 2
        a, b = _sorted_subset_sums(x[:h]), _sorted_subset_sums(x[h:])
        # #{a + b ≥ thr}: queries thr − a come out descending; reversed they are sorted (fast search)
        count = b.size * a.size - int(np.searchsorted(b, (thr - a)[::-1], side="left").sum())
        return float(2.0 * count / 2.0**n), kind
    rng = np.random.default_rng(seed)
    rows = max(1, _CHUNK // n)
    count = 0
    for done in range(0, n_mc, rows):
        signs = 1.0 - 2.0 * rng.integers(0, 2, size=(min(rows, n_mc - done), n))
        count += int(np.count_nonzero(np.abs(signs @ x) >= thr))
    return (1.0 + count) / (1.0 + n_mc), kind


def sign_flip_test(
    d: Any, *, clusters: Any = None, n_mc: int = 20_000, seed: int = 0, exact_max_n: int = _EXACT_LIMIT
) -> float:
    """The p-value of :func:`sign_flip` alone (a float in ``(0, 1]``): exact up to ``exact_max_n``
    (default 40) units, else Monte Carlo. Tables must print the kind too: use :func:`sign_flip`."""
    return sign_flip(d, clusters=clusters, n_mc=n_mc, seed=seed, exact_max_n=exact_max_n)[0]


# ----------------------------------------------------------------------------- intervals


def _boot_indices(rng: np.random.Generator, n: int, n_boot: int, chunk: int = _CHUNK):
    """Yield index blocks ``[b, n]`` totalling ``n_boot`` rows, ≤ ``chunk`` entries each."""
    rows = max(1, chunk // max(n, 1))
    for done in range(0, n_boot, rows):
        yield rng.integers(0, n, size=(min(rows, n_boot - done), n))


def bootstrap_ci(
    values: Any, *, clusters: Any = None, n_boot: int = 10_000, alpha: float = 0.05, seed: int = 0,
    paired_with: Any = None,
) -> tuple[float, float, float]:  # fmt: skip
    """Percentile bootstrap CI of a mean; with ``clusters`` a document-level (cluster) bootstrap.

    Without ``clusters`` the units (values) are resampled with replacement. With ``clusters``
    the CLUSTERS are resampled with replacement (``n_clusters`` draws) and the statistic is the
    pooled mean of all values of the drawn clusters (a cluster drawn twice counts twice).
    With ``paired_with`` (same length) the values are ``values − paired_with`` (paired design).
    Random indices come from ``numpy.random.default_rng(seed)`` in blocks of ≤ 4 M entries, so
    memory stays bounded for any ``n_boot``.

    Returns:
        ``(mean, lo, hi)`` as floats: the pooled sample mean and the ``alpha/2`` and
        ``1 − alpha/2`` quantiles of the bootstrap means. A single unit gives ``(x, x, x)``.

    Raises:
        ValueError: empty input, non-finite values, length mismatch, bad ``alpha``/``n_boot``.
    """
    x = as_1d(values, "values")
    if paired_with is not None:
        y = as_1d(paired_with, "paired_with")
        if y.shape != x.shape:
            raise ValueError(f"paired_with has {y.size} values, values has {x.size}")
        x = x - y
    if x.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    check_finite(x, "values")
    check_alpha(alpha)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    mean = float(x.mean())
    rng = np.random.default_rng(seed)
    if clusters is None:
        if x.size == 1:
            return mean, mean, mean
        means = np.concatenate([x[idx].mean(axis=1) for idx in _boot_indices(rng, x.size, n_boot)])
    else:
        ids, inv = np.unique(cluster_labels(clusters, x.size), return_inverse=True)
        if ids.size == 1:
            return mean, mean, mean
        sums = np.bincount(inv, weights=x, minlength=ids.size)
        counts = np.bincount(inv, minlength=ids.size).astype(np.float64)
        means = np.concatenate(
            [sums[idx].sum(axis=1) / counts[idx].sum(axis=1) for idx in _boot_indices(rng, ids.size, n_boot)]
        )
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return mean, float(lo), float(hi)


def ratio_ci(e: np.ndarray, dmg: np.ndarray, *, seed: int, n_boot: int = 10_000) -> tuple[float, float, float]:
    """``mean(e) / mean(dmg)`` with a 95 % percentile bootstrap interval over the units (documents) — a normalised
    recovery of a patch, its effect over the damage — as ``(ratio, low, high)`` floats; all NaN where the damage's own
    interval (:func:`bootstrap_ci`) holds 0: the ratio is undefined without damage."""
    m_d, lo_d, hi_d = bootstrap_ci(dmg, seed=seed)
    if not (lo_d > 0 or hi_d < 0):
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(e), size=(n_boot, len(e)))
    r = e[idx].mean(1) / dmg[idx].mean(1)
    return float(e.mean() / dmg.mean()), float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))


def t_interval(values: Any, *, clusters: Any = None, alpha: float = 0.05) -> tuple[float, float, float]:
    """Student-t confidence interval of the mean, on cluster means when ``clusters`` is given.

    With ``n`` units (values, or per-cluster means) of mean ``m`` and sd ``s`` (ddof 1):
    ``m ± t_{1−α/2, n−1} · s/√n``.

    Returns:
        ``(m, lo, hi)`` as floats (``m`` is the mean of the units — with unequal cluster sizes
        this is the mean of cluster means, not the pooled mean).

    Raises:
        ValueError: fewer than 2 units, non-finite values, bad ``alpha``.
    """
    check_alpha(alpha)
    u = _units(values, clusters, "values")
    if u.size < 2:
        raise ValueError(f"t_interval needs at least 2 units (sequences/documents), got {u.size}")
    m, se = float(u.mean()), float(u.std(ddof=1) / math.sqrt(u.size))
    h = float(sps.t.ppf(1 - alpha / 2, u.size - 1)) * se
    return m, m - h, m + h


def holm(pvalues: Any, m: int | None = None) -> np.ndarray:
    """Holm step-down adjusted p-values for one family of tests.

    With the ``m`` non-NaN p-values sorted ascending, ``p_(1) ≤ … ≤ p_(m)``, the adjusted
    value is ``max_{j ≤ i} min(1, (m − j + 1) · p_(j))``; rejecting where adjusted < α is
    Holm's procedure (family-wise error ≤ α). NaN entries stay NaN and do not count in ``m``,
    unless ``m`` is given: the family's size, counting members that were not tested (conservative).

    Returns:
        ``float64 [n]`` adjusted p-values in the ORIGINAL order, each ≥ its raw p, ≤ 1.

    Raises:
        ValueError: a p-value outside ``[0, 1]`` or an input that is not 1-D.
    """
    p = as_1d(pvalues, "pvalues")
    ok = ~np.isnan(p)
    if np.any((p[ok] < 0) | (p[ok] > 1)):
        raise ValueError(f"p-values must be in [0, 1], got {p[ok][(p[ok] < 0) | (p[ok] > 1)].tolist()}")
    out = np.full(p.shape, np.nan)
    q = p[ok]
    if q.size == 0:
        return out
    if m is not None and m < q.size:
        raise ValueError(f"a family of {m} cannot hold {q.size} tested p-values")
    size = q.size if m is None else int(m)
    order = np.argsort(q, kind="mergesort")
    adj = np.minimum(1.0, np.maximum.accumulate((size - np.arange(q.size)) * q[order]))
    res = np.empty(q.size)
    res[order] = adj
    out[ok] = res
    return out


def tost(d: Any, margin: float, *, clusters: Any = None, alpha: float = 0.05) -> dict[str, Any]:
    """Two one-sided t-tests (TOST) of equivalence: is the mean within ``(−margin, margin)``?

    On units (values, or per-cluster means with ``clusters``) with mean ``m``, standard error
    ``se`` and ``n − 1`` df: ``p_low = P(T ≥ (m + margin)/se)`` tests H0 mean ≤ −margin,
    ``p_high = P(T ≤ (m − margin)/se)`` tests H0 mean ≥ margin; ``p = max(p_low, p_high)``.
    Equivalent iff ``p < alpha`` ⇔ the ``1 − 2α`` t-interval lies inside ``(−margin, margin)``.

    Returns:
        dict with ``mean, lo, hi`` (the ``1 − 2α`` t-interval: 90 % at the default α), ``ci_level``
        (``1 − 2α``), ``p`` (float), ``equivalent`` (bool), ``margin``, ``n`` (units).

    Raises:
        ValueError: ``margin ≤ 0`` or non-finite, fewer than 2 units, non-finite values.
    """
    if not (np.isfinite(margin) and margin > 0):
        raise ValueError(f"margin must be a positive number (stated before the test), got {margin}")
    check_alpha(alpha)
    u = _units(d, clusters, "d")
    if u.size < 2:
        raise ValueError(f"tost needs at least 2 units (sequences/documents), got {u.size}")
    n, m = u.size, float(u.mean())
    se = float(u.std(ddof=1) / math.sqrt(n))
    if se == 0.0:
        p = 0.0 if abs(m) < margin else 1.0
        lo = hi = m
    else:
        p_low = float(sps.t.sf((m + margin) / se, n - 1))
        p_high = float(sps.t.cdf((m - margin) / se, n - 1))
        p = max(p_low, p_high)
        h = float(sps.t.ppf(1 - alpha, n - 1)) * se
        lo, hi = m - h, m + h
    return dict(mean=m, lo=lo, hi=hi, ci_level=1 - 2 * alpha, p=p, equivalent=bool(p < alpha), margin=float(margin), n=n)


def t_test_power(delta: float, sd: float, n: int, alpha: float) -> float:
    """Power of the two-sided one-sample (paired) t-test at true mean ``delta``."""
    df, ncp = n - 1, delta * math.sqrt(n) / sd
    tc = float(sps.t.ppf(1 - alpha / 2, df))
    upper = float(sps.nct.sf(tc, df, ncp))
    if math.isnan(upper):  # scipy's nct has isolated NaNs in far tails
        upper = 1.0 - float(sps.nct.cdf(tc, df, ncp))
    lower = float(sps.nct.sf(tc, df, -ncp))  # = P(T' < −tc), by symmetry
    lower = 0.0 if math.isnan(lower) else lower  # tiny for delta > 0
    if math.isnan(upper):
        raise ValueError(f"power undefined (noncentral t NaN) at delta={delta}, sd={sd}, n={n}")
    return upper + lower


def mde(sd: float, n: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """Minimum detectable effect: the smallest true mean difference that a two-sided paired
    t-test at level ``alpha`` with ``n`` units (sd ``sd``) detects with probability ``power``.

    Solved EXACTLY from the noncentral t distribution (``scipy.stats.nct``, ``n − 1`` df) by
    root finding; the usual approximation ``(t_{1−α/2,n−1} + t_{power,n−1}) · sd/√n`` is the
    starting bracket (it is within a few % for n ≥ 8).

    Returns:
        The MDE as a float in the units of ``sd`` (0 when ``sd == 0``).

    Raises:
        ValueError: ``n < 2``, ``sd < 0`` or non-finite, ``power`` not in ``(alpha/2, 1)``.
    """
    check_alpha(alpha)
    if n < 2:
        raise ValueError(f"mde needs n >= 2 units, got {n}")
    if not (np.isfinite(sd) and sd >= 0):
        raise ValueError(f"sd must be finite and >= 0, got {sd}")
    if not alpha / 2 < power < 1:
        raise ValueError(f"power must be in (alpha/2, 1), got {power}")
    return float(sd) * _mde_unit(int(n), float(alpha), float(power))  # the MDE scales with sd


@functools.lru_cache(maxsize=1024)
def _mde_unit(n: int, alpha: float, power: float) -> float:
    """:func:`mde` for ``sd = 1`` (cached: a family of contrasts shares ``n`` and ``alpha``)."""
    df = n - 1
    approx = (float(sps.t.ppf(1 - alpha / 2, df)) + float(sps.t.ppf(power, df))) / math.sqrt(n)
    hi = max(approx, 1.0 / math.sqrt(n))
    while t_test_power(hi, 1.0, n, alpha) < power:
        hi *= 2.0
    return float(optimize.brentq(lambda x: t_test_power(x, 1.0, n, alpha) - power, 0.0, hi, xtol=1e-12, rtol=1e-12))


# ----------------------------------------------------------------------------- slopes


def unit_slopes(p: Any, y: Any) -> np.ndarray:
    """Least-squares slope of each row of ``y`` over ``p``.

    Args:
        p: ``[n_p]`` abscissa (e.g. swap fractions), at least two distinct values.
        y: ``[n_units, n_p]`` one curve per unit (e.g. ΔNLL per sequence at each ``p``).

    Returns:
        ``float64 [n_units]``: ``Σ (p − p̄)(y − ȳ) / Σ (p − p̄)²`` per row.

    Raises:
        ValueError: shape mismatch, fewer than two distinct ``p``, non-finite input.
    """
    pv = as_1d(p, "p")
    yv = np.asarray(y.detach().cpu().double().numpy() if hasattr(y, "detach") else y, dtype=np.float64)
    if yv.ndim != 2 or yv.shape[1] != pv.size:
        raise ValueError(f"y must be [n_units, {pv.size}], got shape {yv.shape}")
    check_finite(pv, "p")
    check_finite(yv.ravel(), "y")
    pc = pv - pv.mean()
    ss = float(pc @ pc)
    if pv.size < 2 or ss == 0.0:
        raise ValueError("unit_slopes needs at least two distinct p values: the slope is undefined")
    return (yv - yv.mean(axis=1, keepdims=True)) @ pc / ss


def slope_ci(
    p: Any, y_per_unit: Any, *, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, float, float]:
    """Least-squares slope of the unit-mean curve ``ȳ(p)``, with a unit (row) bootstrap CI.

    ``y_per_unit`` is ``[n_units, n_p]``; the slope of the mean curve equals the mean of the
    per-unit slopes (:func:`unit_slopes`), so the CI is the percentile bootstrap of that mean
    over units (``numpy.random.default_rng(seed)``). Sequence-level, not document-level: the
    verdict rule uses :func:`bootstrap_ci` with ``clusters`` instead.

    Returns:
        ``(slope, lo, hi)`` as floats.
    """
    pv = as_1d(p, "p")
    yv = np.asarray(y_per_unit.detach().cpu().double().numpy() if hasattr(y_per_unit, "detach") else y_per_unit,
                    dtype=np.float64)  # fmt: skip
    if yv.ndim != 2 or yv.shape[1] != pv.size:
        raise ValueError(f"y_per_unit must be [n_units, {pv.size}], got {yv.shape}")
    if yv.shape[0] == 0 or pv.size < 2:
        raise ValueError("slope_ci needs at least one unit and two p values")
    s = unit_slopes(pv, yv)
    slope = float(unit_slopes(pv, yv.mean(axis=0, keepdims=True))[0])
    check_alpha(alpha)
    rng = np.random.default_rng(seed)
    boot = np.concatenate([s[idx].mean(axis=1) for idx in _boot_indices(rng, s.size, n_boot, 2**20)])
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    return slope, float(lo), float(hi)


def per_sequence_slopes(rows: pd.DataFrame, value: str = "delta") -> pd.Series:
    """Per-sequence least-squares slope of ``value`` over ``frac`` (seeds averaged first).

    ``rows`` needs columns ``seq, frac, <value>`` (and usually ``seed``); every sequence must
    have every ``frac``.

    Returns:
        ``pd.Series`` of slopes indexed by sequence id (sorted), named ``"slope"``.

    Raises:
        ValueError: missing columns, a sequence lacking some ``frac``, non-finite values.
    """
    missing = {"seq", "frac", value} - set(rows.columns)
    if missing:
        raise ValueError(f"rows lack column(s) {sorted(missing)}")
    w = rows.groupby(["seq", "frac"])[value].mean().unstack("frac").sort_index(axis=1)
    if w.isna().any().any():
        bad = w.index[w.isna().any(axis=1)].tolist()
        raise ValueError(f"sequences {bad[:10]} lack some frac values (or have NaN {value})")
    return pd.Series(unit_slopes(w.columns.to_numpy(float), w.to_numpy(float)), index=w.index, name="slope")


# ----------------------------------------------------------------------------- verdict rule (§8)


def paired_finding(d: Any, clusters: Any = None) -> tuple[float, tuple[float, float], float, str]:
    """The headline numbers of a paired effect: ``(mean, (ci_low, ci_high), p, p_kind)`` — the mean of the
    unit means, the 95 % bootstrap interval resampling ``clusters`` (documents; each value its own
    unit when None), the sign-flip p over the same units and its kind (:func:`sign_flip`'s label)."""
    mean, lo, hi = bootstrap_ci(d, clusters=clusters)
    p, kind = sign_flip(d, clusters=clusters)
    return mean, (lo, hi), p, kind


def rank_correlation(x: np.ndarray, y: np.ndarray) -> tuple[float, tuple[float, float], float, int]:
    """Spearman ρ across units with a Fisher-z 95 % interval (se = √(1.06/(n−3))) and its p-value."""
    from scipy.stats import spearmanr  # noqa: PLC0415

    ok = np.isfinite(x) & np.isfinite(y)
    n = int(ok.sum())
    if n < 4:
        return float("nan"), (float("nan"), float("nan")), float("nan"), n
    res = spearmanr(x[ok], y[ok])
    rho = float(res.statistic)
    z, se = math.atanh(max(min(rho, 0.999999), -0.999999)), math.sqrt(1.06 / (n - 3))
    return rho, (math.tanh(z - 1.96 * se), math.tanh(z + 1.96 * se)), float(res.pvalue), n
