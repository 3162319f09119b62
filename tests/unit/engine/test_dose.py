"""The dose–response run (issue #36): every condition at every strength on the same windows and swaps; the
α = 0 point is the unedited model, shared; the per-document units feed the common-damage contrasts."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models as tm
import torch

from posgen_tl.engine.conditions import build_conditions
from posgen_tl.engine.dose import dose_rows, dose_units, strength_grid
from posgen_tl.hooks.edits import key_means
from posgen_tl.io.sampling import Windows
from posgen_tl.stats.dose import DoseDesign, common_damage_contrasts

FRACS = (0.0, 0.1, 0.2)


@pytest.fixture(scope="module")
def run():
    model, _ = tm.hf_llama(n_layers=2, seed=1)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(3, 100, (6, 32), generator=g)
    w = Windows(tokens=toks, doc_ids=torch.tensor([0, 0, 1, 2, 3, 4]), starts=torch.zeros(6, dtype=torch.long),
                doc_names=[f"d{i}" for i in range(5)])
    km = key_means(model, torch.randint(3, 100, (4, 32), generator=g))
    conds = build_conditions([1], fast=[0, 1], slow=[6, 7], alpha=1.0, controls=("C1", "C2"))
    strengths = {"destroy": (0.0, 0.5, 1.0), "C1": (0.0, 1.0, 2.0), "C2": (0.0, 1.0)}
    rows = dose_rows(model, w, conds, strengths, k_means=km, target_len=8, fracs=FRACS, seeds=(0,), batch_size=4,
                     progress=False)
    return rows, dose_units(rows)


def test_every_condition_shares_the_unedited_alpha_zero_passes(run):
    rows, _ = run
    z = rows[rows["alpha"] == 0].pivot_table(index=["seq", "frac", "seed"], columns="condition", values="nll")
    assert np.allclose(z.to_numpy(), z.to_numpy()[:, :1])
    assert np.allclose(rows.loc[rows["alpha"] == 0, "clean_nll"], rows.loc[rows["alpha"] == 0, "base_clean_nll"])


def test_the_grid_is_run_in_full_with_documents_attached(run):
    rows, units = run
    got = rows.groupby("condition")["alpha"].apply(lambda s: sorted(set(s))).to_dict()
    assert got == {"destroy": [0.0, 0.5, 1.0], "C1": [0.0, 1.0, 2.0], "C2": [0.0, 1.0]}
    assert set(rows["seq"]) == set(range(6)) and rows.groupby("seq")["doc"].nunique().max() == 1
    assert len(units) == 5 * (3 + 3 + 2)  # documents × (condition, strength)


def test_units_measure_damage_and_both_tolerances(run):
    _, u = run
    zero = u[u["alpha"] == 0]
    assert np.allclose(zero["damage"], 0.0) and np.allclose(zero["tolerance"], zero["tolerance_unedited"])
    d = u[(u["condition"] == "destroy") & (u["alpha"] == 1.0)]
    assert (d["damage"].abs() > 1e-6).all()  # the edit does something at α = 1
    # against the unedited clean NLL the curve starts at the damage: the two areas differ by damage-weighted terms
    assert not np.allclose(d["tolerance"], d["tolerance_unedited"])


def test_units_feed_the_common_damage_contrasts(run):
    _, u = run
    dmg = u.loc[(u["condition"] == "destroy") & (u["alpha"] > 0), "damage"].abs()
    levels = tuple(np.quantile(dmg, [0.4, 0.6]))
    rows = u.assign(damage=u["damage"].abs())
    c = common_damage_contrasts(rows, DoseDesign(levels=levels, n_boot=200))
    assert {"destroy − none", "destroy − C1", "C1 − none"} <= set(c["contrast"])


def test_strength_grid_brackets_the_tuned_point():
    assert strength_grid(0.8) == (0.0, 0.2, 0.4, 0.8, 1.6, 3.2)
    assert strength_grid(0.5, alpha_max=1.0) == (0.0, 0.125, 0.25, 0.5, 1.0)
    with pytest.raises(ValueError):
        strength_grid(0.0)


# ----------------------------------------------------------------------------- long texts: chunked passes

def _chunk_inputs(name: str):
    model = tm.hf_llama(n_layers=2, seed=1)[0] if name == "hf_llama" else tm.hf_gemma3()[0]
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(3, 90, (3, 29), generator=g)
    w = Windows(tokens=toks, doc_ids=torch.tensor([0, 1, 1]), starts=torch.zeros(3, dtype=torch.long),
                doc_names=["d0", "d1"])
    km = key_means(model, torch.randint(3, 90, (4, 29), generator=g))
    layers = [1, 2] if name == "hf_gemma3" else [1]  # Gemma3: a local (window 4) and a global layer
    conds = build_conditions(layers, fast=[0, 1], slow=[6, 7], alpha=1.0, controls=("C1", "C4"))
    strengths = {"destroy": (0.0, 4.0, 8.0), "C1": (0.0, 8.0), "C4": (0.0, 8.0)}
    return model, w, conds, strengths, km


@pytest.mark.parametrize("name", ["hf_llama", "hf_gemma3"])
def test_a_chunked_dose_run_gives_the_whole_runs_rows(name):
    """Every pass a chunk of 8 positions at a time (the paired clean passes included): NLLs, damage and the attention
    change equal the whole run's, which stores the unedited patterns and resumes from residuals — and the edits do
    change the attention and the NLL by far more than the two runs differ (else nothing is compared)."""
    model, w, conds, strengths, km = _chunk_inputs(name)
    kw = dict(k_means=km, target_len=9, fracs=(0.0, 0.2), seeds=(0,), batch_size=2, progress=False)
    whole = dose_rows(model, w, conds, strengths, chunk=0, **kw)
    parts = dose_rows(model, w, conds, strengths, chunk=8, **kw)
    keys = ["seq", "condition", "alpha", "frac", "seed"]
    a, b = whole.sort_values(keys).reset_index(drop=True), parts.sort_values(keys).reset_index(drop=True)
    assert a[keys + ["doc", "layers"]].equals(b[keys + ["doc", "layers"]])
    # float32 rounding of the NLLs themselves (≈ 4.6 nats here): a chunked forward sums in another order, and a
    # difference of two NLLs (delta) carries both roundings — 1.4e-6 seen on one AMD EPYC host, over a 1e-6 allowance
    ulps = 16 * float(np.finfo(np.float32).eps) * float(a["nll"].abs().max())
    for col in ("clean_nll", "nll", "delta", "base_clean_nll"):
        np.testing.assert_allclose(b[col], a[col], rtol=1e-5, atol=ulps, err_msg=col)
    edited = a["alpha"] > 0
    np.testing.assert_allclose(b.loc[edited, "attn_kl"], a.loc[edited, "attn_kl"], rtol=1e-4, atol=1e-9)
    assert (a.loc[edited, "attn_kl"] > 1e-5).all()
    damage = (a["clean_nll"] - a["base_clean_nll"]).abs()[edited]
    assert damage.min() > 100 * max(float((b["clean_nll"] - a["clean_nll"]).abs().max()), 1e-7)


def test_long_texts_run_the_dose_passes_in_chunks_by_themselves(monkeypatch):
    """Beyond CHUNK_ABOVE (lowered here to 16) a dose run chunks without being asked — every forward through the
    cache, none with the whole maps — and gives the whole run's numbers."""
    import posgen_tl.hooks.chunked as ch
    import posgen_tl.hooks.positions as ps

    model, w, conds, strengths, km = _chunk_inputs("hf_llama")
    kw = dict(k_means=km, target_len=9, fracs=(0.0, 0.2), seeds=(0,), batch_size=3, progress=False)
    whole = dose_rows(model, w, conds[:1], {"destroy": (0.0, 8.0)}, chunk=0, **kw)
    monkeypatch.setattr(ch, "CHUNK_ABOVE", 16)
    monkeypatch.setattr(ch, "CHUNK", 8)
    calls: list = []
    real = ps.run_chunks
    monkeypatch.setattr(ps, "run_chunks", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    auto = dose_rows(model, w, conds[:1], {"destroy": (0.0, 8.0)}, **kw)
    assert calls == [3, 3, 6, 3]  # unedited clean, its swapped pass, the paired clean pass (3 + 3 rows), its swap
    np.testing.assert_allclose(auto["nll"], whole["nll"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(auto["attn_kl"], whole["attn_kl"], rtol=1e-4, atol=1e-9)


def test_a_paired_pass_whose_edit_reaches_the_unedited_rows_is_refused_by_name(monkeypatch):
    import posgen_tl.engine.dose as dose
    from posgen_tl.hooks.capture import CaptureError

    model, w, conds, strengths, km = _chunk_inputs("hf_llama")
    monkeypatch.setattr(dose, "hooks_on_rows", lambda hooks, rows: hooks)  # the edit on every row of the pair
    with pytest.raises(CaptureError, match="reached rows it was not meant for"):
        dose_rows(model, w, conds[:1], {"destroy": (0.0, 8.0)}, k_means=km, target_len=9, fracs=(0.0,), seeds=(0,),
                  batch_size=3, progress=False, chunk=8)


def test_hooks_on_rows_edit_only_their_rows():
    from posgen_tl.hooks.chunked import hooks_chunk_safe
    from posgen_tl.hooks.edits import hooks_on_rows

    def returns(t, hook):
        return t + 1.0

    def in_place(t, hook):
        t.mul_(0.0)

    x = torch.arange(24.0).reshape(4, 3, 2)
    (_, f), (_, g) = hooks_on_rows([("a", returns), ("b", in_place)], slice(2, 4))
    y = f(x, hook=None)
    assert torch.equal(y[:2], x[:2]) and torch.equal(y[2:], x[2:] + 1) and torch.equal(x, torch.arange(24.0).reshape(4, 3, 2))
    assert g(y, hook=None) is None and torch.equal(y[:2], x[:2]) and not y[2:].any()
    assert not hooks_chunk_safe(hooks_on_rows([("a", returns)], slice(0, 1)))
    from posgen_tl.hooks.chunked import chunk_safe
    assert hooks_chunk_safe(hooks_on_rows([("a", chunk_safe(returns))], slice(0, 1)))


def test_a_whole_run_whose_patterns_outgrow_the_free_memory_chunks_or_is_refused_by_name(monkeypatch):
    """With little free memory (here: less than twice the 29-token run's stored patterns) an automatic dose run goes
    through chunks (quarters of the sequence) to the whole run's numbers; where it cannot chunk, it is refused by
    name instead of the process being killed."""
    import posgen_tl.engine.dose as dose
    import posgen_tl.hooks.chunked as ch

    model, w, conds, strengths, km = _chunk_inputs("hf_llama")
    kw = dict(k_means=km, target_len=9, fracs=(0.0, 0.2), seeds=(0,), batch_size=3, progress=False)
    one = {"destroy": (0.0, 8.0)}
    whole = dose_rows(model, w, conds[:1], one, **kw)  # plenty of memory: whole forwards
    heads = model.cfg.n_heads
    monkeypatch.setattr(dose, "free_bytes", lambda dev: 4 * 3 * heads * 29 * 29)
    used: list = []
    real = dose._chunked_batch
    monkeypatch.setattr(dose, "_chunked_batch", lambda *a, **k: used.append(k["chunk"]) or real(*a, **k))
    low = dose_rows(model, w, conds[:1], one, **kw)
    assert used == [8]  # ⌈29 / 4⌉
    np.testing.assert_allclose(low["nll"], whole["nll"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(low["attn_kl"], whole["attn_kl"], rtol=1e-4, atol=1e-9)
    monkeypatch.setattr(dose, "check_chunked", lambda m: (_ for _ in ()).throw(ch.CaptureError("no cache here")))
    with pytest.raises(MemoryError, match=r"attention patterns.*no cache here.*batch_size"):
        dose_rows(model, w, conds[:1], one, **kw)


# ----------------------------------------------------------------------------- passes stacked in one forward


def _stack_inputs():
    """A 3-layer model, two entries: layers 1–2 (their passes resume at layer 1) and layer 0 (from the start), each
    with destroy and its random controls (two, one) at two strengths — ten edited passes of two kinds of start."""
    model, _ = tm.hf_llama(n_layers=3, seed=2)
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(3, 100, (3, 24), generator=g)
    w = Windows(tokens=toks, doc_ids=torch.tensor([0, 1, 2]), starts=torch.zeros(3, dtype=torch.long),
                doc_names=["d0", "d1", "d2"])
    km = key_means(model, torch.randint(3, 100, (4, 24), generator=g))
    conds = [*build_conditions([1, 2], fast=[0, 1], slow=[6, 7], alpha=1.0, controls=("C1", "C2"), group="upper"),
             *build_conditions([0], fast=[0, 1], slow=[6, 7], alpha=1.0, controls=("C1",), group="lower")]
    strengths = {(c.group, c.key): (0.0, 100.0, 300.0) if c.key == "C2" else (0.0, 8.0, 24.0) for c in conds}
    return model, w, conds, strengths, km


@pytest.mark.parametrize("stack", [0, 2])
def test_stacked_passes_give_the_rows_of_one_pass_per_forward(stack, monkeypatch):
    """Every (condition, α) pass of a batch side by side in one forward's batch, each edit on its own rows (stack=0:
    as many as memory allows — all six of the upper entry together, the four of the lower one together; stack=2: runs
    of at most two): the same rows in the same order as one pass per forward, NLLs and attention changes within float
    rounding — and the edits change both by far more than that (else nothing is compared). An edit that reached
    another pass's rows would move that pass's numbers by the edit's own size."""
    import posgen_tl.engine.dose as dose

    model, w, conds, strengths, km = _stack_inputs()
    kw = dict(k_means=km, target_len=6, fracs=(0.0, 0.2), seeds=(0,), batch_size=3, progress=False)
    one = dose_rows(model, w, conds, strengths, stack=1, **kw)
    sizes: list = []
    real = dose._stacked_rows
    monkeypatch.setattr(dose, "_stacked_rows", lambda m, w_, part, *a, **k: sizes.append(len(part)) or real(m, w_, part, *a, **k))
    got = dose_rows(model, w, conds, strengths, stack=stack, **kw)
    assert sizes == ([6, 4] if stack == 0 else [2, 2, 2, 2, 2])
    keys = ["seq", "doc", "layers", "condition", "alpha", "frac", "seed"]
    assert list(got.columns) == list(one.columns) and got[keys].equals(one[keys])
    ulps = 16 * float(np.finfo(np.float32).eps) * float(one["nll"].abs().max())
    for col in ("clean_nll", "nll", "delta", "base_clean_nll", "delta_unedited"):
        np.testing.assert_allclose(got[col], one[col], rtol=1e-5, atol=ulps, err_msg=col)
    edited = one["alpha"] > 0
    np.testing.assert_allclose(got.loc[edited, "attn_kl"], one.loc[edited, "attn_kl"], rtol=1e-4, atol=1e-9)
    assert (one.loc[edited, "attn_kl"] > 1e-7).all()  # ≫ the comparison's 1e-9
    damage = (one["clean_nll"] - one["base_clean_nll"]).abs()[edited]
    assert damage.min() > 100 * max(float((got["clean_nll"] - one["clean_nll"]).abs().max()), 1e-7)


def test_a_stacked_pass_whose_edit_reaches_the_other_rows_changes_their_numbers(monkeypatch):
    """The check above can fail: with each edit applied to every row of the stacked batch (no hooks_on_rows), the
    stacked rows no longer equal one pass per forward (destroy at two strengths: each row gets both edits)."""
    import posgen_tl.engine.dose as dose

    model, w, conds, strengths, km = _stack_inputs()
    kw = dict(k_means=km, target_len=6, fracs=(0.0,), seeds=(0,), batch_size=3, progress=False)
    one = dose_rows(model, w, conds[:1], strengths, stack=1, **kw)
    monkeypatch.setattr(dose, "hooks_on_rows", lambda hooks, rows: hooks)
    leaky = dose_rows(model, w, conds[:1], strengths, stack=0, **kw)
    assert float((leaky["nll"] - one["nll"]).abs().max()) > 1e-3


def test_passes_are_stacked_by_their_first_edited_layer_in_even_runs():
    from posgen_tl.engine.dose import _stacks

    assert _stacks([1, 1, None, 1, None, 1, 1], 3) == [[0, 1, 3], [5, 6], [2, 4]]
    assert _stacks([1, 1, 1, 1, 1], 2) == [[0, 1], [2, 3], [4]]
    assert _stacks([2, 2, 2, 2], 3) == [[0, 1], [2, 3]]  # two runs of two, not three and one
    assert _stacks([0, 0], 1) == [[0], [1]]


def test_the_stack_is_bounded_by_the_free_memory(monkeypatch):
    """As many passes as the free memory holds with their attention maps and the target span's logits; at least one;
    all of them on a CPU whose free memory cannot be read."""
    import posgen_tl.engine.dose as dose

    model, *_ = _stack_inputs()
    asked: list = []

    def fits(k):
        return lambda m, n, extra=0: asked.append((n, extra)) or k

    monkeypatch.setattr(dose, "sequences_per_forward", fits(7))
    assert dose.stack_size(model, 24, 3, 6, 9) == 2  # 7 sequences fit: two copies of a batch of 3
    assert asked == [(24, 2 * 4 * 6 * model.cfg.d_vocab)]  # the logits of 6 target rows, twice, per sequence
    monkeypatch.setattr(dose, "sequences_per_forward", fits(2))
    assert dose.stack_size(model, 24, 3, 6, 9) == 1  # not even one copy: one pass per forward all the same
    monkeypatch.setattr(dose, "sequences_per_forward", fits(1000))
    assert dose.stack_size(model, 24, 3, 6, 9) == 9
    monkeypatch.setattr(dose, "sequences_per_forward", fits(None))
    assert dose.stack_size(model, 24, 3, 6, 9) == 9


def test_stacked_kl_is_each_conditions_attention_kl_on_its_rows():
    from posgen_tl.engine.conditions import StackedKL, attention_kl

    g = torch.Generator().manual_seed(0)

    def pattern(b):
        s = torch.randn(b, 2, 5, 5, generator=g).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
        return s.softmax(-1)

    ref = {0: pattern(3), 1: pattern(3)}
    kl = StackedKL(ref, [[0, 1], [1]], 3)
    assert kl.layers == [0, 1]
    stacked = {0: pattern(6), 1: pattern(6)}
    for layer in (0, 1):
        kl(layer, stacked[layer])
    want = torch.cat([(attention_kl(ref[0], stacked[0][:3]) + attention_kl(ref[1], stacked[1][:3])) / 2,
                      attention_kl(ref[1], stacked[1][3:])])
    assert torch.allclose(kl.per_sequence(), want, rtol=1e-6)
    with pytest.raises(ValueError, match="expected 2 conditions × 3"):
        kl(0, pattern(3))
    with pytest.raises(ValueError, match="layers \\[2\\]"):
        StackedKL(ref, [[2]], 3)
    with pytest.raises(RuntimeError, match="not captured"):
        StackedKL(ref, [[0, 1]], 3).per_sequence()
