"""Tests of posgen_tl.experiments.taxonomy (docs/method.md §6 runner) and its figures, on tiny models + SmolLM2."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tiny_models as tm
import torch

from posgen_tl.experiments.taxonomy import (
    HEAD_COLUMNS,
    head_table,
    head_taxonomy,
    head_taxonomy_with_twin,
    label_counts,
    region_layout,
    share_by_class,
    taxonomy_agreement,
)
from posgen_tl.hooks.stream import capture_qk
from posgen_tl.maths.rope import causal_mask
from posgen_tl.maths.taxonomy import LABELS, band_logits, region_logit_scores, region_permutations

N_POS, REGION, N_Q = 32, 8, 8
KW = dict(region_len=REGION, n_query=N_Q, n_perm=8, batch_size=2, progress=False)


@pytest.fixture(scope="module")
def llama():
    return tm.hf_llama()[0]


@pytest.fixture(scope="module")
def native():
    return tm.native(n_ctx=64)


def _tokens(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, N_POS), generator=g)


def _run(model, tokens, ref=None, **kw):
    ref = _tokens(2, 50, seed=99) if ref is None else ref
    return head_taxonomy(model, tokens, ref, **(KW | kw))


@pytest.mark.parametrize("which", ["native", "llama"])
def test_head_table_shape_and_ranges(which, request):
    model = request.getfixturevalue(which)
    df = _run(model, _tokens(3, 50))
    heads = head_table(df)
    assert list(heads.columns) == HEAD_COLUMNS
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    assert len(heads) == n_layers * n_heads
    assert not heads.duplicated(["layer", "head"]).any()
    for col in ("positional", "symbolic", "null_mc"):
        assert df[col].dropna().between(-1 - 1e-9, 1 + 1e-9).all(), col
    assert (heads["null_q"] > 0).all() and (heads["null_sd"] > 0).all()
    assert heads["positional_share"].between(0, 1).all()
    assert set(df["label"]) <= set(LABELS)
    # every (query row × permutation) is used or excluded
    assert ((heads["n_rows_used"] + heads["n_rows_excluded"]) == 3 * 8 * N_Q).all()
    assert heads["region_mass"].between(0, 1).all()
    bands = df[df["band"] >= 0]
    n_bands = df["band"].max() + 1
    assert len(bands) == n_layers * n_heads * n_bands
    sums = bands.groupby(["layer", "head"])[["q_energy_share", "k_energy_share"]].sum()
    np.testing.assert_allclose(sums.to_numpy(), 1.0, atol=1e-9)
    assert heads["k_centroid"].between(0, n_bands - 1).all()


def test_runner_matches_pure_function(llama):
    """The batched, streamed runner equals scoring separately captured prompts by hand."""
    tokens, ref = _tokens(1, 100, seed=3), _tokens(2, 100, seed=4)
    df = _run(llama, tokens, ref, seed=5)
    r0, r1 = region_layout(N_POS, REGION, N_Q)
    g = torch.Generator().manual_seed(1_000_003 * 5 + 0)  # the runner's per-prompt seed
    perms = region_permutations(REGION, 8, generator=g)
    nulls = torch.stack([torch.randperm(REGION, generator=g) for _ in range(8)])
    seqs = [tokens[0]] + [torch.cat([tokens[0, :r0], tokens[0, r0:r1][p], tokens[0, r1:]]) for p in perms]
    caps = [capture_qk(llama, s[None], layers=[1])[1] for s in seqs]
    rows = torch.arange(r1, N_POS)
    logits = [c.logits()[0][:, rows] for c in caps]  # [H, n_q, n]
    w0 = logits[0][..., r0:r1]
    wp = torch.stack([x[..., r0:r1] for x in logits[1:]])
    attn = torch.softmax(logits[0].double().masked_fill(~causal_mask(N_POS)[rows], float("-inf")), -1)
    mass = attn[..., r0:r1].sum(-1)
    sd = w0.double().std(-1, correction=0).median()
    s = region_logit_scores(w0, wp, perms, mass, min_std=max(1e-3 * float(sd), 1e-6), null_perm=nulls).finalize()
    got = df[(df["layer"] == 1) & (df["band"] == -1)].sort_values("head")
    for col in ("positional", "symbolic", "null_mc", "null_sd"):
        np.testing.assert_allclose(got[col], s[col].numpy(), atol=1e-5, err_msg=col)
    # band 0 alone, scored the same way
    bl = [band_logits(c.rot_q[:, rows], c.rot_k[:, r0:r1], c.rope)[0, :, 0] for c in caps]
    sb = region_logit_scores(bl[0], torch.stack(bl[1:]), perms, mass,
                             min_std=max(1e-3 * float(sd), 1e-6), null_perm=nulls).finalize()
    got_b = df[(df["layer"] == 1) & (df["band"] == 0)].sort_values("head")
    np.testing.assert_allclose(got_b["positional"], sb["positional"].numpy(), atol=1e-5)


def test_deterministic_and_batch_invariant(llama):
    tokens = _tokens(2, 100)
    a, b = _run(llama, tokens), _run(llama, tokens)
    pd.testing.assert_frame_equal(a, b)
    c = _run(llama, tokens, batch_size=1)
    pd.testing.assert_frame_equal(a, c, check_exact=False, atol=1e-6)
    d = _run(llama, tokens, seed=7)  # other permutations: other numbers
    assert not np.allclose(a["symbolic"], d["symbolic"], equal_nan=True)


def test_twin_counts_and_link(llama):
    df = head_taxonomy_with_twin(llama, _tokens(2, 100), _tokens(2, 100, seed=9), seed=1, **KW)
    heads = head_table(df)
    assert set(heads["twin"]) == {"trained", "random"}
    counts = label_counts(df)
    assert set(counts["label"]) == set(LABELS)
    assert counts.groupby("twin")["n"].sum().tolist() == [llama.cfg.n_layers * llama.cfg.n_heads] * 2
    bands = label_counts(df, by_band=True)
    assert {"band", "label", "n"} <= set(bands.columns)
    link = share_by_class(df)
    assert list(link.columns) == ["model", "twin", "class_a", "class_b", "n_a", "n_b", "median_a", "median_b", "U", "p"]
    assert len(link) == 2
    agree = taxonomy_agreement(df)
    assert set(agree) == {"trained", "random"}


def test_share_by_class_test_can_fail():
    rng = np.random.default_rng(0)
    df = pd.DataFrame(dict(model="m", twin="trained", band=-1,
                           label=["positional"] * 12 + ["symbolic"] * 12 + ["neither"] * 3,
                           positional_share=np.r_[rng.uniform(0.6, 0.9, 12), rng.uniform(0.1, 0.4, 12), [0.5] * 3]))
    res = share_by_class(df).iloc[0]
    assert res.n_a == 12 and res.n_b == 12 and res.p < 1e-4 and res.median_a > res.median_b
    df["positional_share"] = rng.uniform(0, 1, len(df))
    assert share_by_class(df).iloc[0].p > 0.01


def test_layout_and_input_errors(llama):
    assert region_layout(32, 8, 8) == (16, 24)
    with pytest.raises(ValueError):
        region_layout(32, 24, 8)  # overlaps the sink
    with pytest.raises(ValueError):
        region_layout(32, 2, 8)
    with pytest.raises(ValueError, match="reference"):
        head_taxonomy(llama, _tokens(1, 100), None, **KW)


def test_gemma3_sliding_window_rows_must_see_the_region():
    model = tm.hf_gemma3()[0]  # local layers: window 4
    df = _run(model, _tokens(2, 100), _tokens(2, 100, seed=5))
    heads = head_table(df)
    assert list(heads["kind"].unique()) == ["local", "global"]
    local, glob = heads[heads["kind"] == "local"], heads[heads["kind"] == "global"]
    # window 4 < region length 8: no query row sees all of R → nothing scored, never 'both'
    assert (local["label"] == "undefined").all() and (local["n_rows_used"] == 0).all()
    assert glob[["positional", "symbolic"]].notna().all().all()
    # with a region that fits the window, the local rows that see it are scored
    df2 = _run(model, _tokens(2, 100), _tokens(2, 100, seed=5), region_len=3, n_query=4)
    loc2 = head_table(df2).query("kind == 'local'")
    assert (loc2["n_rows_used"] + loc2["n_rows_excluded"] == 2 * 8 * 1).all()  # only row r1 sees [r0, r1)


def test_figures(llama):
    import matplotlib.pyplot as plt

    from posgen_tl.plot.taxonomy import (
        plot_frequency_usage,
        plot_label_counts,
        plot_positional_symbolic_plane,
        plot_taxonomy_vs_share,
    )

    df = head_taxonomy_with_twin(llama, _tokens(2, 100), _tokens(2, 100, seed=9), seed=1, **KW)
    for fn, arg in ((plot_positional_symbolic_plane, head_table(df)), (plot_frequency_usage, df),
                    (plot_taxonomy_vs_share, df), (plot_label_counts, df)):
        fig = fn(arg)
        panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
        assert len(panels) == 2, fn.__name__  # trained beside random
        plt.close(fig)
    from posgen_tl.experiments.taxonomy import share_by_class

    titles = [ax.get_title() for ax in plot_taxonomy_vs_share(df, share_by_class(df)).axes]
    assert all("Mann–Whitney pos vs sym p=" in t for t in titles), titles  # the test it is given, in each title
    assert not any("Mann–Whitney" in ax.get_title() for ax in plot_taxonomy_vs_share(df).axes)  # none computed


@pytest.mark.real
def test_smollm2_random_twin_is_not_both(smollm2):
    """The degenerate first metric put the random twin on 'both' (≈ 1 on both axes); the logit
    metric must not. Layers 0 (keys ≈ token embeddings), 3 (transition) and 6."""
    from posgen_tl.io.models import random_twin
    from posgen_tl.io.sampling import sample_windows

    tokens, ref = sample_windows(smollm2, None, n_seq=2, seq_len=96, n_ref=1)
    twin = random_twin(smollm2, 0)
    df = head_taxonomy(twin, tokens, ref, layers=[0, 3, 6], region_len=32, n_query=32, n_perm=8,
                       model_label="smollm2", twin_label="random", progress=False)
    heads = head_table(df)
    assert len(heads) == 3 * smollm2.cfg.n_heads
    assert heads[["positional", "symbolic", "null_q", "positional_share"]].notna().all().all()
    assert (heads["n_rows_used"] > 0).all()
    # never the degenerate signature, and 'both' is not what the twin lands on
    assert not ((heads["positional"] > 0.5) & (heads["symbolic"] > 0.5)).any()
    counts = heads["label"].value_counts()
    assert counts.idxmax() != "both" and counts.get("both", 0) <= len(heads) // 4, counts
    # layer 0 reads token embeddings: symbolic; deeper layers read a per-sequence key constant
    # (docs/method.md §2) and turn positional
    assert (heads.loc[heads["layer"] == 0, "label"] == "symbolic").all()
    l6 = heads[heads["layer"] == 6]
    assert (l6["positional"] > l6["symbolic"]).all()
