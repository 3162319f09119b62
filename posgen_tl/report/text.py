"""Numbers and tables as text — the one formatter every report section, study page and docs page uses."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

__all__ = ["sig3", "fmt", "md_table", "section_markdown"]


def sig3(x: Any) -> str:
    """A number to 3 significant digits (``–`` for None, NaN and empty text; ints, bools and text unchanged)."""
    if x is None or (isinstance(x, str) and not x.strip()):
        return "–"
    if isinstance(x, (bool, int)):
        return str(x)
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    return "–" if math.isnan(v) else f"{v:.3g}"


def fmt(x: Any, digits: int = 3) -> str:
    """A number with ``digits`` decimals (``nan`` for None/NaN); tiny non-zero values in ``g`` form
    so that they do not print as ``0.000``."""
    if x is None:
        return "nan"
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(v):
        return "nan"
    if v != 0 and abs(v) < 10 ** (-digits):
        return f"{v:.{digits}g}"
    return f"{v:.{digits}f}"


def md_table(df: pd.DataFrame, cols: Sequence[str] | None = None, cell=sig3) -> str:
    """A GitHub-markdown table of ``df`` (``cols`` only, where given), each cell through ``cell``."""
    d = df if cols is None else df[[c for c in cols if c in df.columns]]
    lines = ["| " + " | ".join(map(str, d.columns)) + " |", "|" + "|".join("---" for _ in d.columns) + "|"]
    for row in d.itertuples(index=False):
        lines.append("| " + " | ".join(cell(v) for v in row) + " |")
    return "\n".join(lines)


def section_markdown(sec: Any, *, level: int, fold_details: bool) -> list[str]:
    """The markdown lines of a report ``Section`` (findings, title, verdict, paragraphs, tables):
    its title and the findings' heading at heading ``level`` (``#`` × level), captions as headings one
    level below, or in bold where ``fold_details`` (then ``details`` tables fold in ``<details>``;
    otherwise they follow the tables). Figures are the caller's (their file names differ)."""
    h, sub = "#" * level, "#" * (level + 1)
    out: list[str] = []
    if sec.findings:
        head = "**Findings**" if fold_details else f"{h} Findings"
        out += [head, ""] + [f"- {f.line()}" + (f" — {f.note}" if f.note else "") for f in sec.findings] + [""]
    out += [f"{h if not fold_details else sub} {sec.title}", ""]
    if sec.verdict:
        out += [f"> {sec.verdict}", ""]
    out += [p + "\n" for p in sec.paragraphs]
    tables = sec.tables if fold_details else [*sec.tables, *sec.details]
    for cap, df in tables:
        out += [f"**{cap}**" if fold_details else f"{sub} {cap}", "", md_table(df), ""]
    if fold_details:
        for cap, df in sec.details:
            out += ["<details markdown=\"1\"><summary>" + cap + "</summary>", "", md_table(df), "", "</details>", ""]
    return out
