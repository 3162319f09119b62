"""METHOD.md §3 runner: the intermediate-feature pattern of RoPE planes, per layer/head/band.

One streaming pass over a corpus (:func:`posgen_tl.capture.stream_qk`, no scores, the
forward stops after the last requested layer) feeds, per layer, a
:class:`~posgen_tl.features.BandStats` for the pre-rotation queries (query heads) and one
for the keys (kv-groups). The first ``sink`` positions of every sequence are masked out.
Memory is the accumulators (``O(layers · heads · d_head)``) plus one layer of one batch:
it does not grow with the corpus.

From the accumulated statistics:

* ``bands`` — one row per (layer, q|k, head, band): energy share, offset ratio ``ρ``,
  phase concentration, residual rms, energy and the band's period ``2π/θ_m`` in tokens;
* ``heads`` — one row per (layer, query head): the pattern score and expected D3 bound of
  :func:`posgen_tl.features.pattern_scores` (``max_distance = seq_len − 1``), the mean key
  ``ρ`` of the fastest quarter of the bands and the key energy centroid (band index).

:func:`link_to_decomposition` joins ``heads`` with per-sequence D3 scores
(``posgen_tl.analysis.decomposition``) and reports how the pattern predicts D3's
within-row r across heads, trained and random-init twin apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from posgen_tl.capture import QKCapture, probe_hooks, stream_qk
from posgen_tl.features import BandStats, fast_band_offset, pattern_scores, stats_frame
from posgen_tl.heads import frequency_centroid
from posgen_tl.rope import LayerRope

__all__ = [
    "PatternResult",
    "TwinPattern",
    "feature_pattern",
    "feature_pattern_with_twin",
    "pattern_frames",
    "link_to_decomposition",
    "BAND_COLUMNS",
    "HEAD_COLUMNS",
]

BAND_COLUMNS = [
    "model", "twin", "layer", "kind", "which", "head", "band", "energy_share", "offset_ratio",
    "phase_concentration", "residual_rms", "energy", "period",
]
HEAD_COLUMNS = [
    "model", "twin", "layer", "head", "kv_group", "pattern_score", "expected_bound",
    "fast_key_offset", "key_energy_centroid",
]


def _n_fast(n_bands: int) -> int:
    """Size of the "fastest quarter" of the bands (at least one band)."""
    return max(1, n_bands // 4)


def pattern_frames(
    q_stats: BandStats,
    k_stats: BandStats,
    rope: LayerRope,
    *,
    layer: int,
    max_distance: int,
    model: str = "",
    twin: str = "trained",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ``bands`` and ``heads`` rows of one layer from its q and k accumulators.

    Returns:
        ``(bands, heads)``: ``bands`` has :data:`BAND_COLUMNS`, ``(H + G) · n_bands`` rows
        (q rows per query head, k rows per kv-group); ``heads`` has :data:`HEAD_COLUMNS`,
        ``H`` rows (one per query head, key statistics taken from its kv-group).
    """
    period = (2 * math.pi / rope.theta).cpu().numpy()  # inf for a zero frequency
    parts = []
    for which, st in (("q", q_stats), ("k", k_stats)):
        f = stats_frame(st, layer=layer, which=which, model=model, twin=twin)
        f["kind"] = rope.kind
        f["period"] = period[f["band"].to_numpy()]
        parts.append(f)
    bands = pd.concat(parts, ignore_index=True)[BAND_COLUMNS]

    H, G = q_stats.n_heads, k_stats.n_heads
    scores = pattern_scores(q_stats, k_stats, rope, max_distance)
    group = torch.arange(H) // (H // G)
    fast = fast_band_offset(k_stats, _n_fast(k_stats.n_bands)).double().cpu()[group]
    centroid = frequency_centroid(k_stats.energy_share()).cpu()[group]
    heads = pd.DataFrame({
        "model": model, "twin": twin, "layer": layer, "head": np.arange(H), "kv_group": group.numpy(),
        "pattern_score": scores["pattern_score"].cpu().numpy(),
        "expected_bound": scores["expected_bound"].cpu().numpy(),
        "fast_key_offset": fast.numpy(),
        "key_energy_centroid": centroid.numpy(),
    })[HEAD_COLUMNS]
    return bands, heads


@dataclass
class PatternResult:
    """Output of :func:`feature_pattern` for one model (trained or its random twin).

    Attributes:
        bands: tidy frame, :data:`BAND_COLUMNS`, one row per (layer, which, head, band).
        heads: tidy frame, :data:`HEAD_COLUMNS`, one row per (layer, query head).
        states: ``{layer: {"q": BandStats.state_dict(), "k": ...}}`` — mergeable raw sums.
        k_means: ``{layer: Float[Tensor, "kv_head d_head"]}`` mean pre-rotation key ``k̄``
            (sink excluded), the reference of the D3 split.
        ropes: ``{layer: LayerRope}``; ``max_distance``: ``L`` used for the pattern score.
    """

    model: str
    twin: str
    bands: pd.DataFrame
    heads: pd.DataFrame
    states: dict[int, dict[str, dict]]
    k_means: dict[int, Float[Tensor, "kv_head d_head"]]
    ropes: dict[int, LayerRope] = field(repr=False, default_factory=dict)
    max_distance: int = 1
    sink: int = 0

    @property
    def n_tokens(self) -> int:
        """Tokens accumulated per layer (sink positions excluded)."""
        first = next(iter(self.states.values()))
        return int(first["k"]["n"])

    @classmethod
    def from_states(
        cls,
        states: dict[int, dict[str, dict]],
        ropes: dict[int, LayerRope],
        *,
        max_distance: int,
        model: str = "",
        twin: str = "trained",
        sink: int = 0,
    ) -> "PatternResult":
        """Rebuild the frames and ``k̄`` from raw accumulator states."""
        bands, heads, k_means = [], [], {}
        for layer in sorted(states):
            q = BandStats.from_state_dict(states[layer]["q"])
            k = BandStats.from_state_dict(states[layer]["k"])
            b, h = pattern_frames(q, k, ropes[layer], layer=layer, max_distance=max_distance,
                                  model=model, twin=twin)
            bands.append(b)
            heads.append(h)
            k_means[layer] = k.mean().float()
        return cls(model, twin, pd.concat(bands, ignore_index=True), pd.concat(heads, ignore_index=True),
                   states, k_means, dict(ropes), max_distance, sink)

    def merge(self, other: "PatternResult") -> "PatternResult":
        """The result of having streamed both corpora (same model, layers and settings)."""
        if set(self.states) != set(other.states) or (self.model, self.twin) != (other.model, other.twin):
            raise ValueError("can only merge results of the same model/twin over the same layers")
        states = {}
        for layer, st in self.states.items():
            states[layer] = {
                w: BandStats.from_state_dict(st[w]).merge(BandStats.from_state_dict(other.states[layer][w])).state_dict()
                for w in ("q", "k")
            }
        return PatternResult.from_states(states, self.ropes, max_distance=max(self.max_distance, other.max_distance),
                                         model=self.model, twin=self.twin, sink=self.sink)


@dataclass
class TwinPattern:
    """Trained model and its random-init twin over the same tokens; frames concatenated."""

    trained: PatternResult
    random: PatternResult

    @property
    def bands(self) -> pd.DataFrame:
        return pd.concat([self.trained.bands, self.random.bands], ignore_index=True)

    @property
    def heads(self) -> pd.DataFrame:
        return pd.concat([self.trained.heads, self.random.heads], ignore_index=True)


def _model_label(model: Any) -> str:
    return str(getattr(getattr(model, "cfg", None), "model_name", None) or type(model).__name__)


def _tokens(model: Any, corpus: Any, n_seq: int, seq_len: int) -> Tensor:
    if isinstance(corpus, Tensor) and not corpus.is_floating_point():
        return corpus[None] if corpus.ndim == 1 else corpus
    from posgen_tl.corpus import corpus_tokens  # noqa: PLC0415

    return corpus_tokens(model, corpus, seq_len=seq_len, n_seq=n_seq)


def feature_pattern(
    model: Any,
    corpus: Any = None,
    *,
    layers: Sequence[int] | None = None,
    n_seq: int = 64,
    seq_len: int = 512,
    sink: int = 1,
    batch_size: int = 8,
    model_label: str | None = None,
    twin_label: str = "trained",
    progress: bool = True,
) -> PatternResult:
    """Per-band q/k statistics and per-head pattern scores of ``model`` over a corpus.

    Args:
        model: a TransformerLens(-bridge) RoPE model.
        corpus: token ids ``[batch, pos]`` (used as given), or a source for
            :func:`posgen_tl.corpus.corpus_tokens` (``None`` = the default pydoc prose),
            cut into ``n_seq`` sequences of ``seq_len`` tokens.
        layers: layers to measure (default all).
        sink: the first ``sink`` positions of every sequence are excluded from all statistics.
        model_label / twin_label: the ``model`` / ``twin`` columns.

    Returns:
        :class:`PatternResult`; the pattern score uses ``max_distance = seq_len − 1``.
    """
    tokens = _tokens(model, corpus, n_seq, seq_len)
    n_pos = tokens.shape[1]
    if not 0 <= sink < n_pos:
        raise ValueError(f"sink={sink} must be in [0, {n_pos - 1}]")
    spec, _ = probe_hooks(model)
    layers = list(range(spec.n_layers)) if layers is None else sorted({int(x) % spec.n_layers for x in layers})
    acc: dict[int, dict[str, BandStats]] = {}
    for layer in layers:
        lr = spec.layer(layer)
        acc[layer] = {
            "q": BandStats(spec.n_heads, spec.d_head, lr.rotary_dim, lr.layout),
            "k": BandStats(spec.n_kv_heads, spec.d_head, lr.rotary_dim, lr.layout),
        }
    keep = torch.arange(n_pos) >= sink  # [pos]

    def update(c: QKCapture) -> None:
        mask = keep.to(c.q.device).expand(c.q.shape[0], -1)
        acc[c.layer]["q"].update(c.q, mask)
        acc[c.layer]["k"].update(c.k, mask)

    desc = f"pattern {twin_label}" if progress else False
    stream_qk(model, tokens, update, layers, batch_size=batch_size, progress=desc)
    states = {layer: {w: st.state_dict() for w, st in d.items()} for layer, d in acc.items()}
    ropes = {layer: spec.layer(layer) for layer in layers}
    return PatternResult.from_states(states, ropes, max_distance=max(1, n_pos - 1),
                                     model=model_label or _model_label(model), twin=twin_label, sink=sink)


def feature_pattern_with_twin(model: Any, corpus: Any = None, seed: int = 0, *, twin: Any = None,
                              **kw: Any) -> TwinPattern:
    """:func:`feature_pattern` of ``model`` and of ``random_twin(model, seed)`` on the same tokens.

    Both results carry the trained model's label in ``model``; ``twin`` is
    ``"trained"`` / ``"random"``. ``kw`` go to :func:`feature_pattern`. ``twin``: an
    already-built ``random_twin(model, seed)`` to reuse (built here if None).
    """
    from posgen_tl.models import random_twin  # noqa: PLC0415

    kw = dict(kw)
    tokens = _tokens(model, corpus, kw.pop("n_seq", 64), kw.pop("seq_len", 512))
    label = kw.pop("model_label", None) or _model_label(model)
    kw.pop("twin_label", None)
    trained = feature_pattern(model, tokens, model_label=label, twin_label="trained", **kw)
    twin = random_twin(model, seed) if twin is None else twin
    rand = feature_pattern(twin, tokens, model_label=label, twin_label="random", **kw)
    del twin
    return TwinPattern(trained, rand)


# ----------------------------------------------------------------------------- link to D3


def _corr(x: pd.Series, y: pd.Series) -> tuple[float, float, int]:
    ok = x.notna() & y.notna() & np.isfinite(x) & np.isfinite(y)
    x, y = x[ok].astype(float), y[ok].astype(float)
    n = int(ok.sum())
    if n < 3 or x.std() == 0 or y.std() == 0:
        return float("nan"), float("nan"), n
    return float(x.corr(y, method="pearson")), float(x.corr(y, method="spearman")), n


def link_to_decomposition(
    pattern_heads: pd.DataFrame,
    decomposition: pd.DataFrame,
    *,
    on: Sequence[str] = ("model", "twin", "layer", "head"),
) -> tuple[pd.DataFrame, dict]:
    """Join per-head pattern scores with D3 scores and correlate them across heads.

    Args:
        pattern_heads: ``heads`` frame of :func:`feature_pattern` (or a :class:`TwinPattern`).
        decomposition: per-sequence rows with ``model, twin, layer, head, seq, estimator,
            sink_excluded, r, r2, r_within, d3_err_mean, d3_bound_mean``; only
            ``estimator == "D3"`` rows with ``sink_excluded`` are used, averaged over ``seq``.
        on: join keys (drop ``"model"`` if the two frames label models differently).

    Returns:
        ``(merged, summary)``: ``merged`` = one row per head with the pattern columns and
        the seq-mean ``r, r2, r_within, d3_err_mean, d3_bound_mean`` plus ``n_seq``;
        ``summary[twin]`` (and ``summary["all"]``) = ``n_heads``, ``pearson_pattern_r_within``,
        ``spearman_pattern_r_within``, ``pearson_bound_err`` / ``spearman_bound_err``
        (expected_bound vs d3_err_mean), ``err_over_bound_median`` and
        ``err_over_bound_pooled`` (``Σ err / Σ bound``).
    """
    on = list(on)
    if not isinstance(pattern_heads, pd.DataFrame):
        pattern_heads = pattern_heads.heads
    d = decomposition[(decomposition["estimator"] == "D3") & decomposition["sink_excluded"].astype(bool)]
    if d.empty:
        raise ValueError("the decomposition frame has no D3 rows with sink_excluded=True")
    vals = ["r", "r2", "r_within", "d3_err_mean", "d3_bound_mean"]
    agg = d.groupby(on, as_index=False).agg(**{v: (v, "mean") for v in vals}, n_seq=("seq", "nunique"))
    merged = pattern_heads.merge(agg, on=on, how="inner")
    if merged.empty:
        raise ValueError(f"no rows in common on {on}: check the model/twin labels of the two frames")
    summary: dict[str, dict] = {}
    twins = sorted(set(merged["twin"]), key=lambda t: ({"trained": 0, "random": 1}.get(t, 2), str(t)))
    groups = [(t, merged[merged["twin"] == t]) for t in twins] + [("all", merged)]
    for twin, g in groups:
        pr, sr, n = _corr(g["pattern_score"], g["r_within"])
        pb, sb, _ = _corr(g["expected_bound"], g["d3_err_mean"])
        ratio = g["d3_err_mean"] / g["expected_bound"]
        summary[str(twin)] = {
            "n_heads": n,
            "pearson_pattern_r_within": pr,
            "spearman_pattern_r_within": sr,
            "pearson_bound_err": pb,
            "spearman_bound_err": sb,
            "err_over_bound_median": float(ratio[np.isfinite(ratio)].median()),
            "err_over_bound_pooled": float(g["d3_err_mean"].sum() / g["expected_bound"].sum()),
        }
    return merged, summary
