"""Figures: one function per figure, built from DataFrames/tensors, never from a model.

Every function returns a ``matplotlib.figure.Figure`` and selects no backend, so in Jupyter
the returned figure is shown exactly once (as the cell's value).
"""

from .decomposition import plot_head_maps, plot_r_by_layer
from .heads import plot_frequency_usage, plot_label_counts, plot_positional_symbolic_plane, plot_taxonomy_vs_share
from .pattern import plot_band_heatmaps, plot_pattern_distribution, plot_pattern_vs_d3, plot_phase_histogram
from .tolerance import plot_causal_conditions, plot_length, plot_tolerance_curves

__all__ = [
    "plot_band_heatmaps",
    "plot_causal_conditions",
    "plot_frequency_usage",
    "plot_head_maps",
    "plot_label_counts",
    "plot_length",
    "plot_pattern_distribution",
    "plot_pattern_vs_d3",
    "plot_phase_histogram",
    "plot_positional_symbolic_plane",
    "plot_r_by_layer",
    "plot_taxonomy_vs_share",
    "plot_tolerance_curves",
]
