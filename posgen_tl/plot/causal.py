"""Figure of the dose–response causal test (:mod:`posgen_tl.experiments.causal`): a table in, a Figure out."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

__all__ = ["plot_dose_curves", "MIN_COVERAGE_SHOWN"]

_COLORS = {"none": "black", "destroy": "tab:red", "C1": "tab:blue", "C2": "tab:green", "C3": "tab:purple",
           "C4": "tab:orange"}

#: a curve is drawn only where at least this share of the documents bracket the damage (elsewhere its mean
#: would be that of a few documents that happen to reach it)
MIN_COVERAGE_SHOWN = 0.5


def plot_dose_curves(curves: pd.DataFrame, levels: Sequence[float], *, title: str = "") -> Figure:
    """One entry: each condition's mean tolerance loss (nats × p) against damage (nats) with its 95 %
    document-bootstrap band, drawn where ≥ :data:`MIN_COVERAGE_SHOWN` of the documents bracket the damage;
    the unedited model (``none``, damage 0) as a horizontal line with its band; the declared common damage
    levels as dotted vertical lines.

    ``curves``: the ``curves`` table of :class:`posgen_tl.experiments.causal.Result` for ONE entry
    (columns ``condition, damage, tolerance, ci_low, ci_high, coverage``)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    none = curves[curves["condition"] == "none"]
    if len(none):
        r = none.iloc[0]
        ax.axhline(r["tolerance"], color=_COLORS["none"], lw=1, label="none (unedited)")
        ax.axhspan(r["ci_low"], r["ci_high"], color=_COLORS["none"], alpha=0.08)
    for cond, g in curves[curves["condition"] != "none"].groupby("condition", sort=True):
        g = g[g["coverage"] >= MIN_COVERAGE_SHOWN].sort_values("damage")
        if g.empty:
            continue
        col = _COLORS.get(str(cond))
        ax.plot(g["damage"], g["tolerance"], marker="o", ms=3, color=col, label=str(cond),
                lw=2 if cond == "destroy" else 1.2)
        ax.fill_between(g["damage"], g["ci_low"], g["ci_high"], color=col, alpha=0.15)
    for i, lv in enumerate(levels):
        ax.axvline(float(lv), color="grey", ls=":", lw=1, label="common damage levels" if i == 0 else None)
    ax.set(xlabel="damage: clean-NLL increase (nats)", ylabel="tolerance loss: AUC of ΔNLL over p (nats × p)",
           title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig
