"""Rows of summary tables from per-sequence values clustered by document — the one path every
experiment's summary table takes (docs/method.md §8: document means throughout).

Per row: the mean of the DOCUMENT means, its percentile bootstrap over documents and its t-interval
(both at ``ci_level``, which the row records), and for paired differences the sign-flip p over
documents with its kind (exact enumeration or Monte Carlo, :func:`posgen_tl.stats.inference.sign_flip`).
Columns follow the package convention: ``estimate, ci_low, ci_high, ci_level, ci_method, t_low,
t_high, p, p_kind, p_holm, holm_scope, n_docs, n_seqs, label``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from posgen_tl.stats.curves import EXPLORATORY_MIN_DOCS, boot_label, doc_bootstrap, doc_t_interval
from posgen_tl.stats.inference import holm, sign_flip

__all__ = ["ci_row", "contrast_row", "finish_table", "document_means"]


def document_means(values: Any, docs: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(means [n_docs], ids [n_docs])``: the mean of ``values`` within each document (sorted ids).

    Raises:
        ValueError: length mismatch, no values, non-finite values."""
    v, d = np.asarray(values, dtype=np.float64), np.asarray(docs)
    if v.shape != d.shape or v.size == 0:
        raise ValueError(f"{v.size} values for {d.size} document ids")
    if not np.isfinite(v).all():
        raise ValueError("non-finite values in a summary row")
    ids, inv = np.unique(d, return_inverse=True)
    return np.bincount(inv, weights=v) / np.bincount(inv), ids


def ci_row(values: Any, docs: Any, *, n_boot: int = 10_000, ci_level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """``{estimate, ci_low, ci_high, ci_level, ci_method, t_low, t_high, n_docs, n_seqs}``: the mean of the
    document means, its bootstrap interval over documents and (with ≥ 2 documents) its t-interval."""
    dm, _ = document_means(values, docs)
    lo, hi = doc_bootstrap(dm, n_boot=n_boot, ci_level=ci_level, seed=seed)
    out = dict(estimate=float(dm.mean()), ci_low=float(lo[0]), ci_high=float(hi[0]), ci_level=ci_level,
               ci_method=boot_label(n_boot), t_low=np.nan, t_high=np.nan, n_docs=int(dm.size),
               n_seqs=int(np.asarray(values).size))
    if dm.size >= 2:
        tlo, thi = doc_t_interval(dm, ci_level=ci_level)
        out.update(t_low=float(tlo[0]), t_high=float(thi[0]))
    return out


def contrast_row(d: Any, docs: Any, **kw: Any) -> dict[str, Any]:
    """:func:`ci_row` of paired differences plus the two-sided sign-flip ``p`` over documents and its
    ``p_kind``; identically-zero differences (identical by construction, e.g. tokens that see no
    changed entry) get no p and do not enter the Holm family."""
    out = ci_row(d, docs, **kw)
    dm, _ = document_means(d, docs)
    if dm.size >= 2 and np.any(dm != 0):
        out["p"], out["p_kind"] = sign_flip(dm)
    else:
        out["p"], out["p_kind"] = np.nan, "none (fewer than 2 documents or identically zero)"
    return out


def finish_table(df: pd.DataFrame) -> pd.DataFrame:
    """Adds ``p_holm`` and ``holm_scope`` (Holm over every p of the table: one family) and ``label``
    ("exploratory" when a row has fewer than 32 documents). Returns ``df`` (changed in place).

    The columns are always there: a table without any p (every row's documents identical or too few) gets
    ``p_holm`` NaN and a ``holm_scope`` that says so, so readers of the table never meet a missing column."""
    if "p" in df and df["p"].notna().any():
        df["p_holm"] = holm(df["p"].to_numpy(float))
        df["holm_scope"] = f"Holm over the {int(df['p'].notna().sum())} p-values of this table"
    else:
        df["p_holm"] = np.nan
        df["holm_scope"] = "none: no p-value in this table"
    df["label"] = np.where(df["n_docs"] < EXPLORATORY_MIN_DOCS, f"exploratory (< {EXPLORATORY_MIN_DOCS} documents)", "")
    return df
