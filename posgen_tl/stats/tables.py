"""Rows of summary tables from per-sequence values clustered by document — the one path every
experiment's summary table takes (mean, document-bootstrap CI, t-interval, sign-flip p, Holm).

Units (METHOD §8): the document. ``values``/``d`` are per-sequence numbers and ``docs`` their
document ids; the bootstrap resamples documents and the sign-flip test flips documents.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from posgen_tl.stats.inference import bootstrap_ci, holm, sign_flip_test, t_interval

__all__ = ["ci_row", "contrast_row", "finish_table", "EXPLORATORY_BELOW"]

#: METHOD §8: a table with fewer units than this is labelled exploratory
EXPLORATORY_BELOW = 32


def ci_row(values: Any, docs: Any, n_boot: int = 10_000) -> dict[str, Any]:
    """``{value, ci_low, ci_high, n_seq, n_docs[, t_low, t_high]}``: the mean, the 95 % bootstrap
    interval over documents and (with ≥ 2 documents) the 95 % t-interval over document means."""
    values, docs = np.asarray(values, dtype=float), np.asarray(docs)
    m, lo, hi = bootstrap_ci(values, clusters=docs, n_boot=n_boot)
    out = dict(value=m, ci_low=lo, ci_high=hi, n_seq=len(values), n_docs=len(np.unique(docs)))
    if out["n_docs"] >= 2:
        _, tlo, thi = t_interval(values, clusters=docs)
        out.update(t_low=tlo, t_high=thi)
    return out


def contrast_row(d: Any, docs: Any) -> dict[str, Any]:
    """:func:`ci_row` of paired differences plus the sign-flip ``p`` over documents; identically-zero
    differences (identical by construction, e.g. tokens that see no changed entry) get no p and do
    not enter the Holm family."""
    d, docs = np.asarray(d, dtype=float), np.asarray(docs)
    out = ci_row(d, docs)
    out["p"] = sign_flip_test(d, clusters=docs) if out["n_docs"] >= 2 and np.any(d != 0) else np.nan
    return out


def finish_table(df: pd.DataFrame) -> pd.DataFrame:
    """Adds ``p_holm`` (Holm over every p of the table: one family) and ``label`` ("exploratory" when
    a row has fewer than :data:`EXPLORATORY_BELOW` sequences). Returns ``df`` (changed in place)."""
    if "p" in df and df["p"].notna().any():
        df["p_holm"] = holm(df["p"].to_numpy(float))
    df["label"] = np.where(df["n_seq"] < EXPLORATORY_BELOW, "exploratory", "")
    return df
