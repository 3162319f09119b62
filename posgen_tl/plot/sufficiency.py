"""Figures of the sufficiency test (:mod:`posgen_tl.experiments.sufficiency`)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from posgen_tl.plot._common import finish

__all__ = ["plot_sufficiency"]


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
        err = np.vstack([g["estimate"] - g["ci_low"], g["ci_high"] - g["estimate"]])
        ax.bar(x, g["estimate"], w, yerr=err, capsize=2, label=s)
    ax.set_xticks(np.arange(len(groups)), groups)
    return finish(fig, ax, xlabel="layers whose logits are substituted", ylabel="ΔNLL on the target span (nats)",
                  title=title or "Sufficiency: substituting the logits by a decomposition", zero=True)
