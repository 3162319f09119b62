"""Figures of the head taxonomy (docs/method.md §6), from :mod:`posgen_tl.experiments.taxonomy` frames.

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

__all__ = ["plot_positional_symbolic_plane", "plot_frequency_usage", "plot_taxonomy_vs_share", "plot_label_counts"]

_TWIN_ORDER = ("trained", "random")
_LABELS = ("positional", "symbolic", "both", "neither", "undefined")
_COLOURS = {"positional": "tab:blue", "symbolic": "tab:orange", "both": "tab:purple", "neither": "0.6",
            "undefined": "0.85"}


def _twins(df: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(df["twin"].astype(str)))
    return [t for t in _TWIN_ORDER if t in present] + [t for t in present if t not in _TWIN_ORDER]


def _heads(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["band"] == -1] if "band" in df else df


def _title(df: pd.DataFrame, twin: str) -> str:
    model = ", ".join(sorted(df["model"].astype(str).unique())) if "model" in df else ""
    return f"{model} — {twin}" if model else twin


def plot_positional_symbolic_plane(head_df: pd.DataFrame) -> Figure:
    """Scatter of each head's positional vs symbolic score (row-centred logit correlations),
    coloured by label; one panel per twin. Dashed lines: ``min_score`` (if the frame carries
    it); the dotted square is the largest null 95 % quantile of the panel's heads. Label
    counts in the corner ('undefined' heads have no score and are not drawn)."""
    df = _heads(head_df)
    twins = _twins(df)
    fig, axes = plt.subplots(1, len(twins), figsize=(4.6 * len(twins), 4.4), squeeze=False, sharey=True)
    for ax, twin in zip(axes[0], twins):
        g = df[df["twin"] == twin]
        for lab in _LABELS:
            s = g[g["label"] == lab]
            if len(s):
                ax.scatter(s["positional"], s["symbolic"], s=14, alpha=0.85, edgecolors="none",
                           color=_COLOURS[lab], label=lab, zorder=2)
        if "min_score" in g and len(g):
            m = float(g["min_score"].iloc[0])
            ax.axvline(m, color="0.5", ls="--", lw=0.8)
            ax.axhline(m, color="0.5", ls="--", lw=0.8)
        if "null_q" in g and g["null_q"].notna().any():
            q = float(g["null_q"].max())
            ax.plot([-q, q, q, -q, -q], [-q, -q, q, q, -q], color="0.3", ls=":", lw=0.8)
        counts = g["label"].value_counts()
        txt = "\n".join(f"{k}: {int(counts.get(k, 0))}" for k in _LABELS)
        ax.text(0.97, 0.97, txt, transform=ax.transAxes, va="top", ha="right", fontsize=8,
                bbox=dict(facecolor="white", edgecolor="0.8", alpha=0.9))
        ax.set(xlim=(-0.3, 1.05), ylim=(-0.3, 1.05), xlabel="positional score (same positions)", title=_title(df, twin))
        ax.legend(loc="lower right", fontsize=7, frameon=False)
    axes[0][0].set_ylabel("symbolic score (follows the tokens)")
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


def plot_taxonomy_vs_share(head_df: pd.DataFrame, link: pd.DataFrame | None = None) -> Figure:
    """D3 positional share ``V(f)/(V(f)+V(g))`` (global k̄) per head, grouped by label (strip
    plot with medians); one panel per twin. ``link``: the Mann–Whitney test of positional vs symbolic
    heads (:func:`posgen_tl.experiments.taxonomy.share_by_class`, a taxonomy Result's ``link`` table),
    written in each title where given (a figure draws; it does not compute the test)."""
    df = _heads(head_df)
    link = pd.DataFrame(columns=["twin"]) if link is None else link
    twins = _twins(df)
    fig, axes = plt.subplots(1, len(twins), figsize=(4.6 * len(twins), 4.2), squeeze=False, sharey=True)
    rng = np.random.default_rng(0)
    for ax, twin in zip(axes[0], twins):
        g = df[df["twin"] == twin]
        for x, lab in enumerate(_LABELS):
            v = g.loc[g["label"] == lab, "positional_share"].dropna().to_numpy(float)
            if len(v):
                ax.scatter(x + rng.uniform(-0.18, 0.18, len(v)), v, s=10, alpha=0.7, color=_COLOURS[lab],
                           edgecolors="none")
                ax.hlines(np.median(v), x - 0.3, x + 0.3, color="k", lw=1.5)
        r = link[link["twin"] == twin]
        t = "" if r.empty else (f"\nMann–Whitney pos vs sym p={r['p'].iloc[0]:.2g} "
                                f"(n={int(r['n_a'].iloc[0])}/{int(r['n_b'].iloc[0])})")
        ax.set_xticks(range(len(_LABELS)), [f"{lab}\n({int((g['label'] == lab).sum())})" for lab in _LABELS],
                      fontsize=7)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{_title(df, twin)}{t}", fontsize=9)
    axes[0][0].set_ylabel("D3 positional share V(f)/(V(f)+V(g))")
    plt.close(fig)
    return fig


def plot_label_counts(df: pd.DataFrame) -> Figure:
    """Label counts per band (band rows of :func:`head_taxonomy`: each band as a 2-D head),
    stacked bars over bands, one panel per twin; band 0 is the fastest."""
    sub = df[df["band"] >= 0]
    twins = _twins(df)
    fig, axes = plt.subplots(1, len(twins), figsize=(4.6 * len(twins), 3.8), squeeze=False, sharey=True)
    for ax, twin in zip(axes[0], twins):
        g = sub[sub["twin"] == twin]
        tab = g.groupby(["band", "label"]).size().unstack(fill_value=0).reindex(columns=list(_LABELS), fill_value=0)
        bottom = np.zeros(len(tab))
        for lab in _LABELS:
            ax.bar(tab.index, tab[lab], bottom=bottom, width=1.0, color=_COLOURS[lab], label=lab)
            bottom += tab[lab].to_numpy()
        ax.set(xlabel="band (0 = fastest)", title=_title(df, twin))
    axes[0][0].set_ylabel("heads (layer × head) per band")
    axes[0][0].legend(fontsize=7, frameon=False)
    plt.close(fig)
    return fig
