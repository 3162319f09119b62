"""Figures for docs/method.md §3 (feature pattern): each takes tidy frames and returns a Figure.

Every figure shows the trained model beside its random-init twin, on a shared scale.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = [
    "plot_band_heatmaps",
    "plot_pattern_distribution",
    "plot_pattern_vs_d3",
    "plot_phase_histogram",
]

_TWIN_ORDER = ("trained", "random")
_COLOURS = {"trained": "tab:blue", "random": "tab:orange"}


def _twins(df: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(df["twin"]))
    return [t for t in _TWIN_ORDER if t in present] + [t for t in present if t not in _TWIN_ORDER]


def _one_model(df: pd.DataFrame, model: str | None) -> tuple[pd.DataFrame, str]:
    models = list(dict.fromkeys(df["model"]))
    if model is None:
        if len(models) > 1:
            raise ValueError(f"frame holds several models {models}: pass model=")
        model = models[0] if models else ""
    return df[df["model"] == model], str(model)


def plot_band_heatmaps(
    bands: pd.DataFrame, which: str = "k", stat: str = "rho_cross", *, model: str | None = None,
    cmap: str = "viridis",
) -> Figure:
    """Band × layer heat maps of ``stat`` (mean over heads), one panel per twin, one colour scale.

    Args:
        bands: ``PatternResult.bands`` / ``TwinPattern.bands`` (columns model, twin, layer,
            which, head, band, ``stat``).
        which: ``"q"`` or ``"k"``; stat: e.g. ``"rho_cross"`` (default), ``"rho_within"``,
            ``"stability"``, ``"energy_share"``, ``"phase_concentration"``, ``"offset_ratio"`` (legacy plug-in).

    Returns:
        Figure with one image per twin (x = layer, y = band, band 0 = fastest at the top);
        NaN cells (a band with zero energy, e.g. zeroed by a QK-norm weight) are white.
    """
    df, model = _one_model(bands[bands["which"] == which], model)
    if df.empty:
        raise ValueError(f"no rows with which={which!r}")
    twins = _twins(df)
    grids = {t: df[df["twin"] == t].pivot_table(index="band", columns="layer", values=stat, aggfunc="mean")
             for t in twins}
    vals = np.concatenate([g.to_numpy().ravel() for g in grids.values()])
    vals = vals[np.isfinite(vals)]
    vmin, vmax = (float(vals.min()), float(vals.max())) if vals.size else (0.0, 1.0)
    if stat in ("offset_ratio", "phase_concentration", "rho_within"):
        vmin, vmax = 0.0, 1.0  # bounded statistics: the natural scale
    elif stat == "rho_cross":
        vmin, vmax = min(0.0, vmin), 1.0  # cross-fitted: may dip below 0 by noise
    fig, axes = plt.subplots(1, len(twins), figsize=(4.2 * len(twins) + 0.8, 4.0), squeeze=False,
                             sharey=True, constrained_layout=True)
    im = None
    for ax, t in zip(axes[0], twins):
        g = grids[t]
        im = ax.imshow(g.to_numpy(), aspect="auto", origin="upper", vmin=vmin, vmax=vmax, cmap=cmap,
                       interpolation="nearest",
                       extent=(g.columns.min() - 0.5, g.columns.max() + 0.5, g.index.max() + 0.5, g.index.min() - 0.5))
        ax.set_title(f"{t}")
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_facecolor("white")  # NaN cells (bands with zero energy) show white
    axes[0][0].set_ylabel("band (0 = fastest)")
    fig.colorbar(im, ax=axes[0].tolist(), label=f"{stat} ({which}, mean over heads)")
    fig.suptitle(f"{model}: {which} {stat} by band and layer")
    plt.close(fig)
    return fig


def plot_pattern_distribution(heads: pd.DataFrame, column: str = "pred_d3_err_global", *,
                              model: str | None = None, bins: int = 30) -> Figure:
    """Histogram of a per-head column (default the rotation-aware pattern score with the global
    k̄), trained vs random twin."""
    df, model = _one_model(heads, model)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), constrained_layout=True)
    vals = df[column].to_numpy(dtype=float)
    vals = vals[np.isfinite(vals)]
    edges = np.linspace(vals.min(), vals.max() + 1e-12, bins + 1) if vals.size else bins
    for t in _twins(df):
        x = df.loc[df["twin"] == t, column].to_numpy(dtype=float)
        ax.hist(x[np.isfinite(x)], bins=edges, alpha=0.6, label=f"{t} (median {np.nanmedian(x):.3f})",
                color=_COLOURS.get(t))
    ax.set_xlabel(column)
    ax.set_ylabel("heads")
    ax.set_title(f"{model}: {column} per head")
    ax.legend()
    plt.close(fig)
    return fig


def plot_pattern_vs_d3(merged: pd.DataFrame, x: str = "pred_d3_err", y: str = "r_within",
                       k_mean: str | None = "global") -> Figure:
    """Scatter of the per-head pattern score vs D3 within-row r, coloured by twin (log x for
    ``pred_d3_err``).

    ``merged`` is the first output of :func:`posgen_tl.experiments.pattern.link_to_decomposition`;
    ``k_mean`` picks its rows of one k̄ kind (``None`` = all rows). The legend gives each twin's
    Spearman rank correlation across heads (each twin apart — never pooled).
    """
    if k_mean is not None and "k_mean" in merged:
        merged = merged[merged["k_mean"] == k_mean]
    fig, ax = plt.subplots(figsize=(5.5, 4.2), constrained_layout=True)
    for t in _twins(merged):
        g = merged[merged["twin"] == t]
        ok = np.isfinite(g[x].astype(float)) & np.isfinite(g[y].astype(float))
        r = g.loc[ok, x].corr(g.loc[ok, y], method="spearman") if ok.sum() > 2 else float("nan")
        ax.scatter(g[x], g[y], s=12, alpha=0.7, color=_COLOURS.get(t),
                   label=f"{t} (Spearman {r:.2f}, n = {int(ok.sum())})")
    if x == "pred_d3_err" and (merged[x] > 0).all():
        ax.set_xscale("log")
    ax.set_xlabel(f"{x} (per head)")
    ax.set_ylabel(f"D3 {y} (mean over sequences)")
    ax.set_title(f"feature pattern vs D3 decomposition (k̄: {k_mean or 'all'})")
    ax.legend()
    plt.close(fig)
    return fig


def plot_phase_histogram(phases: pd.DataFrame, *, bins: int = 36) -> Figure:
    """Polar histogram of one band's phase angle, one panel per twin (trained beside random).

    ``phases``: :func:`posgen_tl.experiments.head_maps.phase_angles_with_twin` (or
    :func:`~posgen_tl.experiments.head_maps.phase_angles`) output — columns ``twin, layer, which,
    head, band, phase``. Each panel's title gives the mean resultant length ``R`` (1 = all
    tokens share one phase, ≈ 0 = uniform).
    """
    if phases.empty:
        raise ValueError("no phase angles to plot (empty frame)")
    twins = _twins(phases)
    fig, axes = plt.subplots(1, len(twins), figsize=(4 * len(twins), 4), subplot_kw={"projection": "polar"},
                             squeeze=False, constrained_layout=True)
    edges = np.linspace(-np.pi, np.pi, bins + 1)
    for ax, label in zip(axes[0], twins):
        ph = phases.loc[phases["twin"] == label, "phase"].to_numpy(float)
        counts, _ = np.histogram(ph, bins=edges)
        dens = counts / max(1, counts.sum())
        ax.bar(edges[:-1], dens, width=np.diff(edges), align="edge", color=_COLOURS.get(label), alpha=0.75)
        R = float(np.abs(np.exp(1j * ph).mean())) if ph.size else float("nan")
        ax.set_title(f"{label}: R = {R:.2f} (n = {ph.size})")
        ax.set_yticklabels([])
    r0 = phases.iloc[0]
    fig.suptitle(f"layer {r0['layer']}, {r0['which']} head {r0['head']}, band {r0['band']}: phase of z_m")
    plt.close(fig)
    return fig
