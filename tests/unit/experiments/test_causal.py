"""The causal study of docs/method.md §5 (posgen_tl.experiments.causal) and the T1/T2 study of §4 (…tolerance)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tiny_models as tm
import torch

from posgen_tl.experiments import causal as ca
from posgen_tl.experiments import tolerance as tol
from posgen_tl.experiments.tolerance import nll_on_target
from posgen_tl.hooks.capture import capture_qk, probe_hooks
from posgen_tl.hooks.edits import Intervention, change_vectors, key_means
from posgen_tl.io.sampling import sample_windows
from posgen_tl.maths.perturb import position_ids_for_permutation
from posgen_tl.maths.rope import to_bands

# ----------------------------------------------------------------------------- fixtures


def _corpus(n_docs=14, seed=0):
    g = np.random.default_rng(seed)
    return [" ".join(f"t{int(x)}" for x in g.integers(3, 99, int(g.integers(40, 90)))) for _ in range(n_docs)]


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return tm.hf_llama(n_layers=3)[0]


def _windows(model, n_seq=6, seq_len=24, n_ref=3):
    return sample_windows(model, _corpus(), n_seq=n_seq, seq_len=seq_len, n_ref=n_ref, seed=0)


# ----------------------------------------------------------------------------- sampling


def test_reference_disjoint_by_document(llama):
    ana, ref = _windows(llama, n_seq=8)
    assert not set(ana.doc_ids.tolist()) & set(ref.doc_ids.tolist())
    assert ana.n_docs == 8  # one window per document first
    ref_rows = {tuple(r) for r in ref.tokens.tolist()}
    assert not any(tuple(r) in ref_rows for r in ana.tokens.tolist())
    # a run given overlapping windows refuses (the old token-offset bug shared documents)
    bad_ref = ana.subset([0, 1])
    with pytest.raises(ValueError, match="share documents"):
        ca.causal_study(llama, n_seq=6, seq_len=24, target_len=6, groups=("1",), windows=(ana, bad_ref), progress=False)


def test_perms_independent_per_sequence_and_seed(llama):
    ana, _ = _windows(llama)
    n = ana.tokens.shape[1]
    p0 = tol.sequence_perms(ana, 0.2, 0, start=1, stop=n - 6)
    assert len({tuple(r) for r in p0.tolist()}) == len(ana)  # different sequences, different swaps
    assert torch.equal(p0, tol.sequence_perms(ana, 0.2, 0, start=1, stop=n - 6))  # same seed: same swaps
    assert not torch.equal(p0, tol.sequence_perms(ana, 0.2, 1, start=1, stop=n - 6))
    # one sequence alone (another batch composition) gets the same swaps
    assert torch.equal(tol.sequence_perms(ana.subset([3]), 0.2, 0, start=1, stop=n - 6)[0], p0[3])
    # T1 and T2 use the same permutation; p counts pairs, so ≈ 2p of the window moves
    t1, _ = tol.perturbed_inputs(ana, 0.2, 0, "T1", target_len=6)
    t2, pid = tol.perturbed_inputs(ana, 0.2, 0, "T2", target_len=6)
    assert torch.equal(t1, torch.gather(ana.tokens, 1, p0)) and torch.equal(t2, ana.tokens)
    assert torch.equal(pid, torch.stack([position_ids_for_permutation(p) for p in p0]))
    moved = (p0 != torch.arange(n)).sum(1).float()
    assert torch.allclose(moved, torch.full_like(moved, 2 * round(0.2 * (n - 6 - 1 - 1))))


# ----------------------------------------------------------------------------- controls


def test_control_norms_and_rephase(llama):
    toks = torch.randint(3, 90, (3, 20), generator=torch.Generator().manual_seed(0))
    km = key_means(llama, toks)
    lr = probe_hooks(llama)[0].layer(0)
    k = capture_qk(llama, toks, [0])[0].k
    fast = [0, 1]
    iv = Intervention("destroy", fast, alpha=0.7)
    norm = lambda c: c.abs().pow(2).sum(-1)  # noqa: E731  per (token, head)
    for ctrl in (Intervention("random_bands", fast, alpha=0.7, base="destroy"), Intervention("noise", fast, alpha=0.7)):
        torch.testing.assert_close(norm(change_vectors(k, km[0], ctrl, lr, 0)), norm(change_vectors(k, km[0], iv, lr, 0)),
                                   rtol=1e-5, atol=1e-7)
    dn = change_vectors(k, km[0], Intervention("noise", fast, alpha=0.7), lr, 0)
    assert (dn[..., 2:] == 0).all() and dn[..., :2].abs().std() >= 0  # only the fast bands
    assert not torch.allclose(dn[:, 0], dn[:, 1])  # phases differ per position
    # C3 keeps |k̄^(m)| at any strength (the angle is scaled, not the vector)
    zbar = to_bands(km[0], lr.rotary_dim, lr.layout)
    for a in (0.37, 1.0):
        d = change_vectors(k, km[0], Intervention("rephase", fast, alpha=a), lr, 0)
        new_offset = zbar[:, fast] + d[0, 0][:, fast]
        torch.testing.assert_close(new_offset.abs(), zbar[:, fast].abs(), rtol=1e-5, atol=1e-6)


def test_match_alpha():
    f = lambda a: 0.3 * a**1.5  # noqa: E731
    m = ca.match_alpha(f, 0.2, start=1.0, alpha_max=8.0, max_steps=5)
    assert m["reached"] and m["n_evals"] <= 5 and abs(m["damage"] - 0.2) <= 0.05 * 0.2
    m = ca.match_alpha(f, 0.8, start=1.0, alpha_max=8.0, max_steps=5)  # needs alpha > 1
    assert m["alpha"] > 1 and abs(m["damage"] - 0.8) <= 0.1 * 0.8
    m = ca.match_alpha(lambda a: 0.01 * min(a, 1.0), 0.5, alpha_max=4.0)
    assert not m["reached"]  # unreachable: reported, never hidden


# ----------------------------------------------------------------------------- passes


def test_noop_bit_identical_and_kl_zero(llama):
    ana, ref = _windows(llama)
    km = key_means(llama, ref.tokens[:, :-6])
    kl = ca.AttentionKL([1, 2])
    none = ca.Condition("none", None)
    noop = ca.Condition("noop", Intervention("noop", layers=[1, 2]))
    a, ca_clean, _ = ca.condition_rows(llama, ana, none, k_means=km, target_len=6, fracs=(0, 0.2), seeds=(0, 1), kl=kl)
    b, cb_clean, kv = ca.condition_rows(llama, ana, noop, k_means=km, target_len=6, fracs=(0, 0.2), seeds=(0, 1), kl=kl)
    pd.testing.assert_frame_equal(a, b)  # same swaps, bit-identical NLL
    assert torch.equal(kv, torch.zeros_like(kv))
    destroy = ca.Condition("destroy", Intervention("destroy", [0, 1], layers=[1, 2], alpha=1.0))
    _, _, kd = ca.condition_rows(llama, ana, destroy, k_means=km, target_len=6, fracs=(0,), seeds=(0,), kl=kl)
    assert (kd > 0).all()


def test_prefix_residual_reproduces_full_forward(llama):
    ana, _ = _windows(llama, n_seq=4)
    toks = ana.tokens
    pid = torch.stack([position_ids_for_permutation(p) for p in tol.sequence_perms(ana, 0.3, 0, start=1, stop=18)])
    with torch.no_grad():
        resid = llama(toks, stop_at_layer=1, position_ids=pid)
        full = nll_on_target(llama, toks, target_len=6, position_ids=pid, batch_size=4)
        resumed = nll_on_target(llama, toks, target_len=6, position_ids=pid, batch_size=4, resid_at=(1, resid))
    torch.testing.assert_close(resumed, full, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- the recipe


def _run(llama, **kw):
    opts = dict(n_seq=6, seq_len=24, target_len=6, fracs=(0, 0.1, 0.3), seeds=(0,), groups=("1", "2"), controls=ca.CONTROLS, alpha=0.5,
                n_ref=3, batch_size=4, progress=False)
    return ca.causal_study(llama, _corpus(), **{**opts, **kw})


@pytest.fixture(scope="module")
def study(llama):
    torch.manual_seed(0)
    partial = []
    return _run(llama, on_partial=partial.append), partial


def test_causal_study_rows_and_draws(study):
    res, partial = study
    r = res.rows
    assert {"layers", "condition", "kind", "alpha", "draw", "seq", "doc", "doc_name", "frac", "seed", "clean_nll", "nll",
            "delta", "base_clean_nll"} <= set(r.columns)
    assert set(r["condition"]) == {"none", "destroy", *ca.CONTROLS} and set(r["layers"]) == {"", "L1", "L2"}
    assert len(r) == (1 + 2 * 5) * 6 * 3 and r["doc"].notna().all()
    none = r[r["condition"] == "none"]
    assert np.allclose(none["clean_nll"], none["base_clean_nll"]) and (none["layers"] == "").all()
    # every condition sees the same perturbed inputs: the same (seq, frac, seed) grid
    grids = {k: set(map(tuple, g[["seq", "frac", "seed"]].to_numpy())) for k, g in r.groupby(["layers", "condition"])}
    assert len({frozenset(v) for v in grids.values()}) == 1
    # random controls: one fresh draw per document, the same in every pass; fixed edits have none
    for c in ("C1", "C3", "C4"):
        g = r[(r["condition"] == c) & (r["layers"] == "L1")]
        per_doc = g.groupby("doc")["draw"].nunique()
        assert (per_doc == 1).all() and g["draw"].nunique() == g["doc"].nunique()
    assert r[r["condition"].isin(["destroy", "C2", "none"])]["draw"].isna().all()
    # partial rows after every batch but the last (6 sequences, batches of 4: one partial)
    assert len(partial) == 1 and set(partial[0]["seq"]) == {0, 1, 2, 3}


def test_causal_study_tables(study):
    res, _ = study
    t = res.tables
    assert set(t) == {"verdicts", "components", "damage", "adjusted", "contrasts", "summary", "interaction"}
    v = t["verdicts"]
    assert list(v["layers"]) == ["L1", "L2"] and v["verdict"].str.contains("exploratory").all()  # 6 documents < 32
    assert {"estimate", "ci_low", "ci_high", "ci_level", "p", "p_kind", "p_holm", "p_claim", "mde", "n_docs"} <= set(v)
    assert (v["p_claim"] == v["p_holm"]).all() and (v["claim_size"] == 2).all()  # the run covers its own claim
    c = t["contrasts"]
    assert {"destroy − none", "destroy − C1", "C1 − none"} <= set(c["contrast"])
    assert set(c["estimator"]) == {"auc", "dnll", "slope"} and set(c["frac"].dropna()) == {0.1, 0.3}
    s = t["summary"]
    assert {"damage", "attn_kl", "dnll", "auc", "slope"} <= set(s["estimator"])
    kl = s[(s["estimator"] == "attn_kl")].set_index(["layers", "condition"])["estimate"]
    assert (kl.xs("none", level="condition") == 0).all() and (kl.drop("none", level="condition") > 0).all()
    assert len(t["interaction"]) and (t["interaction"]["first"] == "tiny L1").all()
    assert set(t["damage"]["control"]) == set(ca.CONTROLS) and "matched" in t["damage"]
    m = res.matching
    assert set(m["condition"]) == {"destroy", *ca.CONTROLS} and (m["n_evals"] >= 1).all()
    cfg = res.config
    assert cfg["claim_family"]["controls_redrawn_per_document"] and cfg["claim_family"]["damage_margin_rel"] == 0.1
    assert cfg["entries"]["L1"]["layers"] == [1] and not cfg["none_swaps_from_t12"]


def test_controls_are_tuned_on_the_reference_documents_only(llama, monkeypatch):
    """Every forward of the damage matching runs on the reference windows: never an analysed document."""
    from posgen_tl.io.sampling import sample_windows

    ana, ref = sample_windows(llama, _corpus(), n_seq=6, seq_len=24, n_ref=3, seed=0)
    seen = []
    real = ca._match_on_reference

    def spy(model, conds, ref_w, *args, **kw):
        real_nll = ca.nll_on_target

        def nll(model, tokens, **k):
            seen.append(tokens.clone())
            return real_nll(model, tokens, **k)

        monkeypatch.setattr(ca, "nll_on_target", nll)
        try:
            return real(model, conds, ref_w, *args, **kw)
        finally:
            monkeypatch.setattr(ca, "nll_on_target", real_nll)

    monkeypatch.setattr(ca, "_match_on_reference", spy)
    _run(llama, groups=("2",), controls=("C1",), windows=(ana, ref))
    ref_rows = {tuple(r) for r in ref.tokens.tolist()}
    assert seen and all(tuple(row) in ref_rows for tk in seen for row in tk.tolist())


def test_claim_declared_beyond_the_run_bounds_the_p(llama):
    res = _run(llama, groups=("2",), controls=("C2",), claim=("tiny:L2", "other:L2", "other:L1", "tiny:L1"))
    v = res.tables["verdicts"].iloc[0]
    assert v["claim_size"] == 4 and v["p_claim"] == pytest.approx(min(1.0, 4 * v["p"]))
    assert "Bonferroni bound over the declared claim of 4 entries" in v["p_claim_method"]


@pytest.mark.parametrize("kw,match", [
    (dict(damage_margin=0.0), "damage_margin"), (dict(groups=("middle", "L9")), "layer group .L9.: expected early"), (dict(groups=("x",)), "layer group .x."),
    (dict(fracs=(0.1, 0.2)), "include 0"), (dict(controls=("C9",)), "unknown controls"),
    (dict(groups=("1", "1")), "twice"), (dict(damage_rule="loose"), "damage_rule"),
])
def test_bad_options_raise_before_any_verdict(llama, kw, match):
    with pytest.raises(ValueError, match=match):
        _run(llama, **kw)


def test_t1_t2_study(llama, tmp_path):
    ana, _ = _windows(llama)
    twin = tm.hf_llama(n_layers=3, seed=1)[0]
    res = tol.t1_t2_study(llama, n_seq=6, target_len=6, fracs=(0, 0.1, 0.3), seeds=(0,), twin=twin, windows=ana,
                          progress=False)
    assert set(res.rows["twin"]) == {"trained", "random"} and set(res.rows["mode"]) == {"T1", "T2"}
    assert res.rows["doc"].notna().all() and len(res.equivalence) == 2
    assert res.config["margin"] > 0 and "Equivariance" in res.config["note"]
    assert "Equivariance" in tol.write_t12_outputs(res, tmp_path)["md"].read_text()


# ----------------------------------------------------------------------------- real model


@pytest.mark.real
def test_smollm2_prefix_exact_and_windows_disjoint(smollm2):
    ana, ref = sample_windows(smollm2, None, n_seq=2, seq_len=64, n_ref=2, seed=0)
    assert not set(ana.doc_ids.tolist()) & set(ref.doc_ids.tolist())
    pid = torch.stack([position_ids_for_permutation(p) for p in tol.sequence_perms(ana, 0.1, 0, start=1, stop=48)])
    with torch.no_grad():
        resid = smollm2(ana.tokens, stop_at_layer=10, position_ids=pid)
        full = nll_on_target(smollm2, ana.tokens, target_len=16, position_ids=pid, batch_size=2)
        resumed = nll_on_target(smollm2, ana.tokens, target_len=16, position_ids=pid, batch_size=2, resid_at=(10, resid))
    torch.testing.assert_close(resumed, full, atol=1e-6, rtol=0)


def test_causal_none_reuses_the_t1_curve(llama):
    """Given the T1/T2 result on the same windows, the `none` condition runs only its clean pass and
    takes the swapped passes from the trained T1 rows: same rows as recomputing them, fewer forwards;
    a T1/T2 result from other windows, seeds or target is refused."""
    ana, ref = _windows(llama, n_seq=6, seq_len=24)
    kw = dict(n_seq=6, seq_len=24, target_len=6, fracs=(0, 0.1, 0.3), seeds=(0, 1), groups=("1",), controls=("C1",),
              n_ref=3, match_steps=1, batch_size=4, windows=(ana, ref), progress=False)
    t12 = tol.t1_t2_study(llama, n_seq=6, target_len=6, fracs=(0, 0.1, 0.3), seeds=(0, 1), twin=None, windows=ana,
                         batch_size=4, progress=False)
    calls = {"n": 0}

    def count(module, args, kwargs):
        calls["n"] += 1

    h = llama.embed.register_forward_pre_hook(count, with_kwargs=True)  # one call per forward pass
    try:
        plain = ca.causal_study(llama, **kw)
        n_plain = calls["n"]
        calls["n"] = 0
        shared = ca.causal_study(llama, **kw, t12=t12)
        n_shared = calls["n"]
    finally:
        h.remove()
    key = ["layers", "condition", "seq", "frac", "seed"]
    a = plain.rows.sort_values(key).reset_index(drop=True)
    b = shared.rows.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b, check_exact=False, atol=1e-6, rtol=0)
    num = ["estimate", "p"]
    pd.testing.assert_frame_equal(plain.tables["contrasts"][num], shared.tables["contrasts"][num], check_exact=False,
                                  atol=1e-6)
    assert shared.config["none_swaps_from_t12"] and not plain.config["none_swaps_from_t12"]
    assert n_plain - n_shared == 2 * 4  # 2 batches × 4 swapped passes (2 fracs × 2 seeds) of `none` saved
    with pytest.raises(ValueError, match="seed"):
        ca.causal_study(llama, **{**kw, "seeds": (0, 2)}, t12=t12)
    with pytest.raises(ValueError, match="target_len"):
        ca.causal_study(llama, **{**kw, "target_len": 5}, t12=t12)
    other, _ = sample_windows(llama, _corpus(seed=1), n_seq=6, seq_len=24, n_ref=3, seed=0)
    t12_other = tol.t1_t2_study(llama, n_seq=6, target_len=6, fracs=(0, 0.1, 0.3), seeds=(0, 1), twin=None,
                               windows=other, batch_size=4, progress=False)
    with pytest.raises(ValueError, match="other windows"):
        ca.causal_study(llama, **kw, t12=t12_other)


def test_matching_draws_per_document_across_batches(llama):
    """More reference windows than a batch: every batch gets its own documents' draws (a regression:
    the whole reference set's seeds were once handed to a 4-row batch)."""
    res = _run(llama, groups=("2",), controls=("C1", "C4"), n_ref=5, batch_size=2, n_seq=4, match_steps=1)
    assert set(res.matching["condition"]) == {"destroy", "C1", "C4"}


def test_a_verdict_is_read_over_the_declared_claim():
    """A run holding two of a four-entry claim: an entry passing Holm over the run (p_holm < .05) but
    not the claim's bound (p_claim ≥ .05) must not read "depends"; one passing both keeps it."""
    import pandas as pd

    from posgen_tl.experiments.causal import claim_verdicts

    v = pd.DataFrame(dict(layers=["L1", "L2", "L3"], p=[0.02, 0.004, 0.3], p_holm=[0.04, 0.008, 0.3],
                          p_claim=[0.08, 0.016, 1.0], p_claim_method=["Bonferroni bound over 4"] * 3,
                          verdict=["depends (exploratory)", "depends", "no evidence"], label=["a", "b", "c"]))
    out = claim_verdicts(v, 0.05)
    assert out["verdict"].tolist() == ["no evidence (exploratory)", "depends", "no evidence"]
    assert out["label"].iloc[0].startswith("p over the declared claim = 0.08 ≥ 0.05") and out["label"].iloc[1] == "b"
    pd.testing.assert_frame_equal(claim_verdicts(out, 0.05), out)  # idempotent
