"""Figure of the patching sweep (:mod:`posgen_tl.experiments.patching`): a table in, a Figure out."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

__all__ = ["plot_patching_heatmap"]


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
    use = value
    if value == "recovery" and heads["recovery"].isna().all():
        use = "effect"
    rows = sorted(int(x) for x in heads["layer"].unique())  # one row per PATCHED layer, labelled with its index
    row_of = {layer: i for i, layer in enumerate(rows)}
    nh = int(heads["head"].max() + 1)
    grid = np.full((len(rows), nh), np.nan)
    for r in heads.itertuples():
        grid[row_of[int(r.layer)], int(r.head)] = getattr(r, use)
    lim = 1.0 if use == "recovery" else float(np.nanmax(np.abs(grid))) or 1.0
    cmap = plt.get_cmap("RdBu").copy()
    cmap.set_bad("0.85")  # a head without a value (never silently white = 0)
    fig, ax = plt.subplots(figsize=(1.6 + 0.42 * nh, 1.2 + 0.28 * len(rows)))
    im = ax.imshow(np.clip(grid, -lim, lim), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto", origin="upper",
                   interpolation="nearest")
    for r in heads[heads["significant"].astype(bool)].itertuples():
        ax.add_patch(Rectangle((int(r.head) - 0.5, row_of[int(r.layer)] - 0.5), 1, 1, fill=False, ec="black", lw=1.8))
    ax.set_xticks(range(nh))
    step = max(1, len(rows) // 15)
    ax.set_yticks(range(0, len(rows), step), [str(layer) for layer in rows[::step]])
    of = f" ({len(rows)} of {n_layers} layers patched)" if n_layers is not None and len(rows) < n_layers else ""
    ax.set(xlabel="head", ylabel="layer" + of, title=title)
    label = ("normalised recovery (1 = the patch accounts for all the damage)" if use == "recovery"
             else "mean effect (nats) — recovery undefined: no detectable damage")
    fig.colorbar(im, ax=ax, label=label, shrink=0.8)
    fig.tight_layout()
    plt.close(fig)
    return fig
