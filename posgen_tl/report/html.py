"""A self-contained, one-page HTML report: figures embedded as base64 PNG, tables inline.

Readable offline: no scripts, no external CSS or fonts. The page opens with a summary box of
:class:`Finding` s — one line per question of docs/method.md — before any section; numbers are
printed to 3 significant digits, and tables longer than :data:`FOLD_ROWS` rows are folded in
``<details>``.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd

from posgen_tl.report.text import compact, header, sig3

__all__ = ["Section", "Finding", "skipped_section", "QUESTIONS", "figure_to_png", "render_html", "sig3", "FOLD_ROWS"]

#: the questions of docs/method.md, in the order the summary box lists them (key → what is asked)
QUESTIONS: dict[str, str] = {
    "decomposition": "Logits = positional + semantic, beyond the random twin? (§2)",
    "sufficiency": "Does f + g carry what the model uses? (§5, substitution)",
    "pattern": "Does the feature pattern explain the decomposition across heads? (§3)",
    "tolerance": "Does NLL rise when context tokens are swapped? (§4)",
    "causal": "Does tolerance depend on the pattern? (§5, primary contrast)",
    "taxonomy": "Do positional/symbolic heads line up with D3's positional share? (§6)",
    "length": "Do unseen distances hurt, and does the split help? (§7)",
    "patching": "Which heads carry the damage of perturbed positions? (§9, patching)",
}

#: tables with more rows than this are folded in <details> (their caption stays visible)
FOLD_ROWS = 12
#: docs/method.md §8: runs with fewer sequences are labelled exploratory
MIN_N = 32

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.7em;border-bottom:2px solid #444;padding-bottom:.2em}
h2{font-size:1.3em;margin-top:2em;border-bottom:1px solid #bbb}
.tablewrap{max-width:100%;overflow-x:auto}
table{border-collapse:collapse;font-size:.85em;margin:.8em 0}
td,th{border:1px solid #ccc;padding:.2em .5em;text-align:right}
th{background:#f0f0f0}
figure{margin:1em 0}
figure img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:.85em;color:#555}
.verdict{background:#fff7e0;border-left:4px solid #e0a000;padding:.5em 1em}
.summary{background:#eef4fb;border:2px solid #2a5d9f;border-radius:6px;padding:.6em 1.2em;margin:1em 0 1.5em}
.summary h2{margin:.2em 0 .5em;border:none;font-size:1.25em}
.summary table{font-size:.9em;width:100%}
.summary td,.summary th{text-align:left}
.summary td.num{text-align:right;white-space:nowrap}
.summary td.eff{min-width:14em}.summary td:first-child{width:22%}.pkinds{margin:.2em 0 .6em;padding-left:1.6em}
.v-yes{font-weight:bold;color:#0a5d1e}.v-no{font-weight:bold;color:#7a4b00}.v-none{color:#888}
.expl{color:#a33;font-size:.85em}
details{margin:.6em 0}summary{cursor:pointer;color:#2a5d9f}
.meta{font-size:.85em;color:#555}
code{background:#f4f4f4;padding:0 .2em}
"""


@dataclass
class Finding:
    """The headline of one question, as the summary box prints it.

    Attributes:
        question: a key of :data:`QUESTIONS` (e.g. ``"causal"``).
        verdict: the verdict word (the causal test's, as :func:`posgen_tl.stats.dose.dose_verdict` decides; the
            stage's own word elsewhere).
        effect: the effect's value; ``what``: what it measures (with its unit).
        ci: ``(low, high)`` 95 % interval of the effect; ``p``: its p-value; ``n``: the unit count.
        exploratory: ``n < 32`` (docs/method.md §8) unless given.
        note: one short clause of context (e.g. the reason a verdict is "no evidence").
        p_kind: what the p is — its test and adjustment (e.g. ``"exact sign-flip (all 2^12 sign patterns of 12
            documents)"``, ``"… ; Holm over the 8 p-values of this table"``); pages print it beside the p.
        unit: what ``n`` counts (``"documents"``; ``"heads"`` where heads are the units of a descriptive test).
    """

    question: str
    verdict: str
    effect: float | None = None
    what: str = ""
    ci: tuple[float, float] | None = None
    p: float | None = None
    n: int | None = None
    exploratory: bool | None = None
    note: str = ""
    p_kind: str = ""
    unit: str = "documents"

    def __post_init__(self) -> None:
        if self.question not in QUESTIONS:
            raise ValueError(f"unknown question {self.question!r}; one of {list(QUESTIONS)}")
        if self.exploratory is None:
            self.exploratory = self.n is not None and self.n < MIN_N

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """The plain-text line (markdown and console): ``question: verdict · effect … · p · n``."""
        parts = [f"{self.question}: {self.verdict}"]
        if self.effect is not None:
            ci = f" [{sig3(self.ci[0])}, {sig3(self.ci[1])}]" if self.ci else ""
            parts.append(f"{self.what + ' ' if self.what else ''}{sig3(self.effect)}{ci}")
        if self.p is not None:
            parts.append(f"p = {sig3(self.p)}")
        if self.n is not None:
            parts.append(f"n = {self.n}")
        if self.exploratory:
            parts.append("exploratory")
        return " · ".join(parts)


@dataclass
class Section:
    """One report section: a title, paragraphs (plain text), tables, figures (PNG bytes + caption).

    ``details``: tables always folded in ``<details>`` (e.g. an all-PASS check); ``findings``:
    headlines this section contributes to the summary box; ``results``: the section's numbers as
    JSON-friendly data (``results.json`` of a report, ``<name>.json`` of a study).
    """

    title: str
    paragraphs: list[str] = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    figures: list[tuple[bytes, str]] = field(default_factory=list)
    verdict: str | None = None
    details: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    results: dict = field(default_factory=dict)


#: what a skipped section suggests, by the reason it was skipped (``posgen_tl.experiments.base.or_skip``)
SKIP_HINTS = {
    "corpus": "Give a corpus of several documents (a folder of text files, or the default pydoc topics): the global "
              "k̄ and the reference windows come from documents disjoint from the analysed ones.",
    "model": "This model cannot be analysed this way (the reason names what is missing); the other sections are "
             "unaffected.",
}


def skipped_section(title: str, reason: str, question: str | None = None, hint: str | None = None) -> Section:
    """The section of an experiment that could not run (``reason``), with a hint (default: the corpus
    hint of :data:`SKIP_HINTS`) and — when it answers a summary ``question`` — a "not testable"
    headline naming the reason."""
    hint = SKIP_HINTS["corpus"] if hint is None else hint
    findings = [Finding(question, "not testable", note=str(reason))] if question else []
    return Section(title, verdict=reason, paragraphs=[hint], findings=findings, results={"skipped": reason})


def figure_to_png(fig: Any, dpi: int = 100) -> bytes:
    """PNG bytes of a matplotlib figure (closed afterwards to free memory)."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _table_html(df: pd.DataFrame) -> str:
    """The table with word headers, its constant columns as one line beneath (:func:`~posgen_tl.report.text.compact`),
    inside a box that scrolls sideways rather than widening the page."""
    narrow, notes = compact(df)
    body = narrow.rename(columns=header).to_html(index=False, float_format=sig3, border=0, na_rep="–")
    note = f"<p class='meta'>{html.escape('; '.join(notes))}.</p>" if notes else ""
    return f"<div class='tablewrap'>{body}</div>{note}"


def _table(caption: str, df: pd.DataFrame, fold: bool = False) -> str:
    if fold or len(df) > FOLD_ROWS:
        return (f"<details><summary><b>{html.escape(caption)}</b> ({len(df)} rows — click to show)</summary>"
                f"{_table_html(df)}</details>")
    return f"<p><b>{html.escape(caption)}</b></p>{_table_html(df)}"


def _verdict_class(v: str) -> str:
    v = v.lower()
    if v in ("not run", "") or v.startswith(("not testable", "too few")):
        return "v-none"
    return "v-no" if v.startswith("no evidence") else "v-yes"


def summary_box(findings: list[Finding]) -> str:
    """The box at the top of the page: one row per question; absent questions say "not run".

    Columns a reader scans: question, answer (the verdict, "exploratory" under it), the effect (what it is in
    small print above the number), its 95 % interval, p and n. What each p is (its test and adjustment) is a
    numbered note under the table, shared by the rows whose p is of the same kind."""
    by_q: dict[str, list[Finding]] = {}
    for f in findings:
        by_q.setdefault(f.question, []).append(f)
    rows, kinds = [], []
    for q, asked in QUESTIONS.items():
        for f in by_q.get(q) or [Finding(q, "not run")]:
            ci = f"[{sig3(f.ci[0])}, {sig3(f.ci[1])}]" if f.ci else "–"
            eff = "–"
            if f.effect is not None:
                eff = (f"<span class='meta'>{html.escape(f.what)}</span><br>" if f.what else "") + f"<b>{sig3(f.effect)}</b>"
            if f.note:
                eff += f"<br><span class='meta'>{html.escape(f.note)}</span>"
            expl = "<br><span class='expl'>exploratory</span>" if f.exploratory else ""
            mark = ""
            if f.p_kind and f.p is not None:
                if f.p_kind not in kinds:
                    kinds.append(f.p_kind)
                mark = f"<sup>{kinds.index(f.p_kind) + 1}</sup>"
            rows.append(
                f"<tr><td><b>{html.escape(q)}</b><br><span class='meta'>{html.escape(asked)}</span></td>"
                f"<td class='{_verdict_class(f.verdict)}'>{html.escape(f.verdict)}{expl}</td>"
                f"<td class='eff'>{eff}</td><td class='num'>{ci}</td><td class='num'>{sig3(f.p)}{mark}</td>"
                f"<td class='num'>{'–' if f.n is None else f.n}</td></tr>")
    notes = "".join(f"<li>{html.escape(k)}</li>" for k in kinds)
    return ("<div class='summary' id='summary'><h2>Findings</h2><table><tr><th>question</th><th>answer</th>"
            "<th>effect</th><th>95 % interval</th><th>p</th><th>n</th></tr>" + "".join(rows) + "</table>"
            + (f"<p class='meta'>What each p is:</p><ol class='meta pkinds'>{notes}</ol>" if notes else "")
            + f"<p class='meta'>“exploratory”: fewer than {MIN_N} sequences (docs/method.md §8). “no evidence” is "
            "not evidence of no effect. Details and the random-twin/control comparisons follow below.</p></div>")


def render_html(title: str, meta: dict[str, Any], sections: list[Section], findings: list[Finding] | None = None) -> str:
    """The whole page as a string: title, the findings box, a contents list, then the sections."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    parts.append(summary_box(list(findings or []) or [f for s in sections for f in s.findings]))
    parts.append("<p class='meta'>" + " · ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in meta.items()) + "</p>")
    parts.append("<ul>" + "".join(f"<li><a href='#s{i}'>{html.escape(s.title)}</a></li>" for i, s in enumerate(sections)) + "</ul>")
    for i, s in enumerate(sections):
        parts.append(f"<h2 id='s{i}'>{html.escape(s.title)}</h2>")
        if s.verdict:
            parts.append(f"<div class='verdict'>{html.escape(s.verdict)}</div>")
        for p in s.paragraphs:
            parts.append(f"<p>{html.escape(p)}</p>")
        for cap, df in s.tables:
            parts.append(_table(cap, df))
        for cap, df in s.details:
            parts.append(_table(cap, df, fold=True))
        for png, cap in s.figures:
            b64 = base64.b64encode(png).decode("ascii")
            parts.append(f"<figure><img alt='{html.escape(cap)}' src='data:image/png;base64,{b64}'/>"
                         f"<figcaption>{html.escape(cap)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)
