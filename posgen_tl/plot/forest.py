"""The estimation (forest) plot that opens a results page: one row per run, its effect and 95 % interval."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = ["plot_forest"]


def plot_forest(df: pd.DataFrame, *, title: str = "") -> Figure:
    """Effects with their 95 % intervals, one panel per measure and one row per run.

    ``df``: one row per headline, columns ``what`` (the measure with its unit: one panel each), ``label`` (the
    row's name, e.g. ``"smollm2-135m · pydoc"``), ``effect``, ``ci_low``, ``ci_high`` (NaN where the measure has no
    interval: a point alone), ``verdict`` (printed at the row's right) and ``exploratory`` (drawn hollow). A dotted
    line marks 0 where a panel's range comes near it.

    Returns:
        the Figure (closed: Jupyter shows it once, as a cell's value).

    Raises:
        ValueError: ``df`` is empty or lacks a column.
    """
    need = {"what", "label", "effect", "ci_low", "ci_high", "verdict", "exploratory"}
    if missing := need - set(df.columns):
        raise ValueError(f"plot_forest needs the columns {sorted(missing)}")
    if df.empty:
        raise ValueError("plot_forest needs at least one row")
    whats = list(dict.fromkeys(df["what"]))
    heights = [max(1, int((df["what"] == w).sum())) for w in whats]
    fig, axes = plt.subplots(len(whats), 1, figsize=(7.5, 0.9 + 0.42 * sum(heights) + 0.55 * len(whats)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, what in zip(axes[:, 0], whats):
        g = df[df["what"] == what].reset_index(drop=True)
        ys = np.arange(len(g))[::-1]
        eff = g["effect"].astype(float).to_numpy()
        lo, hi = g["ci_low"].astype(float).to_numpy(), g["ci_high"].astype(float).to_numpy()
        has = np.isfinite(lo) & np.isfinite(hi)
        ax.hlines(ys[has], lo[has], hi[has], color="#2a5d9f", lw=2)
        expl = g["exploratory"].astype(bool).to_numpy()
        ax.plot(eff[~expl], ys[~expl], "o", color="#2a5d9f", ms=6)
        ax.plot(eff[expl], ys[expl], "o", mfc="white", mec="#2a5d9f", ms=6)
        vals = np.concatenate([eff[np.isfinite(eff)], lo[has], hi[has]])
        if vals.size and vals.min() <= 0.25 * np.abs(vals).max() and vals.max() >= -0.25 * np.abs(vals).max():
            ax.axvline(0, color="k", lw=0.7, ls=":")
        ax.set_yticks(ys, g["label"].tolist(), fontsize=8)
        ax.set_ylim(-0.7, len(g) - 0.3)
        for y, v in zip(ys, g["verdict"]):
            ax.annotate(str(v), (1.01, y), xycoords=("axes fraction", "data"), va="center", fontsize=7.5)
        ax.set_title(str(what), fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))  # at most ~6 labels: small-number ticks never run together
    if title:
        fig.suptitle(title, fontsize=10)
    fig.text(0.01, 0.005, "hollow: exploratory (fewer than 32 documents); bars: 95 % intervals", fontsize=7,
             color="#555")
    fig.tight_layout(rect=(0, 0.03, 0.8, 1))
    plt.close(fig)
    return fig
