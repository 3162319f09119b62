"""Summary-box headlines of the length and sufficiency stages, from constructed tables (no model)."""

from __future__ import annotations

import pandas as pd
import pytest

from posgen_tl.report.findings import DERIVE, length_findings, sufficiency_findings


class _Work:
    def __init__(self, frames: dict, jsons: dict):
        self.frames, self.jsons = frames, jsons

    def load_df(self, name):
        if name not in self.frames:
            raise FileNotFoundError(name)
        return self.frames[name]

    def load_json(self, name):
        if name not in self.jsons:
            raise FileNotFoundError(name)
        return self.jsons[name]


class _Ctx:
    def __init__(self, frames=None, jsons=None, n_seq=40):
        self.work = _Work(frames or {}, jsons or {})
        self.cfg = type("Cfg", (), {"n_seq": n_seq})()


def _gap(value, lo, hi, p_holm, dis_value=-0.5):
    rows = [dict(condition="vanilla", gap=g, gap_frac=g / 100, estimator="d_vs_gap0", value=v, ci_low=l, ci_high=h,
                 p=p_holm / 4, p_holm=p_holm, n_seq=40, n_docs=40)
            for g, v, l, h in ((100, 0.01, -0.1, 0.1), (200, value, lo, hi))]
    rows.append(dict(condition="disentangled", gap=200, gap_frac=2.0, estimator="d_vs_vanilla", value=dis_value,
                     ci_low=dis_value - 0.1, ci_high=dis_value + 0.1, p=0.001, p_holm=0.004, n_seq=40, n_docs=40))
    return _Ctx({"length_gap_summary.csv": pd.DataFrame(rows)}, {"length_gap_meta.json": {"cap": 10}})


def test_length_headline_is_the_largest_gap_and_names_the_disentangled_change():
    (f,) = length_findings(_gap(4.1, 3.5, 4.7, 0.001))
    assert f.question == "length" and f.verdict == "degrades" and f.effect == pytest.approx(4.1)
    assert f.ci == (3.5, 4.7) and f.p == pytest.approx(0.001) and f.n == 40 and not f.exploratory
    assert "G = 2·n_ctx" in f.note and "disentangled − vanilla there -0.5" in f.note
    (g,) = length_findings(_gap(0.2, -0.1, 0.5, 0.3))  # not significant: no verdict word
    assert g.verdict == "no evidence"
    (h,) = length_findings(_gap(-0.4, -0.6, -0.2, 0.01))
    assert h.verdict == "improves"


def test_length_headline_for_a_skipped_stage_says_why():
    (f,) = length_findings(_Ctx({}, {"length_gap_meta.json": {"skipped": "one document"}}))
    assert f.verdict == "not testable" and "one document" in f.note


def _suff(value, p_holm, n=12):
    rows = [dict(source=s, group=g, estimator="dnll", value=v, ci_low=v - 0.05, ci_high=v + 0.05, p=p_holm, p_holm=p_holm,
                 n_seq=n, n_docs=n)
            for s, g, v in (("d3", "0–9", 0.9), ("d3", "all", value), ("d1", "all", 2.5))]
    return _Ctx({"sufficiency_summary.csv": pd.DataFrame(rows)}, {"sufficiency_meta.json": {"gamma": 0.9}}, n_seq=n)


def test_sufficiency_headline_is_the_all_layers_d3_substitution_beside_its_d1_control():
    (f,) = sufficiency_findings(_suff(0.46, 0.001))
    assert f.question == "sufficiency" and f.verdict == "costs NLL" and f.effect == pytest.approx(0.46)
    assert f.n == 12 and f.exploratory and "D1 control ΔNLL 2.5" in f.note
    (g,) = sufficiency_findings(_suff(0.01, 0.4))
    assert g.verdict == "no evidence of a cost"  # never "sufficient": that needs an equivalence margin


def test_sufficiency_headline_without_the_all_group_is_an_error_not_a_number():
    ctx = _suff(0.46, 0.001)
    df = ctx.work.frames["sufficiency_summary.csv"]
    ctx.work.frames["sufficiency_summary.csv"] = df[df["group"] != "all"]
    with pytest.raises(ValueError, match="group"):
        sufficiency_findings(ctx)


def test_every_question_of_the_summary_has_a_headline_function():
    from posgen_tl.report.html import QUESTIONS
    from posgen_tl.report.stages import STAGES

    covered = set(DERIVE) | {"causal"}  # causal comes with the tolerance stage
    assert {name for name, _, _ in STAGES} - {"exactness"} <= covered
    assert set(QUESTIONS) <= covered
