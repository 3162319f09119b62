"""The feature pattern's tables from raw accumulator states (docs/method.md §3): :func:`pattern_frames` gives one
layer's ``bands`` and ``heads`` rows, :func:`layer_frames` every layer's — layers with the same rope and counts
stacked on the head axis and computed in one go (on a run of 30 layers, thirty times fewer small operations), then
put back in the per-layer order. Pure tensor and table code (no model); used by
:mod:`posgen_tl.experiments.pattern`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from posgen_tl.maths.band_stats import (
    BandStats,
    distance_weights,
    pattern_scores,
    predicted_d3_error,
    stats_frame,
)
from posgen_tl.maths.groups import band_group
from posgen_tl.maths.rho import SequenceBandSums
from posgen_tl.maths.rope import LayerRope, kv_head_index, to_bands
from posgen_tl.maths.taxonomy import frequency_centroid

__all__ = ["BAND_COLUMNS", "HEAD_COLUMNS", "join_states", "layer_frames", "pattern_frames", "split_state"]

BAND_COLUMNS = [
    "model", "twin", "layer", "kind", "which", "head", "band", "band_group", "energy_share",
    "rho_within", "rho_cross", "stability", "offset_ratio", "phase_concentration", "residual_rms", "energy", "period",
]
HEAD_COLUMNS = [
    "model", "twin", "layer", "head", "kv_group", "logit_spread", "pred_d3_err_global", "pred_d3_err_per_sequence",
    "blind_d3_err_global", "blind_d3_err_per_sequence",
    "fast_key_rho_within", "fast_key_rho_cross", "fast_key_stability", "key_energy_centroid",
    "legacy_pattern_score", "expected_bound",
]


def pattern_frames(
    q_stats: BandStats,
    k_stats: BandStats,
    rope: LayerRope,
    *,
    layer: int,
    max_distance: int,
    model: str = "",
    twin: str = "trained",
    q_seq: SequenceBandSums | None = None,
    k_seq: SequenceBandSums | None = None,
    spread: tuple[Tensor, Tensor] | None = None,
    k_global: Float[Tensor, "kv_head d_head"] | None = None,
    sink: int = 0,
    n_splits: int = 16,
    seed: int = 0,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ``bands`` and ``heads`` rows of one layer from its accumulators.

    ``q_seq``/``k_seq``: per-sequence sums (ρ forms; NaN columns if absent); ``spread``:
    ``(Σ within-row squared deviations [head_index], n entries)`` of the logits; ``k_global``:
    the reference k̄ (``pred_d3_err_global`` is NaN without it).

    Returns:
        ``(bands, heads)``: ``bands`` has :data:`BAND_COLUMNS`, ``(H + G) · n_bands`` rows
        (q rows per query head, k rows per kv-group); ``heads`` has :data:`HEAD_COLUMNS`,
        ``H`` rows (one per query head, key statistics taken from its kv-group).
    """
    period = (2 * math.pi / rope.theta).cpu().numpy()  # inf for a zero frequency
    nb = k_stats.n_bands
    parts, forms = [], {}
    for which, st, seq in (("q", q_stats, q_seq), ("k", k_stats, k_seq)):
        f = stats_frame(st, layer=layer, which=which, model=model, twin=twin)
        f["kind"] = rope.kind
        f["period"] = period[f["band"].to_numpy()]
        f["band_group"] = np.array([band_group(b, nb) for b in range(nb)])[f["band"].to_numpy()]  # a label per band
        nan = torch.full((st.n_heads, nb), float("nan"), dtype=torch.float64)
        forms[which] = seq.forms(n_splits, seed) if seq is not None else {k: nan for k in ("rho_within", "rho_cross", "stability")}
        for key in ("rho_within", "rho_cross", "stability"):
            f[key] = forms[which][key].reshape(-1).cpu().numpy()
        parts.append(f)
    bands = pd.concat(parts, ignore_index=True)[BAND_COLUMNS]

    H, G = q_stats.n_heads, k_stats.n_heads
    legacy = pattern_scores(q_stats, k_stats, rope, max_distance, sink=sink)
    group = kv_head_index(H, G)
    fast = max(1, nb // 3)
    nan_h = torch.full((H,), float("nan"), dtype=torch.float64)
    if spread is not None:
        sigma = torch.where(spread[1] > 0, (spread[0] / spread[1].clamp(min=1)).sqrt(), torch.nan)
        w = distance_weights(rope, max_distance, sink=sink)
        scale = rope.score_scale * rope.attention_scaling**2
        q_e = q_seq.energy() if q_seq is not None else q_stats.energy().double().cpu()
        res_seq = k_seq.within_residual_energy() if k_seq is not None else None
        flat = torch.full_like(w, float(w.mean()))  # control: every band the same (mean) rotation weight

        def pred(res: Tensor | None, weights: Tensor) -> Tensor:
            return nan_h if res is None else predicted_d3_error(q_e, res, weights, sigma, scale)["pred_d3_err"]

        per_seq, blind_seq = pred(res_seq, w), pred(res_seq, flat)
        res_g = None
        if k_global is not None:
            kg = to_bands(k_global.double().cpu(), rope.rotary_dim, rope.layout)
            res_g = (k_seq.residual_energy(kg) if k_seq is not None else
                     (k_stats.energy().double().cpu() - 2 * (k_stats.mean_bands().cpu() * kg.conj()).real + kg.abs().square()))
        glob, blind_g = pred(res_g, w), pred(res_g, flat)
    else:
        sigma, per_seq, glob, blind_seq, blind_g = nan_h, nan_h, nan_h, nan_h, nan_h
    centroid = frequency_centroid(k_stats.energy_share()).cpu()[group]
    fk = {key: torch.nanmean(forms["k"][key][:, :fast].double(), -1)[group].cpu().numpy() for key in ("rho_within", "rho_cross", "stability")}
    heads = pd.DataFrame({
        "model": model, "twin": twin, "layer": layer, "head": np.arange(H), "kv_group": group.cpu().numpy(),
        "logit_spread": sigma.cpu().numpy(),
        "pred_d3_err_global": glob.cpu().numpy(),
        "pred_d3_err_per_sequence": per_seq.cpu().numpy(),
        "blind_d3_err_global": blind_g.cpu().numpy(),
        "blind_d3_err_per_sequence": blind_seq.cpu().numpy(),
        "fast_key_rho_within": fk["rho_within"], "fast_key_rho_cross": fk["rho_cross"],
        "fast_key_stability": fk["stability"],
        "key_energy_centroid": centroid.cpu().numpy(),
        "legacy_pattern_score": legacy["legacy_pattern_score"].cpu().numpy(),
        "expected_bound": legacy["expected_bound"].cpu().numpy(),
    })[HEAD_COLUMNS]
    return bands, heads


def split_state(state: dict, n_layers: int, head_dim: int) -> list[dict]:
    """The ``state_dict`` of an accumulator of a stack of ``n_layers`` layers cut into each layer's (the inverse of
    :func:`join_states`): every tensor whose axis ``head_dim`` holds the stack's ``state["n_heads"]`` heads is
    chunked along it (the layers' heads are consecutive), everything else — token counts, per-sequence ids,
    settings — is each layer's as it is, and ``n_heads`` is one layer's."""
    h = int(state["n_heads"])
    out: list[dict] = [dict(state, n_heads=h // n_layers) for _ in range(n_layers)]
    for key, v in state.items():
        if isinstance(v, Tensor) and v.ndim > head_dim and v.shape[head_dim] == h:
            for o, part in zip(out, torch.chunk(v, n_layers, dim=head_dim)):
                o[key] = part.clone()
    return out


def join_states(states: Sequence[dict], head_dim: int) -> dict:
    """Accumulator states of several layers as one of their heads side by side (the inverse of :func:`split_state`):
    tensors over the heads concatenated along ``head_dim``,
    the rest (counts, ids, settings) taken from the first state."""
    h = int(states[0]["n_heads"])
    out = dict(states[0], n_heads=h * len(states))
    for key, v in states[0].items():
        if isinstance(v, Tensor) and v.ndim > head_dim and v.shape[head_dim] == h:
            out[key] = torch.cat([st[key] for st in states], dim=head_dim)
    return out


def _shared(states: Sequence[dict], key: str, names: Sequence[str]) -> bool:
    """Whether every state's ``key`` sub-state has the same values of ``names`` (token counts, sequence ids)."""
    first = states[0].get(key)
    return all((st.get(key) is None) == (first is None) for st in states) and (first is None or all(
        torch.equal(st[key][n], first[n]) for st in states[1:] for n in names))


def _stackable(states: Sequence[dict]) -> bool:
    """Layers whose states can be computed as one: equal token counts and sequences, equal spread counts, all with or
    all without a global k̄."""
    return (_shared(states, "q", ["n"]) and _shared(states, "k", ["n"]) and _shared(states, "q_seq", ["doc", "n"])
            and _shared(states, "k_seq", ["doc", "n"])
            and all((st.get("spread") is None) == (states[0].get("spread") is None) for st in states)
            and (states[0].get("spread") is None or all(torch.equal(st["spread"][1], states[0]["spread"][1])
                                                        for st in states))
            and len({st.get("k_global") is None for st in states}) == 1)


def layer_frames(states: Mapping[int, dict], ropes: Mapping[int, LayerRope], *, max_distance: int, model: str = "",
                 twin: str = "trained", sink: int = 0, n_splits: int = 16) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`pattern_frames` of every layer of ``states`` (``{layer: {"q", "k", "q_seq", "k_seq", "spread",
    "k_global"}}`` as :class:`posgen_tl.experiments.pattern.PatternResult` keeps them), concatenated in layer order —
    layers that share one rope object and their counts computed together, stacked on the head axis (the same numbers
    up to float rounding; the kv-head grouping carries over: query head ``L·H + h`` reads kv-head ``L·G + h // (H/G)``).
    Returns ``(bands, heads)``."""
    groups: dict[tuple, list[int]] = {}
    for layer in sorted(states):
        groups.setdefault((id(ropes[layer]),), []).append(layer)
    bands, heads = [], []
    for layers in groups.values():
        sts = [states[la] for la in layers]
        parts = [[la] for la in layers] if len(layers) == 1 or not _stackable(sts) else [layers]
        for part in parts:
            b, h = _frames_of(part, [states[la] for la in part], ropes[part[0]], max_distance=max_distance,
                              model=model, twin=twin, sink=sink, n_splits=n_splits)
            bands.append(b)
            heads.append(h)
    bands_df, heads_df = pd.concat(bands, ignore_index=True), pd.concat(heads, ignore_index=True)
    order = {w: i for i, w in enumerate(("q", "k"))}
    bands_df = bands_df.iloc[np.lexsort((bands_df["band"], bands_df["head"], bands_df["which"].map(order),
                                         bands_df["layer"]))].reset_index(drop=True)
    heads_df = heads_df.sort_values(["layer", "head"], kind="stable").reset_index(drop=True)
    return bands_df, heads_df


def _frames_of(layers: list[int], sts: list[dict], rope: LayerRope, **kw: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`pattern_frames` of ``layers`` (states ``sts``) as one stack, rows labelled with each one's layer."""
    one = len(layers) == 1
    st: dict[str, Any] = sts[0] if one else {
        w: join_states([s[w] for s in sts], 1 if w.endswith("_seq") else 0) if sts[0].get(w) else None
        for w in ("q", "k", "q_seq", "k_seq")}
    if not one:
        st["spread"] = None if sts[0].get("spread") is None else (
            torch.cat([s["spread"][0] for s in sts]), sts[0]["spread"][1])
        st["k_global"] = None if sts[0].get("k_global") is None else torch.cat([s["k_global"] for s in sts], dim=-2)
    q, k = BandStats.from_state_dict(st["q"]), BandStats.from_state_dict(st["k"])
    seqs = {w: SequenceBandSums.from_state_dict(st[f"{w}_seq"]) if st.get(f"{w}_seq") else None for w in ("q", "k")}
    b, h = pattern_frames(q, k, rope, layer=layers[0], q_seq=seqs["q"], k_seq=seqs["k"], spread=st.get("spread"),
                          k_global=st.get("k_global"), **kw)
    if one:
        return b, h
    n_q, n_k = q.n_heads // len(layers), k.n_heads // len(layers)
    per = np.where(b["which"].to_numpy() == "q", n_q, n_k)
    b["layer"] = np.asarray(layers)[b["head"].to_numpy() // per]
    b["head"] = b["head"].to_numpy() % per
    h["layer"] = np.asarray(layers)[h["head"].to_numpy() // n_q]
    h["head"] = h["head"].to_numpy() % n_q
    h["kv_group"] = h["kv_group"].to_numpy() % n_k
    return b, h
