"""The feature pattern's tables from accumulator states (posgen_tl.maths.pattern_frames): every row against the
accumulators' own statistics computed one layer and one side (q or k) at a time — the stacked, q-and-k-together
computation must give the same numbers, labels and dtypes — and the accumulators put side by side."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from posgen_tl.maths.band_stats import BandStats, distance_weights, pattern_scores, predicted_d3_error
from posgen_tl.maths.groups import band_group
from posgen_tl.maths.pattern_frames import BAND_COLUMNS, HEAD_COLUMNS, layer_frames, pattern_frames
from posgen_tl.maths.rho import SequenceBandSums
from posgen_tl.maths.rope import LayerRope, kv_head_index, to_bands
from posgen_tl.maths.taxonomy import frequency_centroid

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/maths/conftest.py

H, G, D, R, N_BANDS = 4, 2, 10, 6, 3  # partial rotary: dims 6..9 pass through
ROPE = LayerRope(inv_freq=1.0 / 50.0 ** (torch.arange(0, R, 2).float() / R), rotary_dim=R, score_scale=0.3, kind="full")
LOCAL = LayerRope(inv_freq=ROPE.inv_freq, rotary_dim=R, score_scale=0.3, sliding_window=5, kind="local")


def _state(seed: int, k_tokens: int | None = None, global_k: bool = True) -> dict:
    """One layer's accumulator states from random q/k of 4 sequences × 9 positions (``k_tokens``: keys of that many
    positions only — a key count unlike the queries')."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, 9, H, D, generator=g, dtype=torch.float64) + 0.4
    k = torch.randn(4, 9, G, D, generator=g, dtype=torch.float64) * 0.7 - 0.3
    k[..., 0], k[..., R // 2] = 0.0, 0.0  # band 0 of every key head is zero: NaN statistics where they are undefined
    docs = torch.tensor([3, 3, 5, 8])
    stats = {"q": BandStats(H, D, R, "half"), "k": BandStats(G, D, R, "half"),
             "q_seq": SequenceBandSums(H, R, "half"), "k_seq": SequenceBandSums(G, R, "half")}
    stats["q"].update(q)
    stats["q_seq"].update(q, docs)
    kk = k if k_tokens is None else k[:, :k_tokens]
    stats["k"].update(kk)
    stats["k_seq"].update(kk, docs)
    out: dict = {w: s.state_dict() for w, s in stats.items()}
    out["spread"] = (torch.rand(H, generator=g, dtype=torch.float64) * 5, torch.tensor(120.0, dtype=torch.float64))
    out["k_global"] = (torch.randn(G, D, generator=g, dtype=torch.float64) - 0.3) if global_k else None
    return out


def _reference(layer: int, st: dict, rope: LayerRope, max_distance: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One layer's rows, each side's statistics from its own accumulator (no stacking, q and k apart)."""
    q, k = BandStats.from_state_dict(st["q"]), BandStats.from_state_dict(st["k"])
    seqs = {w: SequenceBandSums.from_state_dict(st[f"{w}_seq"]) for w in ("q", "k")}
    rows = []
    for which, s in (("q", q), ("k", k)):
        forms = seqs[which].forms(16, 0)
        for h in range(s.n_heads):
            for m in range(N_BANDS):
                rows.append({"layer": layer, "kind": rope.kind, "which": which, "head": h, "band": m,
                             "band_group": band_group(m, N_BANDS), "energy_share": float(s.energy_share()[h, m]),
                             "rho_within": float(forms["rho_within"][h, m]), "rho_cross": float(forms["rho_cross"][h, m]),
                             "stability": float(forms["stability"][h, m]), "offset_ratio": float(s.offset_ratio()[h, m]),
                             "phase_concentration": float(s.phase_concentration()[h, m]),
                             "residual_rms": float(s.residual_rms()[h, m]), "energy": float(s.energy()[h, m]),
                             "period": float(2 * math.pi / rope.theta[m])})
    group = kv_head_index(H, G)
    legacy = pattern_scores(q, k, rope, max_distance)
    sigma = (st["spread"][0] / st["spread"][1]).sqrt()
    w = distance_weights(rope, max_distance)
    scale = rope.score_scale * rope.attention_scaling**2
    kg = to_bands(st["k_global"], R, "half")
    res_g = seqs["k"].residual_energy(kg)
    pred = predicted_d3_error(seqs["q"].energy(), seqs["k"].within_residual_energy(), w, sigma, scale)["pred_d3_err"]
    glob = predicted_d3_error(seqs["q"].energy(), res_g, w, sigma, scale)["pred_d3_err"]
    fk = seqs["k"].forms(16, 0)
    heads = pd.DataFrame({
        "layer": layer, "head": np.arange(H), "kv_group": group.numpy(), "logit_spread": sigma.numpy(),
        "pred_d3_err_global": glob.numpy(), "pred_d3_err_per_sequence": pred.numpy(),
        "fast_key_rho_within": torch.nanmean(fk["rho_within"][:, :1], -1)[group].numpy(),
        "fast_key_stability": torch.nanmean(fk["stability"][:, :1], -1)[group].numpy(),
        "key_energy_centroid": frequency_centroid(k.energy_share())[group].numpy(),
        "legacy_pattern_score": legacy["legacy_pattern_score"].numpy(), "expected_bound": legacy["expected_bound"].numpy()})
    return pd.DataFrame(rows), heads


def _check(got: pd.DataFrame, want: pd.DataFrame) -> None:
    for c in want.columns:
        if pd.api.types.is_float_dtype(want[c]):
            np.testing.assert_allclose(got[c].to_numpy(float), want[c].to_numpy(float), rtol=1e-12, atol=1e-15,
                                       equal_nan=True, err_msg=c)
        else:
            assert got[c].tolist() == want[c].tolist(), c


@pytest.mark.parametrize("local_layer", [False, True])
def test_layer_frames_equal_each_layer_and_side_computed_alone(local_layer):
    """Three layers stacked (one with a sliding window, in its own group where asked): every band row and head row
    equals the statistics of that layer's q or k accumulator alone, in (layer, which, head, band) order, with the
    columns and dtypes of the documented tables."""
    states = {layer: _state(layer) for layer in range(3)}
    ropes = {0: ROPE, 1: LOCAL if local_layer else ROPE, 2: ROPE}
    bands, heads = layer_frames(states, ropes, max_distance=8, model="m", twin="trained")
    assert list(bands.columns) == BAND_COLUMNS and list(heads.columns) == HEAD_COLUMNS
    assert len(bands) == 3 * (H + G) * N_BANDS and len(heads) == 3 * H
    assert (bands["model"] == "m").all() and (heads["twin"] == "trained").all()
    assert pd.api.types.is_string_dtype(bands["which"]) and bands["layer"].dtype == np.int64
    assert np.isnan(bands["offset_ratio"]).any() and np.isfinite(bands["offset_ratio"]).mean() > 0.8
    for layer in range(3):
        want_b, want_h = _reference(layer, states[layer], ropes[layer], 8)
        _check(bands[bands["layer"] == layer].reset_index(drop=True), want_b)
        _check(heads[heads["layer"] == layer].reset_index(drop=True), want_h)


def _stacked(states: list[dict]) -> dict:
    """The states of several layers as ONE stack's (heads side by side), as the stream accumulates them."""
    out: dict = {w: BandStats.from_state_dicts([s[w] for s in states]).state_dict() for w in ("q", "k")}
    out |= {w: SequenceBandSums.from_state_dicts([s[w] for s in states]).state_dict() for w in ("q_seq", "k_seq")}
    out["spread"] = (torch.cat([s["spread"][0] for s in states]), states[0]["spread"][1])
    out["k_global"] = torch.cat([s["k_global"] for s in states], dim=-2)
    return out


def test_layer_frames_from_the_stacks_as_accumulated_equal_those_from_each_layers_state():
    """``stacks`` (the same sums per stack of layers) give the tables bit for bit; they are taken only where they
    cover the layers of a group in order — a stack that does not (here one starting at layer 1 of the group 0, 1, 2),
    even holding other numbers, is left for the layers' own states."""
    states = {layer: _state(layer) for layer in range(3)}
    ropes = {layer: ROPE for layer in range(3)}
    want = layer_frames(states, ropes, max_distance=8, model="m")
    got = layer_frames(states, ropes, max_distance=8, model="m",
                       stacks={(0, 1): _stacked([states[0], states[1]]), (2,): _stacked([states[2]])})
    for g, w in zip(got, want):
        pd.testing.assert_frame_equal(g, w, check_exact=True)
    wrong = _stacked([states[1], states[2]])
    wrong["spread"] = (wrong["spread"][0] * 4, wrong["spread"][1])
    unused = layer_frames(states, ropes, max_distance=8, model="m", stacks={(1, 2): wrong})
    pd.testing.assert_frame_equal(unused[1], want[1], check_exact=True)
    used = layer_frames(states, ropes, max_distance=8, model="m", stacks={(0,): _stacked([states[0]]), (1, 2): wrong})
    assert not np.allclose(used[1]["logit_spread"], want[1]["logit_spread"])  # the stacks' own numbers, when taken


def test_pattern_frames_of_keys_over_other_tokens_than_queries():
    """Query and key accumulators of different token counts (keys of 5 positions, queries of 9) cannot share one
    accumulator: each side is computed apart and the rows still equal each side's own statistics."""
    st = _state(7, k_tokens=5)
    q, k = BandStats.from_state_dict(st["q"]), BandStats.from_state_dict(st["k"])
    assert int(q.n) != int(k.n)
    bands, heads = pattern_frames(q, k, ROPE, layer=4, max_distance=8,
                                  q_seq=SequenceBandSums.from_state_dict(st["q_seq"]),
                                  k_seq=SequenceBandSums.from_state_dict(st["k_seq"]), spread=st["spread"],
                                  k_global=st["k_global"])
    want_b, want_h = _reference(4, st, ROPE, 8)
    _check(bands, want_b)
    _check(heads, want_h)


def test_pattern_frames_without_sequence_sums_leave_the_rho_columns_nan():
    st = _state(2, global_k=False)
    bands, heads = pattern_frames(BandStats.from_state_dict(st["q"]), BandStats.from_state_dict(st["k"]), ROPE, layer=0,
                                  max_distance=8, k_seq=SequenceBandSums.from_state_dict(st["k_seq"]))
    assert bands.loc[bands["which"] == "q", "rho_within"].isna().all()
    assert bands.loc[bands["which"] == "k", "rho_within"].notna().any()
    assert heads["pred_d3_err_global"].isna().all() and heads["logit_spread"].isna().all()


def test_accumulators_side_by_side_equal_each_ones_statistics_and_refuse_other_tokens():
    a, b = _state(0), _state(1)
    both = BandStats.from_state_dicts([a["q"], b["k"]])  # a layer's query heads then another's key heads
    assert both.n_heads == H + G
    for name in ("energy", "offset_ratio", "phase_concentration", "residual_rms", "mean"):
        got = getattr(both, name)()
        torch.testing.assert_close(got[:H], getattr(BandStats.from_state_dict(a["q"]), name)(), equal_nan=True)
        torch.testing.assert_close(got[H:], getattr(BandStats.from_state_dict(b["k"]), name)(), equal_nan=True)
    both.sum_x += 1.0  # fresh tensors: the states are untouched
    torch.testing.assert_close(BandStats.from_state_dict(a["q"]).mean(), BandStats.state_mean(a["q"]))
    with pytest.raises(ValueError, match="tokens"):
        BandStats.from_state_dicts([a["q"], _state(0, k_tokens=5)["k"]])
    with pytest.raises(ValueError, match="rotary_dim"):
        BandStats.from_state_dicts([a["q"], BandStats(H, D, 4, "half").state_dict() | {"n": a["q"]["n"]}])
    seq = SequenceBandSums.from_state_dicts([a["q_seq"], a["k_seq"]])
    for name in ("rho_within", "rho_cross", "energy"):
        got = getattr(seq, name)()
        torch.testing.assert_close(got[:H], getattr(SequenceBandSums.from_state_dict(a["q_seq"]), name)(), equal_nan=True)
        torch.testing.assert_close(got[H:], getattr(SequenceBandSums.from_state_dict(a["k_seq"]), name)(), equal_nan=True)
    other = dict(a["k_seq"], doc=a["k_seq"]["doc"] + 1)
    with pytest.raises(ValueError, match="different sequences"):
        SequenceBandSums.from_state_dicts([a["q_seq"], other])
