"""Comparing two decomposition frames of the same design row by row (shared by the tests of its code paths)."""

from __future__ import annotations

import numpy as np
import pandas as pd

KEYS = ["layer", "head", "seq", "estimator", "k_mean", "sink_excluded"]
SCORES = ("r", "r2", "r_within", "d3_err_mean", "d3_bound_mean", "d3_bound_holds")


def assert_same_scores(want: pd.DataFrame, got: pd.DataFrame, rtol: float, atol: float = 1e-6) -> None:
    """The same rows (by :data:`KEYS`) and every score within ``rtol``/``atol`` (NaN where NaN), and scores that
    are mostly finite (a comparison of NaN with NaN proves nothing)."""
    a, b = (d.sort_values(KEYS).reset_index(drop=True) for d in (want, got))
    pd.testing.assert_frame_equal(a[KEYS], b[KEYS])
    for col in SCORES:
        np.testing.assert_allclose(b[col].to_numpy(float), a[col].to_numpy(float), rtol=rtol, atol=atol,
                                   equal_nan=True, err_msg=col)
    assert np.isfinite(b["r"].to_numpy(float)).mean() > 0.9
