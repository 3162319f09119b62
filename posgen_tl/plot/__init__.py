"""Figures: one function per figure, built from DataFrames/tensors, never from a model.

Every function builds its figure with pyplot, closes it (``plt.close(fig)``) and returns the
``matplotlib.figure.Figure``; no backend is selected anywhere in the package. In Jupyter the
returned figure is therefore shown exactly once, as the cell's value; in a script call
``fig.savefig(...)``. The analysis that feeds each figure is named in its docstring:

=========================  ===========================================================
``head_maps(res)``         :func:`posgen_tl.decompose_head`
``r_by_layer(df)``         :func:`posgen_tl.decompose_model` / ``decompose_with_twin``
``band_heatmaps(bands)``   ``feature_pattern_with_twin(...).bands``
``pattern_distribution``   ``feature_pattern_with_twin(...).heads``
``pattern_vs_d3(merged)``  :func:`posgen_tl.experiments.pattern.link_to_decomposition`
``phase_histogram(df)``    :func:`posgen_tl.experiments.head_maps.phase_angles_with_twin`
``tolerance_curves(df)``   :func:`posgen_tl.stats.curves.curve_summary`
``dose_curves(df, levels)`` :func:`posgen_tl.causal_study` ``["curves"]`` (one entry)
``length_buckets(df)``     :func:`posgen_tl.experiments.tolerance.length_summary`
``patching_heatmap(df)``   ``posgen_tl.experiments.patching.run(...)["heads"]`` (one quantity and direction)
``patching_maps(maps)``    several such maps side by side on one colour scale
``forest(df)``             the headline findings of several runs (:func:`posgen_tl.report.pages.top_block`)
``gap_probe``, ``gap_heads``, ``sufficiency``: :mod:`posgen_tl.experiments.length`, :mod:`posgen_tl.experiments.sufficiency`
``positional_symbolic_plane``, ``frequency_usage``, ``taxonomy_vs_share``, ``label_counts``: :func:`posgen_tl.head_taxonomy`
=========================  ===========================================================
"""

from posgen_tl.plot.causal import plot_dose_curves as dose_curves
from posgen_tl.plot.decomposition import plot_head_maps as head_maps
from posgen_tl.plot.decomposition import plot_r_by_layer as r_by_layer
from posgen_tl.plot.forest import plot_forest as forest
from posgen_tl.plot.gap_attention import plot_gap_heads as gap_heads
from posgen_tl.plot.length import plot_gap_probe as gap_probe
from posgen_tl.plot.length import plot_window_removal as window_removal
from posgen_tl.plot.patching import plot_patching_heatmap as patching_heatmap
from posgen_tl.plot.patching import plot_patching_maps as patching_maps
from posgen_tl.plot.pattern import plot_band_heatmaps as band_heatmaps
from posgen_tl.plot.pattern import plot_pattern_distribution as pattern_distribution
from posgen_tl.plot.pattern import plot_pattern_vs_d3 as pattern_vs_d3
from posgen_tl.plot.pattern import plot_phase_histogram as phase_histogram
from posgen_tl.plot.sufficiency import plot_sufficiency as sufficiency
from posgen_tl.plot.taxonomy import plot_frequency_usage as frequency_usage
from posgen_tl.plot.taxonomy import plot_label_counts as label_counts
from posgen_tl.plot.taxonomy import plot_positional_symbolic_plane as positional_symbolic_plane
from posgen_tl.plot.taxonomy import plot_taxonomy_vs_share as taxonomy_vs_share
from posgen_tl.plot.tolerance import plot_length as length_buckets
from posgen_tl.plot.tolerance import plot_tolerance_curves as tolerance_curves

__all__ = [
    "band_heatmaps",
    "dose_curves",
    "forest",
    "frequency_usage",
    "head_maps",
    "label_counts",
    "gap_heads",
    "gap_probe",
    "length_buckets",
    "patching_heatmap",
    "patching_maps",
    "sufficiency",
    "pattern_distribution",
    "pattern_vs_d3",
    "phase_histogram",
    "positional_symbolic_plane",
    "r_by_layer",
    "taxonomy_vs_share",
    "tolerance_curves",
    "window_removal",
]
