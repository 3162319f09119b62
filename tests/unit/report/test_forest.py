"""The answer figure of a results page, as a reader sees it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from posgen_tl.plot.forest import plot_forest


def _df():
    return pd.DataFrame({"what": ["A (nats)", "A (nats)", "B (r)"], "label": ["m · pydoc", "m · readmes", "m · pydoc"],
                         "effect": [0.02, 0.05, -0.8], "ci_low": [0.01, 0.03, np.nan],
                         "ci_high": [0.03, 0.07, np.nan], "verdict": ["rises", "rises", "related"],
                         "exploratory": [True, False, False]})


def test_one_panel_per_measure_one_row_per_run_with_intervals_and_verdicts():
    fig = plot_forest(_df())
    axes = fig.axes
    assert [a.get_title(loc="left") for a in axes] == ["A (nats)", "B (r)"]
    assert [t.get_text() for t in axes[0].get_yticklabels()] == ["m · pydoc", "m · readmes"]
    assert [t.get_text() for t in axes[0].texts] == ["rises", "rises"]
    segs = axes[0].collections[0].get_segments()  # the interval bars, drawn where an interval exists
    assert sorted((round(s[0][0], 3), round(s[1][0], 3)) for s in segs) == [(0.01, 0.03), (0.03, 0.07)]
    assert len(axes[1].collections[0].get_segments()) == 0  # no interval: a point alone
    hollow = [ln for ln in axes[0].lines if ln.get_marker() == "o" and ln.get_markerfacecolor() == "white"]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [0.02]  # the exploratory run is drawn hollow
    zero = [ln for ln in axes[0].lines if ln.get_linestyle() == ":"]
    assert len(zero) == 1  # 0 marked: the panel's range comes near it


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="verdict"):
        plot_forest(_df().drop(columns="verdict"))
    with pytest.raises(ValueError, match="at least one row"):
        plot_forest(_df().iloc[:0])


def test_small_effects_get_tick_labels_that_do_not_run_together():
    """The Gemma3 L6-11 panel (an effect of 0.0011 with an interval 0.00026 … 0.0020) once printed nine labels
    '0.00000 0.00025 …' into one another: every x tick label now has room of its own."""
    df = pd.DataFrame({"what": ["destroy − C4 (nats × p)"], "label": ["gemma3-270m · pydoc"], "effect": [0.00113],
                       "ci_low": [0.000261], "ci_high": [0.002], "verdict": ["not detected"], "exploratory": [False]})
    fig = plot_forest(df)
    fig.canvas.draw()
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    boxes = sorted((t.get_window_extent() for t in ax.get_xticklabels()
                    if t.get_text() and lo <= t.get_position()[0] <= hi), key=lambda b: b.x0)
    assert len(boxes) >= 3
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [(b.x0, b.x1) for b in boxes]
