"""Figures for METHOD.md §2: decomposition scores by layer (trained vs random twin) and the
Figure-1 view of one head (logit map W, positional f, semantic g, remainder W − f − g).

Functions take the tidy frame of :func:`posgen_tl.analysis.decomposition.decompose_model`
(or a model and tokens) and return a matplotlib ``Figure``; nothing is shown or saved.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from matplotlib.figure import Figure
from torch import Tensor

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
    fig = Figure(figsize=(5.2 * len(metrics), 3.8), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
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
    return fig


def plot_head_maps(
    model: Any,
    tokens: Int[Tensor, "batch pos"] | Int[Tensor, "pos"],
    layer: int,
    head: int,
    k_mean: Tensor | None = None,
    *,
    sink: int = 1,
    show_a: bool = True,
) -> Figure:
    """Figure-1 view of one head on the first sequence of ``tokens``: W, f, g and W − f − g
    (:func:`posgen_tl.decompose.d3_split`; causal entries only, the rest blank), plus D1's
    distance term ``a[i−j]`` if ``show_a``.

    ``k_mean`` ``[kv_head, d_head]``: the mean pre-rotation key; ``None`` = computed from
    ``tokens`` themselves (all rows, first ``sink`` positions excluded — say so when
    publishing; :func:`posgen_tl.analysis.decomposition.reference_key_means` gives a
    disjoint-reference one). Returns the Figure.
    """
    from posgen_tl.analysis.decomposition import reference_key_means  # noqa: PLC0415
    from posgen_tl.capture import capture_qk  # noqa: PLC0415
    from posgen_tl.decompose import causal_mask, d3_split, fit_additive, pearson_r, within_row_r  # noqa: PLC0415

    tokens = tokens[None] if tokens.ndim == 1 else tokens
    if k_mean is None:
        k_mean = reference_key_means(model, tokens, [layer], sink=sink, progress=False)[layer]
    cap = capture_qk(model, tokens[:1], [layer])[layer]
    split = d3_split(cap.q, cap.k, k_mean, cap.positions, cap.rope)
    n = cap.q.shape[1]
    mask = causal_mask(n, 0, cap.rope.sliding_window)
    w, f, g = (x[0, head].cpu() for x in (split.W, split.f, split.g))
    maps = {"logits W": w, "positional f": f, "semantic g": g, "remainder W − f − g": w - f - g}
    score_mask = causal_mask(n, sink, cap.rope.sliding_window)
    r = float(pearson_r(w, f + g, score_mask))
    rw = float(within_row_r(w, f + g, score_mask))

    ncols = 4 + int(show_a)
    fig = Figure(figsize=(3.3 * ncols, 3.4), layout="constrained")
    axes = fig.subplots(1, ncols)
    lim = float(torch.quantile(w[mask].abs().double(), 0.99))
    for ax, (name, m) in zip(axes, maps.items()):
        shown = np.where(mask.numpy(), m.numpy(), np.nan)
        im = ax.imshow(shown, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
    fig.colorbar(im, ax=axes[3], shrink=0.8)
    if show_a:
        fit = fit_additive(split.W[0, head], causal_mask(n, sink, cap.rope.sliding_window), three_axis=True)
        ax = axes[4]
        ax.plot(np.arange(n), fit.a.numpy(), lw=1)
        ax.set_title("D1 distance term a[i − j]", fontsize=9)
        ax.set_xlabel("i − j")
        ax.grid(alpha=0.3)
    fig.suptitle(f"layer {layer}, head {head}: D3 r = {r:.3f}, within-row r = {rw:.3f} "
                 f"(first {sink} key(s) excluded from the scores)", fontsize=10)
    return fig
