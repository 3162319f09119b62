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
