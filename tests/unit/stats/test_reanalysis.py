"""The committed causal rows through the docs/method.md §8 v2 rule (:func:`posgen_tl.stats.verdicts.reanalyse_committed`).

One family of four entries: SmolLM2 layers 10–19 and 20–29 (64 sequences, 39 documents) and Gemma3
layers 6–11 and 12–17 (32 sequences, 32 documents). Those runs predate the v2 config: their random
controls were ONE draw each and their family, order and damage margin are stated after the data —
the labels must say so.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from posgen_tl.stats.verdicts import reanalyse_committed

RESULTS = Path(__file__).resolve().parents[3] / "results" / "v1"
RUNS = [
    ("causal_n64/causal_smollm2_L10-19_n64_rows.csv", "causal_n64/causal_smollm2_L10-19_n64_config.json"),
    ("causal_n64/causal_smollm2_L20-29_n64_rows.csv", "causal_n64/causal_smollm2_L20-29_n64_config.json"),
    ("causal_gemma3_n32/gemma3_L6-11_n32/causal_rows.csv", "causal_gemma3_n32/gemma3_L6-11_n32/causal_config.json"),
    ("causal_gemma3_n32/gemma3_L12-17_n32/causal_rows.csv", "causal_gemma3_n32/gemma3_L12-17_n32/causal_config.json"),
]


@pytest.fixture(scope="module")
def out():
    paths = [(RESULTS / r, RESULTS / c) for r, c in RUNS]
    if not all(p.exists() for pair in paths for p in pair):
        pytest.skip("committed causal results not present")
    return reanalyse_committed(paths)


def test_layers_10_19_small_p_effect_is_in_the_per_fraction_table(out):
    """destroy − none at 2 / 5 / 10 % is positive and significant after Holm over the fractions
    (document means: +0.016 / +0.031 / +0.030 nats; the pooled-sequence means the issue quotes are
    +0.016 / +0.029 / +0.027), not at 20 %; the AUC sees it; the slope (secondary) hides it."""
    t = out["per_fraction"]
    t = t[(t["model"] == "smollm2-135m") & (t["layers"] == "L10-19") & (t["contrast"] == "destroy − none")]
    t = t.set_index(["estimator", "frac"])
    for f, want in ((0.02, 0.0158), (0.05, 0.0310), (0.10, 0.0301)):
        r = t.loc[("dnll", f)]
        assert r["estimate"] == pytest.approx(want, abs=5e-4)
        assert r["p_holm"] < 0.01 and r["ci_low"] > 0 and r["t_low"] > 0, f
        assert r["p_kind"] == "exact sign-flip (all 2^39 sign patterns of 39 documents)" and r["n_docs"] == 39
    assert t.loc[("dnll", 0.2), "p_holm"] > 0.5
    auc = t.loc[("auc", np.nan)]
    assert auc["estimate"] > 0 and auc["p"] < 0.01 and auc["ci_low"] > 0 and auc["units"] == "nats × p"
    slope = t.loc[("slope", np.nan)]
    assert slope["p"] > 0.5 and slope["ci_low"] < 0 < slope["ci_high"] and slope["label"].startswith("secondary")


def test_no_depends_rests_on_a_control_that_moves_tolerance_by_itself(out):
    comp, v = out["components"], out["verdicts"].set_index(["model", "layers"])
    for (model, layers), r in v.iterrows():
        c = comp[(comp["model"] == model) & (comp["layers"] == layers) & (comp["control"] != "")]
        opposite = c["moves_by_itself"].astype(bool) & (np.sign(c["self_estimate"]) != np.sign(r["estimate"]))
        assert (c.loc[opposite, "role"].str.startswith("not counted")).all()
        assert set(c.loc[opposite, "control"]).isdisjoint(str(r["counted_controls"]).split(","))
    l10 = v.loc[("smollm2-135m", "L10-19")]
    assert l10["excluded_controls"] == "C1,C3,C4" and l10["verdict"] == "no evidence"
    assert "C3 moves tolerance by itself" in l10["label"]
    # the Gemma3 12–17 "depends" of the old table does not survive the family
    g = v.loc[("gemma3-270m", "L12-17")]
    assert g["p"] < 0.05 <= g["p_holm"] and g["verdict"] == "no evidence"


def test_labels_say_what_the_legacy_runs_were(out):
    v = out["verdicts"]
    assert v["label"].str.contains("ONE draw each").all() and v["label"].str.contains("LEGACY").all()
    assert v["label"].str.contains("in sample").all()
    assert not out["family"].controls_redrawn_per_document and out["family"].damage_margin_rel == 0.10
    assert np.allclose(out["damage"]["ci_level"], 0.9)
    assert out["damage"]["p_kind"].str.startswith("TOST").all()
    assert out["per_fraction"]["p_kind"].str.startswith("exact sign-flip").all()  # ≤ 40 documents everywhere
    assert (v["p_adj_method"] == "Holm over the 4 entries of the declared family").all()


def test_verdict_and_table_agree(out):
    """The verdict's destroy − none AUC is the per-fraction table's row (one path, one number)."""
    t = out["per_fraction"]
    for r in out["verdicts"].itertuples():
        row = t[(t["model"] == r.model) & (t["layers"] == r.layers) & (t["contrast"] == "destroy − none")
                & (t["estimator"] == "auc")].iloc[0]  # fmt: skip
        for k in ("estimate", "ci_low", "ci_high", "t_low", "t_high"):
            assert getattr(r, k) == pytest.approx(row[k], rel=1e-12), k


def test_middle_vs_late_layers_is_one_paired_test(out):
    i = out["interactions"]
    s = i[i["first"] == "smollm2-135m L10-19"].set_index(["estimator", "frac"])
    assert s.loc[("auc", np.nan), "p"] > 0.05  # the AUC difference between the layer groups: not significant
    assert s.loc[("dnll", 0.05), "p_holm"] < 0.05 and s.loc[("dnll", 0.05), "estimate"] > 0
