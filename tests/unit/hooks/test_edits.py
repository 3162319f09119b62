"""Interventions on pre-rotation keys as TransformerLens hooks (posgen_tl.hooks.edits)."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from posgen_tl.hooks.capture import probe_hooks
from posgen_tl.hooks.edits import (
    Intervention,
    change_vectors,
    destroy_hooks,
    enforce_hooks,
    intervention_hooks,
    key_means,
    noop_hooks,
)
from posgen_tl.hooks.positions import reposition_hooks
from posgen_tl.hooks.stream import capture_qk
from posgen_tl.maths.rope import to_bands

MAKERS = {"native": lambda: tm.native(), "llama": lambda: tm.hf_llama()[0], "gemma3": lambda: tm.hf_gemma3()[0]}


@pytest.fixture(scope="module", params=list(MAKERS))
def tiny(request):
    torch.manual_seed(0)
    model = MAKERS[request.param]()
    toks = torch.randint(3, 40, (3, 20))
    return model, toks, key_means(model, toks)


def _logits(model, toks, hooks=()):
    with torch.no_grad():
        return model.run_with_hooks(toks, fwd_hooks=list(hooks))


def test_noop_is_bit_identical(tiny):
    model, toks, _ = tiny
    hooks = noop_hooks(model)
    assert len(hooks) == probe_hooks(model)[0].n_layers
    assert torch.equal(_logits(model, toks, hooks), _logits(model, toks))


@pytest.mark.parametrize("kind", ["enforce", "destroy", "rephase", "random_bands"])
def test_alpha_zero_is_noop_and_alpha_one_is_not(tiny, kind):
    model, toks, km = tiny
    ref = _logits(model, toks)
    iv = Intervention(kind, bands=[0, 1], layers=[0])
    assert torch.equal(_logits(model, toks, intervention_hooks(model, iv.with_alpha(0.0), km)), ref)
    assert not torch.allclose(_logits(model, toks, intervention_hooks(model, iv, km)), ref, atol=1e-6)


def test_enforce_all_bands_makes_keys_equal_mean(tiny):
    model, toks, km = tiny
    spec, _ = probe_hooks(model)
    nb = spec.layer(0).n_bands
    hooks = enforce_hooks(model, km, bands=range(nb), layers=[0])
    clean = capture_qk(model, toks, [0, spec.n_layers - 1])
    with model.hooks(fwd_hooks=hooks):
        got = capture_qk(model, toks, [0, spec.n_layers - 1])
    r = spec.layer(0).rotary_dim
    k0 = got[0].k
    assert torch.equal(k0[..., :r], km[0][..., :r].expand_as(k0[..., :r]))
    assert torch.equal(k0[..., r:], clean[0].k[..., r:])  # pass-through dims untouched
    assert torch.equal(got[0].q, clean[0].q)  # queries untouched
    assert not torch.allclose(got[spec.n_layers - 1].k, clean[spec.n_layers - 1].k)  # downstream changed


def test_destroy_removes_offset_only_in_bands(tiny):
    model, toks, km = tiny
    spec, _ = probe_hooks(model)
    lr = spec.layer(0)
    clean = capture_qk(model, toks, [0])[0]
    with model.hooks(fwd_hooks=destroy_hooks(model, km, bands=[0], layers=[0])):
        got = capture_qk(model, toks, [0])[0]
    z0, z1 = to_bands(clean.k, lr.rotary_dim, lr.layout), to_bands(got.k, lr.rotary_dim, lr.layout)
    zbar = to_bands(km[0], lr.rotary_dim, lr.layout)
    torch.testing.assert_close(z1[..., 0], z0[..., 0] - zbar[:, 0], atol=1e-5, rtol=1e-5)
    assert torch.equal(z1[..., 1:], z0[..., 1:])


def test_rephase_keeps_residual_and_offset_norm(tiny):
    model, toks, km = tiny
    lr = probe_hooks(model)[0].layer(0)
    clean = capture_qk(model, toks, [0])[0]
    with model.hooks(fwd_hooks=intervention_hooks(model, Intervention("rephase", bands=[0, 1], layers=[0]), km)):
        got = capture_qk(model, toks, [0])[0]
    z0, z1 = (to_bands(x, lr.rotary_dim, lr.layout)[..., :2] for x in (clean.k, got.k))
    zbar = to_bands(km[0], lr.rotary_dim, lr.layout)[:, :2]
    new_offset = z1 - (z0 - zbar)
    torch.testing.assert_close(new_offset.abs(), zbar.abs().expand_as(new_offset), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(new_offset, zbar.expand_as(new_offset), atol=1e-4)


@pytest.mark.parametrize("scramble", [True, False])
def test_random_bands_control_has_same_change_norm(tiny, scramble):
    model, toks, km = tiny
    lr = probe_hooks(model)[0].layer(0)
    k = capture_qk(model, toks, [0])[0].k
    nb = lr.n_bands
    bands = [0] if nb < 4 else [0, 1]
    iv = Intervention("destroy", bands=bands, alpha=0.7)
    ctrl = Intervention("random_bands", bands=bands, alpha=0.7, base="destroy", scramble=scramble)
    d_iv, d_c = change_vectors(k, km[0], iv, lr, 0), change_vectors(k, km[0], ctrl, lr, 0)
    torch.testing.assert_close(d_c.abs().pow(2).sum(-1), d_iv.abs().pow(2).sum(-1), rtol=1e-5, atol=1e-7)
    moved = (d_c.abs() > 0).any(0).any(0).any(0)
    assert moved.sum() == len(bands) and not moved[bands].all()  # lands in other bands
    # through the hooks: the key change per token has the intervention's norm
    clean = capture_qk(model, toks, [0])[0].k
    outs = []
    for x in (iv, ctrl):
        with model.hooks(fwd_hooks=intervention_hooks(model, Intervention(**{**x.__dict__, "layers": [0]}), km)):
            outs.append(capture_qk(model, toks, [0])[0].k - clean)
    torch.testing.assert_close(outs[0].norm(dim=-1), outs[1].norm(dim=-1), rtol=1e-4, atol=1e-5)


def test_key_means_matches_capture(tiny):
    model, toks, km = tiny
    k = capture_qk(model, toks, [1])[1].k
    torch.testing.assert_close(km[1], k[:, 1:].mean((0, 1)), atol=1e-5, rtol=1e-5)


def test_hooks_context_and_run_with_hooks_agree(tiny):
    model, toks, km = tiny
    hooks = destroy_hooks(model, km, bands=[0], layers=[1])
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        a = model(toks)
    assert torch.equal(a, _logits(model, toks, hooks))


def test_hooks_removed_after_exception(tiny):
    from posgen_tl.experiments.tolerance import nll_on_target

    model, toks, km = tiny
    hooks = destroy_hooks(model, km, bands=[0])

    def boom(x, hook):
        raise RuntimeError("boom")

    last = probe_hooks(model)[1].name(probe_hooks(model)[0].n_layers - 1, "hook_k")
    with pytest.raises(RuntimeError, match="boom"):
        nll_on_target(model, toks, target_len=4, fwd_hooks=hooks + [(last, boom)])
    for name, _ in hooks + [(last, None), ("ln_final.hook_out", None)]:
        assert len(model.hook_dict[name]._forward_hooks) == 0, name
    nll_on_target(model, toks, target_len=4, fwd_hooks=hooks)  # normal exit (StopForward path) too
    assert all(len(model.hook_dict[n]._forward_hooks) == 0 for n, _ in hooks + [("ln_final.hook_out", None)])


def test_reposition_hooks_equal_position_ids(tiny):
    model, toks, _ = tiny
    pid = torch.randperm(toks.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = model(toks, position_ids=pid.expand(toks.shape[0], -1))
    b = _logits(model, toks, reposition_hooks(model, pid))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(a, _logits(model, toks), atol=1e-4)


def test_intervention_validation():
    with pytest.raises(ValueError):
        Intervention("enforce", bands=[0], alpha=1.5)
    with pytest.raises(ValueError):
        Intervention("destroy", bands=[0], alpha=-0.1)
    assert Intervention("destroy", bands=[0], alpha=1.5).alpha == 1.5  # over-driven control (C2)
    with pytest.raises(ValueError):
        Intervention("smash", bands=[0])
    with pytest.raises(ValueError):
        Intervention("enforce", bands=[])
    assert Intervention("random_bands", bands=[0], alpha=3.0).alpha == 3.0  # controls may exceed 1
    assert Intervention("destroy", bands=range(0, 8)).label == "destroy k bands 0–7"


@pytest.mark.real
def test_smollm2_reposition_and_noop(smollm2, smollm2_tokens):
    toks = smollm2_tokens[:1, :32]
    pid = torch.arange(32)
    pid[5], pid[6] = 6, 5
    with torch.no_grad():
        ref = smollm2(toks)
        a = smollm2(toks, position_ids=pid[None])
    assert torch.equal(_logits(smollm2, toks, noop_hooks(smollm2)), ref)
    torch.testing.assert_close(a, _logits(smollm2, toks, reposition_hooks(smollm2, pid)), atol=2e-3, rtol=1e-3)


def test_row_seeds_draw_each_row_afresh():
    """A control drawn per document: row i of a batch with row_seeds gets exactly the change of seed
    row_seeds[i] alone; rows with different seeds get different draws; destroy ignores seeds."""
    from posgen_tl.maths.rope import LayerRope

    g = torch.Generator().manual_seed(0)
    rope = LayerRope(inv_freq=1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8)), rotary_dim=8, layout="half")
    x, mean = torch.randn(3, 5, 2, 8, generator=g), torch.randn(2, 8, generator=g)
    for kind in ("random_bands", "rephase", "noise"):
        iv = Intervention(kind, bands=[0, 1], alpha=0.7, seed=0).with_row_seeds([11, 12, 11])
        d = change_vectors(x, mean, iv, rope, layer=2)
        for i, s in enumerate((11, 12, 11)):
            alone = change_vectors(x[i : i + 1], mean, Intervention(kind, bands=[0, 1], alpha=0.7, seed=s), rope, 2)
            assert torch.equal(d[i : i + 1], alone), (kind, i)
        assert not torch.allclose(d[0], d[1])
    fixed = Intervention("destroy", bands=[0, 1], alpha=0.7)
    assert torch.equal(change_vectors(x, mean, fixed.with_row_seeds([1, 2, 3]), rope, 0),
                       change_vectors(x, mean, fixed, rope, 0))
    with pytest.raises(ValueError, match="2 row seeds for a batch of 3"):
        change_vectors(x, mean, Intervention("noise", bands=[0], row_seeds=(1, 2)), rope, 0)


# ----------------------------------------------------------------------------- shared_means


def _counted_passes(monkeypatch) -> list[int]:
    """Count the streamed passes feature_means runs (each call of its stream_qk)."""
    from posgen_tl.hooks import edits

    calls: list[int] = []
    real = edits.stream_qk

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(edits, "stream_qk", counting)
    return calls


def test_shared_means_computes_a_mean_once_and_gives_the_same_numbers_as_a_pass_of_its_own(monkeypatch):
    from posgen_tl.hooks.edits import _MEANS, reference_key_means, shared_means

    model, _ = tm.hf_llama(n_layers=3)
    toks = torch.randint(3, 100, (5, 12), generator=torch.Generator().manual_seed(1))
    own = reference_key_means(model, toks, [0, 1, 2], sink=1, batch_size=2, progress=False)
    calls = _counted_passes(monkeypatch)
    with shared_means():
        first = reference_key_means(model, toks, [0, 1, 2], sink=1, batch_size=2, progress=False)
        first[0].add_(1.0)  # a caller's edit of what it got does not reach the next caller
        again = reference_key_means(model, toks, None, sink=1, batch_size=2, progress=False)  # None: every layer
        assert len(calls) == 1
        for layer in own:
            assert torch.equal(again[layer], own[layer])
        reference_key_means(model, toks, [0, 1, 2], sink=1, batch_size=3, progress=False)  # another batch size
        reference_key_means(model, toks, [0, 1, 2], sink=2, batch_size=2, progress=False)  # another sink
        reference_key_means(model, toks[:4], [0, 1, 2], sink=1, batch_size=2, progress=False)  # other tokens
        assert len(calls) == 4
        with model.hooks(fwd_hooks=[("blocks.0.attn.hook_k", lambda t, hook: t * 2)]):  # a caller's hook: not taken
            edited = reference_key_means(model, toks, [0, 1, 2], sink=1, batch_size=2, progress=False)
        assert len(calls) == 5 and not torch.equal(edited[0], own[0])
        twin, _ = tm.hf_llama(n_layers=3, seed=1)  # another model object of the same shape
        reference_key_means(twin, toks, [0, 1, 2], sink=1, batch_size=2, progress=False)
        assert len(calls) == 6
    assert not _MEANS  # dropped when the scope closes
    reference_key_means(model, toks, [0, 1, 2], sink=1, batch_size=2, progress=False)
    assert len(calls) == 7  # outside a scope every call runs its pass
