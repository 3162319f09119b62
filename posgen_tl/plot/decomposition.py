"""Figures for docs/method.md §2: decomposition scores by layer (trained vs random twin) and the
Figure-1 view of one head (logit map W, positional f, semantic g, remainder W − f − g).

Functions take the tidy frame of :func:`posgen_tl.experiments.decomposition.decompose_model` or
the :class:`~posgen_tl.experiments.head_maps.HeadDecomposition` of :func:`posgen_tl.decompose_head`
and return a matplotlib ``Figure`` (built with pyplot, closed before it is returned, so
Jupyter shows it exactly once as the cell's value); nothing is computed, shown or saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

if TYPE_CHECKING:
    from posgen_tl.experiments.head_maps import HeadDecomposition

__all__ = ["plot_r_by_layer", "plot_head_maps"]

_COLOURS = {"D1": "tab:blue", "D2": "tab:orange", "D3": "tab:green", "D3 global": "tab:green",
            "D3 per_sequence": "tab:red", "D3 given": "tab:purple"}
_STYLES = {"trained": "-", "random": "--"}


def plot_r_by_layer(
    df: pd.DataFrame,
    metrics: Sequence[str] = ("r", "r_within"),
    sink_excluded: bool | None = None,
    band: bool = True,
) -> Figure:
    """Per-layer mean of each metric (one panel per metric), one curve per estimator and k̄
    kind (colour: D3 with the global k̄ and with the per-sequence k̄ apart) and twin (trained
    solid, random dashed), ± std over heads × sequences as a faint band.

    ``sink_excluded``: which rows to plot; ``None`` = the sink-excluded rows when present.
    Returns the Figure.
    """
    if sink_excluded is None:
        sink_excluded = bool(df["sink_excluded"].any())
    d = df[df["sink_excluded"] == sink_excluded].copy()
    km = d["k_mean"].astype(str) if "k_mean" in d else pd.Series("none", index=d.index)
    d["curve"] = [e if k in ("none", "nan") else f"{e} {k}" for e, k in zip(d["estimator"], km)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8), squeeze=False, layout="constrained")
    axes = axes[0]
    for ax, metric in zip(axes, metrics):
        for (est, twin), g in d.groupby(["curve", "twin"], sort=True):
            s = g.groupby("layer")[metric].agg(["mean", "std"])
            ax.plot(s.index, s["mean"], _STYLES.get(twin, ":"), color=_COLOURS.get(est), marker="o", ms=3,
                    label=f"{est} {twin}")
            if band:
                ax.fill_between(s.index, s["mean"] - s["std"], s["mean"] + s["std"], color=_COLOURS.get(est), alpha=0.08)
        ax.set_xlabel("layer")
        ax.set_ylabel(f"mean {metric}")
        ax.set_title(f"{metric} ({'sink excluded' if sink_excluded else 'sink kept'})")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2)
    models = ", ".join(map(str, d["model"].unique())) if "model" in d else ""
    fig.suptitle(f"Logit-map decompositions by layer — {models} (solid trained, dashed random twin)", fontsize=10)
    plt.close(fig)
    return fig


def plot_head_maps(result: HeadDecomposition, *, show_a: bool = True) -> Figure:
    """Figure-1 view of one head: logits W, positional f, semantic g and the remainder
    W − f − g on one colour scale (causal entries only, the rest blank), plus D1's distance
    term ``a[i−j]`` if ``show_a``.

    ``result``: :func:`posgen_tl.decompose_head` output (nothing is computed here).
    Returns the Figure (closed from pyplot: Jupyter shows it once, as the cell's value).
    """
    mask = result.mask.numpy()
    maps = {"logits W": result.W, "positional f": result.f, "semantic g": result.g,
            "remainder W − f − g": result.remainder}
    ncols = 4 + int(show_a)
    fig, axes = plt.subplots(1, ncols, figsize=(3.3 * ncols, 3.4), layout="constrained")
    lim = float(np.quantile(np.abs(result.W.numpy()[mask]), 0.99)) if mask.any() else 1.0
    im = None
    for ax, (name, m) in zip(axes, maps.items()):
        im = ax.imshow(np.where(mask, m.numpy(), np.nan), cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
    fig.colorbar(im, ax=axes[3], shrink=0.8)
    if show_a:
        ax = axes[4]
        ax.plot(np.arange(len(result.a)), result.a.numpy(), lw=1)
        ax.set_title("D1 distance term a[i − j]", fontsize=9)
        ax.set_xlabel("i − j")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result.model_name} layer {result.layer}, head {result.head}: D3 r = {result.score('D3', 'r'):.3f}, "
                 f"within-row r = {result.score('D3', 'r_within'):.3f} (k̄ {result.k_mean_kind.replace('_', '-')}; "
                 f"first {result.sink} key(s) excluded from the scores)", fontsize=10)
    plt.close(fig)
    return fig
