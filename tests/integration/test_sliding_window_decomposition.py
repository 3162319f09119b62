"""Mistral / Phi-3 keep their sliding window in ``config.sliding_window`` only (applied through HF's mask):
the decomposition of the bridge (D1 fit and D3 split, per-sequence k̄) must equal the same decomposition
computed from Hugging Face's OWN eager attention — its rotated q/k, its cos/sin, its mask — and must
differ from one that ignores the window (so this test would catch the old behaviour)."""

from __future__ import annotations

import warnings

import arch_matrix as am
import pytest
import torch

from posgen_tl.experiments.decomposition import decompose_model
from posgen_tl.maths.decompose import fit_additive, score_maps

SINK = 1


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _hf_maps(folder, tokens):
    """Per layer: HF's logits W, D3's f + g (per-sequence k̄, sink excluded) and HF's visible mask —
    pre-rotation q/k recovered from HF's rotated q/k with HF's own cos/sin (half-split, as HF rotates)."""
    ref = am.hf_reference(folder, tokens, torch.float32)
    hf = am._HF[(str(folder), torch.float32)]
    pos = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        cos, sin = hf.model.rotary_emb(torch.zeros(1), pos)
    cos, sin = cos[:, None].double(), sin[:, None].double()  # [1, 1, pos, r]
    r = cos.shape[-1]
    out = {}
    for layer, rec in ref.items():
        q, k = rec.query.double(), rec.key.double()  # [b, h, pos, d], rotated by HF
        rep = q.shape[1] // k.shape[1]

        def unrot(x):
            xr, xp = x[..., :r], x[..., r:]
            return torch.cat([xr * cos - _rotate_half(xr) * sin, xp], dim=-1)

        def rot(x):
            xr, xp = x[..., :r], x[..., r:]
            return torch.cat([xr * cos + _rotate_half(xr) * sin, xp], dim=-1)

        q_pre, k_pre = unrot(q), unrot(k)
        kbar = k_pre[:, :, SINK:].mean(2, keepdim=True)  # [b, g, 1, d]
        expand = lambda t: t.repeat_interleave(rep, dim=1)  # noqa: B023, E731 — HF's repeat_kv
        w = rec.scores()
        f = rec.scaling * q @ expand(rot(kbar.expand_as(k_pre))).transpose(-1, -2)
        g = rec.scaling * q_pre @ expand(k_pre - kbar).transpose(-1, -2)
        out[layer] = (w, f + g, rec.visible())
    return out


@pytest.mark.parametrize("arch", ["mistral", "phi3"])
def test_decomposition_equals_hf_masked_attention(arch, tmp_path):
    folder = am.build_folder(am.ARCHS[arch], tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = am.load(am.ARCHS[arch], "bridge", torch.float32, tmp_path)
    tokens = am._tokens(am.SEQ_LEN, batch=2)
    df = decompose_model(model, tokens, k_mean="per_sequence", sink=SINK, progress=False)  # a tensor: analysed as given
    maps = _hf_maps(folder, tokens)
    n = tokens.shape[1]
    j = torch.arange(n)[None, :]
    compared = 0
    for layer, (w, fg, visible) in maps.items():
        assert not visible.tril().equal(torch.ones(n, n, dtype=torch.bool).tril()), "HF applied no window here"
        m = visible & (j >= SINK)
        fit = fit_additive(w, m, three_axis=True)
        ref = {"D1": score_maps(w, fit.fitted, m), "D3": score_maps(w, fg, m)}
        naive = causal = torch.ones(n, n, dtype=torch.bool).tril() & (j >= SINK)  # the window ignored
        naive = score_maps(w, fit_additive(w, causal, three_axis=True).fitted, causal)
        for est in ("D1", "D3"):
            rows = df[(df.layer == layer) & (df.estimator == est) & df.sink_excluded]
            got = torch.tensor(rows.sort_values(["seq", "head"])[["r", "r2", "r_within"]].to_numpy())
            want = torch.stack([ref[est][k] for k in ("r", "r2", "r_within")], -1).reshape(-1, 3)  # [seq·head, 3]
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            compared += want.numel()
        d1 = torch.tensor(df[(df.layer == layer) & (df.estimator == "D1") & df.sink_excluded]
                          .sort_values(["seq", "head"])["r"].to_numpy())
        assert (d1 - naive["r"].reshape(-1)).abs().max() > 1e-3, "the window made no difference: test too weak"
    assert compared == 2 * len(maps) * 2 * model.cfg.n_heads * 3
