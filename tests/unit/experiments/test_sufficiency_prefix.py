"""The sufficiency study's substituted passes resume at their group's first layer from the residuals the clean pass
recorded (the blocks below it compute what the clean pass computed): the rows are those of passes run from the first
block, also when the clean rows come from a checkpoint (the residuals are then recorded in a pass of their own), and
every pass runs from the first block where the residuals would not fit their budget."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import tiny_models as tm
import torch

from posgen_tl.experiments import sufficiency
from posgen_tl.io.sampling import Windows

GROUPS = {"0": [0], "1–2": [1, 2], "2": [2], "all": [0, 1, 2]}


@pytest.fixture(scope="module")
def setting():
    model, _ = tm.hf_llama(n_layers=3, seed=2)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(3, 100, (5, 24), generator=g)
    win = Windows(tokens=toks, doc_ids=torch.arange(5), starts=torch.zeros(5, dtype=torch.long),
                  doc_names=[f"d{i}" for i in range(5)])
    ref = Windows(tokens=torch.randint(3, 100, (3, 24), generator=g), doc_ids=torch.arange(3),
                  starts=torch.zeros(3, dtype=torch.long), doc_names=[f"r{i}" for i in range(3)])
    cfg = sufficiency.Config(n_seq=5, seq_len=24, n_ref=3, sources=("d3", "d1", "wrong_kbar"), batch_size=2)
    return model, win, ref, cfg


def _rows(model, win, ref, cfg, **kw) -> pd.DataFrame:
    return sufficiency.run(model, cfg, corpus=win, reference=ref, groups=GROUPS, progress=False, **kw).tables["rows"]


def _passes(model, monkeypatch) -> list[int | None]:
    """Record the layer each target-NLL pass of a run resumes at (None: from the first block)."""
    from posgen_tl.engine import swaps

    seen: list[int | None] = []
    orig = swaps.nll_on_target

    def spy(*a, **k):
        seen.append(None if k.get("resid_at") is None else int(k["resid_at"][0]))
        return orig(*a, **k)

    monkeypatch.setattr(sufficiency, "nll_on_target", spy)
    return seen


def test_resumed_passes_give_the_rows_of_passes_from_the_first_block(setting, monkeypatch):
    model, win, ref, cfg = setting
    seen = _passes(model, monkeypatch)
    got = _rows(model, win, ref, cfg)
    # clean, then per group (d3, d1, wrong_kbar): groups "1–2" and "2" resume at layers 1 and 2
    assert seen == [None] + [None] * 3 + [1] * 3 + [2] * 3 + [None] * 3
    seen.clear()
    monkeypatch.setattr(sufficiency, "PREFIX_BYTES", 0)  # no room for the residuals: every pass from the first block
    full = _rows(model, win, ref, cfg)
    assert seen == [None] * 13
    pd.testing.assert_frame_equal(got.drop(columns=["nll", "dnll"]), full.drop(columns=["nll", "dnll"]))
    np.testing.assert_allclose(got["nll"], full["nll"], rtol=0, atol=0)
    # a substituted group moves the NLL (the comparison above compares passes that differ from the clean one)
    moved = (full["dnll"].abs() > 1e-4).groupby(full["group"]).any()
    assert moved[["1–2", "2"]].all()


def test_a_run_continued_from_its_clean_rows_records_the_residuals_again(setting, monkeypatch, tmp_path):
    model, win, ref, cfg = setting
    want = _rows(model, win, ref, cfg)
    seen = _passes(model, monkeypatch)
    orig = sufficiency.sufficiency_hooks_for

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sufficiency, "sufficiency_hooks_for", stop)  # interrupted after the clean rows were kept
    with pytest.raises(KeyboardInterrupt):
        _rows(model, win, ref, cfg, checkpoint=tmp_path / "ck")
    monkeypatch.setattr(sufficiency, "sufficiency_hooks_for", orig)
    seen.clear()
    got = _rows(model, win, ref, cfg, checkpoint=tmp_path / "ck")
    # the clean rows come from the checkpoint; group "0" from the first block; then one recording pass, then resumed
    assert seen == [None] * 3 + [None] + [1] * 3 + [2] * 3 + [None] * 3
    np.testing.assert_allclose(got["nll"], want["nll"], rtol=0, atol=0)


def test_no_resumption_where_the_clean_pass_runs_in_chunks_or_memory_is_short(setting, monkeypatch):
    model, win, _, _ = setting
    groups = list(GROUPS.values())
    assert sufficiency.resume_layers(model, win.tokens, groups) == [1, 2]
    assert sufficiency.resume_layers(model, win.tokens, [[0], [0, 1]]) == []
    monkeypatch.setattr(sufficiency, "free_bytes", lambda device: 4 * 5 * 24 * model.cfg.d_model * 2 * 4 - 1)
    assert sufficiency.resume_layers(model, win.tokens, groups) == []  # two layers' residuals > a quarter of it
    monkeypatch.setattr(sufficiency, "free_bytes", lambda device: None)
    monkeypatch.setattr(sufficiency, "forward_chunk", lambda model, n: 8)
    assert sufficiency.resume_layers(model, win.tokens, groups) == []


def test_the_budget_counts_the_model_dtype(setting, monkeypatch):
    model, win, _, _ = setting
    monkeypatch.setattr(sufficiency, "free_bytes", lambda device: None)
    per_layer = 5 * 24 * model.cfg.d_model * 4  # float32 residuals of the five windows at one layer
    monkeypatch.setattr(sufficiency, "PREFIX_BYTES", 2 * per_layer)
    assert sufficiency.resume_layers(model, win.tokens, list(GROUPS.values())) == [1, 2]
    monkeypatch.setattr(sufficiency, "PREFIX_BYTES", 2 * per_layer - 1)
    assert sufficiency.resume_layers(model, win.tokens, list(GROUPS.values())) == []
    assert dataclasses.is_dataclass(sufficiency.Config)
