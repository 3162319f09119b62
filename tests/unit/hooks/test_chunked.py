"""Chunked capture through the model's key/value cache (posgen_tl.hooks.chunked): the same q/k as one whole forward,
refused where the cached forward is not the whole one, and the decomposition's scores unchanged."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tiny_models as tm
import torch
from score_frames import assert_same_scores

import posgen_tl.hooks.chunked as ch
from posgen_tl.experiments.decomposition import decompose_model
from posgen_tl.hooks.capture import CaptureError
from posgen_tl.hooks.stream import stream_qk

N = 29  # not a multiple of the chunks below: a short last chunk


@pytest.fixture(scope="module", params=["hf_llama", "hf_gemma3"])
def tiny(request):
    return getattr(tm, request.param)()[0]


def _tokens(n_seq: int = 3, n: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 90, (n_seq, n), generator=torch.Generator().manual_seed(seed))


def _captures(model, tokens, **kw) -> dict:
    out: dict = {}

    def keep(c) -> None:
        out[(c.layer, c.seq_offset)] = {k: getattr(c, k).clone() for k in ("q", "k", "rot_q", "rot_k", "positions")}

    stream_qk(model, tokens, keep, batch_size=2, progress=False, **kw)
    return out


@pytest.mark.parametrize("chunk", [4, 7, 16])
def test_a_chunked_capture_is_the_whole_forwards(tiny, chunk):
    """Every layer arrives whole (all positions, in order), its q/k equal to the whole forward's to float32 rounding
    — Gemma3's sliding window (4 keys) is shorter than some chunks and longer than others."""
    toks = _tokens()
    whole, parts = _captures(tiny, toks), _captures(tiny, toks, chunk=chunk)
    assert whole.keys() == parts.keys()
    for key, w in whole.items():
        p = parts[key]
        assert torch.equal(p["positions"], w["positions"]) and p["q"].shape == w["q"].shape
        for name in ("q", "k", "rot_q", "rot_k"):
            err = float((p[name] - w[name]).abs().max() / w[name].abs().max())
            assert err < 1e-5, (key, name, err)


def test_the_cached_forward_is_checked_and_a_wrong_one_refused(monkeypatch):
    """Without the cache handed to the attention the chunks attend only to themselves: the check sees later layers'
    q/k differ and refuses by name; auto_chunk then falls back to one whole forward, with a warning."""
    model = tm.hf_llama(seed=3)[0]
    monkeypatch.setattr(ch, "_cache_kwarg", lambda m: __import__("contextlib").nullcontext())
    with pytest.raises(CaptureError, match="does not reproduce its whole forward .*relative difference"):
        ch.check_chunked(model)
    with pytest.warns(UserWarning, match="in one forward instead"):
        assert ch.auto_chunk(model, ch.CHUNK_ABOVE + 1) == 0
    with pytest.raises(CaptureError, match="does not reproduce"):
        stream_qk(model, _tokens(), lambda c: None, chunk=8, progress=False)


def test_chunks_are_refused_with_tensors_that_would_be_a_chunks(tiny):
    for kw, name in ((dict(with_scores=True), "with_scores"), (dict(extra_hooks=[("x", lambda t, hook: None)]),
                                                               "extra hooks not marked chunk_safe")):
        with pytest.raises(ValueError, match=f"chunk=8.*{name}"):
            stream_qk(tiny, _tokens(), lambda c: None, chunk=8, progress=False, **kw)


def test_a_native_bridge_is_refused_by_name():
    with pytest.raises(CaptureError, match="chunked forward"):
        ch.check_chunked(tm.native(n_ctx=64))


def test_auto_chunk_only_for_long_sequences_and_without_extra_hooks(tiny):
    assert ch.auto_chunk(tiny, ch.CHUNK_FROM - 1) == 0
    assert ch.auto_chunk(tiny, 1024) == 256 and ch.auto_chunk(tiny, ch.CHUNK_ABOVE) == ch.CHUNK_ABOVE // 4
    assert ch.auto_chunk(tiny, ch.CHUNK_ABOVE + 1) == ch.CHUNK
    assert ch.auto_chunk(tiny, ch.CHUNK_ABOVE, memory_only=True) == 0
    assert ch.auto_chunk(tiny, ch.CHUNK_ABOVE + 1, memory_only=True) == ch.CHUNK
    assert ch.auto_chunk(tiny, ch.CHUNK_ABOVE + 1, extra_hooks=[("x", None)]) == 0
    assert ch.auto_chunk(tiny, 10, 6) == 6 and ch.auto_chunk(tiny, 10_000, 0) == 0


def test_the_decomposition_through_chunks_gives_the_whole_forwards_scores(tiny):
    """D1/D2/D3 of every head from a chunked capture (and its k̄ reference pass) equal the whole forward's."""
    toks = _tokens(5)
    kw = dict(sink=1, batch_size=2, bound_rows=8, progress=False)
    whole = decompose_model(tiny, toks[:3], reference=toks[3:], chunk=0, **kw)
    parts = decompose_model(tiny, toks[:3], reference=toks[3:], chunk=6, row_block=7, **kw)
    assert_same_scores(whole, parts, rtol=1e-5)


def test_the_feature_statistics_through_chunks_are_the_whole_forwards(tiny, monkeypatch):
    """The feature statistics chunk their forward automatically (CHUNK_FROM / CHUNK_ABOVE lowered here to 5 / 10):
    every band and head statistic equals the whole forward's."""
    from posgen_tl.experiments.pattern import feature_pattern

    toks = _tokens(4)
    whole = feature_pattern(tiny, toks, sink=1, batch_size=2, progress=False)
    monkeypatch.setattr(ch, "CHUNK_FROM", 5)
    monkeypatch.setattr(ch, "CHUNK_ABOVE", 10)
    monkeypatch.setattr(ch, "CHUNK", 8)
    calls = []
    real = ch.run_chunks
    monkeypatch.setattr("posgen_tl.hooks.stream.run_chunks", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    parts = feature_pattern(tiny, toks, sink=1, batch_size=2, progress=False)
    assert calls and set(calls) == {8}  # the chunked forward really ran
    for name in ("bands", "heads"):
        a, b = getattr(whole, name), getattr(parts, name)
        num = [c for c in a.columns if a[c].dtype.kind == "f"]
        pd.testing.assert_frame_equal(a.drop(columns=num), b.drop(columns=num))
        np.testing.assert_allclose(b[num].to_numpy(float), a[num].to_numpy(float), rtol=1e-5, atol=1e-7, equal_nan=True)


def test_a_rope_that_depends_on_the_length_is_refused_by_name():
    """Dynamic NTK picks its frequencies from the longest position seen: chunks would be rotated differently."""
    model = tm.hf_llama(rope={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0})[0]
    with pytest.raises(CaptureError, match=r"RoPE \(dynamic\) chooses frequencies from the sequence length"):
        ch.check_chunked(model)
    with pytest.warns(UserWarning, match="in one forward instead"):
        assert ch.auto_chunk(model, ch.CHUNK_ABOVE + 1) == 0


def test_nothing_is_left_on_the_model_when_a_chunked_forward_raises(tiny):
    """Hooks and the cache bridge are removed on every exit path: a hook raising in the second chunk leaves no
    forward hook and no patched ``_update_kv_cache`` behind, and the next whole forward is the same as before."""
    toks = _tokens(1)
    before = _captures(tiny, toks)
    name = "blocks.0.attn.hook_rot_k"

    def boom(t, hook):
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        ch.run_chunks(tiny, toks, 8, lambda c0, c1: [(name, boom)] if c0 else [])
    assert all(len(hp._forward_hooks) == 0 for hp in tiny.hook_dict.values())
    assert not any("_update_kv_cache" in vars(b.attn) for b in tiny.blocks)
    after = _captures(tiny, toks)
    assert all(torch.equal(after[k]["q"], before[k]["q"]) for k in before)


def test_a_chunked_pass_asks_after_each_layer_whether_to_return_the_freed_heap(tiny, monkeypatch):
    """A long sequence's layers are scored one after another after its chunked forward, each for seconds, with tables
    of its own sizes: the pass asks a second trimmer (margin 128 MiB, no proportional part) after every layer, and the
    batch trimmer after every batch; the layer trimmer runs after the layer's analysis saw the layer."""
    import posgen_tl.hooks.heap as heap  # noqa: PLC0415
    import posgen_tl.hooks.stream as stream  # noqa: PLC0415

    events: list = []

    class Counting(heap.BatchTrim):
        def __call__(self) -> bool:
            events.append(("trim", self.growth, self.min_growth))
            return super().__call__()

    stream_qk(tiny, _tokens(), lambda c: None, batch_size=2, chunk=8, progress=False)  # the model's one-time checks
    monkeypatch.setattr(stream, "BatchTrim", Counting)
    n_layers = len(tiny.blocks)
    stream_qk(tiny, _tokens(), lambda c: events.append(("layer", c.layer)), batch_size=2, chunk=8, progress=False)
    layer_trim, batch_trim = ("trim", 0.0, heap.TRIM_MIN_GROWTH), ("trim", heap.TRIM_GROWTH, heap.TRIM_MIN_GROWTH)
    one_batch = [e for i in range(n_layers) for e in (("layer", i), layer_trim)] + [batch_trim]
    assert events == one_batch * 2  # 3 sequences in batches of 2
