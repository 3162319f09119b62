"""Figures for longer texts (METHOD §7) and the sufficiency test (§5): DataFrame → matplotlib Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from posgen_tl.plot._common import ci_lines

__all__ = ["plot_gap_probe", "plot_window_removal", "plot_sufficiency", "plot_gap_heads"]


def _nll_by(summary: pd.DataFrame, x: str, xlabel: str, ylabel: str, title: str) -> Figure:
    """NLL (``estimator == 'nll'`` rows) vs ``x``, one line with its 95 % CI band per condition."""
    d = summary[summary["estimator"] == "nll"]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ci_lines(ax, d, x, "condition")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)  # returned, not left open: Jupyter shows it once
    return fig


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


def plot_sufficiency(summary: pd.DataFrame, *, title: str = "") -> Figure:
    """ΔNLL (substituted − clean) per layer group and source, 95 % CIs, log-free bars.

    ``summary``: :func:`posgen_tl.experiments.sufficiency.sufficiency_summary` (``estimator == 'dnll'``).
    """
    d = summary[summary["estimator"] == "dnll"]
    groups = list(dict.fromkeys(d["group"]))
    sources = list(dict.fromkeys(d["source"]))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    w = 0.8 / max(len(sources), 1)
    for k, s in enumerate(sources):
        g = d[d["source"] == s].set_index("group").reindex(groups)
        x = np.arange(len(groups)) + (k - (len(sources) - 1) / 2) * w
        err = np.vstack([g["value"] - g["ci_low"], g["ci_high"] - g["value"]])
        ax.bar(x, g["value"], w, yerr=err, capsize=2, label=s)
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("layers whose logits are substituted")
    ax.set_ylabel("ΔNLL on the target span (nats)")
    ax.set_title(title or "Sufficiency: substituting the logits by a decomposition")
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)  # returned, not left open: Jupyter shows it once
    return fig


def plot_gap_heads(rows: pd.DataFrame, *, title: str = "") -> Figure:
    """Per head: attention change under the gap (mean KL over sequences) vs D3's positional share.

    ``rows``: :func:`posgen_tl.experiments.length.gap_attention` output.
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
