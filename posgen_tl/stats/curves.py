"""Per-document tolerance curves (docs/method.md §8 version 2): the ONE path from per-sequence rows to
per-document ΔNLL curves, their area (AUC, primary), their slope (secondary) and the tidy summary.

numpy / scipy / pandas only. Definitions (used by every table of :mod:`posgen_tl.stats.verdicts`):

- **curve**: ΔNLL(p) = NLL on the target span with a fraction ``p`` of adjacent context pairs
  swapped − the same condition's clean NLL (nats). ``ΔNLL(0) = 0`` BY CONSTRUCTION (the p = 0
  pass is the clean pass): a ``frac = 0`` row must carry ``delta = 0`` and is otherwise an error;
  rows without ``frac = 0`` get the point ``(0, 0)`` all the same.
- **document unit**: seeds are averaged inside a sequence, then sequences inside their document
  (the document is the unit everywhere; several windows of one document never count twice).
- **AUC** (primary): trapezoid area under ΔNLL(p) from ``p = 0`` to the largest ``p``, in
  **nats × p** (p = fraction of adjacent pairs swapped, ≈ half the fraction of moved tokens).
  It is a positively weighted sum of the ΔNLL values (:func:`auc_weights`; with
  p ∈ {0, 2, 5, 10, 20} %: 0.025, 0.04, 0.075, 0.05), so more damage at ANY p raises it.
- **slope** (secondary): free-intercept least-squares slope of ΔNLL over p INCLUDING the point
  (0, 0), in nats per unit p; its weights (:func:`slope_weights`; −2.12, −0.94, +1.02, +4.94
  for the same grid) are negative at small p, so it can hide or invert an effect.
- **damage**: ``clean_nll − base_clean_nll`` (the condition's clean NLL minus the unedited
  model's, nats), averaged like the curve.

Because AUC and slope are linear in the curve, the AUC of a document's mean curve equals the
mean of its sequences' AUCs: one estimator, whichever order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as sps

from posgen_tl.stats.inference import as_1d, check_finite

__all__ = [
    "EXPLORATORY_MIN_DOCS",
    "UNITS",
    "auc_weights",
    "curve_auc",
    "curve_summary",
    "doc_bootstrap",
    "doc_t_interval",
    "document_units",
    "slope_weights",
    "unit_summary",
]

#: fewer documents than this: every table labels its rows "exploratory" (docs/method.md §8).
EXPLORATORY_MIN_DOCS = 32
#: unit of each estimator of :func:`document_units`.
UNITS = {"dnll": "nats", "auc": "nats × p", "slope": "nats per unit p", "damage": "nats"}
_ORDER = {"auc": 0, "dnll": 1, "slope": 2, "damage": 3}
_ZERO_TOL = 1e-9


def _fracs(fracs: Any) -> np.ndarray:
    p = as_1d(fracs, "fracs")
    check_finite(p, "fracs")
    if p.size == 0 or np.any(p <= 0) or np.any(np.diff(p) <= 0):
        raise ValueError(f"fracs must be positive and strictly increasing (p = 0 is implicit), got {p.tolist()}")
    return p


def auc_weights(fracs: Any) -> np.ndarray:
    """Trapezoid weights ``w`` with ``AUC = Σ_i w_i ΔNLL(p_i)`` over the positive ``fracs``
    (ΔNLL(0) = 0 contributes nothing). ``w_i = (p_{i+1} − p_{i−1}) / 2`` with ``p_0 = 0``, the last
    ``(p_n − p_{n−1}) / 2``; all positive. Returns ``float64 [n_fracs]``."""
    p = np.concatenate([[0.0], _fracs(fracs)])
    w = np.zeros(p.size)
    w[:-1] += np.diff(p) / 2
    w[1:] += np.diff(p) / 2
    return w[1:]


def slope_weights(fracs: Any) -> np.ndarray:
    """Weights ``v`` with ``slope = Σ_i v_i ΔNLL(p_i)``: the free-intercept least-squares slope over
    ``{0} ∪ fracs`` with ΔNLL(0) = 0, ``v_i = (p_i − p̄) / Σ (p − p̄)²``. Returns ``[n_fracs]``."""
    p = np.concatenate([[0.0], _fracs(fracs)])
    pc = p - p.mean()
    return pc[1:] / float(pc @ pc)


def curve_auc(fracs: Any, y: Any) -> np.ndarray:
    """AUC (nats × p) of each row of ``y`` (``[n_units, n_fracs]``, ΔNLL at the positive ``fracs``),
    trapezoid from ``(0, 0)``. Returns ``float64 [n_units]``.

    Raises:
        ValueError: ``fracs`` not positive and increasing, shape mismatch, non-finite ``y``."""
    w = auc_weights(fracs)
    yv = np.asarray(y, dtype=np.float64)
    if yv.ndim != 2 or yv.shape[1] != w.size:
        raise ValueError(f"y must be [n_units, {w.size}], got shape {yv.shape}")
    check_finite(yv.ravel(), "y")
    return yv @ w


def _check_rows(rows: pd.DataFrame, by: Sequence[str], value: str) -> None:
    if not isinstance(rows, pd.DataFrame) or rows.empty:
        raise ValueError("rows must be a non-empty DataFrame of per-(sequence, frac, seed) values")
    missing = (set(by) | {"doc", "seq", "frac", value}) - set(rows.columns)
    if missing:
        hint = " (legacy rows name the condition 'intervention': rename it)" if "condition" in missing else ""
        raise ValueError(f"rows lack column(s) {sorted(missing)}{hint}")
    check_finite(rows[value].to_numpy(np.float64), f"rows[{value!r}]")
    f = rows["frac"].to_numpy(np.float64)
    check_finite(f, "rows['frac']")
    if np.any((f < 0) | (f > 1)):
        raise ValueError(f"frac must be in [0, 1], got {sorted(set(f[(f < 0) | (f > 1)].tolist()))[:5]}")
    if rows["doc"].isna().any():
        raise ValueError("rows have missing (NaN) document ids")
    n_doc = rows.groupby([*by, "seq"])["doc"].nunique()
    if (n_doc > 1).any():
        raise ValueError(f"sequences {n_doc[n_doc > 1].index.tolist()[:5]} carry several document ids")


def _sequence_curves(rows: pd.DataFrame, by: Sequence[str], value: str) -> pd.DataFrame:
    """Wide ``[(by, doc, seq) × positive frac]`` ΔNLL, seeds averaged; checks p = 0 and completeness."""
    w = rows.groupby([*by, "doc", "seq", "frac"])[value].mean().unstack("frac").sort_index(axis=1)
    if 0.0 in w.columns:
        zero = w.pop(0.0)
        bad = zero[zero.notna() & (zero.abs() > _ZERO_TOL)]
        if len(bad):
            raise ValueError(f"{value} at p = 0 must be 0 by construction (the condition's own clean pass); "
                             f"got {bad.iloc[0]:.3g} for {bad.index[0]} ({len(bad)} sequences)")  # fmt: skip
    if w.shape[1] == 0:
        raise ValueError("rows have no frac > 0: there is no tolerance curve")
    if w.isna().any().any():
        gaps = w.isna().stack()
        raise ValueError(f"sequences lack {value} at some frac, e.g. {gaps[gaps].index[:3].tolist()} "
                         "((group…, doc, seq, frac)): every sequence needs every frac")  # fmt: skip
    return w


def document_units(rows: pd.DataFrame, *, by: Sequence[str] = ("condition",), value: str = "delta") -> pd.DataFrame:
    """Per-document estimators of the tolerance curve, one tidy table (the unit table of every test).

    Args:
        rows: per (sequence, frac, seed) rows with columns ``doc, seq, frac, <value>`` and the
            ``by`` columns; with ``clean_nll`` and ``base_clean_nll`` the damage is added.
        by: the columns that identify one curve (e.g. ``("model", "layers", "condition")``).

    Returns:
        ``pd.DataFrame`` with columns ``*by, doc, estimator, frac, value, n_seqs``: estimator
        ``"dnll"`` (one row per positive ``frac``, nats), ``"auc"`` (nats × p), ``"slope"``
        (nats per unit p) and ``"damage"`` (nats; only with the clean-NLL columns), each the mean
        over the document's sequences (seeds averaged first); ``frac`` is NaN except for dnll;
        ``n_seqs`` = sequences of that document. ``.attrs["fracs"]`` = the positive fracs.

    Raises:
        ValueError: missing columns, NaN/inf values, a frac outside [0, 1], ΔNLL ≠ 0 at p = 0, a
            sequence missing some frac, a sequence with several document ids.
    """
    by = list(by)
    _check_rows(rows, by, value)
    w = _sequence_curves(rows, by, value)
    fr = w.columns.to_numpy(np.float64)
    keys = [*by, "doc"]
    dm = w.groupby(level=keys, sort=True).mean()
    n_seqs = w.groupby(level=keys, sort=True).size().to_numpy()
    y = dm.to_numpy(np.float64)
    base = dm.index.to_frame(index=False)
    parts = [base.assign(estimator="auc", frac=np.nan, value=y @ auc_weights(fr), n_seqs=n_seqs),
             base.assign(estimator="slope", frac=np.nan, value=y @ slope_weights(fr), n_seqs=n_seqs)]
    parts += [base.assign(estimator="dnll", frac=f, value=y[:, j], n_seqs=n_seqs) for j, f in enumerate(fr)]
    if {"clean_nll", "base_clean_nll"} <= set(rows.columns):
        dmg = (rows["clean_nll"] - rows["base_clean_nll"]).to_numpy(np.float64)
        check_finite(dmg, "clean_nll − base_clean_nll")
        per_seq = pd.Series(dmg, index=pd.MultiIndex.from_frame(rows[[*by, "doc", "seq"]])).groupby(level=[*keys, "seq"]).mean()
        d = per_seq.groupby(level=keys).mean().reindex(dm.index)
        parts.append(base.assign(estimator="damage", frac=np.nan, value=d.to_numpy(), n_seqs=n_seqs))
    out = pd.concat(parts, ignore_index=True)
    out = out.sort_values([*by, "estimator", "frac", "doc"], key=lambda s: s.map(_ORDER) if s.name == "estimator" else s,
                          kind="mergesort", na_position="first").reset_index(drop=True)  # fmt: skip
    out.attrs["fracs"] = fr.tolist()
    return out


def doc_bootstrap(x: Any, *, n_boot: int = 10_000, ci_level: float = 0.95, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap of the MEAN over documents, for every column of ``x`` at once.

    ``x`` is ``[n_docs, k]`` (or ``[n_docs]``): one row per DOCUMENT (already averaged over its
    sequences). Each replicate draws ``n_docs`` documents with replacement (``integers`` from
    ``numpy.random.default_rng(seed)``, as counts; the same draws for all columns) and takes the mean.

    Returns:
        ``(lo, hi)``, each ``float64 [k]`` (scalars' arrays for 1-D input): the ``(1 − ci_level)/2``
        and ``(1 + ci_level)/2`` quantiles. One document gives ``lo = hi = x``.

    Raises:
        ValueError: no documents, non-finite values, ``n_boot < 1``, ``ci_level`` not in (0, 1).
    """
    a = np.asarray(x, dtype=np.float64)
    a = a[:, None] if a.ndim == 1 else a
    if a.ndim != 2 or a.shape[0] == 0:
        raise ValueError(f"x must be [n_docs, k] with n_docs ≥ 1, got shape {np.shape(x)}")
    check_finite(a.ravel(), "x")
    if n_boot < 1 or not 0 < ci_level < 1:
        raise ValueError(f"need n_boot ≥ 1 and 0 < ci_level < 1, got {n_boot}, {ci_level}")
    n = a.shape[0]
    if n == 1:
        return a[0].copy(), a[0].copy()
    rng = np.random.default_rng(seed)
    step = max(1, 2**22 // n)
    means = []
    for s in range(0, n_boot, step):
        b = min(step, n_boot - s)
        idx = rng.integers(0, n, size=(b, n)) + n * np.arange(b)[:, None]  # documents drawn per replicate
        means.append(np.bincount(idx.ravel(), minlength=b * n).reshape(b, n) @ a / n)
    means = np.concatenate(means)
    q = (1 - ci_level) / 2
    lo, hi = np.quantile(means, [q, 1 - q], axis=0)
    return lo, hi


def doc_t_interval(x: Any, *, ci_level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Student-t interval ``m ± t_{(1+level)/2, n−1} · sd/√n`` of the mean over documents, per
    column of ``x`` (``[n_docs, k]``). Returns ``(lo, hi)`` (NaN with fewer than 2 documents)."""
    a = np.asarray(x, dtype=np.float64)
    a = a[:, None] if a.ndim == 1 else a
    n = a.shape[0]
    if n < 2:
        return np.full(a.shape[1], np.nan), np.full(a.shape[1], np.nan)
    m = a.mean(axis=0)
    h = float(sps.t.ppf((1 + ci_level) / 2, n - 1)) * a.std(axis=0, ddof=1) / math.sqrt(n)
    return m - h, m + h


def boot_label(n_boot: int) -> str:
    """``ci_method`` text of :func:`doc_bootstrap` intervals."""
    return f"percentile bootstrap over documents ({n_boot} draws); t_low/t_high: t-interval, same level"


def unit_summary(
    units: pd.DataFrame, *, by: Sequence[str] = ("condition",), n_boot: int = 10_000, ci_level: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:  # fmt: skip
    """Tidy DESCRIPTIVE summary of a :func:`document_units` table: per ``by`` × estimator × frac, the
    mean of the document means with a document bootstrap CI and the t-interval.

    Returns:
        ``pd.DataFrame`` with columns ``*by, estimator, frac, units, estimate, ci_low, ci_high,
        ci_level, ci_method, t_low, t_high, n_docs, n_seqs, label``: ``estimate`` = mean over
        documents; ``ci_low/ci_high``: percentile bootstrap over documents (:func:`doc_bootstrap`,
        ``n_boot`` draws, seeded); ``t_low/t_high``: t-interval on document means at the same
        ``ci_level``; ``label``: ``"descriptive"`` plus ``"; exploratory (n_docs < 32)"`` where so.

    Raises:
        ValueError: missing columns (``*by, doc, estimator, frac, value, n_seqs``).
    """
    by = list(by)
    missing = {*by, "doc", "estimator", "frac", "value", "n_seqs"} - set(units.columns)
    if missing:
        raise ValueError(f"units lack column(s) {sorted(missing)} (build them with document_units)")
    out = []
    for key, g in units.groupby([*by, "estimator", "frac"], sort=False, dropna=False):
        v = g["value"].to_numpy(np.float64)
        lo, hi = doc_bootstrap(v, n_boot=n_boot, ci_level=ci_level, seed=seed)
        tlo, thi = doc_t_interval(v, ci_level=ci_level)
        n_docs = int(g["doc"].nunique())
        if n_docs != len(g):
            raise ValueError(f"group {key} has several rows per document: pass a document_units table")
        out.append(dict(zip([*by, "estimator", "frac"], key), units=UNITS.get(key[-2], ""), estimate=float(v.mean()),
                        ci_low=float(lo[0]), ci_high=float(hi[0]), ci_level=ci_level, ci_method=boot_label(n_boot),
                        t_low=float(tlo[0]), t_high=float(thi[0]), n_docs=n_docs, n_seqs=int(g["n_seqs"].sum()),
                        label="descriptive" + ("; exploratory (n_docs < 32)" if n_docs < EXPLORATORY_MIN_DOCS else "")))  # fmt: skip
    return pd.DataFrame(out)


def curve_summary(
    rows: pd.DataFrame, *, by: Sequence[str] = ("condition",), value: str = "delta", n_boot: int = 10_000,
    ci_level: float = 0.95, seed: int = 0,
) -> pd.DataFrame:  # fmt: skip
    """:func:`unit_summary` of :func:`document_units` ``(rows, by=by)``: the tolerance curve summary
    (ΔNLL per p, AUC, slope, damage) with document-level intervals. Columns as :func:`unit_summary`."""
    return unit_summary(document_units(rows, by=by, value=value), by=by, n_boot=n_boot, ci_level=ci_level, seed=seed)
