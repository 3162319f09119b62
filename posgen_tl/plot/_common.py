"""Drawing helpers shared by the figure modules (no figure is created here)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pandas as pd


def ci_lines(ax, d: pd.DataFrame, x: str, by: str | Sequence[str] | None, *, xscale: float = 1.0,
             label: Callable[[tuple], str] | None = None, linestyle: Callable[[tuple], str] | None = None) -> None:
    """Draw, on ``ax``, one line (``estimate`` — or ``value`` in older tables — vs ``x`` × ``xscale``,
    markers) with its CI band (``ci_low`` … ``ci_high``, same colour) per group of ``by`` (a column,
    columns, or None for one line). ``label`` / ``linestyle`` map the group key (always a tuple) to the
    legend text (default the key joined by " / ") and the matplotlib line style (default solid)."""
    y = "estimate" if "estimate" in d.columns else "value"
    groups = d.groupby(by if isinstance(by, str) else list(by), sort=False) if by else [((), d)]
    for key, g in groups:
        key = key if isinstance(key, tuple) else (key,)
        g = g.sort_values(x)
        xs = g[x].to_numpy(float) * xscale
        (line,) = ax.plot(xs, g[y], linestyle(key) if linestyle else "-", marker="o", ms=3,
                          label=label(key) if label else " / ".join(map(str, key)))
        ax.fill_between(xs, g["ci_low"], g["ci_high"], color=line.get_color(), alpha=0.2)


def finish(fig, ax, *, xlabel: str, ylabel: str, title: str, zero: bool = False):
    """Label ``ax`` (and a horizontal zero line when ``zero``), add its legend, lay out and close
    ``fig`` (returned, not left open: Jupyter shows it once, as the cell's value). Returns ``fig``."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    if zero:
        ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.close(fig)
    return fig
