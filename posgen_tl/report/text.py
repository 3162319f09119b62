"""Numbers and tables as text — the one formatter every report section, study page and docs page uses."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

__all__ = ["sig3", "fmt", "md_table", "section_markdown", "HEADERS", "header", "compact", "p_label", "table_lines"]


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


#: column names of the package's tables as a reader's words (a table shown to a person never heads a column with a
#: code identifier; the CSVs keep the identifiers). Names not listed lose their underscores (:func:`header`).
HEADERS: dict[str, str] = {
    "estimate": "effect", "ci_low": "95 % low", "ci_high": "95 % high", "ci_level": "interval level",
    "ci_method": "interval method", "t_low": "t-interval low", "t_high": "t-interval high", "p_kind": "p is",
    "p_holm": "p (Holm)", "holm_scope": "Holm over", "p_iut": "p (intersection–union)", "p_family": "p (over the claim)",
    "p_test": "p tested", "p_claim": "p (over the claim)", "p_claim_method": "claim adjustment", "n_docs": "documents",
    "n_seqs": "sequences", "n_seq": "sequences", "n_heads": "heads", "n_layers": "layers", "mde": "MDE",
    "mde_n": "MDE at n", "frac": "swap fraction p", "twin": "model", "r_within": "within-row r", "k_mean": "k̄",
    "excluded_controls": "controls left out", "doc_name": "document", "run_verdict": "run's verdict",
    "iut_rejects": "test rejects", "wall_s": "seconds", "sink_excluded": "sink left out", "gap_frac": "gap (× context)",
    "n_a": "heads (a)", "n_b": "heads (b)", "class_a": "class a", "class_b": "class b", "median_a": "median (a)",
    "median_b": "median (b)", "binding": "deciding contrast", "reason": "why",
}


def p_label(row: Any) -> str:
    """What a table row's quoted p is: its ``p_kind``, and ``holm_scope`` where the Holm-adjusted ``p_holm`` is the
    one quoted (rows without ``p_holm`` quote the raw p)."""
    kind = str(row.get("p_kind") or "").strip()
    kind = "" if kind == "nan" else kind
    holm, scope = row.get("p_holm"), str(row.get("holm_scope") or "")
    if holm is not None and holm == holm and scope and scope != "nan":
        return f"{kind}; Holm-adjusted ({scope})" if kind else f"Holm-adjusted ({scope})"
    return kind


def header(col: Any) -> str:
    """``col`` as a table header a person reads: :data:`HEADERS`' word for it, else the name with spaces for
    underscores (``"max_abs_err"`` → ``"max abs err"``)."""
    c = str(col)
    return HEADERS.get(c, c.replace("_", " "))


def compact(df: pd.DataFrame, keep: Sequence[str] = ()) -> tuple[pd.DataFrame, list[str]]:
    """``df`` without the columns whose value is the same in every row (a method string, an interval level, a
    document count), and those values as notes ``"header: value"`` to print under the table. Tables of fewer than
    two rows, the first column and the columns in ``keep`` are left whole.

    Returns:
        ``(narrower frame, notes)``.
    """
    if len(df) < 2:
        return df, []
    drop, notes = [], []
    for i, c in enumerate(df.columns):
        if i == 0 or c in keep:
            continue
        vals = df[c].tolist()
        text = [sig3(v) for v in vals]
        if len(set(text)) == 1 and text[0] != "–":
            drop.append(c)
            notes.append(f"{header(c)}: {text[0]}")
    return df.drop(columns=drop), notes


def md_table(df: pd.DataFrame, cols: Sequence[str] | None = None, cell=sig3, words: bool = True) -> str:
    """A GitHub-markdown table of ``df`` (``cols`` only, where given), each cell through ``cell``; headers in
    words (:func:`header`) unless ``words`` is False."""
    d = df if cols is None else df[[c for c in cols if c in df.columns]]
    heads = [header(c) if words else str(c) for c in d.columns]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---" for _ in d.columns) + "|"]
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
        out += [f"**{cap}**" if fold_details else f"{sub} {cap}", "", *table_lines(df)]
    if fold_details:
        for cap, df in sec.details:
            out += ["<details markdown=\"1\"><summary>" + cap + "</summary>", "", *table_lines(df), "</details>", ""]
    return out


def table_lines(df: pd.DataFrame) -> list[str]:
    """A table with word headers, its constant columns printed once beneath it (:func:`compact`)."""
    narrow, notes = compact(df)
    return [md_table(narrow), "", *([f"<small>{'; '.join(notes)}.</small>", ""] if notes else [])]
