"""Figures for position tolerance (METHOD.md §4–§5): functions DataFrame → matplotlib Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from posgen_tl.plot._common import ci_lines

__all__ = ["plot_tolerance_curves", "plot_causal_conditions", "plot_length"]


def plot_tolerance_curves(df: pd.DataFrame, *, hue: str | None = None, title: str = "") -> Figure:
    """ΔNLL (target span) vs swap fraction p with 95 % CI bands.

    ``df``: :func:`posgen_tl.experiments.tolerance.curve_summary` output (rows with
    ``estimator == 'dnll'``, columns ``frac, value, ci_low, ci_high`` and ``mode``; an optional
    ``twin`` ('trained'|'random') or ``intervention`` column, or ``hue``, splits the lines).
    """
    d = df[df["estimator"] == "dnll"] if "estimator" in df.columns else df
    keys = [c for c in ([hue] if hue else []) + ["twin", "intervention", "mode"] if c and c in d.columns]
    keys = list(dict.fromkeys(keys))
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ci_lines(ax, d, "frac", keys, xscale=100, linestyle=lambda key: "--" if "random" in map(str, key) else "-")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("adjacent pairs swapped in the context, p (%)")
    ax.set_ylabel("ΔNLL on the target span (nats)")
    ax.set_title(title or "Position tolerance (T1 tokens, T2 position ids)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig


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


def plot_length(df: pd.DataFrame, *, title: str = "") -> Figure:
    """T3: mean NLL per position bucket with CI, one line per distance cap (None = uncapped).

    ``df``: :func:`posgen_tl.experiments.tolerance.length_summary` output
    (``cap, bucket_start, value, ci_low, ci_high``; optional ``twin``).
    """
    fig, ax = plt.subplots(figsize=(5.5, 4))
    keys = ["twin", "cap"] if "twin" in df.columns else ["cap"]
    d = df.assign(cap=df["cap"].astype(object).where(df["cap"].notna(), "none"))
    ci_lines(ax, d, "bucket_start", keys, label=lambda key: "cap=" + " / ".join(map(str, key)))
    ax.set_xlabel("position (bucket start)")
    ax.set_ylabel("mean NLL (nats)")
    ax.set_title(title or "T3: NLL by position, with/without distance cap")
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig
