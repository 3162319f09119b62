"""Exactness of capture on tiny offline RoPE configs: every layout/variant we claim."""

from __future__ import annotations

import sys

import pytest
import tiny_models as tm
import torch

from posgen_tl.experiments.exactness import ROT_RTOL, SCORE_RTOL, exactness_table
from posgen_tl.hooks.capture import CaptureError, QKCapture, probe_hooks
from posgen_tl.hooks.stream import capture_qk, stream_qk
from posgen_tl.maths.rope import RopeError, causal_mask, expand_kv, rotate, scores_from_prerotation

TINY = {
    "native_adjacent_gqa_partial": lambda: tm.native(rotary_dim=6, n_heads=4, n_kv=2, d_head=8),
    "native_linear_scaling": lambda: tm.native(rope_scaling={"type": "linear", "factor": 2.0}),
    "hf_llama_half_gqa": lambda: tm.hf_llama()[0],
    "hf_llama_yarn": lambda: tm.hf_llama(rope={"rope_theta": 1000.0, "rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32})[0],
    "hf_llama_llama3": lambda: tm.hf_llama(rope={"rope_theta": 1000.0, "rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 32})[0],
    "hf_gemma3_local_global_qknorm": lambda: tm.hf_gemma3()[0],
}


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request):
    return request.param, TINY[request.param]()


def test_exactness_table_passes(tiny):
    name, model = tiny
    toks = torch.randint(3, 50, (2, 12))
    df = exactness_table(model, toks)
    spec, info = probe_hooks(model)
    assert len(df) == spec.n_layers
    assert df["passed"].all(), df
    if info.rot_fires:
        # R_pos(pre-rotation q) == hook_rot_q to the stated tolerance (in practice: bit-exact)
        assert (df["rot_q_max_err"] <= ROT_RTOL * df["rot_ref"]).all()
        assert (df["rot_k_max_err"] <= ROT_RTOL * df["rot_ref"]).all()
    if info.scores_kind == "pre_softmax":
        assert (df["score_rel_err"] <= SCORE_RTOL).all()


def test_hook_detection(tiny):
    name, model = tiny
    spec, info = probe_hooks(model)
    if name.startswith("native"):
        # TL-native models fire neither hook_rot_* nor pre-softmax scores: detected, not assumed
        assert not info.rot_fires and info.scores_kind == "post_softmax"
        assert spec.layers[0].layout == "adjacent"
    else:
        assert info.rot_fires and info.scores_kind == "pre_softmax"
        assert spec.layers[0].layout == "half"
    if "gemma3" in name:
        assert info.q_hook == "hook_q_normed" and spec.qk_norm
        assert [lr.kind for lr in spec.layers] == ["local", "local", "global"]
        assert spec.layers[0].sliding_window == 4 and spec.layers[2].sliding_window is None
        # local and global layers really use different bases
        assert not torch.equal(spec.layers[0].inv_freq, spec.layers[2].inv_freq)
    if "yarn" in name:
        assert spec.layers[0].attention_scaling > 1.0
    if "partial" in name:
        assert spec.layers[0].rotary_dim == 6 and spec.d_head == 8


def test_recomputed_scores_match_model_on_local_and_global_layers():
    """Gemma3-style model, sequence longer than the window: both layer kinds exact on unmasked entries."""
    model, _ = tm.hf_gemma3()
    toks = torch.randint(3, 90, (1, 10))
    caps = capture_qk(model, toks, with_scores=True)
    for layer, c in caps.items():  # noqa: B007
        m = causal_mask(10, sliding_window=c.rope.sliding_window)
        w = c.logits()
        assert torch.allclose(w[..., m], c.scores[..., m], rtol=0, atol=1e-5 * c.scores[..., m].abs().max())
        # masked entries really are masked by the model (window respected)
        assert (c.scores[..., ~m] < -1e30).all() or torch.isinf(c.scores[..., ~m]).all()
        # the band-picture formula q_iᵀ R_{j−i} k_j agrees with the rotated dot product
        w2 = scores_from_prerotation(c.q, c.k, c.positions, c.rope)
        assert torch.allclose(w, w2, atol=1e-4)


def test_gqa_mapping_matches_model():
    """Query head h reads kv-group h // (H/G): expanded keys reproduce every head's scores."""
    model, _ = tm.hf_llama(n_heads=6, n_kv=2)
    c = capture_qk(model, torch.randint(3, 90, (1, 7)), layers=[1], with_scores=True)[1]
    spec, _ = probe_hooks(model)
    assert c.k.shape[-2] == 2 and c.k_expanded().shape[-2] == 6
    for h in range(6):
        g = spec.kv_group(h)
        assert g == h // 3
        w = torch.einsum("bqd,bkd->bqk", c.rot_q[:, :, h], c.rot_k[:, :, g]) * c.rope.score_scale
        m = causal_mask(7)
        assert torch.allclose(w[..., m], c.scores[:, h][..., m], atol=1e-5)


def test_logits_equal_hf_logits():
    model, hf = tm.hf_llama()
    toks = torch.randint(3, 90, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(toks), hf(toks).logits)


def test_stream_stops_early_and_visits_each_layer_once():
    model = tm.native(n_layers=4)
    seen = []
    stream_qk(model, torch.randint(3, 50, (5, 8)), lambda c: seen.append((c.batch_index, c.layer)), layers=[1, 2],
              batch_size=2, progress=False)
    assert seen == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)]


def test_stream_asks_after_each_batch_whether_to_return_the_freed_heap(monkeypatch):
    """Memory independent of the number of batches: after each batch the pass's BatchTrim decides (glibc) whether the
    freed heap goes back to the OS; the real trim runs where there is glibc."""
    import platform  # noqa: PLC0415

    import posgen_tl.hooks.stream as cap  # noqa: PLC0415
    from posgen_tl.hooks.gate import check_result  # noqa: PLC0415

    model = tm.native(n_layers=2)
    check_result(model)  # the gate's one exactness pass, before counting
    calls: list[int] = []

    class Counting(cap.BatchTrim):
        def __call__(self) -> bool:
            calls.append(id(self))
            return super().__call__()

    monkeypatch.setattr(cap, "BatchTrim", Counting)
    stream_qk(model, torch.randint(3, 50, (5, 8)), lambda c: None, batch_size=2, progress=False)
    assert len(calls) == 3 and len(set(calls)) == 1  # 3 batches, one trimmer for the pass
    if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
        assert cap.release_freed_memory() is True


def test_stream_rotation_fallback_matches_model_pattern():
    """native: rot computed from the spec; softmax of our logits equals the model's pattern."""
    model = tm.native()
    caps = capture_qk(model, torch.randint(3, 50, (2, 10)), with_scores=True)
    for c in caps.values():
        assert c.rot_source == "computed" and c.scores_kind == "post_softmax"
        m = causal_mask(10)
        p = torch.softmax(c.logits().masked_fill(~m, float("-inf")), -1)
        assert torch.allclose(p, c.scores, atol=1e-6)
        assert torch.equal(c.rot_q, rotate(c.q, c.positions, c.rope))


def test_hooks_removed_after_exception_in_consumer():
    model = tm.native()

    def boom(c):
        raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        stream_qk(model, torch.randint(3, 50, (1, 6)), boom, progress=False)
    for name, hp in model.hook_dict.items():
        assert len(hp._forward_hooks) == 0, name


def test_users_own_hooks_are_kept_and_see_the_forward():
    model = tm.native()
    calls = []
    name = "blocks.0.attn.hook_q"
    with model.hooks(fwd_hooks=[(name, lambda t, hook: calls.append(t.shape))]):
        capture_qk(model, torch.randint(3, 50, (1, 6)), layers=[0])
        assert len(model.hook_dict[name]._forward_hooks) == 1  # ours gone, the user's kept
    assert len(calls) >= 1
    assert len(model.hook_dict[name]._forward_hooks) == 0


def test_the_probe_describes_the_model_not_the_hooks_of_its_first_caller():
    """probe_hooks caches what the hooks hold per model: run first inside a user's hook that plants a NaN in the
    last layer's scores, it still finds them pre-softmax logits (with the hook in place it found 'unknown', and
    every later exactness check skipped the scores); the user's temporary hook is set aside only for the probe — it
    fires on the user's next forward inside the context and is gone after it — and a permanent hook stays on."""
    model = tm.hf_llama(n_layers=3)[0]
    name = "blocks.2.attn.hook_attn_scores"
    calls = []

    def plant(x, hook):
        calls.append(1)
        x = x.clone()
        x[0, 0, 5, 2] = float("nan")
        return x

    kept = []  # a permanent hook is part of the model: it stays on for the probe
    model.hook_dict["blocks.0.attn.hook_q"].add_hook(lambda t, hook: kept.append(1), is_permanent=True)
    try:
        with model.hooks(fwd_hooks=[(name, plant)]):
            _, hooked = probe_hooks(model, refresh=True)
            assert not calls and kept == [1]  # the temporary hook set aside during the probe, the permanent one not
            assert len(model.hook_dict[name]._forward_hooks) == 1  # and back after it
            model(torch.randint(3, 100, (1, 8)), return_type=None)
            assert calls == [1]
        assert len(model.hook_dict[name]._forward_hooks) == 0
    finally:
        model.reset_hooks(including_permanent=True)
    _, clean = probe_hooks(model, refresh=True)
    assert hooked == clean and clean.scores_kind == "pre_softmax"
    table = exactness_table(model, torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0)))
    assert (table["status"] == "passed").all()


def test_non_rope_model_is_refused():
    model = tm.native(positional="standard")
    with pytest.raises(RopeError, match="not rotary"):
        probe_hooks(model)


def test_scores_requested_but_absent_is_refused(monkeypatch):
    model = tm.native()
    spec, info = probe_hooks(model)
    from dataclasses import replace

    import posgen_tl.hooks.capture as cap

    monkeypatch.setitem(cap._PROBES, model, (spec, replace(info, scores_kind="absent")))
    with pytest.raises(CaptureError, match="hook_attn_scores"):
        capture_qk(model, torch.randint(3, 50, (1, 6)), with_scores=True)


def test_expand_kv_rejects_bad_grouping():
    with pytest.raises(RopeError, match="multiple"):
        expand_kv(torch.randn(1, 2, 3, 4), 4)


@pytest.mark.parametrize("make", [lambda: tm.hf_llama(n_layers=3)[0], lambda: tm.hf_gemma3()[0]], ids=["llama", "gemma3"])
def test_stream_hands_stacks_of_layers_each_checked_once(make, monkeypatch):
    """``stream_qk(stack=…)``: ``fn`` gets each batch's layers stacked on the head axis — q/k/rotations equal to the
    layers' own captures side by side, ``layers`` naming them, Gemma3's local and global layers (other windows) in
    different stacks — and the finiteness/rotation check runs once per stack instead of once per layer."""
    import posgen_tl.hooks.stream as st  # noqa: PLC0415
    from posgen_tl.hooks.gate import check_result  # noqa: PLC0415

    model = make()
    check_result(model)  # the gate's exactness pass, before counting checks
    spec, _ = probe_hooks(model)
    toks = torch.randint(3, 90, (3, 10), generator=torch.Generator().manual_seed(0))
    one: dict[tuple[int, int], object] = {}
    stream_qk(model, toks, lambda c: one.__setitem__((c.batch_index, c.layer), c), batch_size=2, progress=False)
    real, checks = st._check_capture, []
    monkeypatch.setattr(st, "_check_capture", lambda cap, *a: checks.append(cap.layer_ids) or real(cap, *a))
    stacks = []
    stream_qk(model, toks, stacks.append, batch_size=2, progress=False, stack=64)
    windows = [spec.layer(i).sliding_window for i in range(spec.n_layers)]
    expected = [(0, 1, 2)] if len(set(windows)) == 1 else [(0, 1), (2,)]
    assert [s.layer_ids for s in stacks] == expected * 2  # two batches
    assert checks == expected * 2  # one check per stack, none per layer
    for s in stacks:
        for name in ("q", "k", "rot_q", "rot_k"):
            parts = [getattr(one[(s.batch_index, layer)], name) for layer in s.layer_ids]
            assert torch.equal(getattr(s, name), torch.cat(parts, dim=2)), name
        assert s.rot_source == "hook"
    checks.clear()
    stream_qk(model, toks, lambda c: None, batch_size=2, progress=False)
    assert checks == [(i,) for i in range(spec.n_layers)] * 2  # one layer at a time: one check per layer


def test_a_stack_names_the_layer_whose_values_are_not_finite_or_not_rotated_as_the_spec_says():
    """A check per stack still names the layer at fault: a NaN in layer 1's keys, or layer 1's rotated keys shifted
    by one position (the relative tolerance is each layer's own, not the stack's largest value)."""
    from posgen_tl.maths.rope import unrotate  # noqa: PLC0415

    model = tm.hf_llama(n_layers=3)[0]
    spec, info = probe_hooks(model)
    toks = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(1))
    poison = [(info.name(1, "hook_k"), lambda t, hook: t.index_fill(1, torch.tensor([2]), float("nan")))]
    with pytest.raises(CaptureError, match=r"non-finite value\(s\) \(NaN/inf\) in blocks\.1\.attn\.hook_k"):
        stream_qk(model, toks, lambda c: None, extra_hooks=poison, progress=False, stack=3)
    rope = spec.layer(1)

    def shift(x, hook):
        ar = torch.arange(x.shape[1])
        return rotate(unrotate(x.float(), ar, rope), ar + 1, rope).to(x.dtype)

    with pytest.raises(CaptureError, match="layer 1: the rotation the spec gives"):
        stream_qk(model, toks, lambda c: None, extra_hooks=[(info.name(1, "hook_rot_k"), shift)], progress=False,
                  stack=3)
    with pytest.raises(ValueError, match="scores, patterns or tables"):
        stream_qk(model, toks, lambda c: None, with_scores=True, progress=False, stack=2)
    assert not any(h.fwd_hooks for h in model.hook_dict.values())


@pytest.mark.parametrize("layout", ["half", "adjacent"])
def test_the_rotation_check_is_exact_on_the_spec_s_rotation_and_sees_a_change_in_any_dim_of_one_layer(layout):
    """_rotation_errors on a stack of two layers, partial rotary (6 of 10 dims), attention scaling: 0 where rot_q/rot_k
    are rotate()'s own output (the same bits), and a change of one value — a rotated dim or an unrotated one, in the
    second layer only — shows as that layer's error, the first layer's staying 0; the reference is each layer's max."""
    from posgen_tl.hooks.stream import _rotation_errors  # noqa: PLC0415
    from posgen_tl.maths.rope import LayerRope  # noqa: PLC0415

    gen = torch.Generator().manual_seed(3)
    rope = LayerRope(inv_freq=1.0 / (50.0 ** (torch.arange(0, 6, 2).float() / 6)), rotary_dim=6, layout=layout,
                     attention_scaling=1.3)
    pos = torch.arange(7).expand(2, 7)
    q, k = torch.randn(2, 7, 4, 10, generator=gen), torch.randn(2, 7, 2, 10, generator=gen)
    cap = QKCapture(layer=0, q=q, k=k, rot_q=rotate(q, pos, rope), rot_k=rotate(k, pos, rope), positions=pos, rope=rope,
                    rot_source="hook", layers=(0, 1))
    err = _rotation_errors(cap)  # [err_q (2 layers), ref_q, err_k, ref_k]
    assert err[[0, 1, 4, 5]].tolist() == [0.0] * 4
    torch.testing.assert_close(err[2:4], cap.rot_q.abs().reshape(2, 7, 2, -1).amax(dim=(0, 1, 3)))
    for dim, value in ((1, 0.25), (8, -0.5)):  # a rotated dim, an unrotated one; heads 2-3 = the second layer
        bumped = cap.rot_k.clone()
        bumped[1, 3, 1, dim] += value  # kv-head 1 = the second layer's
        err = _rotation_errors(QKCapture(**{**vars(cap), "rot_k": bumped}))
        assert err[4] == 0.0 and err[5].item() == pytest.approx(abs(value), rel=1e-5)
    bumped = cap.rot_k.clone()
    bumped[0, 2, 1, 4] = float("nan")  # a NaN is never the largest difference's absence: it propagates
    err = _rotation_errors(QKCapture(**{**vars(cap), "rot_k": bumped}))
    assert err[4] == 0.0 and err[5].isnan() and err[7].isnan()
