"""posgen_tl — how RoPE language models tolerate positions, read through TransformerLens hooks.

Layers (data flows one way):
    corpus → models + capture (hooks) → rope / decompose / features / heads / perturb (pure maths)
    → analysis runners (DataFrames) → report / cli / notebooks
"""

from __future__ import annotations

from .capture import CaptureError, HookInfo, QKCapture, capture_qk, probe_hooks, stream_qk
from .corpus import CorpusError, corpus_tokens, default_texts, load_texts, tokenize_corpus
from .decompose import (
    AdditiveFit,
    D3Split,
    causal_mask,
    d3_bound,
    d3_split,
    fit_additive,
    pearson_r,
    r_squared,
    score_maps,
    within_row_r,
)
from .interventions import Intervention, intervention_hooks, key_means, noop_hooks, reposition_hooks, distance_cap_hooks
from .analysis.decomposition import decompose_model, decompose_with_twin, summarize_decomposition
from .analysis.pattern import PatternResult, feature_pattern, feature_pattern_with_twin, link_to_decomposition
from .analysis.taxonomy import head_table, head_taxonomy, head_taxonomy_with_twin, taxonomy_agreement
from .analysis.tolerance import (
    causal_table,
    curve_summary,
    length_curve,
    matched_alpha,
    nll_on_target,
    summarize_tolerance,
    t1_vs_t2,
    tolerance_rows,
    tolerance_under_intervention,
    transposition_curve,
)
from .exactness import exactness_table
from .features import BandStats, band_stats, distance_weights, pattern_scores, stats_frame
from .models import DEFAULT_MODEL, ZOO, ModelLoadError, cache_dir, load_model, random_twin
from .perturb import adjacent_swap_permutation, capped_scores, position_ids_for_permutation
from .stats import bootstrap_ci, slope_ci
from .plot.decomposition import plot_head_maps, plot_r_by_layer
from .plot.heads import plot_frequency_usage, plot_positional_symbolic_plane, plot_taxonomy_vs_share
from .plot.pattern import plot_band_heatmaps, plot_pattern_vs_d3, plot_phase_histogram
from .plot.tolerance import plot_dose_response, plot_length, plot_tolerance_curves
from .rope import LayerRope, RopeError, RopeSpec, rotate, scores_from_rotated, to_bands, unrotate
from .rope_spec import rope_spec

__version__ = "0.1.0"

__all__ = [
    "AdditiveFit",
    "adjacent_swap_permutation",
    "band_stats",
    "BandStats",
    "bootstrap_ci",
    "cache_dir",
    "capped_scores",
    "capture_qk",
    "CaptureError",
    "causal_mask",
    "causal_table",
    "corpus_tokens",
    "CorpusError",
    "curve_summary",
    "d3_bound",
    "d3_split",
    "D3Split",
    "decompose_model",
    "decompose_with_twin",
    "DEFAULT_MODEL",
    "default_texts",
    "distance_cap_hooks",
    "distance_weights",
    "exactness_table",
    "feature_pattern",
    "feature_pattern_with_twin",
    "fit_additive",
    "head_table",
    "head_taxonomy",
    "head_taxonomy_with_twin",
    "HookInfo",
    "Intervention",
    "intervention_hooks",
    "key_means",
    "LayerRope",
    "length_curve",
    "link_to_decomposition",
    "load_model",
    "load_texts",
    "matched_alpha",
    "ModelLoadError",
    "nll_on_target",
    "noop_hooks",
    "pattern_scores",
    "PatternResult",
    "pearson_r",
    "plot_band_heatmaps",
    "plot_dose_response",
    "plot_frequency_usage",
    "plot_head_maps",
    "plot_length",
    "plot_pattern_vs_d3",
    "plot_phase_histogram",
    "plot_positional_symbolic_plane",
    "plot_r_by_layer",
    "plot_taxonomy_vs_share",
    "plot_tolerance_curves",
    "position_ids_for_permutation",
    "probe_hooks",
    "QKCapture",
    "r_squared",
    "random_twin",
    "reposition_hooks",
    "rope_spec",
    "RopeError",
    "RopeSpec",
    "rotate",
    "score_maps",
    "scores_from_rotated",
    "slope_ci",
    "stats_frame",
    "stream_qk",
    "summarize_decomposition",
    "summarize_tolerance",
    "t1_vs_t2",
    "taxonomy_agreement",
    "to_bands",
    "tokenize_corpus",
    "tolerance_rows",
    "tolerance_under_intervention",
    "transposition_curve",
    "unrotate",
    "within_row_r",
    "ZOO",
]
