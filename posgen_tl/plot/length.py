"""Figures for longer texts (docs/method.md §7): DataFrame → matplotlib Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from posgen_tl.plot._common import ci_lines, finish

__all__ = ["plot_gap_probe", "plot_window_removal"]


def _nll_by(summary: pd.DataFrame, x: str, xlabel: str, ylabel: str, title: str) -> Figure:
    """NLL (``estimator == 'nll'`` rows) vs ``x``, one line with its 95 % CI band per condition."""
    d = summary[summary["estimator"] == "nll"]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ci_lines(ax, d, x, "condition")
    return finish(fig, ax, xlabel=xlabel, ylabel=ylabel, title=title)


def plot_gap_probe(summary: pd.DataFrame, *, title: str = "") -> Figure:
    """Suffix NLL vs gap G (units of n_ctx) per condition, 95 % document-bootstrap CIs.

    ``summary``: :func:`posgen_tl.experiments.length.gap_summary` (rows ``estimator == 'nll'``).
    """
    return _nll_by(summary, "gap_frac", "gap G (units of the trained context n_ctx)", "suffix NLL (nats)",
                   title or "Gap probe: the suffix sees its prefix at unseen distances")


def plot_window_removal(summary: pd.DataFrame, *, title: str = "") -> Figure:
    """NLL by position bucket per condition (Gemma3 window removal), 95 % CIs.

    ``summary``: :func:`posgen_tl.experiments.length.window_summary` (rows ``estimator == 'nll'``).
    """
    return _nll_by(summary, "bucket_start", "position of the predicted token (bucket start)", "NLL (nats)",
                   title or "Local layers with / without their sliding window")
