"""The target-span NLL through a chunked forward (posgen_tl.engine.swaps.nll_on_target with chunk=): under every key
edit of the causal test, with swapped tokens and with permuted position ids, and under the sufficiency substitution
W ← f + g, the same NLL as one whole forward — so a causal condition or a sufficiency test runs on sequences whose
whole forward does not fit in memory."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

import posgen_tl.engine.swaps as sw
import posgen_tl.hooks.chunked as ch
import posgen_tl.hooks.edits as ed
import posgen_tl.hooks.positions as ps
from posgen_tl.hooks.capture import CaptureError
from posgen_tl.hooks.edits import Intervention, intervention_hooks, key_means
from posgen_tl.hooks.logits import sufficiency_hooks
from posgen_tl.hooks.stream import stream_qk
from posgen_tl.maths.perturb import adjacent_swap_permutation, position_ids_for_permutation

N, TARGET = 29, 10  # chunks of 8: the target span (rows 18 … 27) straddles two chunks, the last chunk is short
EDITS = {
    "destroy": dict(kind="destroy", alpha=8.0),
    "enforce": dict(kind="enforce", alpha=1.0),
    "rephase": dict(kind="rephase", alpha=2.0, seed=3),
    "noise": dict(kind="noise", alpha=8.0, seed=3),
    "random_bands": dict(kind="random_bands", alpha=8.0, seed=3, scramble=True),
}


@pytest.fixture(scope="module", params=["hf_llama", "hf_gemma3"])
def tiny(request):
    model = getattr(tm, request.param)()[0]
    toks = torch.randint(3, 90, (3, N), generator=torch.Generator().manual_seed(1))
    return model, toks, key_means(model, toks)


def _hooks(model, km, edit: str):
    return intervention_hooks(model, Intervention(bands=[0, 1, 2], **EDITS[edit]), km)  # every layer


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_chunked_forward_gives_the_whole_forwards_nll(tiny, edit):
    """Each edit moves the NLL (by 1e-5 or more on these near-uniform tiny models) a hundred times more than the
    chunked and whole forwards differ (else nothing is compared)."""
    model, toks, km = tiny
    hooks = _hooks(model, km, edit)
    clean = sw.nll_on_target(model, toks, target_len=TARGET, chunk=0)
    whole = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks, chunk=0)
    parts = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks, chunk=8)
    err = float((parts - whole).abs().max())
    assert float((whole - clean).abs().max()) > 100 * max(err, 1e-7), edit
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("edit", ["noise", "random_bands"])
def test_a_draw_per_position_reads_the_chunks_place_in_the_sequence(tiny, edit, monkeypatch):
    """Hidden the chunk's span, the per-position draws of noise (C4) and of C1's phases restart in every chunk and the
    chunked NLL is not the whole one — the test above compares what it claims to."""
    model, toks, km = tiny
    hooks = _hooks(model, km, edit)
    whole = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks, chunk=0)
    monkeypatch.setattr(ed, "chunk_range", lambda n_pos: (0, n_pos, n_pos))
    parts = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks, chunk=8)
    assert float((parts - whole).abs().max()) > 1e-4


@pytest.mark.parametrize("edit", ["noise", "random_bands"])
def test_a_chunked_forward_draws_each_tables_per_position_draw_once(tiny, edit, monkeypatch):
    """The whole sequence's table of a per-position draw is drawn once per forward and layer (kept for its later
    chunks), not once per chunk — and drawn per chunk again when the forward's memo has no room, with the same NLL;
    no memo outlives the forward."""
    model, toks, km = tiny
    hooks = _hooks(model, km, edit)
    draws: list[tuple] = []
    rand = torch.rand

    def counted(*a, **k):
        if k.get("generator") is not None:
            draws.append(tuple(a[0]))
        return rand(*a, **k)

    monkeypatch.setattr(ed.torch, "rand", counted)
    kept = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks, chunk=8)
    n_layers, n_chunks = model.cfg.n_layers, -(-N // 8)
    assert len(draws) == n_layers and all(d[0] == N for d in draws)  # one table per layer, of all N positions
    assert ch.chunk_memo() is None
    draws.clear()
    monkeypatch.setattr(ch, "MEMO_BYTES", 0)
    redrawn = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks, chunk=8)
    assert len(draws) == n_layers * n_chunks
    torch.testing.assert_close(redrawn, kept, rtol=0, atol=0)


def test_swapped_tokens_and_permuted_position_ids_through_chunks(tiny):
    """T1 (tokens swapped) and T2 (the same swaps on the position ids, through the cache) under destroy."""
    model, toks, km = tiny
    hooks = _hooks(model, km, "destroy")
    perm = torch.stack([adjacent_swap_permutation(N, 0.3, start=1, stop=N - TARGET, seed=s) for s in range(3)])
    pids = torch.stack([position_ids_for_permutation(p) for p in perm])
    assert not torch.equal(pids, torch.arange(N).expand(3, -1))
    for t, p in ((torch.gather(toks, 1, perm), None), (toks, pids)):
        whole = sw.nll_on_target(model, t, target_len=TARGET, position_ids=p, fwd_hooks=hooks, chunk=0)
        parts = sw.nll_on_target(model, t, target_len=TARGET, position_ids=p, fwd_hooks=hooks, chunk=8)
        torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)
    t2 = sw.nll_on_target(model, toks, target_len=TARGET, position_ids=pids, fwd_hooks=hooks, chunk=8)
    t0 = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks, chunk=8)
    assert float((t2 - t0).abs().max()) > 1e-4  # the ids reached the chunks (chunked vs whole: < 1e-6)


def test_long_sequences_chunk_by_themselves_and_the_logits_path_agrees(tiny, monkeypatch):
    """Beyond CHUNK_ABOVE (lowered here to 16) the NLL runs chunked without being asked, with the edit's hooks; and
    where the final residual cannot be unembedded alone (soft-capped output logits) the chunks' own logits give the
    same NLL."""
    model, toks, km = tiny
    hooks = _hooks(model, km, "noise")
    whole = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks, chunk=0)
    monkeypatch.setattr(ch, "CHUNK_ABOVE", 16)
    monkeypatch.setattr(ch, "CHUNK", 8)
    calls: list = []
    real = ps.run_chunks
    monkeypatch.setattr(ps, "run_chunks", lambda *a, **k: calls.append((a[2], k["return_type"])) or real(*a, **k))
    auto = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks)
    monkeypatch.setattr(ps, "final_residual_hook", lambda *a: None)
    logits = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks)
    assert calls == [(8, None), (8, "logits")]
    torch.testing.assert_close(auto, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-6)


def test_what_cannot_run_in_chunks_runs_whole_or_is_refused_by_name(tiny, monkeypatch):
    model, toks, km = tiny
    other = [("blocks.0.attn.hook_pattern", lambda t, hook: None)]
    monkeypatch.setattr(ch, "CHUNK_ABOVE", 16)
    calls: list = []
    monkeypatch.setattr(ps, "run_chunks", lambda *a, **k: calls.append(a[2]))
    sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=other)  # automatic: a hook that is not chunk_safe
    assert calls == []
    with pytest.raises(ValueError, match="chunk=8: fwd_hooks not marked chunk_safe"):
        sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=other, chunk=8)
    resid = model(toks, stop_at_layer=1)
    with pytest.raises(ValueError, match="chunk=8 cannot be combined with resid_at"):
        sw.nll_on_target(model, toks, target_len=TARGET, resid_at=(1, resid), chunk=8)


def test_a_chunked_capture_takes_the_edits_and_sees_their_keys(tiny):
    """stream_qk runs chunk_safe extra hooks on every chunk: the captured (edited) keys equal the whole forward's."""
    model, toks, km = tiny
    hooks = _hooks(model, km, "noise")
    got: dict = {}

    def keep(tag):
        return lambda c: got.setdefault(tag, {}).__setitem__((c.layer, c.seq_offset), c.rot_k.clone())

    stream_qk(model, toks, keep("plain"), batch_size=2, progress=False)
    stream_qk(model, toks, keep("whole"), batch_size=2, progress=False, extra_hooks=hooks)
    stream_qk(model, toks, keep("parts"), batch_size=2, progress=False, extra_hooks=hooks, chunk=8)
    for key, w in got["whole"].items():
        assert float((w - got["plain"][key]).abs().max()) > 1e-3 or key[0] != 0
        torch.testing.assert_close(got["parts"][key], w, rtol=1e-5, atol=1e-5)


def test_the_sufficiency_substitution_runs_through_chunks(tiny):
    """W ← f + g (global k̄) in every layer through chunks of 8 and 5 (Gemma3: its window of 4 keys is what the cache
    hands on to the local layers) — the NLL of the whole substituted forward, and far from the clean NLL."""
    model, toks, km = tiny
    hooks = sufficiency_hooks(model, source="d3", k_means=km)
    assert ch.hooks_chunk_safe(hooks) and not ch.hooks_chunk_safe(sufficiency_hooks(model, source="d1"))
    clean = sw.nll_on_target(model, toks, target_len=TARGET, chunk=0)
    whole = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks, chunk=0)
    for chunk in (8, 5):
        parts = sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks, chunk=chunk)
        err = float((parts - whole).abs().max())
        assert float((whole - clean).abs().max()) > 100 * max(err, 1e-7)
        torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)


def test_keys_other_than_assumed_in_a_chunk_are_refused_by_name(tiny):
    """The scores of layer 0 shifted by one key before the substitution sees them: its check of each query's score on
    its own key fails, by name, instead of substituting against the wrong keys."""
    model, toks, km = tiny
    name = "blocks.0.attn.hook_attn_scores"
    shifted = [(name, ch.chunk_safe(lambda w, hook: torch.roll(w, 1, dims=-1)))]
    hooks = shifted + sufficiency_hooks(model, source="d3", k_means=km, layers=[0])
    with pytest.raises(CaptureError, match="layer 0: in a chunked forward .* its cache hands on keys other than"):
        sw.nll_on_target(model, toks, target_len=TARGET, fwd_hooks=hooks, chunk=8)
    assert all(len(hp._forward_hooks) == 0 for hp in model.hook_dict.values())
