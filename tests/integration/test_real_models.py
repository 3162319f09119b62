"""Exactness on the real models (SmolLM2-135M default, Gemma3-270M local + global layers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posgen_tl.experiments.exactness import ROT_RTOL, SCORE_RTOL, exactness_table
from posgen_tl.hooks.capture import probe_hooks
from posgen_tl.hooks.stream import capture_qk
from posgen_tl.maths.rope import causal_mask, rotate

pytestmark = pytest.mark.real


def test_smollm2_spec_from_model(smollm2):
    spec, info = probe_hooks(smollm2)
    assert (spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.d_head) == (30, 9, 3, 64)
    # rope_theta 1e5 from the HF rotary module — not the bridge's wrong cfg.rotary_base (10000)
    assert smollm2.cfg.rotary_base == 10000
    theta = spec.layers[0].inv_freq.double()
    assert torch.allclose(theta, 1.0 / 1e5 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64), rtol=1e-6)
    assert spec.layers[0].layout == "half" and spec.layers[0].score_scale == pytest.approx(64**-0.5)
    assert info.rot_fires and info.scores_kind == "pre_softmax" and info.q_hook == "hook_q"


def test_smollm2_exact_all_layers(smollm2, smollm2_tokens):
    df = exactness_table(smollm2, smollm2_tokens)
    assert len(df) == 30 and df["passed"].all()
    assert (df["rot_q_max_err"] <= ROT_RTOL * df["rot_ref"]).all()
    assert (df["score_rel_err"] <= SCORE_RTOL).all()


def test_smollm2_logits_equal_hf_and_paris(smollm2):
    toks = torch.tensor([[504, 3575, 282, 4649, 314]])  # "The capital of France is"
    with torch.no_grad():
        bl = smollm2(toks)
        hl = smollm2.original_model(toks).logits
    assert torch.equal(bl, hl)
    assert smollm2.tokenizer.decode(bl[0, -1].argmax()).strip().startswith("Paris")


def test_smollm2_rotation_identity_on_captured(smollm2, smollm2_tokens):
    c = capture_qk(smollm2, smollm2_tokens[:1], layers=[15])[15]
    assert torch.equal(rotate(c.q, c.positions, c.rope), c.rot_q)
    assert torch.equal(rotate(c.k, c.positions, c.rope), c.rot_k)


@pytest.mark.gemma
def test_gemma3_local_and_global_exact(gemma3):
    spec, info = probe_hooks(gemma3)
    assert info.q_hook == "hook_q_normed"  # QK-norm: the tensor entering RoPE
    kinds = [lr.kind for lr in spec.layers]
    assert kinds.count("global") == 3 and kinds[5] == "global" and kinds[0] == "local"
    assert spec.layers[0].sliding_window == 512
    base_local = 1.0 / spec.layers[0].inv_freq[1].double() ** (-256 / 2)
    assert float(spec.layers[0].inv_freq[1]) == pytest.approx(1e4 ** (-2 / 256), rel=1e-6)
    assert float(spec.layers[5].inv_freq[1]) == pytest.approx(1e6 ** (-2 / 256), rel=1e-6)
    assert base_local is not None
    from posgen_tl.io.corpus import corpus_tokens

    toks = corpus_tokens(gemma3, None, seq_len=48, n_seq=1)
    assert int(toks[0, 0]) == gemma3.tokenizer.bos_token_id  # Gemma's own policy: BOS first
    df = exactness_table(gemma3, toks, layers=[0, 5])
    assert df["passed"].all() and set(df["kind"]) == {"local", "global"}
    with torch.no_grad():
        assert torch.equal(gemma3(toks[:, :8]), gemma3.original_model(toks[:, :8]).logits)


@pytest.mark.gemma
def test_gemma3_window_respected_beyond_512(gemma3):
    """A 600-token sequence: local layer masks keys ≥ 512 back, global does not; both exact."""
    from posgen_tl.io.corpus import corpus_tokens

    toks = corpus_tokens(gemma3, None, seq_len=600, n_seq=1)
    caps = capture_qk(gemma3, toks, layers=[0, 5], with_scores=True)
    for layer, c in caps.items():
        m = causal_mask(600, sliding_window=c.rope.sliding_window)
        err = (c.logits() - c.scores)[..., m].abs().max()
        assert err <= SCORE_RTOL * c.scores[..., m].abs().max()
        assert bool(m.sum(-1)[-1] == (512 if layer == 0 else 600))


def _chunked_forwards(model) -> None:
    """Skip where the model's cached forward cannot run chunks (TransformerLens 3.x's HookedTransformer: refused by
    name, as tests/unit/hooks/test_chunked.py checks)."""
    from posgen_tl.hooks.capture import CaptureError
    from posgen_tl.hooks.chunked import check_chunked

    try:
        check_chunked(model)
    except CaptureError as e:
        pytest.skip(f"no chunked forward here: {e}")


def _edited_nll_chunked_vs_whole(model, toks, target: int, chunk: int) -> dict:
    """Target NLL of the clean forward, a destroy edit, the noise control C4 and the sufficiency substitution of the
    middle third of the layers, each whole and through chunks: ``{condition: (whole, chunked)}``."""
    from posgen_tl.engine.swaps import nll_on_target

    _chunked_forwards(model)
    from posgen_tl.hooks.edits import Intervention, intervention_hooks, key_means
    from posgen_tl.hooks.logits import sufficiency_hooks

    spec = probe_hooks(model)[0]
    km = key_means(model, toks)
    mid = list(range(spec.n_layers // 3, 2 * spec.n_layers // 3))
    fast = list(range(spec.layer(0).n_bands // 4))
    conds = {"clean": [],
             "destroy": intervention_hooks(model, Intervention("destroy", bands=fast, layers=mid, alpha=1.0), km),
             "noise": intervention_hooks(model, Intervention("noise", bands=fast, layers=mid, alpha=1.0, seed=1), km),
             "sufficiency": sufficiency_hooks(model, source="d3", k_means=km, layers=mid)}
    return {name: (nll_on_target(model, toks, target_len=target, fwd_hooks=hooks, chunk=0),
                   nll_on_target(model, toks, target_len=target, fwd_hooks=hooks, chunk=chunk))
            for name, hooks in conds.items()}


def _assert_chunked_is_whole(got: dict) -> None:
    clean = got["clean"][0]
    for name, (whole, parts) in got.items():
        err = float((parts - whole).abs().max())
        assert err < 1e-4, (name, err)
        if name != "clean":  # the condition moved the NLL far more than chunks and whole forward differ
            assert float((whole - clean).abs().max()) > 20 * max(err, 1e-6), name


def test_smollm2_edits_and_sufficiency_through_chunks(smollm2):
    """SmolLM2, 2 × 200 tokens in chunks of 64: every condition's NLL equals the whole forward's."""
    from posgen_tl.io.corpus import corpus_tokens

    _assert_chunked_is_whole(_edited_nll_chunked_vs_whole(smollm2, corpus_tokens(smollm2, None, seq_len=200, n_seq=2),
                                                          48, 64))


@pytest.mark.gemma
def test_gemma3_edits_and_sufficiency_through_chunks_past_its_window(gemma3):
    """Gemma3, 1 × 1 100 tokens in chunks of 256: the cache hands its local layers only the last 511 keys (the window),
    the substitution and the edits still give the whole forward's NLL."""
    from posgen_tl.io.corpus import corpus_tokens

    _assert_chunked_is_whole(_edited_nll_chunked_vs_whole(gemma3, corpus_tokens(gemma3, None, seq_len=1100, n_seq=1),
                                                          64, 256))


def _dose_chunked_vs_whole(model, toks, target: int, chunk: int) -> None:
    """A dose–response run (destroy at two strengths and the noise control C4 on the middle third's fast bands, one
    swap fraction) whole and through chunks: the same NLLs and attention change — the chunked one reads the attention
    change from paired rows (and checks their unedited half against the unedited pass), the whole one from stored
    patterns."""
    from posgen_tl.engine.conditions import build_conditions
    from posgen_tl.engine.dose import dose_rows
    from posgen_tl.hooks.edits import key_means
    from posgen_tl.io.sampling import Windows

    _chunked_forwards(model)
    spec = probe_hooks(model)[0]
    n = toks.shape[0]
    w = Windows(tokens=toks, doc_ids=torch.arange(n), starts=torch.zeros(n, dtype=torch.long),
                doc_names=[f"d{i}" for i in range(n)])
    mid = list(range(spec.n_layers // 3, 2 * spec.n_layers // 3))
    fast = list(range(spec.layer(0).n_bands // 4))
    conds = build_conditions(mid, fast=fast, slow=[spec.layer(0).n_bands - 1], alpha=1.0, controls=("C4",))
    kw = dict(k_means=key_means(model, toks), target_len=target, fracs=(0.0, 0.2), seeds=(0,), batch_size=n,
              progress=False)
    strengths = {"destroy": (0.0, 0.5, 1.0), "C4": (0.0, 1.0)}
    whole, parts = (dose_rows(model, w, conds, strengths, chunk=c, **kw) for c in (0, chunk))
    for col in ("clean_nll", "nll", "base_clean_nll"):
        err = float(np.abs(parts[col].to_numpy() - whole[col].to_numpy()).max())
        assert err < 1e-4, (col, err)
    edited = whole["alpha"].to_numpy() > 0
    kl_w, kl_p = whole["attn_kl"].to_numpy()[edited], parts["attn_kl"].to_numpy()[edited]
    assert (kl_w > 1e-4).all()  # the edits change the attention: the comparison is not of zeros
    np.testing.assert_allclose(kl_p, kl_w, rtol=1e-3)
    damage = np.abs(whole["clean_nll"] - whole["base_clean_nll"]).to_numpy()[edited]
    assert damage.min() > 20 * max(float(np.abs(parts["clean_nll"] - whole["clean_nll"]).max()), 1e-6)


def test_smollm2_dose_run_through_chunks(smollm2):
    """SmolLM2, 2 × 200 tokens in chunks of 64: the causal study's dose passes equal the whole ones."""
    from posgen_tl.io.corpus import corpus_tokens

    _dose_chunked_vs_whole(smollm2, corpus_tokens(smollm2, None, seq_len=200, n_seq=2), 48, 64)


@pytest.mark.gemma
def test_gemma3_dose_run_through_chunks_past_its_window(gemma3):
    """Gemma3, 1 × 1 100 tokens in chunks of 256: its local layers' attention rows hold only the window's keys in a
    chunked forward, and the attention change read from them is the whole forward's."""
    from posgen_tl.io.corpus import corpus_tokens

    _dose_chunked_vs_whole(gemma3, corpus_tokens(gemma3, None, seq_len=1100, n_seq=1), 64, 256)


def test_smollm2_patching_of_rotated_queries_and_keys_through_chunks(smollm2, monkeypatch):
    """SmolLM2, 1 × 200 tokens: a rot_q and a rot_k sweep of layer 15 through chunks of 64 (CHUNK_ABOVE lowered to
    128) give the whole forwards' maps and baselines."""
    import posgen_tl.hooks.chunked as ch
    import posgen_tl.patching as P
    from posgen_tl.io.corpus import corpus_tokens

    _chunked_forwards(smollm2)
    toks = corpus_tokens(smollm2, None, seq_len=200, n_seq=1)
    metric = P.target_nll(toks, 48)
    kw = dict(corrupted=P.Swaps(0.2), clean=toks, metric=metric)

    def sweeps() -> list:
        return [P.patch_sweep(smollm2, **kw, quantity="rot_q", groups=[{15: [h]} for h in range(3)]),
                P.patch_sweep(smollm2, **kw, quantity="rot_k", groups=[{15: [0]}, {15: [2]}], direction="noising")]

    whole = sweeps()
    monkeypatch.setattr(ch, "CHUNK_ABOVE", 128)
    monkeypatch.setattr(ch, "CHUNK", 64)
    for w, p in zip(whole, sweeps()):
        assert not p.prefix and w.prefix  # the chunked sweep resumed nowhere: it did run in chunks
        assert float((w.corrupted - w.clean).abs().max()) > 1e-2
        for name in ("values", "clean", "corrupted"):
            torch.testing.assert_close(getattr(p, name), getattr(w, name), rtol=1e-4, atol=1e-4)
