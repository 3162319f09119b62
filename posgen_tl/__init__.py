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
from .exactness import exactness_table
from .features import BandStats, band_stats, distance_weights, pattern_scores, stats_frame
from .models import DEFAULT_MODEL, ZOO, ModelLoadError, cache_dir, load_model, random_twin
from .rope import LayerRope, RopeError, RopeSpec, rotate, scores_from_rotated, to_bands, unrotate
from .rope_spec import rope_spec

__version__ = "0.1.0"

__all__ = [
    "AdditiveFit",
    "BandStats",
    "CaptureError",
    "CorpusError",
    "D3Split",
    "DEFAULT_MODEL",
    "HookInfo",
    "LayerRope",
    "ModelLoadError",
    "QKCapture",
    "RopeError",
    "RopeSpec",
    "ZOO",
    "band_stats",
    "cache_dir",
    "capture_qk",
    "causal_mask",
    "corpus_tokens",
    "d3_bound",
    "d3_split",
    "default_texts",
    "distance_weights",
    "exactness_table",
    "fit_additive",
    "load_model",
    "load_texts",
    "pattern_scores",
    "pearson_r",
    "probe_hooks",
    "r_squared",
    "random_twin",
    "rope_spec",
    "rotate",
    "score_maps",
    "scores_from_rotated",
    "stats_frame",
    "stream_qk",
    "to_bands",
    "tokenize_corpus",
    "unrotate",
    "within_row_r",
]
