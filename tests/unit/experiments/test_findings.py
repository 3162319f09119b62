"""Summary-box headlines of the length and sufficiency experiments, from constructed tables (no model)."""

from __future__ import annotations

import pandas as pd
import pytest

from posgen_tl.experiments import length, sufficiency


def _gap(value, lo, hi, p_holm, dis_value=-0.5):
    rows = [dict(condition="vanilla", gap=g, gap_frac=g / 100, estimator="d_vs_gap0", estimate=v, ci_low=l, ci_high=h,
                 p=p_holm / 4, p_holm=p_holm, n_seq=40, n_docs=40)
            for g, v, l, h in ((100, 0.01, -0.1, 0.1), (200, value, lo, hi))]  # noqa: E741
    rows.append(dict(condition="disentangled", gap=200, gap_frac=2.0, estimator="d_vs_vanilla", estimate=dis_value,
                     ci_low=dis_value - 0.1, ci_high=dis_value + 0.1, p=0.001, p_holm=0.004, n_seq=40, n_docs=40))
    return pd.DataFrame(rows)


def test_length_headline_is_the_largest_gap_and_names_the_disentangled_change():
    (f,) = length._findings(_gap(4.1, 3.5, 4.7, 0.001))
    assert f.question == "length" and f.verdict == "degrades" and f.effect == pytest.approx(4.1)
    assert f.ci == (3.5, 4.7) and f.p == pytest.approx(0.001) and f.n == 40 and not f.exploratory
    assert "G = 2·n_ctx" in f.note and "disentangled − vanilla there -0.5" in f.note
    (g,) = length._findings(_gap(0.2, -0.1, 0.5, 0.3))  # not significant: no verdict word
    assert g.verdict == "no evidence"
    (h,) = length._findings(_gap(-0.4, -0.6, -0.2, 0.01))
    assert h.verdict == "improves"


def test_length_headline_without_a_gap_says_so():
    summ = _gap(4.1, 3.5, 4.7, 0.001)
    (f,) = length._findings(summ[summ["estimator"] != "d_vs_gap0"])
    assert f.verdict == "not testable" and "no gap beyond 0" in f.note


def _suff(value, p_holm, n=12):
    rows = [dict(source=s, group=g, estimator="dnll", estimate=v, ci_low=v - 0.05, ci_high=v + 0.05, p=p_holm, p_holm=p_holm,
                 n_seq=n, n_docs=n)
            for s, g, v in (("d3", "0–9", 0.9), ("d3", "all", value), ("d1", "all", 2.5))]
    return pd.DataFrame(rows)


def test_sufficiency_headline_is_the_all_layers_d3_substitution_beside_its_d1_control():
    (f,) = sufficiency._findings(_suff(0.46, 0.001))
    assert f.question == "sufficiency" and f.verdict == "costs NLL" and f.effect == pytest.approx(0.46)
    assert f.n == 12 and f.exploratory and "D1 control ΔNLL 2.5" in f.note
    (g,) = sufficiency._findings(_suff(0.01, 0.4))
    assert g.verdict == "no evidence of a cost"  # never "sufficient": that needs an equivalence margin


def test_sufficiency_headline_without_the_all_group_is_not_testable_not_a_number():
    df = _suff(0.46, 0.001)
    (f,) = sufficiency._findings(df[df["group"] != "all"])
    assert f.verdict == "not testable" and f.effect is None and "all layers" in f.note


def test_every_question_of_the_summary_comes_from_an_experiment():
    """Each question of the summary box is answered by the experiment of the same name."""
    from posgen_tl.experiments import registry
    from posgen_tl.report.html import QUESTIONS

    assert set(QUESTIONS) <= set(registry.REPORT)


def test_sufficiency_with_identically_zero_dnll_has_no_p_and_still_renders_its_headline():
    """Every ΔNLL exactly 0 (a substitution that changes nothing the NLL can see: a tiny model on the H200 did
    this): no p-value anywhere, yet the summary keeps its ``p_holm`` / ``holm_scope`` columns (NaN, saying why)
    and the headline reads "no evidence of a cost" — before, the missing column crashed the report."""
    import numpy as np

    rows = pd.DataFrame([dict(source=s, group=g, layers="0–1", seq=i, doc=i, clean_nll=7.65, nll=7.65, dnll=0.0)
                         for s in ("d3", "d1") for g in ("0", "all") for i in range(4)])
    summ = sufficiency.sufficiency_summary(rows)
    assert summ["p"].isna().all() and summ["p_holm"].isna().all()
    assert set(summ["holm_scope"]) == {"none: no p-value in this table"}
    (f,) = sufficiency._findings(summ)
    assert f.verdict == "no evidence of a cost" and f.effect == 0.0 and np.isnan(f.p)
    assert "identically zero" in f.p_kind
