"""Figures of the patching sweep (:mod:`posgen_tl.experiments.patching`): a table in, a Figure out."""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.patches import Rectangle

__all__ = ["plot_patching_heatmap", "plot_patching_maps"]


def _value(maps: list[pd.DataFrame], value: str) -> str:
    """``value``, or ``"effect"`` where the recovery is asked for but undefined in every map (no detectable damage)."""
    return "effect" if value == "recovery" and all(m["recovery"].isna().all() for m in maps) else value


def _panel(ax: Axes, heads: pd.DataFrame, *, use: str, lim: float, nh: int, n_layers: int | None,
           title: str) -> AxesImage:
    """Draw one layer × head map on ``ax``: one row per patched layer (labelled with its index), ``use`` on the
    −lim … lim diverging scale (clipped), significant heads outlined, heads without a value grey."""
    rows = sorted(int(x) for x in heads["layer"].unique())
    row_of = {layer: i for i, layer in enumerate(rows)}
    grid = np.full((len(rows), nh), np.nan)
    for r in heads.itertuples():
        grid[row_of[int(r.layer)], int(r.head)] = getattr(r, use)
    cmap = plt.get_cmap("RdBu").with_extremes(bad="0.85")  # a head without a value: grey, never white = 0
    im = ax.imshow(np.clip(grid, -lim, lim), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto", origin="upper",
                   interpolation="nearest")
    for r in heads[heads["significant"].astype(bool)].itertuples():
        ax.add_patch(Rectangle((int(r.head) - 0.5, row_of[int(r.layer)] - 0.5), 1, 1, fill=False, ec="black", lw=1.8))
    ax.set_xticks(range(nh))
    step = max(1, len(rows) // 15)
    ax.set_yticks(range(0, len(rows), step), [str(layer) for layer in rows[::step]])
    of = f" ({len(rows)} of {n_layers} layers patched)" if n_layers is not None and len(rows) < n_layers else ""
    ax.set(xlabel="head", ylabel="layer" + of, title=title)
    return im


def _bar_label(use: str, short: bool = False) -> str:
    if short:
        return ("normalised recovery (1 = all the damage)" if use == "recovery"
                else "mean effect (nats); recovery undefined:\nno detectable damage")
    return ("normalised recovery (1 = the patch accounts for all the damage)" if use == "recovery"
            else "mean effect (nats) — recovery undefined: no detectable damage")


def _limit(maps: list[pd.DataFrame], use: str) -> float:
    if use == "recovery":
        return 1.0
    vals = np.concatenate([m[use].to_numpy(float) for m in maps])
    vals = vals[np.isfinite(vals)]
    return float(np.abs(vals).max()) if len(vals) and np.abs(vals).max() > 0 else 1.0


def plot_patching_heatmap(heads: pd.DataFrame, *, n_layers: int | None = None, value: str = "recovery",
                          title: str = "") -> Figure:
    """TransformerLens-style layer × head map of ONE (quantity, direction): ``value`` (default the normalised
    recovery) on a fixed −1 … 1 diverging scale (values beyond are clipped to the end colours, so two maps read
    alike), heads significant at the family-wise level outlined in black. Where the recovery is undefined (the
    corruption did no detectable damage) the mean effect in nats is drawn instead, on its own symmetric scale, and
    the colour bar says so.

    Rows are the patched layers only, labelled with their indices (``n_layers``: the model's, named in the axis
    label when fewer were patched); a head without a value is grey.

    ``heads``: rows of the ``heads`` table of :class:`posgen_tl.experiments.patching.Result` for one quantity and
    direction (columns ``layer, head, recovery, effect, significant``)."""
    use = _value([heads], value)
    nh = int(heads["head"].max() + 1)
    n_rows = heads["layer"].nunique()
    fig, ax = plt.subplots(figsize=(1.6 + 0.42 * nh, 1.2 + 0.28 * n_rows))
    im = _panel(ax, heads, use=use, lim=_limit([heads], use), nh=nh, n_layers=n_layers, title=title)
    fig.colorbar(im, ax=ax, label=_bar_label(use), shrink=0.8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def plot_patching_maps(maps: Mapping[str, pd.DataFrame], *, n_layers: int | None = None, value: str = "recovery",
                       title: str = "", ncols: int = 2) -> Figure:
    """Several layer × head maps side by side on ONE colour scale (e.g. a term patched in both directions, beside
    its random-k̄ control): ``maps`` is ``{panel title: heads rows}`` (as for :func:`plot_patching_heatmap`),
    ``ncols`` panels per row. The scale is −1 … 1 of the normalised recovery, or — where the recovery is undefined
    in every map (no detectable damage) — the mean effect in nats, symmetric around 0 over all panels; one colour
    bar names it. Returns the Figure (closed: it renders once in Jupyter)."""
    if not maps:
        raise ValueError("plot_patching_maps: no map to draw")
    items = list(maps.items())
    use = _value([m for _, m in items], value)
    if use == "recovery" and any(m["recovery"].isna().all() for _, m in items):
        use = "effect"  # one scale for every panel: the effect where any map has no recovery
    lim = _limit([m for _, m in items], use)
    nh = int(max(m["head"].max() for _, m in items) + 1)
    n_rows = max(m["layer"].nunique() for _, m in items)
    ncols = max(1, min(ncols, len(items)))
    nrows = -(-len(items) // ncols)
    fig, axes = plt.subplots(nrows, ncols, squeeze=False, layout="constrained",
                             figsize=(1.6 + ncols * max(2.8, 1.0 + 0.36 * nh), 0.9 + nrows * (1.1 + 0.2 * n_rows)))
    im = None
    for ax, (name, m) in zip(axes.flat, items):
        im = _panel(ax, m, use=use, lim=lim, nh=nh, n_layers=n_layers, title=name)
    for ax in list(axes.flat)[len(items):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    assert im is not None
    fig.colorbar(im, ax=axes, label=_bar_label(use, short=True), shrink=0.7)
    plt.close(fig)
    return fig
