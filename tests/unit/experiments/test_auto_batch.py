"""``batch_size=0``, an option of the tolerance, sufficiency, patching and gap-probe runs: every analysed window in one
forward where the free memory holds it (:func:`posgen_tl.hooks.memory.batch_that_fits`), fewer where not — and the
tables are those of a run whose batch was chosen by hand, in the same order (an order the batches do not change)."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import tiny_models as tm
import torch

from posgen_tl.experiments import base, registry
from posgen_tl.hooks.capture import probe_hooks

N, SEQ = 5, 24
CASES = {
    "tolerance": dict(fracs=(0.0, 0.2), seeds=(0,), twin_seeds=(0,)),
    "sufficiency": dict(n_ref=2),
    # one patch per forward (replicas=1): a forward's batch is the windows' batch
    "patching": dict(target_len=6, quantities=("pos_term",), layers=(1, 2), n_ref=2, n_perm=200, replicas=1),
    "length": dict(n_ref=2, gaps=(0.0, 1.0), prefix_len=12, suffix_len=12, window=False),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tm.sharpened(tm.hf_llama(n_layers=3)[0])


def _run(name, model, cfg, widths):
    """The run's tables, with the batch of every forward of the model on ``SEQ``-token sequences in ``widths``."""

    def pre(m, args, kwargs):
        x = next(a for a in [*args, *kwargs.values()] if torch.is_tensor(a))
        if x.ndim >= 2 and x.shape[1] == SEQ:
            widths.append(int(x.shape[0]))

    handle = model.blocks[0].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        return registry.run(name, model, cfg, twin=False, progress=False).tables
    finally:
        handle.remove()


@pytest.mark.parametrize("name", CASES)
def test_the_automatic_batch_takes_every_window_it_can_and_changes_no_number(name, model, monkeypatch):
    cfg = dataclasses.replace(registry.make_config(name, "quick"), n_seq=N, seq_len=SEQ, **CASES[name],
                              corpus=tm.token_corpus(14))
    _run(name, model, dataclasses.replace(cfg, batch_size=1), [])  # the model's one-time checks run here
    # (the k̄ of the reference windows, n_ref = 2 of them, comes from forwards of at most two)
    by_hand: list[int] = []
    one = _run(name, model, dataclasses.replace(cfg, batch_size=1), by_hand)
    assert max(by_hand) <= 2
    roomy: list[int] = []
    auto = _run(name, model, dataclasses.replace(cfg, batch_size=0), roomy)
    assert max(roomy) == N and len(roomy) < len(by_hand)  # a tiny model's windows all fit: one forward holds them
    seen: list[tuple] = []

    def short(model, n, n_seq, **kw):  # the free memory holds three windows' forwards
        seen.append((n, n_seq))
        return 3

    monkeypatch.setattr("posgen_tl.hooks.memory.batch_that_fits", short)
    tight: list[int] = []
    three = _run(name, model, dataclasses.replace(cfg, batch_size=0), tight)
    assert (SEQ, N) in seen and max(tight) == 3  # 5 windows: batches of 3 and 2
    for t in one:
        if isinstance(one[t], pd.DataFrame):
            for got in (auto, three):
                pd.testing.assert_frame_equal(got[t], one[t], check_exact=False, rtol=1e-6, atol=1e-9)


def test_a_negative_batch_is_refused_by_name_before_any_model_loads():
    for name in CASES:
        with pytest.raises(ValueError, match=f"{name}: batch_size=-1"):
            registry.make_config(name, "default", {"batch_size": "-1"})
    assert base.auto_batch(registry.make_config("tolerance", "default", {"batch_size": "3"}), None, 10, 8) == 3


def test_an_automatic_batch_takes_what_the_free_memory_holds(monkeypatch):
    """:func:`batch_that_fits`: all sequences where their maps (and the caller's extra maps) fit the free share,
    fewer where not, at least one; a set number where the free memory cannot be read."""
    from posgen_tl.hooks import memory

    model = tm.hf_llama(n_layers=1)[0]
    h = probe_hooks(model)[0].n_heads
    one = memory.attention_bytes(h, 100)
    extra = 4 * 4 * h * 100 * 100
    assert memory.batch_that_fits(model, 100, 12, free=int(50 * one / memory.FREE_SHARE)) == 12
    assert memory.batch_that_fits(model, 100, 12, free=int(5.5 * one / memory.FREE_SHARE)) == 5
    assert memory.batch_that_fits(model, 100, 12, extra_maps=4, free=int(5.5 * (one + extra) / memory.FREE_SHARE)) == 5
    assert memory.batch_that_fits(model, 100, 12, extra_maps=4, free=int(5.5 * one / memory.FREE_SHARE)) == 2
    assert memory.batch_that_fits(model, 100, 12, free=0) == 1
    monkeypatch.setattr(memory, "free_bytes", lambda dev: None)
    assert memory.batch_that_fits(model, 100, 12) == 8 and memory.batch_that_fits(model, 100, 3) == 3


@pytest.mark.parametrize("name", ["tolerance", "patching"])
def test_a_checkpoint_kept_in_automatic_batches_is_not_continued_in_other_ones(name, model, tmp_path, monkeypatch):
    """Tolerance and patching keep a checkpoint per batch: a run whose automatic batch resolves to another size than
    the kept one's is another design (refused by name, never mixed); the same size continues it."""
    cfg = dataclasses.replace(registry.make_config(name, "quick"), n_seq=N, seq_len=SEQ, **CASES[name],
                              corpus=tm.token_corpus(14), batch_size=0)
    registry.run(name, model, cfg, twin=False, checkpoint=tmp_path / "ck", progress=False)  # all 5 windows: one batch
    registry.run(name, model, cfg, twin=False, checkpoint=tmp_path / "ck", progress=False)  # the same: continued
    monkeypatch.setattr("posgen_tl.hooks.memory.batch_that_fits", lambda *a, **k: 3)
    with pytest.raises(ValueError, match=f"another {name} design"):
        registry.run(name, model, cfg, twin=False, checkpoint=tmp_path / "ck", progress=False)


def test_logit_budgets_count_the_vocabulary():
    """``logit_row_bytes``: float32 logits and their log-softmax per sequence; ``sequences_within``: the sequences whose
    logit rows fit a byte budget (at least one; all of them for a model without a vocabulary)."""
    from types import SimpleNamespace

    from posgen_tl.hooks.memory import logit_row_bytes, sequences_within

    model = SimpleNamespace(cfg=SimpleNamespace(d_vocab=1000))
    assert logit_row_bytes(model, 3) == 2 * 4 * 3 * 1000
    assert sequences_within(model, 10, 50, 4 * 10 * 1000 * 7 + 5) == 7
    assert sequences_within(model, 10, 50, 100) == 1
    assert sequences_within(SimpleNamespace(), 10, 50, 100) == 50 and logit_row_bytes(SimpleNamespace(), 3) == 0
