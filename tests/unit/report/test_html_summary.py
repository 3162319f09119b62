"""The report's findings box (posgen_tl.report.html.summary_box): what a person scans in it."""

from __future__ import annotations

import re

from posgen_tl.report.html import Finding, summary_box


def test_each_p_points_to_one_note_of_its_kind_and_the_effect_says_what_it_is():
    fs = [Finding("decomposition", "trained beyond twin", 0.495, "D3 within-row r, trained − twin", (0.45, 0.53), 0.0005,
                  12, p_kind="exact sign-flip (all 2^12 sign patterns of 12 documents)"),
          Finding("tolerance", "NLL rises with swaps", 0.0288, "T1 AUC", (0.01, 0.05), 0.001, 12,
                  p_kind="exact sign-flip (all 2^12 sign patterns of 12 documents)"),
          Finding("taxonomy", "shares differ", 0.65, "median share", None, 4e-5, 149, p_kind="Mann–Whitney U")]
    box = summary_box(fs)
    notes = re.findall(r"<li>(.*?)</li>", box.split("What each p is")[1])
    assert notes == ["exact sign-flip (all 2^12 sign patterns of 12 documents)", "Mann–Whitney U"]
    assert "0.0005<sup>1</sup>" in box and "0.001<sup>1</sup>" in box and "4e-05<sup>2</sup>" in box
    row = re.search(r"<tr><td><b>decomposition</b>.*?</tr>", box).group(0)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert "exploratory" in cells[1] and "sign-flip" not in cells[1]  # the answer cell holds the answer only
    assert cells[2].index("D3 within-row r") < cells[2].index("<b>0.495</b>")  # what it is, above the number
    assert [h for h in re.findall(r"<th>(.*?)</th>", box)] == ["question", "answer", "effect", "95 % interval", "p", "n"]
    assert "<b>length</b>" in box and "not run" in box  # a question without a finding says so
