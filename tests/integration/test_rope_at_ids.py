"""RoPE whose frequencies depend on the position ids (dynamic NTK) or on the largest id (LongRoPE),
at ids PAST the original length, against Hugging Face's own eager attention of the same weights
run with the same ``position_ids`` (issue #32, item 1).

The capture must give q/k whose rotation (our spec at the capture's positions) is HF's, logit
substitution by exact logits must leave the model's output unchanged, and re-positioning hooks
that cannot reproduce the frequencies must refuse by name.
"""

from __future__ import annotations

import warnings

import arch_matrix as am
import pytest
import torch

N = 24
IDS = 100 + torch.arange(N)  # past max_position_embeddings = 64 and past LongRoPE's 16


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("rope-ids")


def _hf_rotated(folder, tokens, ids):
    """HF eager's rotated query per layer ``[batch, head, pos, d_head]`` with ``position_ids=ids``."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    rec = am.HFRecorder(hf)
    with torch.no_grad(), rec.recording():
        logits = hf(tokens, position_ids=ids[None].expand(tokens.shape[0], -1)).logits
    return rec.layers, logits


@pytest.mark.parametrize("arch", ["llama-dynamic", "llama-longrope", "phi3-longrope"])
def test_capture_at_ids_past_the_original_length_is_hugging_faces_rotation(arch, root):
    import posgen_tl as pg
    from posgen_tl.hooks.stream import capture_qk
    from posgen_tl.maths.rope import rotate

    folder = am.build_folder(am.ARCHS[arch], root)
    model = pg.load_model(str(folder))
    tokens = am._tokens(N)
    ref, _ = _hf_rotated(folder, tokens, IDS)
    caps = capture_qk(model, tokens, position_ids=IDS)  # the capture checks itself against hook_rot_q/k
    for layer, c in caps.items():
        ours = rotate(c.q, c.positions, c.rope).transpose(1, 2)  # [batch, head, pos, d_head]
        hf_q = ref[layer].query
        err = float((ours - hf_q).abs().max() / hf_q.abs().max())
        assert err < 1e-5, f"{arch} layer {layer}: our rotation at ids {int(IDS[0])}… differs from HF's by {err:.2e}"
    if arch == "llama-dynamic":  # the frequencies HF recomputed for these ids, not the base ones
        base = pg.rope_spec(model).layer(0).inv_freq
        assert not torch.allclose(caps[0].rope.inv_freq, base), "dynamic NTK kept the base frequencies past 64"


@pytest.mark.parametrize("arch", ["llama-dynamic", "llama-longrope"])
def test_exact_logit_substitution_at_ids_past_the_original_length_is_the_model(arch, root):
    import posgen_tl as pg
    from posgen_tl.hooks.logits import logit_substitution_hooks
    from posgen_tl.maths.approx_logits import exact_logits

    folder = am.build_folder(am.ARCHS[arch], root)
    model = pg.load_model(str(folder))
    tokens = am._tokens(N)
    _, hf_logits = _hf_rotated(folder, tokens, IDS)

    def every_entry(ctx):
        n = ctx.q.shape[1]
        return exact_logits(ctx.q, ctx.k, ctx.rope, ctx.positions, dtype=torch.float32), torch.ones(n, n, dtype=torch.bool)

    pid = IDS[None].expand(tokens.shape[0], -1)
    with torch.no_grad():
        plain = model(tokens, return_type="logits", position_ids=pid)
        out = model.run_with_hooks(tokens, return_type="logits", position_ids=pid,
                                   fwd_hooks=logit_substitution_hooks(model, every_entry, position_ids=IDS))
    assert float((plain - hf_logits).abs().max() / hf_logits.abs().max()) < 1e-4  # the bridge is HF
    err = float((out - plain).abs().max() / plain.abs().max())
    assert err < 1e-4, f"{arch}: exact-logit substitution at ids {int(IDS[0])}… moves the output by {err:.2e}"


def test_repositioning_hooks_refuse_dynamic_ntk_past_its_switch(root):
    import posgen_tl as pg
    from posgen_tl.hooks.positions import reposition_hooks
    from posgen_tl.maths.rope import RopeError

    model = pg.load_model(str(am.build_folder(am.ARCHS["llama-dynamic"], root)))
    with pytest.raises(RopeError, match="dynamic-NTK .* pass position_ids to the forward"):
        reposition_hooks(model, IDS)
    assert reposition_hooks(model, torch.arange(N) + 3)  # inside the original length: fine


def test_a_capture_whose_rotation_is_not_the_spec_s_raises(root):
    """A hook that changes rot_k behind the capture's back (here: rotating keys by one more position)
    makes the capture refuse instead of handing out q/k whose rotation is not the model's."""
    import posgen_tl as pg
    from posgen_tl.hooks.capture import CaptureError, probe_hooks
    from posgen_tl.hooks.stream import capture_qk
    from posgen_tl.maths.rope import rotate, unrotate

    model = pg.load_model(str(am.build_folder(am.ARCHS["llama"], root)))
    spec, info = probe_hooks(model)
    rope = spec.layer(1)

    def shift(x, hook):
        ar = torch.arange(x.shape[1])
        return rotate(unrotate(x.float(), ar, rope), ar + 1, rope).to(x.dtype)

    model.hook_dict[info.name(1, "hook_rot_k")].add_hook(shift)
    try:
        with pytest.raises(CaptureError, match="layer 1: the rotation the spec gives"):
            capture_qk(model, am._tokens(N))
    finally:
        model.reset_hooks()
    assert set(capture_qk(model, am._tokens(N))) == {0, 1}
