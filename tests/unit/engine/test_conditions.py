"""The causal test's engine (posgen_tl.engine.conditions, posgen_tl.engine.swaps): swaps per sequence and seed, the
controls' norms, the tuning of a strength, bit-identical no-op passes, prefix residuals, the T1/T2 study."""

from __future__ import annotations

import pandas as pd
import pytest
import tiny_models as tm
import torch

from posgen_tl.engine import conditions as ca
from posgen_tl.engine import swaps as tol
from posgen_tl.engine.swaps import nll_on_target
from posgen_tl.experiments import tolerance as tstudy
from posgen_tl.hooks.capture import probe_hooks
from posgen_tl.hooks.edits import Intervention, change_vectors, key_means
from posgen_tl.hooks.stream import capture_qk
from posgen_tl.io.sampling import sample_windows
from posgen_tl.maths.perturb import position_ids_for_permutation
from posgen_tl.maths.rope import to_bands


def _corpus(n_docs=14, seed=0):
    return tm.token_corpus(n_docs, seed)


def _windows(model, n_seq=6, seq_len=24, n_ref=3):
    return sample_windows(model, _corpus(), n_seq=n_seq, seq_len=seq_len, n_ref=n_ref, seed=0)


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


def test_match_alpha_brackets_a_far_target_in_three_evaluations():
    # a slow-band control: damage ≈ 1e-3·α² needs α ≈ 22.6 to reach 0.51 nats (measured shape: C2 on SmolLM2)
    f = lambda a: 1e-3 * a**2  # noqa: E731
    m = ca.match_alpha(f, 0.51, start=1.0, alpha_max=32.0, max_steps=3)
    assert m["reached"], m["trace"]  # doubling (1, 2, 4) would have stopped at damage 0.016
    assert [a for a, _ in m["trace"]][:2] == [1.0, 8.0]  # damage 0.001 → ×8 (the clip), not ×2
    m = ca.match_alpha(lambda a: 0.0, 0.5, start=1.0, alpha_max=32.0, max_steps=6)
    assert not m["reached"] and max(a for a, _ in m["trace"]) == 32.0  # never past the cap


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


def test_t1_t2_study(llama, tmp_path):
    ana, _ = _windows(llama)
    twin = tm.hf_llama(n_layers=3, seed=1)[0]
    res = tstudy.t1_t2_study(llama, n_seq=6, target_len=6, fracs=(0, 0.1, 0.3), seeds=(0,), twin=twin, windows=ana,
                          progress=False)
    assert set(res.rows["twin"]) == {"trained", "random"} and set(res.rows["mode"]) == {"T1", "T2"}
    assert res.rows["doc"].notna().all() and len(res.equivalence) == 2
    assert res.meta["margin"] > 0 and "Equivariance" in res.meta["note"]
    assert set(res.tables) == {"curves", "units", "summary", "contrasts", "tost"} and res.config["n_seq"] == 6
    assert set(res["units"]["twin"]) == {"trained", "random"}


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
