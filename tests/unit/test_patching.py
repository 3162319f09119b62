"""Activation patching over positions (posgen_tl.patching, posgen_tl.hooks.patching) on tiny models.

The checks the method demands (docs/method.md §9): a patch of a run into itself changes nothing; patching every
head's rotated q and k restores the other run exactly; f + g + remainder patched together give the source's
logits; the uniform shift of all ids moves nothing; GQA kv heads reach exactly their group; both backends.
"""

from __future__ import annotations

import math

import pytest
import tiny_models as tm
import torch

import posgen_tl.patching as P
from posgen_tl import compat
from posgen_tl.hooks.capture import CaptureError, probe_hooks
from posgen_tl.hooks.edits import key_means
from posgen_tl.hooks.patching import patch_hooks, record_hooks
from posgen_tl.hooks.positions import reposition_hooks
from posgen_tl.maths.rope import IndexRangeError

N, T = 24, 6


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tm.sharpened(tm.hf_llama(n_layers=3)[0])


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 99, (2, N), generator=g)


@pytest.fixture(scope="module")
def k_means(model):
    g = torch.Generator().manual_seed(2)
    return key_means(model, torch.randint(3, 99, (4, N), generator=g))


def _all(model, quantity):
    spec, _ = probe_hooks(model)
    n = spec.n_kv_heads if quantity == "rot_k" else spec.n_heads
    return {layer: torch.ones(1, N, n, dtype=torch.bool) for layer in range(spec.n_layers)}


def _metric_with(model, tokens, metric, hooks):
    with model.hooks(fwd_hooks=hooks):
        return metric(model(tokens))


def _record(model, tokens, quantities, middle=()):
    """Record ``quantities`` in one run with ``middle`` (re-positioning) hooks: ``{quantity: store}``."""
    stores, before, after = {}, [], []
    for q in quantities:
        stores[q] = {}
        rec = record_hooks(model, q, range(probe_hooks(model)[0].n_layers), stores[q])
        before, after = before + rec.before, after + rec.after
    with model.hooks(fwd_hooks=[*before, *middle, *after]):
        model(tokens)
    return stores


@pytest.mark.parametrize("quantity", ["rot_q", "rot_k", "pattern", "pos_term", "sem_term", "remainder"])
def test_patching_a_run_into_itself_changes_nothing(model, tokens, k_means, quantity):
    metric = P.target_nll(tokens, T)
    clean = _metric_with(model, tokens, metric, [])
    store = _record(model, tokens, [quantity])[quantity]
    ph = patch_hooks(model, quantity, _all(model, quantity), store, k_means=k_means)
    got = _metric_with(model, tokens, metric, ph.around())
    if quantity in ("rot_q", "rot_k", "pattern"):
        assert torch.equal(got, clean)  # bit for bit
    else:  # W − term + term with the term recomputed in float64: equal to float32 rounding
        torch.testing.assert_close(got, clean, rtol=0, atol=1e-5)


def test_patching_every_heads_rotated_q_and_k_restores_the_other_run_exactly(model, tokens):
    metric = P.target_nll(tokens, T)
    ids = P.Swaps(0.3).position_ids(N, n_seq=2, keep_last=T)
    rep = reposition_hooks(model, ids)
    clean = _metric_with(model, tokens, metric, [])
    corrupted = _metric_with(model, tokens, metric, rep)
    assert (corrupted - clean).abs().max() > 1e-3  # the corruption does damage (else the test proves nothing)
    # denoising: clean q/k into the corrupted run
    st = _record(model, tokens, ["rot_q", "rot_k"])
    hooks = [*rep]
    for q in ("rot_q", "rot_k"):
        hooks += patch_hooks(model, q, _all(model, q), st[q]).after
    assert torch.equal(_metric_with(model, tokens, metric, hooks), clean)
    # only q (or only k) does not restore it: the check compares something
    only_q = [*rep, *patch_hooks(model, "rot_q", _all(model, "rot_q"), st["rot_q"]).after]
    assert not torch.equal(_metric_with(model, tokens, metric, only_q), clean)
    # noising: corrupted q/k into the clean run gives the corrupted run
    st_c = _record(model, tokens, ["rot_q", "rot_k"], middle=rep)
    hooks = []
    for q in ("rot_q", "rot_k"):
        hooks += patch_hooks(model, q, _all(model, q), st_c[q]).after
    assert torch.equal(_metric_with(model, tokens, metric, hooks), corrupted)


@pytest.mark.parametrize("which", ["llama", "gemma3"])
def test_patching_every_heads_pattern_restores_the_other_run(model, tokens, which):
    """A pattern write must reach the model (a backend that fires hook_pattern after computing its output would
    discard it silently): every layer's pattern from the clean run makes the corrupted run the clean one."""
    m = model if which == "llama" else tm.sharpened(tm.hf_gemma3()[0])
    metric = P.target_nll(tokens, T)
    ids = P.Swaps(0.3).position_ids(N, n_seq=2, keep_last=T)
    rep = reposition_hooks(m, ids)
    clean = _metric_with(m, tokens, metric, [])
    assert (_metric_with(m, tokens, metric, rep) - clean).abs().max() > 1e-4
    st = _record(m, tokens, ["pattern"])["pattern"]
    hooks = [*rep, *patch_hooks(m, "pattern", _all(m, "pattern"), st).after]
    torch.testing.assert_close(_metric_with(m, tokens, metric, hooks), clean, rtol=0, atol=1e-6)


def _scores_at(model, layer, tokens, hooks):
    out = {}

    def grab(x, hook):
        out["w"] = x.detach().clone()

    with model.hooks(fwd_hooks=[*hooks, (f"blocks.{layer}.attn.hook_attn_scores", grab)]):
        model(tokens)
    return out["w"]


def test_pos_sem_and_remainder_together_give_the_sources_logits(model, tokens, k_means):
    layer = 2
    ids = P.Swaps(0.3).position_ids(N, n_seq=2, keep_last=T)
    rep = reposition_hooks(model, ids)
    w_clean = _scores_at(model, layer, tokens, [])
    w_corr = _scores_at(model, layer, tokens, rep)
    st = _record(model, tokens, ["pos_term", "sem_term", "remainder"])
    mask = {layer: torch.ones(1, N, 4, dtype=torch.bool)}
    before, after = [], []
    for q in ("pos_term", "sem_term", "remainder"):
        h = patch_hooks(model, q, mask, st[q], k_means=k_means, base_positions=ids)
        before += h.before
        after += h.after
    w = _scores_at(model, layer, tokens, [*before, *rep, *after])
    vis = torch.isfinite(w_clean)
    assert torch.equal(vis, torch.isfinite(w))  # masked keys stay masked
    torch.testing.assert_close(w[vis], w_clean[vis], rtol=1e-5, atol=1e-5)
    assert (w_corr[vis] - w_clean[vis]).abs().max() > 1e-2  # the corrupted logits were elsewhere
    # one term alone does not: the positional term carries a part of the difference
    h = patch_hooks(model, "pos_term", mask, st["pos_term"], k_means=k_means, base_positions=ids)
    w_f = _scores_at(model, layer, tokens, h.around(rep))
    assert 1e-3 < (w_f[vis] - w_corr[vis]).abs().max()
    assert (w_f[vis] - w_clean[vis]).abs().max() > 1e-3


def test_noising_terms_give_the_corrupted_logits(model, tokens, k_means):
    """The mirror: f, g and the remainder recorded in the corrupted run (source ids = the corrupted ones) and
    written into the clean run give the corrupted run's logits at that layer."""
    layer = 1
    ids = P.Swaps(0.3).position_ids(N, n_seq=2, keep_last=T)
    rep = reposition_hooks(model, ids)
    w_corr = _scores_at(model, layer, tokens, rep)
    st = _record(model, tokens, ["pos_term", "sem_term", "remainder"], middle=rep)
    mask = {layer: torch.ones(1, N, 4, dtype=torch.bool)}
    before, after = [], []
    for q in ("pos_term", "sem_term", "remainder"):
        h = patch_hooks(model, q, mask, st[q], k_means=k_means, source_positions=ids)
        before, after = before + h.before, after + h.after
    w = _scores_at(model, layer, tokens, [*before, *after])
    vis = torch.isfinite(w_corr)
    torch.testing.assert_close(w[vis], w_corr[vis], rtol=1e-5, atol=1e-5)
    # the positional term alone, with the ids mixed up (source at the clean ids), lands elsewhere
    h = patch_hooks(model, "pos_term", mask, st["pos_term"], k_means=k_means)
    w_bad = _scores_at(model, layer, tokens, h.around())
    h = patch_hooks(model, "pos_term", mask, st["pos_term"], k_means=k_means, source_positions=ids)
    w_f = _scores_at(model, layer, tokens, h.around())
    assert (w_bad[vis] - w_f[vis]).abs().max() > 1e-3


def test_stacked_term_patches_equal_one_patch_per_forward(model, tokens, k_means):
    metric = P.target_nll(tokens, T)
    for d in ("denoising", "noising"):
        a = P.get_act_patch_pos_term(model, P.Swaps(0.3), tokens, metric, k_means=k_means, layers=[1], direction=d,
                                     verbose=False)
        b = P.get_act_patch_pos_term(model, P.Swaps(0.3), tokens, metric, k_means=k_means, layers=[1], direction=d,
                                     verbose=False, replicas=1)
        assert torch.isnan(a[[0, 2]]).all() and torch.isnan(b[[0, 2]]).all()  # layers not patched
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-5)
        assert a[1].std() > 0  # heads differ: a mix-up of replicas would show


def test_layer_zero_sem_term_is_a_no_op_and_pos_plus_remainder_equals_rotated_qk(model, tokens, k_means):
    """In layer 0 the pre-rotation q/k of both runs are the same (same tokens, no position in the embedding): g is
    identical, so a g patch changes nothing and f + remainder carry ALL of the difference — as rot_q + rot_k do."""
    metric = P.target_nll(tokens, T)
    corr = P.Swaps(0.3)
    only0 = [{0: list(range(4))}]
    sw_g = P.patch_sweep(model, corr, tokens, metric, quantity="sem_term", groups=only0, k_means=k_means)
    torch.testing.assert_close(sw_g.values[0], sw_g.corrupted, rtol=0, atol=1e-6)
    ids = sw_g.position_ids
    rep = reposition_hooks(model, ids)
    st = _record(model, tokens, ["pos_term", "remainder", "rot_q", "rot_k"])
    m0 = {0: torch.ones(1, N, 4, dtype=torch.bool)}
    before, after = [], []
    for q in ("pos_term", "remainder"):
        h = patch_hooks(model, q, m0, st[q], k_means=k_means, base_positions=ids)
        before, after = before + h.before, after + h.after
    terms = _metric_with(model, tokens, metric, [*before, *rep, *after])
    qk = [*rep, *patch_hooks(model, "rot_q", m0, st["rot_q"]).after,
          *patch_hooks(model, "rot_k", {0: torch.ones(1, N, 2, dtype=torch.bool)}, st["rot_k"]).after]
    torch.testing.assert_close(terms, _metric_with(model, tokens, metric, qk), rtol=0, atol=1e-5)
    assert (terms - sw_g.corrupted).abs().max() > 1e-4


def test_uniform_shift_moves_no_metric(model, tokens, k_means):
    metric = P.target_nll(tokens, T)
    b = P.baselines(model, P.Shift(500), tokens, metric)
    torch.testing.assert_close(b["corrupted"], b["clean"], rtol=0, atol=2e-4)
    for q in ("pos_term", "sem_term", "pattern"):  # quantities that depend on ids only through distances
        m = P.generic_position_patch(model, P.Shift(500), tokens, metric, quantity=q, k_means=k_means, verbose=False)
        torch.testing.assert_close(m, b["clean"].expand_as(m), rtol=0, atol=2e-4)
    # rotated queries alone are NOT shift-invariant: a patched q rotated at the clean ids meets keys rotated at the
    # shifted ids, so that head's every distance moves by the shift (documented in posgen_tl.patching)
    m = P.get_act_patch_rot_q(model, P.Shift(500), tokens, metric, verbose=False)
    assert (m - b["clean"]).abs().max() > 1e-3
    # while a real corruption moves it (the comparison above can fail)
    s = P.baselines(model, P.Swaps(0.3), tokens, metric)
    assert (s["corrupted"] - s["clean"]).abs().max() > 1e-3


def test_several_corruptions_share_one_clean_forward(model, tokens):
    metric = P.target_nll(tokens, T)
    calls = []
    counted = lambda lg: (calls.append(1), metric(lg))[1]  # noqa: E731
    counted.target_len = T
    corrs = {"swaps": P.Swaps(0.3), "gap": P.Gap(40)}
    got = P.corrupted_metrics(model, corrs, tokens, counted)
    assert len(calls) == 1 + len(corrs)  # one clean forward, one per corruption
    for name, corr in corrs.items():  # the same numbers as one pair of forwards per corruption
        b = P.baselines(model, corr, tokens, metric)
        torch.testing.assert_close(got["clean"], b["clean"], rtol=0, atol=0)
        torch.testing.assert_close(got[name], b["corrupted"], rtol=0, atol=0)
    assert (got["swaps"] - got["gap"]).abs().max() > 1e-4  # each corruption its own run
    with pytest.raises(ValueError, match="cannot be named 'clean'"):
        P.corrupted_metrics(model, {"clean": P.Swaps(0.3)}, tokens, metric)


def test_sweep_agrees_with_one_patch_per_forward_and_has_tl_shapes(model, tokens, k_means):
    metric = P.target_nll(tokens, T)
    corr = P.Swaps(0.3)
    stacked = P.get_act_patch_rot_q(model, corr, tokens, metric, verbose=False)
    assert stacked.shape == (3, 4, 2)  # [n_layers, n_heads, batch]
    one = P.get_act_patch_rot_q(model, corr, tokens, metric, verbose=False, replicas=1)
    torch.testing.assert_close(stacked, one, rtol=0, atol=1e-5)  # batch stacking is only a layout
    kv = P.get_act_patch_rot_k(model, corr, tokens, metric, verbose=False)
    assert kv.shape == (3, 2, 2)  # kv heads
    lay = P.get_act_patch_layer(model, corr, tokens, lambda lg: metric(lg).mean(), layers=[1, 2], verbose=False)
    assert lay.shape == (3,) and math.isnan(float(lay[0])) and not torch.isnan(lay[1:]).any()
    # the recovery is (corrupted − patched) / (corrupted − clean) per document; noising: (patched − clean) / …
    b = P.baselines(model, corr, tokens, metric)
    rec = P.normalised_recovery(stacked, b["clean"], b["corrupted"])
    assert rec.shape == stacked.shape and torch.isfinite(rec).all()
    torch.testing.assert_close(rec, (b["corrupted"] - stacked) / (b["corrupted"] - b["clean"]))
    noised = P.get_act_patch_rot_q(model, corr, tokens, metric, verbose=False, direction="noising", layers=[2])
    rec_n = P.normalised_recovery(noised[2], b["clean"], b["corrupted"], direction="noising")
    torch.testing.assert_close(rec_n, (noised[2] - b["clean"]) / (b["corrupted"] - b["clean"]))
    assert torch.isnan(P.normalised_recovery(torch.ones(2), torch.ones(2), torch.ones(2))).all()


def test_gqa_kv_head_reaches_exactly_its_group(model, tokens):
    layer = 1
    ids = P.Swaps(0.3).position_ids(N, n_seq=2, keep_last=T)
    rep = reposition_hooks(model, ids)
    st = _record(model, tokens, ["rot_k"])
    w_corr = _scores_at(model, layer, tokens, rep)
    mask = torch.zeros(1, N, 2, dtype=torch.bool)
    mask[:, :, 1] = True  # kv head 1 serves query heads 2 and 3 (4 heads, 2 kv heads)
    w = _scores_at(model, layer, tokens, [*rep, *patch_hooks(model, "rot_k", {layer: mask}, st["rot_k"]).after])
    assert torch.equal(w[:, :2], w_corr[:, :2])
    vis = torch.isfinite(w_corr[:, 2:])
    assert (w[:, 2:][vis] - w_corr[:, 2:][vis]).abs().max() > 1e-3


def test_patch_hooks_are_removed_also_on_an_exception(model, tokens):
    before = sum(len(hp._forward_hooks) for hp in model.hook_dict.values())

    def boom(logits):
        raise RuntimeError("metric failed")

    with pytest.raises(RuntimeError, match="metric failed"):
        P.get_act_patch_rot_q(model, P.Swaps(0.3), tokens, boom, verbose=False)
    assert sum(len(hp._forward_hooks) for hp in model.hook_dict.values()) == before


def test_bad_input_is_named(model, tokens, k_means):
    metric = P.target_nll(tokens, T)
    with pytest.raises(IndexRangeError, match="layer 7"):
        P.get_act_patch_rot_q(model, P.Swaps(0.3), tokens, metric, layers=[7], verbose=False)
    with pytest.raises(IndexRangeError, match="head 9"):
        P.get_act_patch_heads(model, P.Swaps(0.3), tokens, metric, [(0, 9)])
    with pytest.raises(ValueError, match="scalar or one value per sequence"):
        P.get_act_patch_rot_q(model, P.Swaps(0.3), tokens, lambda lg: lg[..., :2].mean(-1), verbose=False)
    with pytest.raises(ValueError, match="non-finite"):
        P.get_act_patch_rot_q(model, P.Swaps(0.3), tokens, lambda lg: lg.sum() * math.inf, verbose=False)
    with pytest.raises(ValueError, match="unchanged"):  # 0.01 of 17 pairs rounds to no swap at all
        P.get_act_patch_rot_q(model, P.Swaps(0.01), tokens, metric, verbose=False)
    with pytest.raises(ValueError, match="same length"):
        P.baselines(model, P.IdMap(torch.arange(N + 3)), tokens, metric)
    with pytest.raises(ValueError, match="unchanged"):
        P.baselines(model, P.IdMap(torch.arange(N)), tokens, metric)
    with pytest.raises(ValueError, match="k̄|k_means"):
        P.get_act_patch_pos_term(model, P.Swaps(0.3), tokens, metric, verbose=False)
    with pytest.raises(ValueError, match="direction"):
        P.get_act_patch_rot_q(model, P.Swaps(0.3), tokens, metric, direction="backwards", verbose=False)
    with pytest.raises(ValueError, match="unknown patched quantity"):
        P.generic_position_patch(model, P.Swaps(0.3), tokens, metric, quantity="rot_v", verbose=False)
    with pytest.raises(ValueError, match="positive integer"):
        P.Shift(0)


def test_corruptions_ids():
    ids = P.Swaps(0.25, seed=3).position_ids(20, n_seq=3, keep_last=5)
    assert ids.shape == (3, 20)
    assert (ids[:, 15:] == torch.arange(15, 20)).all() and (ids[:, 0] == 0).all()  # target and BOS stay
    assert all(sorted(r.tolist()) == list(range(20)) for r in ids)  # a permutation of the ids
    assert not torch.equal(ids[0], ids[1])  # drawn per sequence
    g = P.Gap(100).position_ids(10, keep_last=3)[0]
    assert g.tolist() == [0, 1, 2, 3, 4, 5, 6, 107, 108, 109]
    assert (P.Shift(7).position_ids(5)[0] == torch.arange(7, 12)).all()
    assert "null control" in str(P.Shift(7)) and "p = 0.25" in str(P.Swaps(0.25, seed=3))


def _qk_restore(m, n_pos=16):
    """(clean metric, corrupted metric, metric with every layer's rotated q and k patched clean → corrupted), on a
    model ``m`` of any backend: 2 sequences of ``n_pos`` tokens, T2 swaps of 30 % of the pairs."""
    toks = torch.randint(0, 50, (2, n_pos), generator=torch.Generator().manual_seed(0))
    metric = P.target_nll(toks, 4)
    ids = P.Swaps(0.3).position_ids(n_pos, n_seq=2, keep_last=4)
    rep = reposition_hooks(m, ids)
    spec, _ = probe_hooks(m)
    st = _record(m, toks, ["rot_q", "rot_k"])
    hooks = [*rep]
    for q in st:
        n = spec.n_kv_heads if q == "rot_k" else spec.n_heads
        full = {layer: torch.ones(1, n_pos, n, dtype=torch.bool) for layer in range(spec.n_layers)}
        hooks += patch_hooks(m, q, full, st[q]).after
    return (_metric_with(m, toks, metric, []), _metric_with(m, toks, metric, rep),
            _metric_with(m, toks, metric, hooks), toks, metric)


def test_native_bridge_rotated_qk_by_the_pre_rotation_hook_and_terms_refused():
    """A TransformerLens-native bridge fires no hook_rot_* and its hook_attn_scores are post-softmax: rotated q/k
    are patched at the pre-rotation hook (exactly), the logit terms are refused by name."""
    m = tm.native(n_layers=2)
    clean, corrupted, patched, toks, metric = _qk_restore(m)
    torch.testing.assert_close(patched, clean, rtol=0, atol=1e-5)
    assert (corrupted - clean).abs().max() > 0  # the corruption changed something
    with pytest.raises(CaptureError, match="not pre-softmax"):
        P.get_act_patch_pos_term(m, P.Swaps(0.3), toks, metric, k_means={0: torch.zeros(2, 8)}, verbose=False)


@pytest.mark.skipif(not compat.has_hooked_transformer(), reason="needs TransformerLens 3.x (HookedTransformer)")
def test_hooked_transformer_gqa_restores_exactly():
    m = tm.sharpened(tm.hooked(n_key_value_heads=2, n_layers=2))
    clean, corrupted, patched, toks, metric = _qk_restore(m)
    assert torch.equal(patched, clean) and (corrupted - clean).abs().max() > 1e-4
    kv = P.get_act_patch_rot_k(m, P.Swaps(0.3), toks, metric, verbose=False)
    assert kv.shape == (2, 2, 2)


def test_gemma3_qk_norm_sliding_window_restores_and_reconstructs():
    """QK-norm, MQA, local layers with a window of 4 keys: rotated q/k restore the clean run bit for bit, and the
    three logit terms give the clean logits of a local layer with the window's masked keys left masked."""
    m = tm.sharpened(tm.hf_gemma3()[0])
    toks = torch.randint(3, 99, (2, 16), generator=torch.Generator().manual_seed(0))
    metric = P.target_nll(toks, 4)
    ids = P.Swaps(0.3).position_ids(16, n_seq=2, keep_last=4)
    rep = reposition_hooks(m, ids)
    clean = _metric_with(m, toks, metric, [])
    assert (_metric_with(m, toks, metric, rep) - clean).abs().max() > 1e-4
    st = _record(m, toks, ["rot_q", "rot_k", "pos_term", "sem_term", "remainder"])
    hooks = [*rep]
    for q, n in (("rot_q", 2), ("rot_k", 1)):
        hooks += patch_hooks(m, q, {layer: torch.ones(1, 16, n, dtype=torch.bool) for layer in range(3)}, st[q]).after
    assert torch.equal(_metric_with(m, toks, metric, hooks), clean)
    km = key_means(m, torch.randint(3, 99, (3, 16), generator=torch.Generator().manual_seed(5)))
    w_clean = _scores_at(m, 0, toks, [])
    before, after = [], []
    for q in ("pos_term", "sem_term", "remainder"):
        h = patch_hooks(m, q, {0: torch.ones(1, 16, 2, dtype=torch.bool)}, st[q], k_means=km, base_positions=ids)
        before, after = before + h.before, after + h.after
    w = _scores_at(m, 0, toks, [*before, *rep, *after])
    i = torch.arange(16)
    vis = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 4)).expand_as(w)  # causal, inside the window
    vis = vis & torch.isfinite(w_clean)  # (this bridge masks after hook_attn_scores; others before it)
    torch.testing.assert_close(w[vis], w_clean[vis], rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isfinite(w), torch.isfinite(w_clean))


def test_a_sweep_reusing_another_ones_recording_gives_the_same_numbers(model, tokens, k_means):
    metric = P.target_nll(tokens, T)
    groups = [{1: [h]} for h in range(4)]
    first = P.patch_sweep(model, P.Swaps(0.3), tokens, metric, quantity="pos_term", groups=groups, k_means=k_means)
    other = {1: -k_means[1]}  # another k̄ (the random control's case): the recorded q/k do not depend on it
    fresh = P.patch_sweep(model, P.Swaps(0.3), tokens, metric, quantity="pos_term", groups=groups, k_means=other)
    reused = P.patch_sweep(model, P.Swaps(0.3), tokens, metric, quantity="pos_term", groups=groups, k_means=other,
                           reuse=first)
    assert torch.equal(reused.values, fresh.values) and torch.equal(reused.clean, fresh.clean)
    assert not torch.equal(fresh.values, first.values)
    with pytest.raises(ValueError, match="reuse"):
        P.patch_sweep(model, P.Swaps(0.3), tokens, metric, quantity="pos_term", groups=groups, k_means=k_means,
                      direction="noising", reuse=first)


@pytest.mark.parametrize("quantity", ["rot_q", "pos_term"])
@pytest.mark.parametrize("direction", ["denoising", "noising"])
def test_a_sweep_resumed_at_the_patched_layer_equals_whole_forwards(model, tokens, k_means, quantity, direction):
    """Each group's forward resumes at its patched layer from the base run's residual there: the numbers equal
    whole patched forwards built by hand (every block computed), and the blocks below were really skipped."""
    metric = P.target_nll(tokens, T)
    corr = P.Swaps(0.3)
    ids = corr.position_ids(N, n_seq=2, keep_last=T)
    rep = reposition_hooks(model, ids)
    groups = [{layer: [h]} for layer in (1, 2) for h in range(4)]
    from posgen_tl.hooks.reentry import skips_blocks

    assert skips_blocks(model)  # its own check's forwards run here, not in the count below
    calls: list[int] = []
    handle = model.blocks[0].attn.register_forward_hook(lambda m, a, o: calls.append(0))
    try:
        sw = P.patch_sweep(model, corr, tokens, metric, quantity=quantity, groups=groups, k_means=k_means,
                           direction=direction)
    finally:
        handle.remove()
    assert len(calls) == 2  # block 0 ran in the two baseline forwards only, never in the 2 patched ones
    st = _record(model, tokens, [quantity], middle=rep if direction == "noising" else ())[quantity]
    base = list(rep) if direction == "denoising" else []
    for r, g in enumerate(groups):
        (layer, heads), = g.items()
        mask = {layer: torch.zeros(1, N, 4, dtype=torch.bool)}
        mask[layer][0, :, heads[0]] = True
        ph = patch_hooks(model, quantity, mask, st, k_means=k_means, base_positions=ids if direction == "denoising" else None,
                         source_positions=None if direction == "denoising" else ids)
        whole = _metric_with(model, tokens, metric, ph.around(base))
        torch.testing.assert_close(sw.values[r], whole, rtol=0, atol=1e-5)
    assert sw.values.std() > 0  # the heads differ: a wrong residual would show


def test_groups_starting_at_one_layer_share_forwards_and_values_keep_the_given_order(model, tokens, k_means):
    """Groups are stacked with the others that start at the same layer (a group that starts higher does not pay for
    the blocks below it): the rows each block computes show it, and the values equal one forward per group, in the
    order the groups were given."""
    metric = P.target_nll(tokens, T)
    corr = P.Swaps(0.3)
    groups = [{2: [0]}, {0: [0, 1, 2, 3]}, {1: [1]}, {2: [1]}, {1: [0, 1, 2, 3]}, {2: [3]}]
    from posgen_tl.hooks.reentry import skips_blocks

    assert skips_blocks(model)
    rows: dict[int, int] = {}
    widest: list[int] = []  # the rows of each block call: at most `replicas` copies of the batch

    def count(i):
        def pre(m, args, kwargs):
            x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            rows[i] = rows.get(i, 0) + x.shape[0]
            widest.append(x.shape[0])
        return pre

    handles = [b.attn.register_forward_pre_hook(count(i), with_kwargs=True) for i, b in enumerate(model.blocks)]
    try:
        sw = P.patch_sweep(model, corr, tokens, metric, quantity="pos_term", groups=groups, k_means=k_means,
                           replicas=2)
    finally:
        for h in handles:
            h.remove()
    b = tokens.shape[0]
    # two baseline forwards of b rows through every block; then layer 0: 1 group; layer 1: 2; layer 2: 3 (1 + 2)
    assert rows == {0: b * (2 + 1), 1: b * (2 + 1 + 2), 2: b * (2 + 1 + 2 + 3)}
    assert max(widest) == 2 * b  # layer 2's three groups in two forwards (1 + 2), never 3 copies at once
    one = P.patch_sweep(model, corr, tokens, metric, quantity="pos_term", groups=groups, k_means=k_means, replicas=1)
    torch.testing.assert_close(sw.values, one.values, rtol=0, atol=1e-5)
    for r, g in enumerate(groups):  # each value is its own group's, whatever forward it ran in
        alone = P.patch_sweep(model, corr, tokens, metric, quantity="pos_term", groups=[g], k_means=k_means)
        torch.testing.assert_close(sw.values[r], alone.values[0], rtol=0, atol=1e-5)
    assert len({round(float(v), 4) for v in sw.values.flatten()}) > 3  # the groups differ: a mix-up would show
    with pytest.raises(ValueError, match="group 1 of the sweep patches no layer"):
        P.patch_sweep(model, corr, tokens, metric, quantity="pos_term", groups=[{1: [0]}, {}], k_means=k_means)


@pytest.mark.parametrize("quantity", ["pos_term", "sem_term", "remainder"])
def test_a_term_of_identical_replicas_is_computed_once_and_of_different_ones_per_replica(model, k_means, quantity):
    """At the layer a stacked forward resumes at, every replica's q and k are the base run's: the term map is
    computed for one replica and broadcast; where a replica's q differs (a patch acted earlier) each gets its own."""
    from posgen_tl.hooks.patching import _base_term, term_maps

    spec, _ = probe_hooks(model)
    g = torch.Generator().manual_seed(5)
    b, n, n_rep = 2, 9, 3
    q1 = torch.randn(b, n, spec.n_heads, spec.d_head, generator=g)
    k1 = torch.randn(b, n, spec.n_kv_heads, spec.d_head, generator=g)
    pos = torch.arange(n).expand(b * n_rep, n)
    rope, km = spec.layer(1), k_means[1]
    one = term_maps(q1, k1, km, pos[:b], rope, quantity)
    same = _base_term(q1.repeat(n_rep, 1, 1, 1), k1.repeat(n_rep, 1, 1, 1), km, pos, rope, quantity, n_rep)
    assert same.shape == (1, *one.shape)
    torch.testing.assert_close(same[0], one, atol=0, rtol=0)
    stacked = term_maps(q1.repeat(n_rep, 1, 1, 1), k1.repeat(n_rep, 1, 1, 1), km, pos, rope, quantity)
    torch.testing.assert_close(same.expand(n_rep, *one.shape), stacked.reshape(n_rep, *one.shape), atol=0, rtol=0)
    q = q1.repeat(n_rep, 1, 1, 1)
    q[2 * b :, 3] += 0.5  # the last replica differs at one position
    each = _base_term(q, k1.repeat(n_rep, 1, 1, 1), km, pos, rope, quantity, n_rep)
    assert each.shape == (n_rep, *one.shape)
    for r in range(n_rep):
        torch.testing.assert_close(each[r], term_maps(q[r * b : (r + 1) * b], k1, km, pos[:b], rope, quantity),
                                   atol=1e-12, rtol=0)
    assert (each[2] - each[0]).abs().max() > 1e-3


def test_default_replicas_shrink_to_what_the_free_memory_holds_and_give_the_same_values(model, tokens, k_means,
                                                                                         monkeypatch):
    """By default a patched forward stacks the heads of one layer; where that many copies' attention maps would
    outgrow half the free memory (long sequences) it stacks fewer — the widest block call shows it, the sweep says
    how many, and the values are those of one patch per forward. Where not even one copy fits, it is refused."""
    from posgen_tl.hooks import memory

    metric = P.target_nll(tokens, T)
    corr = P.Swaps(0.3)
    spec, _ = probe_hooks(model)
    b, h = tokens.shape[0], spec.n_heads
    groups = [{1: [i]} for i in range(h)]
    widest: list[int] = []

    def pre(m, args, kwargs):
        x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        widest.append(x.shape[0])

    def sweep(**kw):
        widest.clear()
        handle = model.blocks[1].attn.register_forward_pre_hook(pre, with_kwargs=True)
        try:
            return P.patch_sweep(model, corr, tokens, metric, quantity="pos_term", groups=groups, k_means=k_means, **kw)
        finally:
            handle.remove()

    roomy = sweep()
    assert roomy.replicas == h and max(widest) == h * b  # plenty of memory: the heads of the layer side by side
    # room for 2·b + ½ sequences of N tokens (maps, and the T rows of logits and log-softmax the metric reads): two
    # copies of the batch per forward
    per_seq = memory.attention_bytes(h, N) + 2 * 4 * T * model.cfg.d_vocab
    monkeypatch.setattr(memory, "free_bytes", lambda dev: int((2 * b + 0.5) * per_seq / memory.FREE_SHARE))
    tight = sweep()
    assert tight.replicas == 2 and max(widest) == 2 * b
    assert len(widest) == 2 + h // 2  # the two baselines, then h/2 patched forwards
    # one copy fits in the free memory, but not in its share: one copy per forward, not none
    monkeypatch.setattr(memory, "free_bytes", lambda dev: memory.attention_bytes(h, N, b))
    assert sweep().replicas == 1 and max(widest) == b
    # a number asked for is taken as asked where the free memory holds it, if not in its share
    monkeypatch.setattr(memory, "free_bytes", lambda dev: memory.attention_bytes(h, N, h * b))
    asked = sweep(replicas=h)
    assert asked.replicas == h and max(widest) == h * b
    one = sweep(replicas=1)
    torch.testing.assert_close(tight.values, one.values, rtol=0, atol=1e-5)
    torch.testing.assert_close(roomy.values, one.values, rtol=0, atol=1e-5)
    assert roomy.values.std() > 0  # the heads differ: a mix-up of replicas would show
    monkeypatch.setattr(memory, "free_bytes", lambda dev: 1)  # not even one sequence fits: refused by name, not killed
    with pytest.raises(MemoryError, match="activation patching: one whole forward"):
        sweep()


def test_the_free_memory_is_read_and_the_sequences_per_forward_follow_from_it():
    """``free_bytes`` reads Linux's MemAvailable (between 0 and the machine's total); a forward's attention maps are
    MAPS_PER_FORWARD float32 maps of heads·n² entries per sequence, and the sequences that fit in the free share
    follow from them (at least one)."""
    import os

    from posgen_tl.hooks import memory

    free = memory.free_bytes("cpu")
    if os.path.exists("/proc/meminfo"):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert free is not None and 0 < free <= total
    assert memory.attention_bytes(9, 8192) == int(memory.MAPS_PER_FORWARD * 4 * 9 * 8192**2)
    assert memory.attention_bytes(9, 8192, n_seq=3) == 3 * memory.attention_bytes(9, 8192)
    model = tm.hf_llama(n_layers=1)[0]
    h = probe_hooks(model)[0].n_heads
    per = memory.attention_bytes(h, 1000)
    assert memory.sequences_per_forward(model, 1000, free=int(7.9 * per / memory.FREE_SHARE)) == 7
    assert memory.sequences_per_forward(model, 1000, free=0) == 1


def test_a_whole_forward_the_free_memory_cannot_hold_is_refused_by_name(monkeypatch):
    """On the CPU the system's out-of-memory killer would end the process without a word: a whole forward whose
    attention maps exceed the free memory is refused first, naming the sizes and the ways out — in the target NLL,
    a patching forward and a q/k capture; the same passes run where the memory is there."""
    from posgen_tl.engine.swaps import nll_on_target
    from posgen_tl.hooks import memory
    from posgen_tl.hooks.stream import stream_qk

    model = tm.hf_llama(n_layers=1)[0]
    toks = torch.randint(3, 99, (2, 24), generator=torch.Generator().manual_seed(0))
    need = memory.attention_bytes(probe_hooks(model)[0].n_heads, 24, 2)
    metric = P.target_nll(toks, 6)
    stream_qk(model, toks, lambda c: None, batch_size=2, progress=False)  # (its exactness gate probed the model)
    monkeypatch.setattr(memory, "free_bytes", lambda device: need)  # just enough
    ok = nll_on_target(model, toks, target_len=6, chunk=0)
    monkeypatch.setattr(memory, "free_bytes", lambda device: need - 1)
    msg = r"one whole forward of 2 × 24 tokens keeps about .* GiB of attention maps in flight.*batch_size.*chunk="
    with pytest.raises(MemoryError, match="the target NLL: " + msg):
        nll_on_target(model, toks, target_len=6, chunk=0)
    with pytest.raises(MemoryError, match="activation patching: " + msg):
        P.baselines(model, P.Swaps(0.5), toks, metric)
    with pytest.raises(MemoryError, match="reading q/k in one forward: " + msg):
        stream_qk(model, toks, lambda c: None, batch_size=2, progress=False)
    monkeypatch.setattr(memory, "free_bytes", lambda device: None)  # unreadable: nothing is refused
    torch.testing.assert_close(nll_on_target(model, toks, target_len=6, chunk=0), ok)


def test_the_logits_a_metric_reads_count_in_the_default_replicas(monkeypatch):
    """Each copy of a patched forward also holds the float32 logits of the rows its metric reads, and their
    log-softmax: with a large vocabulary and a long target those outweigh the attention maps, and fewer copies fit."""
    from posgen_tl.hooks import memory

    model = tm.hf_llama(n_layers=1)[0]
    h, vocab = probe_hooks(model)[0].n_heads, model.cfg.d_vocab
    att = memory.attention_bytes(h, 1000)
    monkeypatch.setattr(memory, "free_bytes", lambda dev: int(4.5 * att / memory.FREE_SHARE))
    assert P.default_replicas(model, h, 1, 1000) == 4
    rows = int(att / (2 * 4 * vocab))  # logits of as many bytes as the maps: half as many copies
    assert P.default_replicas(model, h, 1, 1000, logit_rows=rows) == 2
    assert P.default_replicas(model, h, 1, 1000, rows=100) == h  # chunk-sized maps: every head's copy fits
