"""T1/T2/T3 runners and the causal-test summaries (posgen_tl.experiments.tolerance)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tiny_models as tm
import torch

from posgen_tl.experiments import tolerance as tol
from posgen_tl.hooks.capture import CaptureError
from posgen_tl.hooks.positions import distance_cap_hooks, reposition_hooks
from posgen_tl.maths.perturb import adjacent_swap_permutation, nll_from_logits, position_ids_for_permutation

MAKERS = {"native": lambda: tm.native(), "llama": lambda: tm.hf_llama()[0], "gemma3": lambda: tm.hf_gemma3()[0]}


@pytest.fixture(scope="module", params=list(MAKERS))
def tiny(request):
    torch.manual_seed(0)
    return MAKERS[request.param](), torch.randint(3, 40, (3, 24))


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return tm.hf_llama()[0], torch.randint(3, 90, (4, 32))


def test_nll_on_target_matches_full_logits(tiny):
    model, toks = tiny
    with torch.no_grad():
        full = nll_from_logits(model(toks), toks)[:, -6:].mean(-1)
    got = tol.nll_on_target(model, toks, target_len=6, batch_size=2)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


def test_identity_position_ids_bit_identical(tiny):
    model, toks = tiny
    ident = position_ids_for_permutation(torch.arange(toks.shape[1]))
    a = tol.nll_on_target(model, toks, target_len=6)
    assert torch.equal(tol.nll_on_target(model, toks, target_len=6, position_ids=ident), a)
    df = tol.transposition_curve(model, toks, fracs=(0.0,), seeds=(0,), target_len=6, modes=("T1", "T2"), progress=False)
    assert (df["delta"] == 0).all()


def test_t2_position_ids_equal_rerotation(tiny):
    model, toks = tiny
    perm = adjacent_swap_permutation(toks.shape[1], 0.3, start=1, stop=toks.shape[1] - 6, seed=0)
    pid = position_ids_for_permutation(perm)
    a = tol.nll_on_target(model, toks, target_len=6, position_ids=pid)
    b = tol.nll_on_target(model, toks, target_len=6, fwd_hooks=reposition_hooks(model, pid))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(a, tol.nll_on_target(model, toks, target_len=6), atol=1e-5)


def test_transposition_curve_rows_and_window(llama):
    model, toks = llama
    df = tol.transposition_curve(model, toks, fracs=(0.0, 0.2), seeds=(0, 1), target_len=8, modes=("T1", "T2"),
                                 progress=False)
    assert len(df) == 2 * 2 * 2 * toks.shape[0]
    assert set(df.columns) >= {"mode", "seq", "frac", "seed", "clean_nll", "nll", "delta"}
    np.testing.assert_allclose(df["delta"], df["nll"] - df["clean_nll"], atol=1e-6)
    assert (df.loc[df["frac"] == 0, "delta"] == 0).all()
    assert (df.loc[df["frac"] > 0, "delta"] != 0).any()
    # swaps never touch token 0 or the target: a swap-window of 1 item means nothing moves
    same = tol.transposition_curve(model, toks, fracs=(0.2,), seeds=(0,), target_len=30, start=1, progress=False)
    assert (same["delta"] == 0).all()
    from posgen_tl.stats.curves import curve_summary

    s = curve_summary(df.rename(columns={"mode": "condition"}), by=("condition",))
    assert set(s["estimator"]) == {"dnll", "auc", "slope"} and (s["ci_low"] <= s["ci_high"]).all()
    assert not hasattr(tol, "curve_summary")  # one curve summary: posgen_tl.stats.curves
    assert (df["doc"] == df["seq"]).all()  # without doc ids, each row is its own document


def test_length_curve_cap(llama):
    model, toks = llama
    unc = tol.length_curve(model, toks, cap=None, bucket=8)
    big = tol.length_curve(model, toks, cap=1000, bucket=8)
    small = tol.length_curve(model, toks, cap=2, bucket=8)
    np.testing.assert_allclose(big["nll"], unc["nll"], atol=1e-5)
    assert not np.allclose(small["nll"], unc["nll"], atol=1e-4)
    # masking kept: future keys get zero attention under the cap hooks
    pat = {}
    hooks = distance_cap_hooks(model, 2) + [("blocks.1.attn.hook_pattern", lambda x, hook: pat.setdefault("p", x))]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        model(toks[:1])
    upper = torch.ones(32, 32, dtype=torch.bool).triu(1)
    assert torch.equal(pat["p"][0][:, upper], torch.zeros_like(pat["p"][0][:, upper]))
    summ = tol.length_summary(pd.concat([unc, small]))
    assert set(summ["cap"].dropna()) == {2} and len(summ) == 2 * 4


def test_cap_needs_pre_softmax_scores():
    with pytest.raises(CaptureError, match="post_softmax"):
        distance_cap_hooks(tm.native(), 4)


def _rows(label, kind, slope, damage, n=12, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n):
        base = 3.0 + 0.1 * rng.standard_normal()
        for f in (0.0, 0.1, 0.2):
            for sd in (0, 1):
                delta = 0.0 if f == 0 else slope * f + 0.002 * rng.standard_normal()
                out.append(dict(intervention=label, kind=kind, alpha=1.0, mode="T1", seq=s, doc=s, frac=f, seed=sd,
                                clean_nll=base + damage, nll=base + damage + delta, delta=delta, base_clean_nll=base))
    return pd.DataFrame(out)


def test_superseded_verdict_code_is_gone():
    for name in ("causal_table", "matched_alpha", "tolerance_rows", "summarize_tolerance", "t1_vs_t2"):
        assert not hasattr(tol, name), name


def test_figures_return_figures(llama):
    """Every tolerance / causal figure draws what its table holds (lines per condition, one AUC bar
    per contrast) and returns a closed Figure."""
    from matplotlib.figure import Figure

    from posgen_tl.plot.causal import plot_dose_curves
    from posgen_tl.plot.tolerance import plot_length, plot_tolerance_curves
    from posgen_tl.stats import curves

    df = pd.concat([_rows("none", "none", 1.0, 0.0), _rows("destroy", "destroy", 0.5, 0.2),
                    _rows("C1", "random_bands", 0.5, 0.1)], ignore_index=True)
    units = curves.document_units(df.rename(columns={"intervention": "condition"}).assign(model="m", layers="L1"),
                                  by=("model", "layers", "condition"))
    summary = curves.unit_summary(units, by=("model", "layers", "condition"))
    fig = plot_tolerance_curves(summary[summary["condition"] != "C1"].rename(columns={"condition": "mode"}))
    assert isinstance(fig, Figure) and len(fig.axes[0].get_lines()) >= 2
    curves_t = pd.DataFrame(dict(condition=["none", "destroy", "destroy", "C1", "C1", "C1"],
                                 damage=[0.0, 0.1, 0.2, 0.1, 0.2, 0.3], tolerance=[0.03, 0.04, 0.05, 0.035, 0.04, 0.045],
                                 ci_low=0.0, ci_high=0.1, coverage=[1.0, 1.0, 0.9, 1.0, 0.8, 0.3]))
    fig = plot_dose_curves(curves_t, levels=[0.1, 0.2])
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert {"none (unedited)", "destroy", "C1", "common damage levels"} <= set(lines)
    assert list(lines["C1"].get_xdata()) == [0.1, 0.2]  # the damage only 30 % of documents reach is not drawn
    assert sum(1 for ln in fig.axes[0].get_lines() if ln.get_linestyle() == ":") == 2  # one line per level
    L = pd.DataFrame(dict(cap=[None, None, 4, 4], seq=[0, 1, 0, 1], bucket_start=[1, 1, 1, 1], nll=[3.0, 3.1, 3.2, 3.3]))
    assert isinstance(plot_length(tol.length_summary(L)), Figure)


@pytest.mark.real
def test_smollm2_identity_ids_and_t2_rerotation(smollm2, smollm2_tokens):
    toks = smollm2_tokens[:1, :48]
    a = tol.nll_on_target(smollm2, toks, target_len=16)
    assert torch.equal(tol.nll_on_target(smollm2, toks, target_len=16, position_ids=torch.arange(48)), a)
    pid = position_ids_for_permutation(adjacent_swap_permutation(48, 0.2, start=1, stop=32, seed=0))
    b = tol.nll_on_target(smollm2, toks, target_len=16, position_ids=pid)
    c = tol.nll_on_target(smollm2, toks, target_len=16, fwd_hooks=reposition_hooks(smollm2, pid))
    torch.testing.assert_close(b, c, atol=1e-3, rtol=1e-4)
