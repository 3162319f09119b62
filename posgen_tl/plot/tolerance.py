"""Figures for position tolerance (docs/method.md §4–§5): functions DataFrame → matplotlib Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from posgen_tl.plot._common import ci_lines, finish

__all__ = ["plot_tolerance_curves", "plot_length"]


def plot_tolerance_curves(df: pd.DataFrame, *, hue: str | None = None, title: str = "") -> Figure:
    """ΔNLL (target span) vs swap fraction p with 95 % CI bands.

    ``df``: a document-level curve summary (:func:`posgen_tl.stats.curves.curve_summary` /
    ``unit_summary``: rows with ``estimator == 'dnll'``, columns ``frac, estimate, ci_low, ci_high``
    and ``condition`` or ``mode``; an optional ``twin`` ('trained'|'random') column, or ``hue``, splits
    the lines). The p = 0 point is ΔNLL = 0 by construction and is drawn at 0.
    """
    d = df[df["estimator"] == "dnll"] if "estimator" in df.columns else df
    keys = [c for c in ([hue] if hue else []) + ["twin", "intervention", "condition", "mode"] if c and c in d.columns]
    keys = list(dict.fromkeys(keys))
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ci_lines(ax, d, "frac", keys, xscale=100, linestyle=lambda key: "--" if "random" in map(str, key) else "-")
    return finish(fig, ax, xlabel="adjacent pairs swapped in the context, p (%)", ylabel="ΔNLL on the target span (nats)",
                  title=title or "Position tolerance (T1 tokens, T2 position ids)", zero=True)


def plot_length(df: pd.DataFrame, *, title: str = "") -> Figure:
    """T3: mean NLL per position bucket with CI, one line per distance cap (None = uncapped).

    ``df``: :func:`posgen_tl.experiments.tolerance.length_summary` output
    (``cap, bucket_start, value, ci_low, ci_high``; optional ``twin``).
    """
    fig, ax = plt.subplots(figsize=(5.5, 4))
    keys = ["twin", "cap"] if "twin" in df.columns else ["cap"]
    d = df.assign(cap=df["cap"].astype(object).where(df["cap"].notna(), "none"))
    ci_lines(ax, d, "bucket_start", keys, label=lambda key: "cap=" + " / ".join(map(str, key)))
    return finish(fig, ax, xlabel="position (bucket start)", ylabel="mean NLL (nats)",
                  title=title or "T3: NLL by position, with/without distance cap")
