"""Tests of posgen_tl.analysis.taxonomy (METHOD §6 runner) and its figures, on tiny models + SmolLM2."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import tiny_models as tm
from posgen_tl.analysis.taxonomy import (
    HEAD_COLUMNS,
    block_layout,
    head_table,
    head_taxonomy,
    head_taxonomy_with_twin,
    taxonomy_agreement,
)
from posgen_tl.capture import capture_qk
from posgen_tl.heads import (
    band_logits,
    band_patterns,
    block_swap_permutation,
    causal_mask,
    pass_logits,
    positional_symbolic_scores,
)

N_POS, BLOCK = 32, 4


@pytest.fixture(scope="module")
def llama():
    return tm.hf_llama()[0]


@pytest.fixture(scope="module")
def native():
    return tm.native(n_ctx=64)


def _tokens(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, N_POS), generator=g)


def _run(model, tokens, **kw):
    kw = dict(n_prompts=tokens.shape[0], block_len=BLOCK, batch_size=2, progress=False) | kw
    return head_taxonomy(model, tokens, **kw)


@pytest.mark.parametrize("which", ["native", "llama"])
def test_head_table_shape_and_ranges(which, request):
    model = request.getfixturevalue(which)
    df = _run(model, _tokens(3, 50))
    heads = head_table(df)
    assert list(heads.columns) == HEAD_COLUMNS
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    assert len(heads) == n_layers * n_heads
    assert not heads.duplicated(["layer", "head"]).any()
    for col in ("positional", "symbolic"):
        assert df[col].between(-1 - 1e-9, 1 + 1e-9).all(), col
    assert heads["positional_share"].between(0, 1).all()
    assert set(heads["label"]) <= {"positional", "symbolic", "mixed"}
    bands = df[df["band"] >= 0]
    n_bands = df["band"].max() + 1
    assert len(bands) == n_layers * n_heads * n_bands
    # energy shares of a head sum to 1 over bands; centroids lie in [0, n_bands − 1]
    sums = bands.groupby(["layer", "head"])[["q_energy_share", "k_energy_share"]].sum()
    np.testing.assert_allclose(sums.to_numpy(), 1.0, atol=1e-9)
    assert heads["k_centroid"].between(0, n_bands - 1).all()


@pytest.mark.parametrize("which", ["native", "llama"])
def test_band_split_reproduces_logits(which, request):
    model = request.getfixturevalue(which)
    cap = capture_qk(model, _tokens(2, 50), layers=[1])[1]
    bl = band_logits(cap.rot_q, cap.rot_k, cap.rope)
    recon = bl.sum(2) + pass_logits(cap.rot_q, cap.rot_k, cap.rope)
    torch.testing.assert_close(recon, cap.logits(), rtol=1e-4, atol=1e-5)
    if which == "native":  # partial rotary: the pass-through dims carry a nonzero term
        assert pass_logits(cap.rot_q, cap.rot_k, cap.rope).abs().max() > 0


def test_paired_stream_matches_separate_runs(llama):
    """The interleaved orig/swap forward equals scoring separately captured prompts."""
    tokens = _tokens(1, 100, seed=3)
    df = _run(llama, tokens)
    (a0, a1), (b0, b1) = block_layout(N_POS, BLOCK, 1)
    perm = block_swap_permutation(N_POS, (a0, a1), (b0, b1))
    orig = capture_qk(llama, tokens, layers=[0])[0]
    swap = capture_qk(llama, tokens[:, perm], layers=[0])[0]
    mask = causal_mask(N_POS, sliding_window=orig.rope.sliding_window)
    p_o, p_s = (band_patterns(c.logits(), mask) for c in (orig, swap))
    pos, sym = positional_symbolic_scores(p_o, p_s, perm, torch.arange(b1, N_POS), torch.arange(a0, b1))
    got = df[(df["layer"] == 0) & (df["band"] == -1)].sort_values("head")
    np.testing.assert_allclose(got["positional"], pos[0].double().numpy(), atol=1e-5)
    np.testing.assert_allclose(got["symbolic"], sym[0].double().numpy(), atol=1e-5)
    # per band as well (band 0 of every head)
    bo, bs = (band_patterns(band_logits(c.rot_q, c.rot_k, c.rope), mask) for c in (orig, swap))
    pos_b, _ = positional_symbolic_scores(bo, bs, perm, torch.arange(b1, N_POS), torch.arange(a0, b1))
    got_b = df[(df["layer"] == 0) & (df["band"] == 0)].sort_values("head")
    np.testing.assert_allclose(got_b["positional"], pos_b[0, :, 0].double().numpy(), atol=1e-5)


def test_deterministic(llama):
    tokens = _tokens(2, 100)
    a, b = _run(llama, tokens), _run(llama, tokens)
    pd.testing.assert_frame_equal(a, b)
    c = _run(llama, tokens, batch_size=1)  # batching must not change the numbers
    pd.testing.assert_frame_equal(a, c, check_exact=False, atol=1e-5)


def test_twin_present_and_different(llama):
    # hf_llama() itself is built under seed 0, so seed 0 would reproduce it: use seed 1
    df = head_taxonomy_with_twin(llama, _tokens(2, 100), seed=1, n_prompts=2, block_len=BLOCK, batch_size=2,
                                 progress=False)
    heads = head_table(df)
    assert set(heads["twin"]) == {"trained", "random"}
    t, r = (heads[heads["twin"] == w].sort_values(["layer", "head"]) for w in ("trained", "random"))
    assert len(t) == len(r) == llama.cfg.n_layers * llama.cfg.n_heads
    assert np.abs(t["positional_share"].to_numpy() - r["positional_share"].to_numpy()).max() > 1e-4
    agree = taxonomy_agreement(df)
    assert set(agree) == {"trained", "random"}
    assert all(a["n"] == len(t) and -1 <= a["rho"] <= 1 for a in agree.values())


def test_block_layout_rejects_too_long_blocks():
    assert block_layout(32, 4, 1) == ((12, 16), (16, 20))
    with pytest.raises(ValueError):
        block_layout(32, 16, 1)


def test_figures(llama):
    import matplotlib.pyplot as plt

    from posgen_tl.plot.heads import (
        plot_frequency_usage,
        plot_positional_symbolic_plane,
        plot_taxonomy_vs_share,
    )

    df = head_taxonomy_with_twin(llama, _tokens(2, 100), seed=1, n_prompts=2, block_len=BLOCK, batch_size=2,
                                 progress=False)
    for fn, arg in ((plot_positional_symbolic_plane, head_table(df)), (plot_frequency_usage, df),
                    (plot_taxonomy_vs_share, df)):
        fig = fn(arg)
        panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
        assert len(panels) == 2, fn.__name__  # trained beside random
        plt.close(fig)


@pytest.mark.real
def test_smollm2_sanity(smollm2):
    from posgen_tl.corpus import corpus_tokens

    tokens = corpus_tokens(smollm2, None, seq_len=128, n_seq=2)
    df = head_taxonomy(smollm2, tokens, layers=[0, 5], n_prompts=2, seq_len=128, block_len=32, batch_size=2,
                       progress=False)
    heads = head_table(df)
    assert len(heads) == 2 * smollm2.cfg.n_heads
    assert heads[["positional", "symbolic", "positional_share", "k_centroid"]].notna().all().all()
    assert heads["positional_share"].between(0, 1).all()
    # trained content heads follow the moved tokens: symbolic beats positional on average
    assert (heads["symbolic"] - heads["positional"]).mean() > 0.1
    assert (df[df["band"] >= 0].groupby(["layer", "head"])["k_energy_share"].sum() - 1).abs().max() < 1e-9


def test_gemma3_sliding_window_and_qk_norm():
    model = tm.hf_gemma3()[0]
    df = _run(model, _tokens(2, 100))
    heads = head_table(df)
    assert list(heads["kind"].unique()) == ["local", "global"]
    assert heads[["positional", "symbolic", "positional_share"]].notna().all().all()
    # window 4 < distance to block A: swapped-in tokens leave the window, no row can follow them
    local = heads[heads["kind"] == "local"]
    np.testing.assert_allclose(local["symbolic"], 0.0, atol=1e-6)
    assert (local["positional"] > 0).all()
