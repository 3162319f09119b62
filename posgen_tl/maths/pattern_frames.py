"""The feature pattern's tables from raw accumulator states (docs/method.md §3): :func:`pattern_frames` gives one
layer's ``bands`` and ``heads`` rows, :func:`layer_frames` every layer's — layers with the same rope and counts
stacked on the head axis and computed in one go (on a run of 30 layers, thirty times fewer small operations), a
layer's query and key heads in one accumulator, the columns gathered as numpy arrays and each table built once, in
the per-layer order. Pure tensor and table code (no model); used by
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
)
from posgen_tl.maths.groups import band_group
from posgen_tl.maths.rho import SequenceBandSums
from posgen_tl.maths.rope import LayerRope, kv_head_index, to_bands
from posgen_tl.maths.taxonomy import frequency_centroid

__all__ = ["BAND_COLUMNS", "HEAD_COLUMNS", "layer_frames", "pattern_frames", "split_state"]

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
    seqs = {w: None if s is None else [s.state_dict()] for w, s in (("q", q_seq), ("k", k_seq))}
    b, h = _columns([layer], [q_stats.state_dict()], [k_stats.state_dict()], seqs["q"], seqs["k"], rope, spread=spread,
                    k_global=k_global, max_distance=max_distance, sink=sink, n_splits=n_splits, seed=seed)
    return _frame(b, BAND_COLUMNS, model, twin), _frame(h, HEAD_COLUMNS, model, twin)


def _columns(layers: list[int], qs: list[dict], ks: list[dict], q_seqs: list[dict] | None, k_seqs: list[dict] | None,
             rope: LayerRope, *, spread: tuple[Tensor, Tensor] | None, k_global: Tensor | None, max_distance: int,
             sink: int, n_splits: int, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The columns of :func:`pattern_frames` for ``layers`` stacked on the head axis (accumulator states ``qs``, ``ks``,
    ``q_seqs``, ``k_seqs``: one per layer; ``spread`` and ``k_global``: the stack's), as numpy arrays — ``which`` as
    0 (q) / 1 (k), ``layer`` and ``head`` each row's own. A layer's query and key heads are computed together where
    they saw the same tokens (one accumulator of ``H + G`` heads: half the small operations).

    Returns ``(bands, heads)``: ``{column: [rows]}``, rows in the order q heads then k heads, bands innermost;
    ``heads``: one row per query head."""
    q, k = BandStats.from_state_dicts(qs), BandStats.from_state_dicts(ks)
    H, G, nb, n_layers = q.n_heads, k.n_heads, k.n_bands, len(layers)
    together = torch.equal(q.n, k.n) and q.d_head == k.d_head
    per_band = _per_band([BandStats.from_state_dicts(qs + ks)] if together else [q, k])
    k_seq = None if k_seqs is None else SequenceBandSums.from_state_dicts(k_seqs)
    q_seq = None if q_seqs is None else SequenceBandSums.from_state_dicts(q_seqs)
    forms = _forms(q_seqs, k_seqs, q_seq, k_seq, (H, G, nb), n_splits, seed)
    period = (2 * math.pi / rope.theta).cpu().numpy()  # inf for a zero frequency
    band = np.tile(np.arange(nb), H + G)
    head = np.repeat(np.concatenate([np.arange(H), np.arange(G)]), nb)
    which = np.repeat(np.array([0, 1], dtype=np.int8), [H * nb, G * nb])
    per = np.where(which == 0, H // n_layers, G // n_layers)  # heads of one layer
    bands: dict[str, np.ndarray] = {
        "layer": np.asarray(layers, dtype=np.int64)[head // per], "kind": np.full(band.shape, rope.kind, dtype=object),
        "which": which, "head": head % per, "band": band,
        "band_group": np.array([band_group(b, nb) for b in range(nb)], dtype=object)[band],  # a label per band
        "period": period[band]}
    bands |= {key: v.reshape(-1).numpy() for key, v in (per_band | forms).items()}

    legacy = pattern_scores(q, k, rope, max_distance, sink=sink)
    group = kv_head_index(H, G)
    fast = max(1, nb // 3)
    nan_h = torch.full((H,), float("nan"), dtype=torch.float64)
    sigma, per_seq, glob, blind_seq, blind_g = nan_h, nan_h, nan_h, nan_h, nan_h
    if spread is not None:
        sigma = torch.where(spread[1] > 0, (spread[0] / spread[1].clamp(min=1)).sqrt(), torch.nan)
        w = distance_weights(rope, max_distance, sink=sink)
        scale = rope.score_scale * rope.attention_scaling**2
        q_e = q_seq.energy() if q_seq is not None else q.energy().double().cpu()
        flat = torch.full_like(w, float(w.mean()))  # control: every band the same (mean) rotation weight

        def pred(res: Tensor | None, weights: Tensor) -> Tensor:
            return nan_h if res is None else predicted_d3_error(q_e, res, weights, sigma, scale)["pred_d3_err"]

        res_seq = k_seq.within_residual_energy() if k_seq is not None else None
        per_seq, blind_seq = pred(res_seq, w), pred(res_seq, flat)
        res_g = None
        if k_global is not None:
            kg = to_bands(k_global.double().cpu(), rope.rotary_dim, rope.layout)
            res_g = (k_seq.residual_energy(kg) if k_seq is not None else
                     (k.energy().double().cpu() - 2 * (k.mean_bands().cpu() * kg.conj()).real + kg.abs().square()))
        glob, blind_g = pred(res_g, w), pred(res_g, flat)
    fk = {key: torch.nanmean(forms[key][H:, :fast].double(), -1)[group] for key in ("rho_within", "rho_cross", "stability")}
    h_layer = H // n_layers
    heads = {"layer": np.asarray(layers, dtype=np.int64)[np.arange(H) // h_layer], "head": np.arange(H) % h_layer,
             "kv_group": group.cpu().numpy() % (G // n_layers)}
    heads |= {key: v.cpu().numpy() for key, v in {
        "logit_spread": sigma, "pred_d3_err_global": glob, "pred_d3_err_per_sequence": per_seq,
        "blind_d3_err_global": blind_g, "blind_d3_err_per_sequence": blind_seq,
        "fast_key_rho_within": fk["rho_within"], "fast_key_rho_cross": fk["rho_cross"], "fast_key_stability": fk["stability"],
        "key_energy_centroid": frequency_centroid(per_band["energy_share"][H:]).cpu()[group],
        "legacy_pattern_score": legacy["legacy_pattern_score"], "expected_bound": legacy["expected_bound"]}.items()}
    return bands, heads


def _per_band(parts: list[BandStats]) -> dict[str, Tensor]:
    """The per-(head, band) statistics of the parts' heads in order, float64 ``[Σ heads, band]`` (CPU)."""
    cols = [st.band_statistics() for st in parts]
    return {key: torch.cat([c[key] for c in cols]).detach().double().cpu() for key in cols[0]}


def _forms(q_seqs: list[dict] | None, k_seqs: list[dict] | None, q_seq: SequenceBandSums | None,
           k_seq: SequenceBandSums | None, sizes: tuple[int, int, int], n_splits: int, seed: int) -> dict[str, Tensor]:
    """ρ within, ρ cross and stability of the query heads then the key heads, float64 ``[H + G, band]`` (NaN where
    a side has no sequence sums); one accumulator of both sides where they saw the same sequences."""
    H, G, nb = sizes
    keys = ("rho_within", "rho_cross", "stability")
    if q_seqs is not None and k_seqs is not None and q_seq is not None and k_seq is not None and \
            torch.equal(q_seq.doc, k_seq.doc) and torch.equal(q_seq.n, k_seq.n):
        both = SequenceBandSums.from_state_dicts(q_seqs + k_seqs).forms(n_splits, seed)
        return {key: both[key] for key in keys}
    sides = [s.forms(n_splits, seed) if s is not None else {key: torch.full((h, nb), float("nan"), dtype=torch.float64)
                                                             for key in keys} for s, h in ((q_seq, H), (k_seq, G))]
    return {key: torch.cat([sides[0][key], sides[1][key]]) for key in keys}


def _frame(cols: Mapping[str, np.ndarray], columns: list[str], model: str, twin: str) -> pd.DataFrame:
    """A tidy frame of ``columns`` from numpy columns (``model`` and ``twin`` the same on every row; ``which``
    codes 0 / 1 written "q" / "k")."""
    data: dict[str, Any] = {c: cols[c] for c in columns if c not in ("model", "twin")}
    if "which" in data:
        data["which"] = np.array(["q", "k"], dtype=object)[data["which"]]
    return pd.DataFrame({"model": model, "twin": twin} | data, columns=columns)


def split_state(state: dict, n_layers: int, head_dim: int) -> list[dict]:
    """The ``state_dict`` of an accumulator of a stack of ``n_layers`` layers cut into each layer's (the inverse of
    ``BandStats.from_state_dicts`` / ``SequenceBandSums.from_state_dicts``): every tensor whose axis ``head_dim`` holds the stack's ``state["n_heads"]`` heads is
    chunked along it (the layers' heads are consecutive), everything else — token counts, per-sequence ids,
    settings — is each layer's as it is, and ``n_heads`` is one layer's."""
    h = int(state["n_heads"])
    out: list[dict] = [dict(state, n_heads=h // n_layers) for _ in range(n_layers)]
    for key, v in state.items():
        if isinstance(v, Tensor) and v.ndim > head_dim and v.shape[head_dim] == h:
            for o, part in zip(out, torch.chunk(v, n_layers, dim=head_dim)):
                o[key] = part.clone()
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
                 twin: str = "trained", sink: int = 0, n_splits: int = 16,
                 stacks: Mapping[tuple[int, ...], dict] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`pattern_frames` of every layer of ``states`` (``{layer: {"q", "k", "q_seq", "k_seq", "spread",
    "k_global"}}`` as :class:`posgen_tl.experiments.pattern.PatternResult` keeps them), concatenated in layer order —
    layers that share one rope object and their counts computed together, stacked on the head axis (the same numbers
    up to float rounding; the kv-head grouping carries over: query head ``L·H + h`` reads kv-head ``L·G + h // (H/G)``).
    The columns are gathered as numpy arrays and put into one frame each at the end. ``stacks``: the same sums as
    states of stacks of layers (``{(layer, …): state}``, e.g. as the stream accumulated them, before
    :func:`split_state`), taken instead of putting each layer's state side by side again where they cover a group's
    layers in order (the same numbers, bit for bit).
    Returns ``(bands, heads)``."""
    groups: dict[tuple, list[int]] = {}
    for layer in sorted(states):
        groups.setdefault((id(ropes[layer]),), []).append(layer)
    bands, heads = [], []
    for layers in groups.values():
        sts = [states[la] for la in layers]
        parts = [[la] for la in layers] if len(layers) == 1 or not _stackable(sts) else [layers]
        for part in parts:
            units = _cover(part, stacks) or [states[la] for la in part]
            b, h = _columns_of(part, units, ropes[part[0]], max_distance=max_distance, sink=sink, n_splits=n_splits)
            bands.append(b)
            heads.append(h)
    b_cols = {c: np.concatenate([b[c] for b in bands]) for c in bands[0]}
    h_cols = {c: np.concatenate([h[c] for h in heads]) for c in heads[0]}
    b_order = np.lexsort((b_cols["band"], b_cols["head"], b_cols["which"], b_cols["layer"]))
    h_order = np.lexsort((h_cols["head"], h_cols["layer"]))
    return (_frame({c: v[b_order] for c, v in b_cols.items()}, BAND_COLUMNS, model, twin),
            _frame({c: v[h_order] for c, v in h_cols.items()}, HEAD_COLUMNS, model, twin))


def _cover(layers: list[int], stacks: Mapping[tuple[int, ...], dict] | None) -> list[dict] | None:
    """The states of ``stacks`` whose layers, in order, are exactly ``layers`` (None if they do not cover them so)."""
    if not stacks:
        return None
    first = {grp[0]: grp for grp in stacks if grp}
    out, at = [], 0
    while at < len(layers) and layers[at] in first:
        grp = first[layers[at]]
        if list(grp) != layers[at : at + len(grp)]:
            return None
        out.append(stacks[grp])
        at += len(grp)
    return out if at == len(layers) else None


def _columns_of(layers: list[int], sts: list[dict], rope: LayerRope, **kw: Any) -> tuple[dict, dict]:
    """:func:`_columns` of ``layers`` as one stack (``sts``: the states of those layers, or of consecutive stacks of
    them, in order)."""
    seqs = {w: [s[f"{w}_seq"] for s in sts] if sts[0].get(f"{w}_seq") else None for w in ("q", "k")}
    spread = None if sts[0].get("spread") is None else (
        torch.cat([s["spread"][0] for s in sts]), sts[0]["spread"][1])
    k_global = None if sts[0].get("k_global") is None else torch.cat([s["k_global"] for s in sts], dim=-2)
    return _columns(layers, [s["q"] for s in sts], [s["k"] for s in sts], seqs["q"], seqs["k"], rope, spread=spread,
                    k_global=k_global, **kw)
