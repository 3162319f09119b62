"""Figures of the causal test (:mod:`posgen_tl.experiments.causal`)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

__all__ = ["plot_causal_conditions"]


def plot_causal_conditions(df: pd.DataFrame, *, title: str = "") -> Figure:
    """Left: tolerance slope vs clean-NLL damage per condition; right: attention change per condition.

    ``df``: the ``conditions`` table of :func:`posgen_tl.experiments.causal.causal_study`
    (columns ``condition, damage[_lo,_hi], slope[_lo,_hi]`` and, if present, ``attn_kl[_lo,_hi]``).
    Conditions at equal damage are the comparisons that mean something (matched controls).
    """
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for r in df.itertuples(index=False):
        axes[0].errorbar([r.damage], [r.slope], xerr=[[r.damage - r.damage_lo], [r.damage_hi - r.damage]],
                         yerr=[[r.slope - r.slope_lo], [r.slope_hi - r.slope]], marker="o", ms=4, capsize=2,
                         label=r.condition)
    axes[0].set_xlabel("clean-NLL damage (nats)")
    axes[0].set_ylabel("tolerance slope dΔNLL/dp")
    axes[0].legend(fontsize=7)
    if "attn_kl" in df.columns:
        kl = df["attn_kl"].fillna(0).to_numpy()
        err = np.vstack([kl - df["attn_kl_lo"].fillna(0), df["attn_kl_hi"].fillna(0) - kl])
        axes[1].bar(df["condition"], kl, yerr=err, capsize=2, color="tab:gray")
    axes[1].set_ylabel("attention change: mean KL(clean ‖ edited) (nats)")
    for ax in axes:
        ax.axhline(0, color="k", lw=0.5)
    fig.suptitle(title or "Causal test: conditions")
    fig.tight_layout()
    plt.close(fig)
    return fig
