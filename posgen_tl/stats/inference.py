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
- the verdict rule: :class:`Contrast`, :func:`paired_differences`, :func:`contrast_from_rows`,
  :func:`verdict_table` — the ONLY place a verdict word ("depends" / "no evidence") is decided;
- T1 vs T2: :func:`t1_t2_equivalence` ("alike" only via TOST with a stated margin) and
  :data:`EQUIVARIANCE_NOTE`, to be printed wherever T1 and T2 are compared.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from scipy import optimize
from scipy import stats as sps

__all__ = [
    "EQUIVARIANCE_NOTE",
    "Contrast",
    "bootstrap_ci",
    "cluster_means",
    "contrast_from_rows",
    "holm",
    "mde",
    "paired_differences",
    "paired_finding",
    "rank_correlation",
    "per_sequence_slopes",
    "P_KIND_EXACT",
    "P_KIND_MC",
    "sign_flip",
    "sign_flip_test",
    "slope_ci",
    "t1_t2_equivalence",
    "t_interval",
    "tost",
    "unit_slopes",
    "verdict_table",
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
P_KIND_EXACT = "exact sign-flip (all 2^{n} sign patterns of {n} documents)"
#: ``p_kind`` label of a Monte Carlo sign-flip p.
P_KIND_MC = "Monte Carlo sign-flip ({draws} draws; floor 1/({draws}+1) = {floor:.1e}) over {n} documents"


def sign_flip(
    d: Any, *, clusters: Any = None, n_mc: int = 20_000, seed: int = 0, exact_max_n: int = _EXACT_LIMIT
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
    kind = P_KIND_EXACT.format(n=n) if exact else P_KIND_MC.format(draws=n_mc, floor=1 / (n_mc + 1), n=n)
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


def holm(pvalues: Any) -> np.ndarray:
    """Holm step-down adjusted p-values for one family of tests.

    With the ``m`` non-NaN p-values sorted ascending, ``p_(1) ≤ … ≤ p_(m)``, the adjusted
    value is ``max_{j ≤ i} min(1, (m − j + 1) · p_(j))``; rejecting where adjusted < α is
    Holm's procedure (family-wise error ≤ α). NaN entries stay NaN and do not count in ``m``.

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
    m = q.size
    if m == 0:
        return out
    order = np.argsort(q, kind="mergesort")
    adj = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * q[order]))
    res = np.empty(m)
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


def _power(delta: float, sd: float, n: int, alpha: float) -> float:
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
    while _power(hi, 1.0, n, alpha) < power:
        hi *= 2.0
    return float(optimize.brentq(lambda x: _power(x, 1.0, n, alpha) - power, 0.0, hi, xtol=1e-12, rtol=1e-12))


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


@dataclass
class Contrast:
    """One paired contrast ``intervention − control`` over sequences (docs/method.md §8).

    Attributes:
        name: label of the contrast (unique within a family).
        intervention, control: labels of the two conditions.
        d: ``[n_seq]`` per-sequence tolerance-slope difference, intervention − control.
        seq: ``[n_seq]`` sequence ids (unique).
        doc: ``[n_seq]`` document id of each sequence (the cluster / resampling unit).
        damage: ``[n_seq]`` per-sequence clean-NLL damage of the intervention.
        control_damage: ``[n_seq]`` per-sequence clean-NLL damage of the control.
        primary: the one contrast declared primary before the run.
    """

    name: str
    intervention: str
    control: str
    d: np.ndarray
    seq: np.ndarray
    doc: np.ndarray
    damage: np.ndarray
    control_damage: np.ndarray
    primary: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` naming the problem if the contrast cannot be tested."""
        where = f"contrast {self.name!r}"
        d = as_1d(self.d, f"{where}: d")
        n = d.size
        if n < 3:
            raise ValueError(f"{where}: needs at least 3 sequences, got {n}")
        check_finite(d, f"{where}: d (slope differences)")
        for nm in ("seq", "doc", "damage", "control_damage"):
            v = np.asarray(getattr(self, nm))
            if v.ndim != 1 or v.shape[0] != n:
                raise ValueError(f"{where}: length mismatch: {nm} has shape {v.shape}, d has {n} values")
        for nm in ("damage", "control_damage"):
            check_finite(as_1d(getattr(self, nm), nm), f"{where}: {nm}")
        seq = pd.Series(np.asarray(self.seq))
        if seq.duplicated().any():
            raise ValueError(f"{where}: duplicated sequence ids {seq[seq.duplicated()].unique()[:10].tolist()}")
        if pd.isna(pd.Series(np.asarray(self.doc))).any():
            raise ValueError(f"{where}: missing (NaN) document ids")
        if np.unique(np.asarray(self.doc)).size < 2:
            raise ValueError(f"{where}: all sequences come from one document: no test across documents is possible")


def paired_differences(a: pd.Series, b: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Pair two per-sequence Series (indexed by sequence id) and return ``a − b``.

    Args:
        a: intervention values (e.g. slopes), index = sequence id.
        b: control values, index = sequence id.

    Returns:
        ``(d [n], seq [n])``: differences and the sequence ids, sorted by sequence id.

    Raises:
        ValueError: duplicated sequence ids, or different sequence sets ("intervention and
            control sequences differ: missing in control: [...]; missing in intervention: [...]").
    """
    for nm, s in (("intervention", a), ("control", b)):
        if s.index.duplicated().any():
            raise ValueError(f"{nm}: duplicated sequence ids {s.index[s.index.duplicated()].unique()[:10].tolist()}")
    ia, ib = set(a.index), set(b.index)
    if ia != ib:
        raise ValueError(
            "intervention and control sequences differ: "
            f"missing in control: {sorted(ia - ib)[:20]}; missing in intervention: {sorted(ib - ia)[:20]}"
        )
    seq = np.asarray(sorted(ia))
    return a.loc[seq].to_numpy(np.float64) - b.loc[seq].to_numpy(np.float64), seq


def contrast_from_rows(
    rows: pd.DataFrame, intervention: str, control: str, *, name: str | None = None, primary: bool = False,
    doc: pd.Series | dict | None = None, value: str = "delta",
) -> Contrast:  # fmt: skip
    """Build a :class:`Contrast` from tolerance rows (``analysis.tolerance.tolerance_rows`` output).

    ``rows`` has columns ``intervention, seq, frac, <value>, clean_nll, base_clean_nll`` (and
    ``seed``, ``doc`` where present). Per sequence: slope of ``value`` over ``frac`` (seeds
    averaged, :func:`per_sequence_slopes`) and damage ``clean_nll − base_clean_nll``. Document
    ids come from ``doc`` (mapping seq → doc) if given, else from a ``doc`` column; without
    either a ``ValueError`` is raised (pass ``doc={s: s ...}`` explicitly when every sequence is
    its own document).

    Returns:
        The :class:`Contrast` (sequences sorted by id).

    Raises:
        ValueError: unknown labels, mismatched sequence sets, missing document ids.
    """
    parts = {}
    for role, label in (("intervention", intervention), ("control", control)):
        g = rows[rows["intervention"] == label]
        if g.empty:
            raise ValueError(f"no rows for {role} {label!r}; labels present: {sorted(rows['intervention'].unique())}")
        dmg = (g["clean_nll"] - g["base_clean_nll"]).groupby(g["seq"]).mean()
        parts[role] = (per_sequence_slopes(g, value), dmg)
    d, seq = paired_differences(parts["intervention"][0], parts["control"][0])
    if doc is None:
        if "doc" not in rows.columns:
            raise ValueError("rows have no 'doc' column: pass doc= (sequence id → document id) explicitly")
        doc = rows.groupby("seq")["doc"].first()
    doc_map = pd.Series(doc)
    if not set(seq) <= set(doc_map.index):
        raise ValueError(f"no document id for sequences {sorted(set(seq) - set(doc_map.index))[:10]}")
    return Contrast(
        name=name or f"{intervention} vs {control}", intervention=intervention, control=control, d=d, seq=seq,
        doc=doc_map.loc[seq].to_numpy(), damage=parts["intervention"][1].loc[seq].to_numpy(float),
        control_damage=parts["control"][1].loc[seq].to_numpy(float), primary=primary,
    )  # fmt: skip


def _split_halves(d: np.ndarray, doc: np.ndarray, split_seed: int) -> tuple[float, float]:
    """Mean ``d`` on two disjoint halves of the documents (seeded permutation of unique ids)."""
    ids = np.unique(doc)
    perm = np.random.default_rng(split_seed).permutation(ids.size)
    in_a = np.isin(doc, ids[perm[: ids.size // 2]])
    return float(d[in_a].mean()), float(d[~in_a].mean())


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def verdict_table(
    contrasts: list[Contrast], *, alpha: float = 0.05, min_n: int = 32, match_rel: float = 0.10,
    split_seed: int = 0, n_boot: int = 10_000, seed: int = 0,
) -> pd.DataFrame:  # fmt: skip
    """docs/method.md §8 version 1 rule (slope contrasts, CI-overlap damage matching), kept for its callers.

    Superseded twice (docs/method.md §8): the causal verdict is :func:`posgen_tl.stats.dose.dose_verdict`
    (dose–response curves compared at common damage).

    Per contrast (``d`` per sequence, averaged within each document first: every statistic of a
    row is on DOCUMENT means, the unit that is resampled and flipped):

    - ``p_exact`` — despite its (legacy) name, exact only up to 40 documents: :func:`sign_flip`
      over document means (exact enumeration up to 40 documents, else 20 000 Monte Carlo draws
      seeded by ``seed``); ``p_kind`` says which; ``p_holm``: :func:`holm` over all contrasts of
      the call;
    - ``mean_diff`` (mean of document means of ``d``) with ``boot_lo/boot_hi`` (percentile
      bootstrap over documents, ``n_boot`` draws, level ``1 − alpha``) and ``t_lo/t_hi``
      (t-interval on document means, same level);
    - ``damage``/``control_damage`` (mean of document means of clean-NLL damage) with
      document-bootstrap CIs;
      ``damage_matched``: ``|damage − control_damage| ≤ match_rel·|damage|`` OR the two CIs overlap;
    - ``half_a``/``half_b``: mean ``d`` on two disjoint halves of the documents (seeded by
      ``split_seed``); ``split_half_agree``: both non-zero with the sign of ``mean_diff``;
    - ``sd`` (of document means) and ``mde``: the mean difference detectable with 80 % power at
      level ``alpha`` by a t-test on those ``n_docs`` units (:func:`mde`; at the UNADJUSTED level,
      so in a family of several contrasts it is a lower bound of what Holm lets through);
    - ``verdict``: ``"depends"`` only if ``p_holm < alpha`` AND damage matched AND split halves
      agree, else ``"no evidence"``; ``reason`` states the conditions that failed (with the MDE).
      ``exploratory`` = ``n_seq < min_n``; then the verdict ends in ``" (exploratory)"``.
      "No evidence" is never evidence of no effect (use :func:`tost` for that).

    Returns:
        ``pd.DataFrame`` (settings and the rule in ``.attrs``), one row per contrast in input
        order, columns ``contrast, intervention, control, primary, n_seq, n_docs, mean_diff,
        boot_lo, boot_hi, t_lo, t_hi, p_exact, p_kind, p_holm, damage, damage_lo, damage_hi,
        control_damage, control_damage_lo, control_damage_hi, damage_matched, half_a, half_b,
        split_half_agree, sd, mde, exploratory, verdict, reason``.

    Raises:
        ValueError: an empty family, duplicated contrast names, more than one primary, or any
            contrast failing :meth:`Contrast.validate` (< 3 sequences, NaN/inf, length
            mismatch, duplicated sequence ids, a single document).
    """
    check_alpha(alpha)
    if not contrasts:
        raise ValueError("verdict_table needs at least one contrast")
    names = [c.name for c in contrasts]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicated contrast names in one family: {sorted({n for n in names if names.count(n) > 1})}")
    if sum(bool(c.primary) for c in contrasts) > 1:
        raise ValueError(f"more than one primary contrast: {[c.name for c in contrasts if c.primary]}")
    for c in contrasts:
        c.validate()
    rows = []
    for c in contrasts:
        d = as_1d(c.d, "d")
        doc = np.asarray(c.doc)
        # one estimator per row: every statistic is on DOCUMENT means (resampled / flipped as units)
        units = cluster_means(d, doc)[0]
        dm, dlo, dhi = bootstrap_ci(cluster_means(c.damage, doc)[0], n_boot=n_boot, alpha=alpha, seed=seed)
        cm, clo, chi = bootstrap_ci(cluster_means(c.control_damage, doc)[0], n_boot=n_boot, alpha=alpha, seed=seed)
        mean, blo, bhi = bootstrap_ci(units, n_boot=n_boot, alpha=alpha, seed=seed)
        _, tlo, thi = t_interval(units, alpha=alpha)
        sd = float(units.std(ddof=1))
        ha, hb = _split_halves(d, doc, split_seed)
        sgn = np.sign(mean)
        p, p_kind = sign_flip(units, seed=seed)
        rows.append(dict(
            contrast=c.name, intervention=c.intervention, control=c.control, primary=bool(c.primary),
            n_seq=int(d.size), n_docs=int(units.size), mean_diff=mean, boot_lo=blo, boot_hi=bhi, t_lo=tlo,
            t_hi=thi, p_exact=p, p_kind=p_kind, damage=dm, damage_lo=dlo,
            damage_hi=dhi, control_damage=cm, control_damage_lo=clo, control_damage_hi=chi,
            damage_matched=bool(abs(dm - cm) <= match_rel * abs(dm) or (dlo <= chi and clo <= dhi)),
            half_a=ha, half_b=hb, split_half_agree=bool(sgn != 0 and np.sign(ha) == sgn and np.sign(hb) == sgn),
            sd=sd, mde=mde(sd, units.size, alpha=alpha), exploratory=bool(d.size < min_n),
        ))  # fmt: skip
    out = pd.DataFrame(rows)
    out.insert(out.columns.get_loc("p_kind") + 1, "p_holm", holm(out["p_exact"].to_numpy()))
    verdicts, reasons = [], []
    for r in out.itertuples(index=False):
        fails = []
        if not r.p_holm < alpha:
            fails.append(f"Holm p = {r.p_holm:.3g} ≥ {alpha:g} (p = {r.p_exact:.3g}, {r.p_kind})")
        if not r.damage_matched:
            fails.append(
                f"damage not matched ({_fmt(r.damage)} [{_fmt(r.damage_lo)}, {_fmt(r.damage_hi)}] vs "
                f"{_fmt(r.control_damage)} [{_fmt(r.control_damage_lo)}, {_fmt(r.control_damage_hi)}])"
            )
        if not r.split_half_agree:
            fails.append(f"split halves disagree (means {_fmt(r.half_a)}, {_fmt(r.half_b)} vs {_fmt(r.mean_diff)})")
        if fails:
            verdict = "no evidence"
            reason = "; ".join(fails) + f"; MDE at 80 % power = {_fmt(r.mde)} (n = {r.n_docs} documents)"
        else:
            verdict = "depends"
            reason = (f"Holm p = {r.p_holm:.3g} < {alpha:g}; damage matched; split halves agree "
                      f"({_fmt(r.half_a)}, {_fmt(r.half_b)})")  # fmt: skip
        if r.exploratory:
            verdict += " (exploratory)"
            reason += f"; n = {r.n_seq} < {min_n} sequences: exploratory"
        verdicts.append(verdict)
        reasons.append(reason)
    out["verdict"] = verdicts
    out["reason"] = reasons
    out.attrs.update(alpha=alpha, min_n=min_n, match_rel=match_rel, n_boot=n_boot, seed=seed, split_seed=split_seed,
                     family_size=len(contrasts),
                     rule=("'depends' only if Holm p < alpha over this table's contrasts, damage matched and the "
                           "sign agrees on both disjoint halves of the documents; otherwise 'no evidence' "
                           "(not evidence of no effect)"))  # fmt: skip
    return out


def t1_t2_equivalence(
    t1_slopes: Any, t2_slopes: Any, doc: Any, margin: float, *, alpha: float = 0.05
) -> dict[str, Any]:
    """Are T1 and T2 tolerance slopes alike? Only a TOST with a stated ``margin`` may say so.

    ``d = t1_slopes − t2_slopes`` per sequence (same sequences, same order), clustered by
    ``doc``; :func:`tost` on document means. Read the result with :data:`EQUIVARIANCE_NOTE`:
    T1 − T2 is the causal-order effect, not "tokens vs ids".

    Returns:
        The :func:`tost` dict (``lo, hi``: the 90 % interval at the default α) plus ``alike``
        (= ``equivalent``), ``n_seq``, ``n_docs``, ``p_diff`` (sign-flip p of a non-zero difference,
        over documents) with ``p_diff_kind`` (exact or Monte Carlo, :func:`sign_flip`) and ``note``
        (:data:`EQUIVARIANCE_NOTE`).

    Raises:
        ValueError: length mismatch, fewer than 3 sequences, non-finite slopes, bad margin.
    """
    a, b = as_1d(t1_slopes, "t1_slopes"), as_1d(t2_slopes, "t2_slopes")
    if a.shape != b.shape:
        raise ValueError(f"length mismatch: {a.size} T1 slopes vs {b.size} T2 slopes")
    if a.size < 3:
        raise ValueError(f"T1 vs T2 needs at least 3 sequences, got {a.size}")
    check_finite(a, "t1_slopes")
    check_finite(b, "t2_slopes")
    doc = cluster_labels(doc, a.size, "doc")
    res = tost(a - b, margin, clusters=doc, alpha=alpha)
    p_diff, p_diff_kind = sign_flip(a - b, clusters=doc)
    res.update(alike=res["equivalent"], n_seq=int(a.size), n_docs=int(np.unique(doc).size),
               p_diff=p_diff, p_diff_kind=p_diff_kind, note=EQUIVARIANCE_NOTE)  # fmt: skip
    return res


def paired_finding(d: Any, clusters: Any = None) -> tuple[float, tuple[float, float], float]:
    """The headline numbers of a paired effect: ``(mean, (ci_low, ci_high), p)`` — the mean of the
    unit means, the 95 % bootstrap interval resampling ``clusters`` (documents; each value its own
    unit when None) and the sign-flip p over the same units."""
    mean, lo, hi = bootstrap_ci(d, clusters=clusters)
    return mean, (lo, hi), sign_flip_test(d, clusters=clusters)


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
