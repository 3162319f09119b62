"""docs/method.md §3 runner: the intermediate-feature pattern of RoPE planes, per layer/head/band.

One streaming pass over the analysed windows (:func:`posgen_tl.hooks.stream.stream_qk`; the
forward stops after the last requested layer) feeds, per layer:

* a :class:`~posgen_tl.maths.band_stats.BandStats` for the pre-rotation queries (query heads) and one
  for the keys (kv-groups): energy share, phase concentration, …;
* a :class:`~posgen_tl.maths.rho.SequenceBandSums` for each (per-sequence sums with document ids):
  ρ in three forms — ``rho_within``, cross-fitted ``rho_cross`` over document halves and
  ``stability = rho_cross / rho_within`` (the plug-in ``offset_ratio`` is kept, labelled legacy);
* the within-row logit spread ``σ(W)`` per head (:func:`~posgen_tl.maths.band_stats.within_row_spread`; on the CPU
  up to 24·d_head tokens from the maps a block of query rows at a time — the forward's own ``hook_attn_scores`` where
  they are W, compared on a few rows first (:func:`~posgen_tl.maths.spread.within_row_spread_of_scores`), else
  recomputed (:func:`~posgen_tl.maths.band_stats.within_row_spread_rows`); beyond, and on a GPU beyond 5·d_head, the
  same sums without the ``n × n`` map, :func:`~posgen_tl.maths.band_stats.within_row_spread_qk`).

The first ``sink`` positions of every sequence are excluded from every statistic. Memory is
the accumulators (``O(layers · heads · d_head)`` plus ``O(n_seq · layers · heads · bands)``)
and one layer of one batch. A reference pass over windows of OTHER documents gives the
global k̄ (as in :mod:`posgen_tl.experiments.decomposition`).

From the accumulated statistics:

* ``bands`` — one row per (layer, q|k, head, band): energy share, the ρ forms, phase
  concentration, residual rms, energy, the band's period ``2π/θ_m`` and its band group;
* ``heads`` — one row per (layer, query head): the rotation-aware pattern score
  ``pred_d3_err_<k̄ kind>`` (predicted relative D3 error, :func:`~posgen_tl.maths.band_stats.predicted_d3_error`,
  entry-weighted rotation factors with ``max_distance = seq_len − 1`` and the sink excluded)
  for the global and the per-sequence k̄, the logit spread, a rotation-BLIND control
  ``blind_d3_err_<kind>`` (every band given the mean rotation weight), the legacy score, and
  the key ρ forms of the fastest third of the bands.

:func:`link_to_decomposition` joins ``heads`` with per-sequence D3 scores
(``posgen_tl.experiments.decomposition``) and reports Spearman's rank correlation of each score
with D3's within-row r across heads, trained and random-init twin apart (never pooled), per k̄.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from posgen_tl.engine.decompose_scores import SCORES_RTOL, scores_are_w
from posgen_tl.engine.swaps import windows_fingerprint
from posgen_tl.experiments import base
from posgen_tl.hooks.capture import QKCapture, model_device, probe_hooks
from posgen_tl.hooks.chunked import auto_chunk
from posgen_tl.hooks.stacking import cache_rows, stack_size
from posgen_tl.hooks.stream import stream_qk
from posgen_tl.io.sampling import Windows, resolve_windows
from posgen_tl.maths.band_stats import (
    BandStats,
    within_row_spread,
    within_row_spread_qk,
    within_row_spread_rows,
)
from posgen_tl.maths.decompose import causal_mask
from posgen_tl.maths.pattern_frames import BAND_COLUMNS, HEAD_COLUMNS, layer_frames, pattern_frames, split_state
from posgen_tl.maths.rho import SequenceBandSums
from posgen_tl.maths.rope import LayerRope
from posgen_tl.maths.spread import scores_mismatch, within_row_spread_of_scores
from posgen_tl.report.text import fmt
from posgen_tl.stats.pattern_tables import (  # noqa: F401 (the names stay importable here)
    SCORES,
    link_to_decomposition,
    rho_by_band_group,
)

__all__ = [
    "Config",
    "PatternResult",
    "TwinPattern",
    "feature_pattern",
    "feature_pattern_with_twin",
    "pattern_frames",
    "link_to_decomposition",
    "BAND_COLUMNS",
    "HEAD_COLUMNS",
]

#: rows longer than this many × d_head get the spread from block-Gram sums (O(n·d²), no n × n map;
#: :func:`~posgen_tl.maths.band_stats.within_row_spread_qk`); shorter ones from the explicit map (cheaper there).
_GRAM_FROM = 5
#: on the CPU, rows up to this many × d_head get it from the maps a block of query rows at a time on the keys they see
#: (:func:`~posgen_tl.maths.band_stats.within_row_spread_rows`): SmolLM2 shapes, 2 threads, one layer — 4 × 512 tokens
#: 12 ms against 31 from block-Gram sums, 2 × 1 024 24 against 40, 1 × 2 048 55 against 46–56 (the crossing)
_ROWS_UPTO = 24


#: on a GPU, a block of the long-row spread keeps its ``[batch, heads, block, 2·block]`` float64 scores within
#: this many entries / 4 (2 GiB)
SPREAD_ENTRIES = 2**29


def _spread_block(c: QKCapture) -> int:
    """Query rows per block of :func:`~posgen_tl.maths.band_stats.within_row_spread_qk` (the numbers do not depend on
    it): ``1.5 · d_head`` on the CPU (the fastest there: SmolLM2, 1 × 4 096 tokens, 86 ms against 118 at ``d_head``
    and 191 at ``d_head / 2``); on a GPU, where each block costs ~25 kernel launches, an eighth of the rows, as long as
    a block's ``[batch, heads, block, 2·block]`` float64 scores stay within
    :data:`SPREAD_ENTRIES` / 4 entries."""
    b, n, h, d = c.q.shape
    if c.q.device.type == "cpu":
        return max(8, 3 * d // 2)
    return max(8, d // 2, min(-(-n // 8), math.isqrt(SPREAD_ENTRIES // (8 * b * h))))


#: query rows on which the score hook's maps are compared with W before the spread is taken from them
SCORE_CHECK_ROWS = 8


def _spread(c: QKCapture, sink: int, cache: dict | None = None) -> tuple[Tensor, Tensor]:
    """The capture's within-row logit spread sums ``(ss [heads], entries)``: on the CPU up to :data:`_ROWS_UPTO` ×
    d_head tokens from the forward's own score maps where the capture holds them (``c.scores``, compared with W on
    :data:`SCORE_CHECK_ROWS` query rows first, :func:`~posgen_tl.maths.spread.scores_mismatch`: within
    :data:`~posgen_tl.engine.decompose_scores.SCORES_RTOL`) — no product to make the maps —, else from the maps
    recomputed in cache-sized row blocks (``cache``: a dict that keeps the scratch of the former for the next call);
    beyond :data:`_GRAM_FROM` × d_head from block-Gram sums (exact, float64),
    else from the explicit maps."""
    b, n, h, d = c.q.shape
    win = c.rope.sliding_window
    if c.q.device.type == "cpu" and n <= _ROWS_UPTO * d:
        block = cache_rows(b * h, n)
        if c.scores is not None:
            rows = torch.linspace(0, n - 1, min(SCORE_CHECK_ROWS, n)).round().long().unique()
            off = scores_mismatch(c.scores, c.rot_q, c.rot_k, c.rope.score_scale, rows, sink=sink,
                                  sliding_window=win)
            if off <= SCORES_RTOL:  # (NaN: nothing compared — the maps are recomputed)
                return within_row_spread_of_scores(c.scores, c.rot_q, c.rot_k, c.rope.score_scale, sink=sink,
                                                   sliding_window=win, block=block, cache=cache)
        return within_row_spread_rows(c.rot_q, c.rot_k, c.rope.score_scale, sink=sink, sliding_window=win,
                                      block=block)
    if n > _GRAM_FROM * d:  # long rows: block-Gram sums, no n × n map
        return within_row_spread_qk(c.rot_q, c.rot_k, c.rope.score_scale, sink=sink, sliding_window=win,
                                    block=_spread_block(c))
    return within_row_spread(c.logits(), causal_mask(n, sink=sink, sliding_window=win, device=c.q.device))


def _scores_for_spread(model: Any, n: int, chunk: int, stack: int) -> bool:
    """Whether the feature statistics read the forward's score maps for the logit spread (:func:`_spread`): on the CPU
    for rows up to :data:`_ROWS_UPTO` × d_head, in one whole forward (no chunks), one layer at a time, where
    ``hook_attn_scores`` holds the logits (:func:`~posgen_tl.engine.decompose_scores.scores_are_w`)."""
    spec, info = probe_hooks(model)
    return (model_device(model).type == "cpu" and n <= _ROWS_UPTO * spec.d_head and not 0 < chunk < n and stack <= 1
            and info.scores_kind != "absent" and scores_are_w(model))


@dataclass
class PatternResult:
    """Output of :func:`feature_pattern` for one model (trained or its random twin).

    Attributes:
        bands: tidy frame, :data:`BAND_COLUMNS`, one row per (layer, which, head, band).
        heads: tidy frame, :data:`HEAD_COLUMNS`, one row per (layer, query head).
        states: ``{layer: {"q", "k": BandStats.state_dict(), "q_seq", "k_seq":
            SequenceBandSums.state_dict(), "spread": (ss [head], n), "k_global": tensor | None}}``
            — mergeable raw sums.
        k_means: ``{layer: Float[Tensor, "kv_head d_head"]}`` mean pre-rotation key of the
            ANALYSED tokens (sink excluded); ``k_global``: the reference (global) k̄ or None.
        ropes: ``{layer: LayerRope}``; ``max_distance``: ``L`` used for the rotation weights.
    """

    model: str
    twin: str
    bands: pd.DataFrame
    heads: pd.DataFrame
    states: dict[int, dict[str, Any]]
    k_means: dict[int, Float[Tensor, "kv_head d_head"]]
    ropes: dict[int, LayerRope] = field(repr=False, default_factory=dict)
    max_distance: int = 1
    sink: int = 0
    n_splits: int = 16

    @property
    def n_tokens(self) -> int:
        """Tokens accumulated per layer (sink positions excluded)."""
        first = next(iter(self.states.values()))
        return int(first["k"]["n"])

    @classmethod
    def from_states(
        cls,
        states: dict[int, dict[str, Any]],
        ropes: dict[int, LayerRope],
        *,
        max_distance: int,
        model: str = "",
        twin: str = "trained",
        sink: int | None = None,
        n_splits: int = 16,
        stacks: dict[tuple[int, ...], dict[str, Any]] | None = None,
    ) -> PatternResult:
        """Rebuild the frames and ``k̄`` from raw accumulator states (``sink``: the states' own by default; ``stacks``:
        the same sums per stack of layers, as accumulated, for the tables — see
        :func:`~posgen_tl.maths.pattern_frames.layer_frames`)."""
        if sink is None:
            sink = int(next(iter(states.values())).get("sink", 0)) if states else 0
        bands, heads = layer_frames(states, ropes, max_distance=max_distance, model=model, twin=twin, sink=sink,
                                    n_splits=n_splits, stacks=stacks)  # layers with one rope computed together
        k_means = {layer: BandStats.state_mean(states[layer]["k"]).float() for layer in sorted(states)}
        return cls(model, twin, bands, heads, states, k_means, dict(ropes), max_distance, sink, n_splits)

    def merge(self, other: PatternResult) -> PatternResult:
        """The result of having streamed both corpora (same model, layers, settings and global k̄)."""
        if set(self.states) != set(other.states) or (self.model, self.twin) != (other.model, other.twin):
            raise ValueError("can only merge results of the same model/twin over the same layers")
        states = {}
        for layer, st in self.states.items():
            ot = other.states[layer]
            new = {w: BandStats.from_state_dict(st[w]).merge(BandStats.from_state_dict(ot[w])).state_dict()
                   for w in ("q", "k")}
            for w in ("q_seq", "k_seq"):
                if st.get(w) and ot.get(w):
                    new[w] = SequenceBandSums.from_state_dict(st[w]).merge(SequenceBandSums.from_state_dict(ot[w])).state_dict()
            if st.get("spread") is not None and ot.get("spread") is not None:
                new["spread"] = (st["spread"][0] + ot["spread"][0], st["spread"][1] + ot["spread"][1])
            new["k_global"] = st.get("k_global")
            new["sink"] = self.sink
            states[layer] = new
        return PatternResult.from_states(states, self.ropes, max_distance=max(self.max_distance, other.max_distance),
                                         model=self.model, twin=self.twin, sink=self.sink, n_splits=self.n_splits)


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


@dataclass(frozen=True)
class Config(base.Config):
    """Options of the feature-pattern experiment (docs/method.md §3)."""

    NAME: ClassVar[str] = "pattern"
    n_ref: int = base.n_ref_option()
    layers: Any = base.layers_option("measured")
    sink: int = base.option(1, "first positions of every sequence excluded from every statistic", "count")
    batch_size: int = base.batch_option(4)
    n_splits: int = base.option(16, "random document halvings averaged in rho_cross", "int")


def feature_pattern(
    model: Any,
    corpus: Any = None,
    cfg: Config | None = None,
    *,
    reference: Windows | Tensor | None = None,
    k_means: dict[int, Tensor] | None = None,
    model_label: str | None = None,
    twin_label: str = "trained",
    progress: bool = True,
    stack: int | None = None,
    **options: Any,
) -> PatternResult:
    """Per-band q/k statistics (ρ in three forms) and per-head pattern scores of ``model``.

    Args:
        model: a TransformerLens(-bridge) RoPE model.
        corpus: :class:`~posgen_tl.io.sampling.Windows` (analysed as given), token ids
            ``[batch, pos]`` (all rows analysed, each row its own document), or a text source
            (``None`` = pydoc topics): then ``cfg.n_seq`` windows of ``cfg.seq_len`` tokens from the
            analysed documents and ``cfg.n_ref`` reference windows from OTHER documents
            (:func:`posgen_tl.io.sampling.resolve_windows`, split by ``cfg.seed``).
        cfg: :class:`Config` (default ``Config()``), with ``options`` applied.
        reference: reference windows for the global k̄ (disjoint documents); ``k_means``: a
            given global k̄ ``{layer: [kv_head, d_head]}`` instead. Without either,
            ``pred_d3_err_global`` is NaN. ``cfg.sink``: the first positions of every sequence
            are excluded from all statistics (and from the logit spread and rotation weights).
        model_label: the ``model`` column.
        twin_label: the ``twin`` column.
        stack: layers accumulated together, stacked on the head axis (``None``: one on the CPU, on a GPU as many
            as :func:`posgen_tl.hooks.stacking.stack_size` allows — the same sums up to float rounding).

    Returns:
        :class:`PatternResult`; rotation weights use ``max_distance = seq_len − 1``.
    """
    from posgen_tl.hooks.edits import reference_key_means  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, options)
    base.gate(model, cfg, "the feature pattern")
    sink, batch_size = cfg.sink, cfg.batch_size
    windows, ref = resolve_windows(model, cfg.corpus if corpus is None else corpus, reference, n_seq=cfg.n_seq, seq_len=cfg.seq_len,
                                   n_ref=0 if k_means is not None else cfg.n_ref, seed=cfg.seed)
    tokens = windows.tokens
    n_pos = tokens.shape[1]
    if not 0 <= sink < n_pos:
        raise ValueError(f"sink={sink} must be in [0, {n_pos - 1}]")
    spec, _ = probe_hooks(model)
    layers = base.resolve_layers(cfg.layers, spec.n_layers)
    if k_means is None and ref is not None:
        k_means = reference_key_means(model, ref, layers, sink=sink, batch_size=batch_size, progress=progress)
    acc: dict[tuple[int, ...], dict[str, Any]] = {}  # per stack of layers (one layer each on the CPU)

    def accumulators(group: tuple[int, ...], dev: torch.device) -> dict[str, Any]:  # on the device: no copy per batch
        lr, h, g = spec.layer(group[0]), spec.n_heads * len(group), spec.n_kv_heads * len(group)
        return {"q": BandStats(h, spec.d_head, lr.rotary_dim, lr.layout, device=dev),
                "k": BandStats(g, spec.d_head, lr.rotary_dim, lr.layout, device=dev),
                "q_seq": SequenceBandSums(h, lr.rotary_dim, lr.layout), "k_seq": SequenceBandSums(g, lr.rotary_dim, lr.layout),
                "spread": (torch.zeros(h, dtype=torch.float64, device=dev), torch.zeros((), dtype=torch.float64, device=dev))}

    docs = windows.doc_ids
    scratch: dict = {}  # the spread's block buffer, kept across layers and batches

    def update(c: QKCapture) -> None:  # one layer, or layers stacked on the head axis (hooks/stacking.py)
        group = c.layer_ids
        a = acc[group] if group in acc else acc.setdefault(group, accumulators(group, c.q.device))
        d = docs[c.seq_offset : c.seq_offset + c.q.shape[0]]
        # the positions from the sink on (the masked positions, as a view), in float64 once for both accumulators
        q, k = c.q[:, sink:].double(), c.k[:, sink:].double()
        for side, x in (("q", q), ("k", k)):  # |z|² of the bands once for both accumulators
            abs2 = a[side].update(x)
            a[side + "_seq"].update(x, d, abs2=abs2.view(*x.shape[:2], *abs2.shape[1:]))
        ss, n = _spread(c, sink, scratch)
        a["spread"] = (a["spread"][0] + ss.to(a["spread"][0].device), a["spread"][1] + n.to(a["spread"][1].device))

    group = stack_size(model, min(batch_size, len(tokens)) * n_pos * n_pos, len(layers)) if stack is None else stack
    desc = f"pattern {twin_label}" if progress else False
    # beyond 2 048 tokens the forward runs in chunks through the model's cache where verified (no [heads, n, n] scores)
    chunk = auto_chunk(model, n_pos)
    stream_qk(model, tokens, update, layers, batch_size=batch_size, progress=desc, chunk=chunk, stack=group,
              with_scores=_scores_for_spread(model, n_pos, chunk, group))
    states: dict[int, dict[str, Any]] = {}
    stacks: dict[tuple[int, ...], dict[str, Any]] = {}  # the same sums per stack: the tables are computed from these
    for grp, d in acc.items():  # the sums come to the CPU once, at the end, cut into each layer's
        whole = {w: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in d[w].state_dict().items()}
                 for w in ("q", "k", "q_seq", "k_seq")}
        parts = {w: split_state(whole[w], len(grp), 1 if w.endswith("_seq") else 0) for w in whole}
        ss, n_spread = d["spread"][0].cpu(), d["spread"][1].cpu()
        kg = None if k_means is None else [k_means[layer].double().cpu() for layer in grp]
        stacks[tuple(grp)] = whole | {"spread": (ss, n_spread), "k_global": None if kg is None else torch.cat(kg, -2),
                                      "sink": sink}
        for i, (layer, part_ss) in enumerate(zip(grp, torch.chunk(ss, len(grp)))):
            states[layer] = {w: parts[w][i] for w in parts} | {"spread": (part_ss.clone(), n_spread),
                                                               "k_global": None if kg is None else kg[i], "sink": sink}
    states = {layer: states[layer] for layer in sorted(states)}
    ropes = {layer: spec.layer(layer) for layer in layers}
    return PatternResult.from_states(states, ropes, max_distance=max(1, n_pos - 1), model=model_label or _model_label(model),
                                     twin=twin_label, sink=sink, n_splits=cfg.n_splits, stacks=stacks)


def feature_pattern_with_twin(model: Any, corpus: Any = None, cfg: Config | None = None, *, twin: Any = None,
                              reference: Windows | Tensor | None = None, progress: bool = True,
                              **options: Any) -> TwinPattern:
    """:func:`feature_pattern` of ``model`` and of ``random_twin(model, cfg.seed)`` on the same
    windows (and the same reference windows, each model computing its own global k̄).

    Both results carry the trained model's label in ``model``; ``twin`` is
    ``"trained"`` / ``"random"``. ``twin``: an already-built random twin to reuse (built here if None).
    """
    from posgen_tl.io.models import random_twin  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, options)
    windows, ref = resolve_windows(model, cfg.corpus if corpus is None else corpus, reference, n_seq=cfg.n_seq, seq_len=cfg.seq_len, n_ref=cfg.n_ref,
                                   seed=cfg.seed)
    label = _model_label(model)
    trained = feature_pattern(model, windows, cfg, reference=ref, model_label=label, twin_label="trained",
                              progress=progress)
    twin = random_twin(model, cfg.seed) if twin is None else twin
    rand = feature_pattern(twin, windows, cfg, reference=ref, model_label=label, twin_label="random", progress=progress)
    return TwinPattern(trained, rand)


# ----------------------------------------------------------------------------- report / study


NAME = "pattern"
ABOUT = "feature pattern in the RoPE planes and its link to D3 (docs/method.md §3)"
NEEDS: tuple[str, ...] = ("decomposition",)  # links its heads to the decomposition's rows


class Result(base.Result):
    """The outcome of :func:`run`.

    Attributes:
        tables: ``bands`` (every twin × layer × head × q/k × band row: ρ in three forms, energy shares), ``heads``
            (per-head pattern scores), ``rho_groups`` (:func:`rho_by_band_group`), ``link`` (heads joined to the
            decomposition's D3 rows) and ``link_summary`` (:func:`link_to_decomposition`: Spearman per twin, k̄
            kind and score).
        config: the Config's options. meta: model, sizes.
    """


#: the tables' files in a study folder (the names published runs already carry)
FILES = {"bands": "pattern_bands.csv", "heads": "pattern_heads.csv", "rho_groups": "pattern_rho_by_band_group.csv",
         "link": "pattern_vs_d3.csv", "link_summary": "pattern_vs_d3_summary.csv"}


@base.shares_heap
def run(model: Any, cfg: Config | None = None, *, upstream: dict[str, Any] | None = None, corpus: Any = None,
        twin: Any = None, progress: bool = True, checkpoint: str | Path | None = None, **options: Any) -> Result:
    """Band statistics and pattern scores of the trained model beside its random twin (``twin``: a model or a
    callable giving one; ``None`` builds it), on the windows the decomposition uses, linked to the decomposition's
    heads. ``upstream["decomposition"]``: the decomposition's Result on the same windows (:data:`NEEDS`;
    ``pg.run("pattern", model)`` runs it first). ``checkpoint``: a folder that keeps each model's finished tables, so
    a rerun of the same design after an interruption computes only the missing model. Returns the :class:`Result`.

    Raises:
        ValueError: no decomposition Result in ``upstream``."""
    from posgen_tl.io.sampling import sample_or_chunks  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, options)
    dec = (upstream or {}).get("decomposition")
    if dec is None or "rows" not in dec.tables:
        raise ValueError("the pattern experiment links its heads to a decomposition on the same windows: pass "
                         "upstream={'decomposition': <its Result>}, or call pg.run('pattern', model, cfg), which runs it")
    windows, ref, _ = sample_or_chunks(model, cfg.corpus if corpus is None else corpus, n_seq=cfg.n_seq,
                                       seq_len=cfg.seq_len, n_ref=cfg.n_ref, seed=cfg.seed)
    label, parts = _model_label(model), []
    for name, m in (("trained", model), ("random", base.twin_of(model, twin, cfg.seed))):
        kept = base.model_pieces(checkpoint, name, NAME, cfg, m, windows, reference=windows_fingerprint(ref))
        parts.append(base.kept_tables(kept, name, ("bands", "heads"), lambda m=m, name=name: vars(feature_pattern(
            m, windows, cfg, reference=ref, model_label=label, twin_label=name, progress=progress))))
    bands = pd.concat([p["bands"] for p in parts], ignore_index=True)
    heads = pd.concat([p["heads"] for p in parts], ignore_index=True)
    merged, summary = link_to_decomposition(heads, dec.tables["rows"], on=("twin", "layer", "head"))
    tables = {"bands": bands, "heads": heads, "rho_groups": rho_by_band_group(bands), "link": merged,
              "link_summary": summary}
    meta = {"model": probe_hooks(model)[0].model_name, "n_seq": len(windows), "n_docs": windows.n_docs}
    return Result(tables, cfg.as_dict(), meta)


def _strength(rho: float, p: float) -> str:
    if rho != rho:
        return "undefined"
    if p >= 0.05 or abs(rho) < 0.3:
        return "weak"
    return "moderate" if abs(rho) < 0.6 else "strong"


def _link(summary: pd.DataFrame, twin: str, km: str, score: str = "pred_d3_err") -> tuple[float, float, int]:
    x = summary[(summary["twin"] == twin) & (summary["k_mean"] == km) & (summary["score"] == score)]
    return (float(x["spearman"].iloc[0]), float(x["p"].iloc[0]), int(x["n_heads"].iloc[0])) if len(x) else (math.nan, math.nan, 0)


def _paragraphs(groups: pd.DataFrame) -> list[str]:
    def g(twin: str, grp: str, col: str) -> float:
        x = groups[(groups["twin"] == twin) & (groups["band_group"] == grp)][col]
        return float(x.iloc[0]) if len(x) else float("nan")

    return [
        f"Stability across texts (keys, fast bands): ρ_within {fmt(g('trained', 'fast', 'rho_within'))} trained vs "
        f"{fmt(g('random', 'fast', 'rho_within'))} random, but cross-fitted ρ_cross {fmt(g('trained', 'fast', 'rho_cross'))} vs "
        f"{fmt(g('random', 'fast', 'rho_cross'))}; stability ρ_cross/ρ_within (median) {fmt(g('trained', 'fast', 'stability_median'))} "
        f"trained vs {fmt(g('random', 'fast', 'stability_median'))} random. A random twin's keys carry a per-text constant; "
        "only an offset shared across documents (stability near 1) can make one global k̄ work — that is what is learned.",
        f"Band selectivity (keys): ρ_cross fast / middle / slow = {fmt(g('trained', 'fast', 'rho_cross'))} / "
        f"{fmt(g('trained', 'middle', 'rho_cross'))} / {fmt(g('trained', 'slow', 'rho_cross'))} trained vs "
        f"{fmt(g('random', 'fast', 'rho_cross'))} / {fmt(g('random', 'middle', 'rho_cross'))} / "
        f"{fmt(g('random', 'slow', 'rho_cross'))} random; share of key energy in the slow third of the bands "
        f"{fmt(g('trained', 'slow', 'key_energy_share_of_group'))} trained vs {fmt(g('random', 'slow', 'key_energy_share_of_group'))} random.",
        "ρ_within = mean over sequences of ‖mean_seq k^(m)‖²/mean_seq‖k^(m)‖²; ρ_cross = Re⟨k̄_A^(m), k̄_B^(m)⟩/E‖k^(m)‖² with "
        "A, B two disjoint halves of the documents (unbiased for ‖E k‖²); the plug-in ‖E k‖²/E‖k‖² is biased upward by the "
        "between-text variance of the per-sequence means and is shown only as legacy.",
        "Pattern score = s·a²·Σ_m ‖q^(m)‖·‖k^(m) − k̄^(m)‖·w_m / σ(W), w_m the mean of 2|sin(Δθ_m/2)| over the causal entries "
        "present (distance Δ weighted by its count n − Δ), σ(W) the head's within-row logit spread. Lower = D3 expected "
        "to fit: a working score has a NEGATIVE Spearman with D3 r. The legacy score (invariant to rescaling the rotation "
        "weights) is listed for comparison only.",
    ]


def render(result: Result) -> Any:
    """The report section: ρ by band group, per-head medians, the pattern ↔ D3 link, four figures."""
    from posgen_tl.plot.pattern import plot_band_heatmaps, plot_pattern_vs_d3  # noqa: PLC0415
    from posgen_tl.report.html import Section, figure_to_png, skipped_section  # noqa: PLC0415

    title = "3 · The feature pattern in the RoPE planes (docs/method.md §3)"
    if result.skipped:
        return skipped_section(title, result.skipped, "pattern", result.meta.get("hint"))
    t = result.tables
    heads, summary, groups, bands = t["heads"], t["link_summary"], t["rho_groups"], t["bands"]
    cols = ["logit_spread", "pred_d3_err_global", "pred_d3_err_per_sequence", "fast_key_rho_within", "fast_key_rho_cross",
            "fast_key_stability"]
    tab = heads.groupby("twin")[cols].median()
    tab.columns = [f"{c} (median)" for c in tab.columns]
    tab = tab.reset_index()
    tr, rd = _link(summary, "trained", "global"), _link(summary, "random", "global")
    blind, inv = _link(summary, "trained", "global", "blind_d3_err"), _link(summary, "trained", "global", "inv_logit_spread")
    verdict = (f"Across TRAINED heads, the rotation-aware pattern score (predicted relative D3 error, global k̄) vs D3 "
               f"within-row r: Spearman {fmt(tr[0])} (p = {tr[1]:.2g}, n = {tr[2]}) — {_strength(tr[0], tr[1])}; within the "
               f"random twin separately: {fmt(rd[0])} (p = {rd[1]:.2g}, n = {rd[2]}). Never pooled: two clusters would "
               f"manufacture a correlation. Controls (trained): rotation-blind {fmt(blind[0])}, 1/σ(W) alone {fmt(inv[0])} — "
               "the rotation weighting adds information only where the score beats them.")
    n_seq = int(result.config.get("n_seq") or result.meta.get("n_seq", 0))
    return Section(
        title,
        verdict=verdict,
        paragraphs=_paragraphs(groups),
        tables=[("Key ρ in three forms by band group (mean over layers × kv heads × bands; stability: median; energy: "
                 "share of each head's key energy in the group)", groups),
                ("Per-head pattern statistics (median over heads), trained vs random twin", tab),
                ("Pattern score ↔ D3 within-row r across heads, each twin and k̄ kind apart", summary)],
        figures=[(figure_to_png(plot_band_heatmaps(bands, which="k", stat="rho_cross")), "Key ρ_cross (cross-fitted "
                  "over document halves), band × layer, trained vs twin, same colour scale"),
                 (figure_to_png(plot_band_heatmaps(bands, which="k", stat="rho_within")), "Key ρ_within "
                  "(token-invariance inside a text), trained vs twin"),
                 (figure_to_png(plot_band_heatmaps(bands, which="k", stat="energy_share")), "Key band energy share "
                  "(RoPE frequency usage), trained vs twin"),
                 (figure_to_png(plot_pattern_vs_d3(t["link"], k_mean="global")), "Pattern score (predicted relative "
                  "D3 error, global k̄) vs D3 within-row r per head")],
        findings=_findings(t["link"], n_seq),
        results={"rho_by_band_group": groups.to_dict("records"), "heads": tab.to_dict("records"),
                 "link": summary.to_dict("records")},
    )


def _findings(merged: pd.DataFrame, n_seq: int) -> list:
    """Spearman ρ of the rotation-aware pattern score (predicted relative D3 error, global k̄) with D3
    within-row r across TRAINED heads (docs/method.md §3: within the trained model, never pooled with the
    twin); heads are the unit — descriptive (docs/method.md §8)."""
    from posgen_tl.report.html import Finding  # noqa: PLC0415
    from posgen_tl.stats.inference import rank_correlation  # noqa: PLC0415

    t = merged[merged["twin"] == "trained"]
    if "k_mean" in t:
        t = t[t["k_mean"] == "global"]
    rho, ci, p, n = rank_correlation(t["pred_d3_err_global"].to_numpy(float), t["r_within"].to_numpy(float))
    word = "related" if p == p and p < 0.05 else "no evidence"
    return [Finding("pattern", word, rho, "Spearman ρ(pred. D3 error, D3 r) over heads", ci, p, n,
                    exploratory=n_seq < 32, note="n = heads (descriptive); sequences per head: " + str(n_seq),
                    p_kind="Spearman's test with heads as units (descriptive: heads of one model are not independent)",
                    unit="heads")]
