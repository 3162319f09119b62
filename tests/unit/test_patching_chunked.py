"""Activation patching of long sequences through a chunked forward (posgen_tl.patching with posgen_tl.hooks.chunked):
rotated queries and keys recorded and written a chunk at a time, the corruption's re-positioning applied at each
chunk's own positions — the same maps as whole forwards."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

import posgen_tl.hooks.chunked as ch
import posgen_tl.hooks.positions as ps
import posgen_tl.patching as P
from posgen_tl.hooks.capture import probe_hooks
from posgen_tl.hooks.edits import key_means

N, T = 29, 6  # chunks of 8: a short last chunk, the target span inside the last two


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tm.sharpened(tm.hf_llama(n_layers=3)[0])  # a corruption does measurable damage


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 99, (2, N), generator=torch.Generator().manual_seed(1))


def _sweeps(model, tokens, metric):
    spec = probe_hooks(model)[0]
    out = {}
    for quantity, n_idx in (("rot_q", spec.n_heads), ("rot_k", spec.n_kv_heads)):
        groups = [{1: [h]} for h in range(n_idx)] + [{0: [0], 2: [n_idx - 1]}]
        for direction in ("denoising", "noising"):
            out[(quantity, direction)] = P.patch_sweep(model, P.Swaps(0.4), tokens, metric, quantity=quantity,
                                                       groups=groups, direction=direction)
    return out


def test_rotated_q_and_k_sweeps_through_chunks_give_the_whole_forwards_maps(model, tokens, monkeypatch):
    """Beyond CHUNK_ABOVE (lowered here to 16) every forward of a rot_q / rot_k sweep — baselines, recording, patched
    replicas — runs in chunks of 8; values, baselines and recordings equal the whole forwards', and the corruption
    and the patches move the metric far more than chunked and whole forwards differ."""
    metric = P.target_nll(tokens, T)
    whole = _sweeps(model, tokens, metric)
    monkeypatch.setattr(ch, "CHUNK_ABOVE", 16)
    monkeypatch.setattr(ch, "CHUNK", 8)
    calls: list = []
    real = ps.run_chunks
    monkeypatch.setattr(ps, "run_chunks", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    parts = _sweeps(model, tokens, metric)
    assert len(calls) >= 4 * 4 and set(calls) == {8}  # 4 sweeps × (2 baselines + patched forwards), all chunked
    for key, w in whole.items():
        p = parts[key]
        for name in ("values", "clean", "corrupted"):
            torch.testing.assert_close(getattr(p, name), getattr(w, name), rtol=1e-5, atol=1e-5)
        for layer, src in w.source.items():
            torch.testing.assert_close(p.source[layer], src, rtol=1e-5, atol=1e-5)
        assert float((w.corrupted - w.clean).abs().max()) > 1e-3, key  # 100× the tolerance above
        assert float((w.values - w.corrupted.expand_as(w.values)).abs().max()) > 1e-4, key


def test_what_needs_the_whole_maps_keeps_whole_forwards(model, tokens, monkeypatch):
    """A logit term (pos_term) reads the layer's whole score map: its sweep keeps whole forwards, resumed from the
    base run's residual, at any length."""
    km = key_means(model, torch.randint(3, 99, (4, N), generator=torch.Generator().manual_seed(2)))
    monkeypatch.setattr(ch, "CHUNK_ABOVE", 16)
    calls: list = []
    monkeypatch.setattr(ps, "run_chunks", lambda *a, **k: calls.append(a[2]))
    sweep = P.patch_sweep(model, P.Swaps(0.4), tokens, P.target_nll(tokens, T), quantity="pos_term",
                          groups=[{1: [0]}, {1: [1]}], k_means=km)
    assert calls == [] and set(sweep.prefix) == {1}
