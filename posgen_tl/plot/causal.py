"""Figures of the causal test (:mod:`posgen_tl.experiments.causal`): tables in, a Figure out."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

__all__ = ["plot_causal_conditions"]

_COLORS = {"none": "black", "destroy": "tab:red", "C1": "tab:blue", "C2": "tab:green", "C3": "tab:purple",
           "C4": "tab:orange"}


def plot_causal_conditions(summary: pd.DataFrame, contrasts: pd.DataFrame, *, title: str = "") -> Figure:
    """Top row, one panel per entry: mean ΔNLL over the swap fraction p for every condition (document
    means with their 95 % bootstrap band; p = 0 is 0 by construction). Bottom row: each contrast's
    AUC (destroy − none, destroy − Ck, Ck − none; nats × p) with its 95 % interval, zero marked.

    ``summary``: the ``summary`` table of :func:`posgen_tl.experiments.causal.causal_tables`;
    ``contrasts``: its ``contrasts`` table.
    """
    entries = list(dict.fromkeys(summary["layers"]))
    fig, axes = plt.subplots(2, len(entries), figsize=(5.5 * len(entries), 7.5), squeeze=False)
    for j, entry in enumerate(entries):
        ax = axes[0, j]
        s = summary[(summary["layers"] == entry) & (summary["estimator"] == "dnll")]
        for cond, g in s.groupby("condition", sort=False):
            g = g.sort_values("frac")
            x = np.r_[0.0, g["frac"].to_numpy(float)]
            y, lo, hi = (np.r_[0.0, g[c].to_numpy(float)] for c in ("estimate", "ci_low", "ci_high"))
            col = _COLORS.get(str(cond), None)
            ax.plot(x, y, marker="o", label=str(cond), color=col)
            ax.fill_between(x, lo, hi, alpha=0.12, color=col)
        ax.set(xlabel="swap fraction p", ylabel="ΔNLL (nats)", title=f"{title} {entry}".strip())
        ax.legend(fontsize=8)
        ax = axes[1, j]
        c = contrasts[(contrasts["layers"] == entry) & (contrasts["estimator"] == "auc")].reset_index(drop=True)
        yy = np.arange(len(c))
        err = np.vstack([(c["estimate"] - c["ci_low"]).to_numpy(float), (c["ci_high"] - c["estimate"]).to_numpy(float)])
        ax.errorbar(c["estimate"], yy, xerr=err, fmt="o", color="tab:red")
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_yticks(yy, c["contrast"])
        ax.set(xlabel="AUC contrast (nats × p), 95 % document bootstrap", title="contrasts")
    fig.tight_layout()
    plt.close(fig)
    return fig
