"""Figures of the per-head gap experiment (:mod:`posgen_tl.experiments.gap_attention`)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

__all__ = ["plot_gap_heads"]


def plot_gap_heads(rows: pd.DataFrame, *, title: str = "") -> Figure:
    """Per head: attention change under the gap (mean KL over sequences) vs D3's positional share.

    ``rows``: :func:`posgen_tl.experiments.gap_attention.gap_attention` output.
    """
    h = rows.groupby(["layer", "head"])[["kl", "f_share"]].mean().reset_index()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    sc = ax.scatter(h["f_share"], h["kl"], c=h["layer"], s=12, cmap="viridis")
    fig.colorbar(sc, ax=ax, label="layer")
    ax.set_xlabel("D3 positional share of within-row logit variance (f_share)")
    ax.set_ylabel("KL(attention with gap ‖ without), nats")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_title(title or "Which heads change under the gap")
    fig.tight_layout()
    plt.close(fig)  # returned, not left open: Jupyter shows it once
    return fig
