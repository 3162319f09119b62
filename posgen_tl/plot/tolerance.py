"""Figures for position tolerance (METHOD.md §4–§5): functions DataFrame → matplotlib Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

__all__ = ["plot_tolerance_curves", "plot_dose_response", "plot_length"]


def plot_tolerance_curves(df: pd.DataFrame, *, hue: str | None = None, title: str = "") -> Figure:
    """ΔNLL (target span) vs swap fraction p with 95 % CI bands.

    ``df``: :func:`posgen_tl.analysis.tolerance.curve_summary` output (rows with
    ``estimator == 'dnll'``, columns ``frac, value, ci_low, ci_high`` and ``mode``; an optional
    ``twin`` ('trained'|'random') or ``intervention`` column, or ``hue``, splits the lines).
    """
    d = df[df["estimator"] == "dnll"] if "estimator" in df.columns else df
    keys = [c for c in ([hue] if hue else []) + ["twin", "intervention", "mode"] if c and c in d.columns]
    keys = list(dict.fromkeys(keys))
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for key, g in d.groupby(keys, sort=False) if keys else [((), d)]:
        key = key if isinstance(key, tuple) else (key,)
        g = g.sort_values("frac")
        x = 100 * g["frac"].to_numpy(float)
        ls = "--" if "random" in map(str, key) else "-"
        (line,) = ax.plot(x, g["value"], ls, marker="o", ms=3, label=" / ".join(map(str, key)))
        ax.fill_between(x, g["ci_low"], g["ci_high"], color=line.get_color(), alpha=0.2)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("adjacent pairs swapped in the context, p (%)")
    ax.set_ylabel("ΔNLL on the target span (nats)")
    ax.set_title(title or "Position tolerance (T1 tokens, T2 position ids)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig


def plot_dose_response(df: pd.DataFrame, *, title: str = "") -> Figure:
    """Left: clean-NLL damage vs strength alpha; right: tolerance slope vs damage (CIs).

    ``df``: :func:`posgen_tl.analysis.tolerance.summarize_tolerance` output (columns
    ``kind, intervention, alpha, damage[_lo,_hi], slope[_lo,_hi]``). Rows of one
    intervention family share ``intervention`` up to the ``@alpha`` suffix; ``none`` is
    drawn at alpha = 0 for every family.
    """
    d = df.copy()
    d.attrs = {}  # per-sequence rows ride in attrs; concat would compare them
    d["family"] = d["intervention"].str.replace(r"\s*@.*$", "", regex=True)
    none = d[d["kind"] == "none"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for fam, g in d[d["kind"] != "none"].groupby("family", sort=False):
        g = pd.concat([none.assign(family=fam), g]).sort_values("alpha")
        for ax, (xc, col) in zip(axes, [("alpha", "damage"), ("damage", "slope")]):
            yerr = np.vstack([g[col] - g[f"{col}_lo"], g[f"{col}_hi"] - g[col]])
            ax.errorbar(g[xc], g[col], yerr=yerr, marker="o", ms=3, capsize=2, label=fam)
    axes[0].set_ylabel("clean-NLL damage (nats)")
    axes[0].set_xlabel("strength α")
    axes[1].set_ylabel("tolerance slope dΔNLL/dp")
    axes[1].set_xlabel("clean-NLL damage (nats): compare lines at equal x")
    for ax in axes:
        ax.axhline(0, color="k", lw=0.5)
    axes[1].legend(fontsize=7)
    fig.suptitle(title or "Dose–response of key interventions")
    fig.tight_layout()
    plt.close(fig)
    return fig


def plot_length(df: pd.DataFrame, *, title: str = "") -> Figure:
    """T3: mean NLL per position bucket with CI, one line per distance cap (None = uncapped).

    ``df``: :func:`posgen_tl.analysis.tolerance.length_summary` output
    (``cap, bucket_start, value, ci_low, ci_high``; optional ``twin``).
    """
    fig, ax = plt.subplots(figsize=(5.5, 4))
    keys = ["twin", "cap"] if "twin" in df.columns else ["cap"]
    d = df.assign(cap=df["cap"].astype(object).where(df["cap"].notna(), "none"))
    for key, g in d.groupby(keys, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        g = g.sort_values("bucket_start")
        (line,) = ax.plot(g["bucket_start"], g["value"], marker="o", ms=3, label="cap=" + " / ".join(map(str, key)))
        ax.fill_between(g["bucket_start"], g["ci_low"], g["ci_high"], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("position (bucket start)")
    ax.set_ylabel("mean NLL (nats)")
    ax.set_title(title or "T3: NLL by position, with/without distance cap")
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig
