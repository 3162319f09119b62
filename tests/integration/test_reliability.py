"""Reliability: dtypes, non-finite activations, odd GQA, determinism, hook hygiene in analyses."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from posgen_tl import decompose_model, feature_pattern, random_twin
from posgen_tl.experiments.exactness import exactness_table
from posgen_tl.hooks.capture import CaptureError, probe_hooks
from posgen_tl.hooks.stream import capture_qk, stream_qk
from posgen_tl.maths.rope import LayerRope, RopeError, RopeSpec


def _no_hooks(model) -> bool:
    return all(len(hp._forward_hooks) == 0 for hp in model.hook_dict.values())


@pytest.mark.parametrize("heads", [(9, 3), (5, 1), (6, 6)])
def test_gqa_odd_head_counts_exact(heads):
    model, _ = tm.hf_llama(n_heads=heads[0], n_kv=heads[1])
    df = exactness_table(model, torch.randint(3, 90, (1, 9)))
    assert df["passed"].all()
    spec, _ = probe_hooks(model)
    assert [spec.kv_group(h) for h in range(heads[0])] == [h // (heads[0] // heads[1]) for h in range(heads[0])]


def test_heads_not_a_multiple_of_kv_heads_refused():
    lr = LayerRope(torch.ones(2), 4)
    with pytest.raises(RopeError, match="not a multiple"):
        RopeSpec("m", 1, 5, 2, 4, 16, (lr,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_analysed_in_float32(dtype):
    model, _ = tm.hf_llama()
    model = model.to(dtype)
    caps = capture_qk(model, torch.randint(3, 90, (1, 9)), with_scores=True)
    assert all(c.q.dtype == torch.float32 and c.rot_k.dtype == torch.float32 for c in caps.values())
    df = exactness_table(model, torch.randint(3, 90, (1, 9)))
    assert df["passed"].all()  # tolerance scaled to the model's own precision (8·eps)
    # and the errors are real rounding, not zero: the float32 tolerance would be too strict
    assert (df["score_rel_err"] > 0).any() or (df["rot_q_max_err"] > 0).any()


def test_nan_in_activations_is_refused_not_averaged():
    model = tm.native()
    poison = [("blocks.1.attn.hook_k", lambda t, hook: t.index_fill(1, torch.tensor([2]), float("nan")))]
    with pytest.raises(CaptureError, match=r"non-finite value\(s\) \(NaN/inf\) in blocks\.1\.attn\.hook_k"):
        stream_qk(model, torch.randint(3, 50, (1, 6)), lambda c: None, extra_hooks=poison, progress=False)
    assert _no_hooks(model)


def test_inf_in_activations_is_refused():
    model, _ = tm.hf_llama()
    poison = [("blocks.0.attn.hook_q", lambda t, hook: t * float("inf"))]
    with pytest.raises(CaptureError, match="NaN/inf"):
        decompose_model(model, torch.randint(3, 90, (2, 8)), reference=torch.randint(3, 90, (1, 8)), layers=[0],
                        extra_hooks=poison, progress=False)
    assert _no_hooks(model)


def test_determinism_same_seed_identical_tables():
    model, _ = tm.hf_llama()
    toks = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(0))
    a = decompose_model(model, toks[:-1], reference=toks[-1:], progress=False)
    b = decompose_model(model, toks[:-1], reference=toks[-1:], progress=False)
    assert a.equals(b)
    pa = feature_pattern(model, toks, n_seq=4, seq_len=12, progress=False)
    pb = feature_pattern(model, toks, n_seq=4, seq_len=12, progress=False)
    assert pa.heads.equals(pb.heads) and pa.bands.equals(pb.bands)


def test_random_twin_reproducible_per_seed_and_different_across_seeds():
    model, _ = tm.hf_llama()
    t1, t2, t3 = random_twin(model, 3), random_twin(model, 3), random_twin(model, 4)
    p1, p2, p3 = (dict(t.original_model.named_parameters()) for t in (t1, t2, t3))
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    assert any(not torch.equal(p1[k], p3[k]) for k in p1)
    assert any(not torch.equal(p1[k], v) for k, v in model.original_model.named_parameters())
    # the caller's RNG is untouched
    torch.manual_seed(123)
    x = torch.rand(1)
    torch.manual_seed(123)
    random_twin(model, 5)
    assert torch.equal(torch.rand(1), x)


def test_native_twin_reproducible():
    model = tm.native()
    a, b = random_twin(model, 7), random_twin(model, 7)
    toks = torch.randint(3, 50, (1, 6))
    with torch.no_grad():
        assert torch.equal(a(toks), b(toks))


def test_hooks_removed_after_failure_inside_analysis_and_user_hooks_kept(monkeypatch):
    from posgen_tl.maths.band_stats import BandStats

    model, _ = tm.hf_llama()
    seen = []
    user = ("blocks.0.attn.hook_q", lambda t, hook: seen.append(1))

    def fail(self, *a, **k):
        raise RuntimeError("boom inside the analysis")

    with model.hooks(fwd_hooks=[user]):
        with monkeypatch.context() as m:
            m.setattr(BandStats, "update", fail)
            with pytest.raises(RuntimeError, match="boom"):
                feature_pattern(model, torch.randint(3, 90, (2, 8)), n_seq=2, seq_len=8, progress=False)
        # our hooks are gone, the user's hook is still attached and still fires (nested use works)
        assert len(model.hook_dict["blocks.0.attn.hook_q"]._forward_hooks) == 1
        n = len(seen)
        decompose_model(model, torch.randint(3, 90, (2, 8)), reference=torch.randint(3, 90, (1, 8)), layers=[0], progress=False)
        assert len(seen) > n
    assert _no_hooks(model)


def test_keyboard_interrupt_leaves_no_hooks():
    model = tm.native()

    def interrupt(c):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stream_qk(model, torch.randint(3, 50, (2, 6)), interrupt, progress=False)
    assert _no_hooks(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to mix devices")
def test_cpu_tokens_on_gpu_model_are_moved():  # pragma: no cover - no GPU in CI
    model = tm.native().to("cuda")
    caps = capture_qk(model, torch.randint(3, 50, (1, 6)))
    assert all(c.q.device.type == "cuda" for c in caps.values())
