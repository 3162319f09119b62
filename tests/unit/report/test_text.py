"""Tables as a person reads them: word headers, constant columns printed once, p labels."""

from __future__ import annotations

import numpy as np
import pandas as pd

from posgen_tl.report.text import compact, header, md_table, p_label


def test_headers_are_words():
    assert header("ci_low") == "95 % low" and header("p_holm") == "p (Holm)" and header("n_docs") == "documents"
    assert header("max_abs_err") == "max abs err" and header("layer") == "layer"
    md = md_table(pd.DataFrame({"ci_low": [1.0], "some_thing": [2]}))
    assert md.splitlines()[0] == "| 95 % low | some thing |"
    assert md_table(pd.DataFrame({"ci_low": [1.0]}), words=False).splitlines()[0] == "| ci_low |"


def test_compact_moves_constant_columns_under_the_table():
    df = pd.DataFrame({"layer": [0, 1, 2], "estimate": [0.1, 0.2, 0.3], "ci_level": [0.95] * 3,
                       "p_kind": ["exact sign-flip"] * 3, "missing": [np.nan] * 3})
    narrow, notes = compact(df)
    assert list(narrow.columns) == ["layer", "estimate", "missing"]  # all-missing stays: it says '–' in each row
    assert notes == ["interval level: 0.95", "p is: exact sign-flip"]
    one = df.iloc[:1]
    assert compact(one) == (one, [])  # a single row keeps every column
    assert list(compact(df, keep=["ci_level"])[0].columns) == ["layer", "estimate", "ci_level", "missing"]


def test_p_label_names_the_kind_and_the_holm_scope_only_when_the_holm_p_is_quoted():
    row = pd.Series({"p_kind": "exact sign-flip", "p_holm": 0.004, "holm_scope": "Holm over the 8 p-values"})
    assert p_label(row) == "exact sign-flip; Holm-adjusted (Holm over the 8 p-values)"
    row["p_holm"] = np.nan
    assert p_label(row) == "exact sign-flip"
