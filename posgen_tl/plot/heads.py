"""Figures of the head taxonomy (METHOD.md §6), from :mod:`posgen_tl.analysis.taxonomy` frames.

Each function takes the tidy frame of :func:`head_taxonomy` / :func:`head_taxonomy_with_twin`
(or :func:`head_table` where only full-head rows are needed) and returns a matplotlib
Figure with one panel per twin (trained beside its random-init twin). No ``plt.show()``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

__all__ = ["plot_positional_symbolic_plane", "plot_frequency_usage", "plot_taxonomy_vs_share"]

_TWIN_ORDER = ("trained", "random")


def _twins(df: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(df["twin"].astype(str)))
    return [t for t in _TWIN_ORDER if t in present] + [t for t in present if t not in _TWIN_ORDER]


def _heads(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["band"] == -1] if "band" in df else df


def _title(df: pd.DataFrame, twin: str) -> str:
    model = ", ".join(sorted(df["model"].astype(str).unique())) if "model" in df else ""
    return f"{model} — {twin}" if model else twin


def plot_positional_symbolic_plane(head_df: pd.DataFrame, *, margin: float = 0.1) -> Figure:
    """Scatter of each head's positional vs symbolic score, coloured by layer; one panel per
    twin. The band ``|positional − symbolic| ≤ margin`` (label 'mixed') is shaded."""
    df = _heads(head_df)
    twins = _twins(df)
    lmax = max(int(df["layer"].max()), 1)
    fig, axes = plt.subplots(1, len(twins), figsize=(4.6 * len(twins), 4.2), squeeze=False, sharey=True)
    sc = None
    for ax, twin in zip(axes[0], twins):
        g = df[df["twin"] == twin]
        x = np.linspace(-0.05, 1.05, 2)
        ax.fill_between(x, x - margin, x + margin, color="0.9", zorder=0, label="mixed")
        ax.plot(x, x, color="0.6", lw=0.8, zorder=1)
        sc = ax.scatter(g["positional"], g["symbolic"], c=g["layer"], cmap="viridis", vmin=0, vmax=lmax,
                        s=14, alpha=0.85, edgecolors="none", zorder=2)
        counts = g["label"].value_counts()
        txt = "\n".join(f"{k}: {int(counts.get(k, 0))}" for k in ("positional", "symbolic", "mixed"))
        ax.text(0.97, 0.03, txt, transform=ax.transAxes, va="bottom", ha="right", fontsize=8,
                bbox=dict(facecolor="white", edgecolor="0.8", alpha=0.9))
        ax.set(xlim=(-0.05, 1.05), ylim=(-0.05, 1.05), xlabel="positional score", title=_title(df, twin))
    axes[0][0].set_ylabel("symbolic score")
    if sc is not None:
        fig.colorbar(sc, ax=axes[0].tolist(), label="layer", shrink=0.85)
    plt.close(fig)
    return fig


def plot_frequency_usage(bands_or_head_df: pd.DataFrame, *, which: str = "k") -> Figure:
    """Heat map (layer·head) × band of the ``which`` ('k' or 'q') energy share; one panel per
    twin, on one log colour scale (values below ``1e-4·max``, zeros included, at the floor).
    Band 0 is the fastest. Needs the band rows (``band ≥ 0``) of :func:`head_taxonomy`;
    a head-only frame falls back to a bar plot of the frequency centroid per (layer, head)."""
    df = bands_or_head_df
    twins = _twins(df)
    col = f"{which}_energy_share"
    has_bands = "band" in df and (df["band"] >= 0).any() and col in df
    fig, axes = plt.subplots(1, len(twins), figsize=(4.6 * len(twins), 5.2), squeeze=False)
    im = None
    norm = None
    if has_bands:  # one log scale for all panels: shares span orders of magnitude
        vals = df.loc[df["band"] >= 0, col].to_numpy(float)
        vals = vals[np.isfinite(vals) & (vals > 0)]
        hi = float(vals.max()) if vals.size else 1.0
        norm = LogNorm(vmin=max(hi * 1e-4, float(vals.min()) if vals.size else 1e-4), vmax=hi)
    for ax, twin in zip(axes[0], twins):
        g = df[df["twin"] == twin]
        if has_bands:
            b = g[g["band"] >= 0]
            mat = b.pivot_table(index=["layer", "head"], columns="band", values=col, aggfunc="mean")
            arr = np.clip(mat.to_numpy(float), norm.vmin, None)  # exact zeros drawn at the floor
            im = ax.imshow(arr, aspect="auto", cmap="magma", interpolation="nearest", norm=norm)
            layers = mat.index.get_level_values(0).to_numpy()
            starts = np.flatnonzero(np.r_[True, layers[1:] != layers[:-1]])
            step = max(1, len(starts) // 10)
            ax.set_yticks(starts[::step], [str(layers[s]) for s in starts[::step]])
            ax.set(xlabel="band (0 = fastest)", ylabel="layer (heads within)", title=_title(df, twin))
        else:
            h = _heads(g)
            ax.bar(np.arange(len(h)), h[f"{which}_centroid"], width=1.0)
            ax.set(xlabel="layer·head", ylabel=f"{which} frequency centroid", title=_title(df, twin))
    if im is not None:
        fig.colorbar(im, ax=axes[0].tolist(), label=f"{which} energy share (log)", shrink=0.85)
    plt.close(fig)
    return fig


def plot_taxonomy_vs_share(head_df: pd.DataFrame) -> Figure:
    """``positional − symbolic`` (x) against the D3 positional share (y) per head, coloured by
    layer; one panel per twin, Spearman ρ in each title."""
    from posgen_tl.analysis.taxonomy import taxonomy_agreement  # noqa: PLC0415

    df = _heads(head_df)
    agree = taxonomy_agreement(df)
    twins = _twins(df)
    lmax = max(int(df["layer"].max()), 1)
    fig, axes = plt.subplots(1, len(twins), figsize=(4.6 * len(twins), 4.2), squeeze=False, sharey=True)
    sc = None
    for ax, twin in zip(axes[0], twins):
        g = df[df["twin"] == twin]
        sc = ax.scatter(g["positional"] - g["symbolic"], g["positional_share"], c=g["layer"], cmap="viridis",
                        vmin=0, vmax=lmax, s=14, alpha=0.85, edgecolors="none")
        ax.axvline(0, color="0.6", lw=0.8)
        a = agree.get(twin, {})
        ax.set(xlabel="positional − symbolic", ylim=(-0.02, 1.02),
               title=f"{_title(df, twin)}\nSpearman ρ={a.get('rho', np.nan):.2f} (n={a.get('n', 0)})")
    axes[0][0].set_ylabel("D3 positional share V(f)/(V(f)+V(g))")
    if sc is not None:
        fig.colorbar(sc, ax=axes[0].tolist(), label="layer", shrink=0.85)
    plt.close(fig)
    return fig
