"""Documentation pages regenerated from study output folders — never edited by hand.

    python -m posgen_tl.report.pages --results results --docs docs          # write the pages (and README headlines)
    python -m posgen_tl.report.pages --results results --docs docs --check  # fail if a page is stale

A study folder is what ``posgen-tl study NAME --out DIR`` writes (tables, figures, ``NAME.json``);
the folders live at ``<results>/<model>/<corpus>/<study>/``. For each experiment, its page
``<docs>/results/<study>.md`` is rebuilt by the experiment's OWN ``render`` from the folder's tables
(so a page cannot say what its tables do not), with the command, commit, preset, options, sizes and
wall time of every run it cites; figures are written to ``<docs>/results/img/`` (versioned with the
pages). Each page opens with its question, the answer in one sentence, a figure of every run's effect
and a small table with word headers; the details are folded. ``<docs>/results/index.md`` gives every
study's answer; the causal claim's tables and sentences are :mod:`posgen_tl.report.claim`'s.
``<results>/MANIFEST.txt`` lists every file a page cites; nothing else belongs in the results folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from posgen_tl.experiments import registry
from posgen_tl.report.claim import (
    CLAIM_STUDY,
    claim_agreement,
    claim_discussion,
    claim_method,
    claim_section,
    claim_table,
    headline_rows,
    primary_answer,
    primary_claim,
)
from posgen_tl.report.corpora import CORPORA, corpus_lines
from posgen_tl.report.html import QUESTIONS, Finding, Section
from posgen_tl.report.runs import Run
from posgen_tl.report.text import md_table, sig3, table_lines

__all__ = ["Run", "find_runs", "study_page", "run_section", "top_block", "answer_sentence", "answer_table", "agreement",
           "index_page", "readme_headlines", "fill_block", "pages", "write_pages",
           "main"]

#: the studies whose first finding per model makes a README headline, in this order (at most five lines)
HEADLINE_ORDER = ("causal", "tolerance", "decomposition", "pattern", "sufficiency", "length", "taxonomy")
#: rows of the first causal runs (before the study layout; withdrawn verdicts), kept because the results index
#: cites them
EARLIER = "v1"



def find_runs(results: Path) -> list[Run]:
    """Every study folder under ``results`` (``<model>/<corpus>/<study>/<study>.json``), report order."""
    runs = []
    for meta_path in sorted(Path(results).glob("*/*/*/*.json")):
        folder = meta_path.parent
        if meta_path.stem != folder.name or folder.name not in registry.ORDER:
            continue
        meta = json.loads(meta_path.read_text())
        runs.append(Run(folder.name, folder.parent.parent.name, folder.parent.name, folder, meta))
    order = {n: i for i, n in enumerate(registry.ORDER)}
    return sorted(runs, key=lambda r: (order[r.study], r.model, r.corpus))


#: renders by (folder, the state of its files): a page build renders each run once, and a changed
#: file (as in the staleness tests) renders it again
_RENDERED: dict[tuple, Section] = {}


def _run_key(run: Run) -> tuple:
    """What a run's render depends on: its folder, study, model and every file's name, mtime and size."""
    state = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(run.folder.iterdir()) if p.is_file())
    return (str(run.folder.resolve()), run.study, run.model, state)


def _section(run: Run) -> Section:
    """The experiment's own render of the run's folder (cached while its files are unchanged)."""
    key = _run_key(run)
    if key not in _RENDERED:
        if len(_RENDERED) > 256:
            _RENDERED.clear()
        _RENDERED[key] = registry.experiment(run.study).render(registry.load(run.study, run.folder))
    return _RENDERED[key]


def _provenance(run: Run, depth: int = 2) -> list[str]:
    m = run.meta
    opts = ", ".join(f"{k}={v}" for k, v in m["config"].items())
    return [f"- command: `{m['command']}`",
            f"- code: commit `{str(m['git_commit'])[:12]}`{' (uncommitted changes)' if 'uncommitted' in str(m['git_commit']) else ''}"
            f", preset `{m.get('preset', 'default')}`, wall time {m['wall_seconds'] / 60:.1f} min",
            f"- corpus: {CORPORA.get(run.corpus, run.corpus)}",
            f"- options: {opts}",
            f"- outputs: `{_rel(run.folder, run.folder.parents[depth])}/` ({len(m['files'])} files)"]


def _rel(path: Path, results: Path) -> str:
    """``path`` as the pages and the manifest name it: from the results folder's name on (never a
    machine path)."""
    root = Path(results).resolve()
    return (Path(root.name) / Path(path).resolve().relative_to(root)).as_posix()


def _figure_name(run: Run, i: int) -> str:
    return f"{run.model}__{run.corpus}__{run.study}__{i}.png"


#: the folder of withdrawn runs, per study: ``<results>/<folder>/<model>/<corpus>/<study>/``, with the one
#: sentence that says why they were withdrawn. Their study's page lists them (what was run, the verdict word
#: printed then) and prints none of their numbers; they give no headline.
WITHDRAWN = {
    "causal": ("v2", "These verdicts (causal test version 2) are withdrawn: no control was damage-matched on the "
                     "analysed documents (0 of 32 control × entry pairs passed the damage-equivalence test) and the "
                     "regression that 'adjusted' for damage was coupled to the outcome, so simulated damage-only "
                     "nulls said 'depends' in 87–100 % of data sets with under-dosed controls. The dose–response "
                     "test at common damage above replaces them."),
}


def withdrawn_runs(results: Path, study: str) -> list[Run]:
    """The withdrawn runs of ``study`` under ``<results>/<WITHDRAWN folder>/`` (none when it has none)."""
    if study not in WITHDRAWN:
        return []
    base = Path(results) / WITHDRAWN[study][0]
    out = []
    for meta_path in sorted(base.glob(f"*/*/{study}/{study}.json")):
        folder = meta_path.parent
        out.append(Run(study, folder.parent.parent.name, folder.parent.name, folder, json.loads(meta_path.read_text())))
    return out


def withdrawn_section(study: str, runs: list[Run]) -> list[str]:
    """The withdrawn runs of ``study``: why, then per run its provenance and the verdict words it printed
    (``<study>_verdicts.csv``: layers and verdict only — no effect, interval or p)."""
    if not runs:
        return []
    folder, why = WITHDRAWN[study]
    out = [f"## Earlier runs ({folder}, withdrawn)", "", why, "",
           f'<details markdown="1"><summary>The {len(runs)} withdrawn runs: how each was made and the verdicts it '
           "printed</summary>", ""]
    for run in runs:
        out += [f"**{run.key} ({folder})**", "", *_provenance(run, depth=3), ""]
        vpath = run.folder / f"{study}_verdicts.csv"
        if vpath.exists():
            v = pd.read_csv(vpath).rename(columns={"verdict": "verdict printed then (withdrawn)"})
            out += [md_table(v, ["layers", "verdict printed then (withdrawn)", "n_docs"]), ""]
    return [*out, "</details>", ""]


def study_page(study: str, runs: list[Run], earlier: list[Run] | None = None) -> tuple[str, dict[str, bytes]]:
    """The markdown of ``docs/results/<study>.md`` and the figures it shows (``{file name: png}``).

    The page opens with its question, the answer in one sentence (derived from the verdicts, :func:`answer_sentence`),
    the effects of every run in one figure (:func:`~posgen_tl.plot.forest.plot_forest`) and a small table with word
    headers (:func:`answer_table`; for the causal study the declared claim's table); how it was computed is folded
    below. Then one section per run: its verdict and figures, its provenance and every table folded (word headers,
    constant columns printed once beneath); then the withdrawn ``earlier`` runs (:func:`withdrawn_section`)."""
    figs: dict[str, bytes] = {}
    out = [f"# {TITLES.get(study, study)}", "", *top_block(study, runs, figs, link_prefix="")]
    out += ["<details markdown=\"1\"><summary>How this was computed</summary>", "",
            f"{registry.experiment(study).ABOUT[:1].upper()}{registry.experiment(study).ABOUT[1:]}. Each run below "
            "gives its command, code version, options and method; the full tables are CSV files in the run's folder "
            "under `results/`. This page is regenerated by `python -m posgen_tl.report.pages` from those folders and "
            "never edited by hand.", "", *(claim_method(runs) if study == CLAIM_STUDY else []), "</details>", ""]
    for run in runs:
        out += run_section(run, figs)
    if not runs and study == CLAIM_STUDY:
        out += ["No run of the dose–response test has been published yet: its re-runs are under way.", ""]
    out += withdrawn_section(study, earlier or [])
    return "\n".join(out).rstrip() + "\n", figs


def run_section(run: Run, figs: dict[str, bytes]) -> list[str]:
    """One run on its study's page: its verdict, its figures (added to ``figs``), then folded: how the run was made
    (command, commit, options, method paragraphs) and each table."""
    sec = _section(run)
    out = [f"## {run.model} · {run.corpus}", ""]
    if sec.verdict:
        out += [f"> {sec.verdict}", ""]
    for i, (png, cap) in enumerate(sec.figures):
        name = _figure_name(run, i)
        figs[name] = png
        out += [f"![{cap}](img/{name})", "", f"*{cap}*", ""]
    out += ["<details markdown=\"1\"><summary>How this run was made</summary>", "", *_provenance(run), "",
            *[p + "\n" for p in sec.paragraphs], "</details>", ""]
    for cap, df in [*sec.tables, *sec.details]:
        out += [f"<details markdown=\"1\"><summary>{cap}</summary>", "", *table_lines(df), "</details>", ""]
    return out


#: each study's page title (the site's navigation names)
TITLES = {"exactness": "Exactness", "decomposition": "Decomposition", "pattern": "Feature pattern",
          "tolerance": "Position tolerance", "causal": "Causal test", "sufficiency": "Sufficiency",
          "taxonomy": "Head taxonomy", "length": "Longer texts", "patching": "Patching positions",
          "gap_attention": "Attention under a gap"}
#: the question each page answers, in words (the summary box's questions without their section numbers)
PAGE_QUESTIONS = {**{k: re.sub(r"\s*\(§[^)]*\)$", "", v) for k, v in QUESTIONS.items()},
                  "exactness": "Do the captured queries and keys reproduce the model's own rotation and attention "
                               "scores?",
                  "gap_attention": "How does each head's attention change under a gap, positional heads beside "
                                   "symbolic ones?"}


def _study_rows(study: str, runs: list[Run]) -> list[tuple[Run, Finding]]:
    return [(r, f) for r, f in _findings(runs) if r.study == study]


def _range(vals: list[float]) -> str:
    """``"lo to hi"`` of the finite values (one value when they print alike; ``–`` when there is none)."""
    v = [x for x in vals if x is not None and x == x]
    if not v:
        return "–"
    lo, hi = min(v), max(v)
    return sig3(lo) if sig3(lo) == sig3(hi) else f"{sig3(lo)} to {sig3(hi)}"


def answer_sentence(study: str, runs: list[Run]) -> str:
    """The answer to ``study``'s question in words, derived from the runs' verdicts: per measure, which verdict in
    how many runs, the range of the effects and where their intervals lie, and whether the runs are exploratory.
    The causal study answers with the declared claim (:func:`primary_answer`); a study without headline findings
    with each run's verdict."""
    if study == CLAIM_STUDY:
        return primary_claim(runs)[1].replace(" ([causal]({prefix}causal.md))", "")
    rows = _study_rows(study, runs)
    mine = [r for r in runs if r.study == study]
    if not rows:
        per_run = [f"{r.model} on {r.corpus}: {(_section(r).verdict or 'no verdict').split(':')[0].rstrip('.')}"
                   for r in mine]
        return ("; ".join(per_run) + ".") if per_run else "No run yet."
    out = []
    by_what: dict[str, list[tuple[Run, Finding]]] = {}
    for r, f in rows:
        by_what.setdefault(f.what, []).append((r, f))
    for what, items in by_what.items():
        n = len(items)
        verdicts = list(dict.fromkeys(f.verdict for _, f in items))
        if len(verdicts) == 1:
            said = f"{verdicts[0]} in {'all ' + str(n) + ' runs' if n > 1 else 'the one run'}"
        else:
            said = "; ".join(f"{v} in {sum(f.verdict == v for _, f in items)} of {n} runs "
                             f"({', '.join(r.key for r, f in items if f.verdict == v)})" for v in verdicts)
        eff = [f.effect for _, f in items if f.effect is not None]
        cis = [f.ci for _, f in items if f.ci and f.ci[0] == f.ci[0]]
        where = ""
        if cis and len(cis) == n:
            above, below = sum(c[0] > 0 for c in cis), sum(c[1] < 0 for c in cis)
            where = (", every 95 % interval above 0" if above == n else ", every 95 % interval below 0" if below == n
                     else f", {above + below} of {n} 95 % intervals exclude 0")
        out.append(f"{said[:1].upper()}{said[1:]}: {what} {_range(eff)}{where}.")
    expl = [(r, f) for r, f in rows if f.exploratory]
    if expl:
        ns = sorted({int(f.n) for _, f in expl if f.n is not None and f.unit == "documents"})
        size = f" (n = {', '.join(map(str, ns))} documents)" if ns else ""
        keys = list(dict.fromkeys(r.key for r, _ in expl))
        who = "every run" if len(keys) == len({r.key for r, _ in rows}) else ", ".join(keys)
        out.append(f"Exploratory: {who} rests on fewer than 32 documents{size}, too few to confirm or contradict "
                   "([method](../method.md)).")
    return " ".join(out)


def _short_replication(rep: str) -> str:
    if rep.startswith("same verdict"):
        return "same verdict; too small to replicate"
    if rep.startswith("not replicated"):
        return "not replicated (a run too small)"
    if rep.startswith("NO"):
        return "NO: the corpora disagree"
    return rep


def answer_table(study: str, runs: list[Run]) -> list[tuple[str, pd.DataFrame]]:
    """Per measure of ``study``'s headlines: ``(measure, table)``, one row per run with word columns — run, answer,
    effect, 95 % interval, p, n (with its unit) and whether the second corpus replicates it."""
    rows = _study_rows(study, runs)
    df = _headline_frame(runs)
    agree = agreement(df) if len(df) else pd.DataFrame()
    out: dict[str, list[dict]] = {}
    for r, f in rows:
        rep = "–"
        if len(agree):
            a = agree[(agree["question"] == f.question) & (agree["model"] == r.model) & (agree["what"] == f.what)]
            rep = _short_replication(str(a.iloc[0]["replicated"])) if len(a) else "–"
        ci = f"[{sig3(f.ci[0])}, {sig3(f.ci[1])}]" if f.ci and f.ci[0] == f.ci[0] else "–"
        out.setdefault(f.what, []).append({
            "run": r.key, "answer": f.verdict + (" (exploratory)" if f.exploratory else ""), "effect": sig3(f.effect),
            "95 % interval": ci, "p": sig3(f.p), "n": "–" if f.n is None else f"{f.n} {f.unit}",
            "second corpus": rep})
    return [(what, pd.DataFrame(v)) for what, v in out.items()]


def top_block(study: str, runs: list[Run], figs: dict[str, bytes] | None, link_prefix: str) -> list[str]:
    """The opening of a results page (or of its entry in the overview): the question, the answer in one sentence,
    the forest plot of the runs' effects (only where ``figs`` is given: it receives the PNG), the answer table(s)
    and what each p is."""
    from posgen_tl.plot.forest import plot_forest  # noqa: PLC0415
    from posgen_tl.report.html import figure_to_png  # noqa: PLC0415

    question = primary_claim(runs)[0] if study == CLAIM_STUDY else PAGE_QUESTIONS.get(study, study)
    out = [f"**Question.** {question}", "",
           f"**Answer.** {answer_sentence(study, runs)}", ""]
    rows = _study_rows(study, runs)
    plotted = [dict(what=f.what, label=r.key, effect=f.effect, ci_low=f.ci[0] if f.ci else np.nan,
                    ci_high=f.ci[1] if f.ci else np.nan, verdict=f.verdict, exploratory=bool(f.exploratory))
               for r, f in rows if f.effect is not None and f.effect == f.effect]
    if figs is not None and plotted:
        name = f"{study}__answer.png"
        figs[name] = figure_to_png(plot_forest(pd.DataFrame(plotted)))
        out += [f"![Every run's effect with its 95 % interval]({link_prefix}img/{name})", ""]
    if study == CLAIM_STUDY:
        out += claim_section(runs)
    else:
        for what, t in answer_table(study, runs):
            out += [f"*{what}*", "", md_table(t), ""]
    kinds = list(dict.fromkeys(f.p_kind for _, f in rows if f.p_kind and f.p is not None))
    notes = [f"{r.key}: {f.note}" for r, f in rows if f.note and study != CLAIM_STUDY]
    if kinds and study != CLAIM_STUDY:
        out += ["<small>p: " + "; ".join(kinds) + ". Words and units: [glossary](../glossary.md).</small>", ""]
    if notes:
        out += ["<details markdown=\"1\"><summary>Notes on the runs</summary>", "", *[f"- {x}" for x in notes], "",
                "</details>", ""]
    return out


_FINDINGS: dict[tuple, list[tuple[Run, Finding]]] = {}


def _findings(runs: list[Run]) -> list[tuple[Run, Finding]]:
    """Every run's headline findings; a causal entry of a declared claim is quoted from the claim
    table (its p adjusted over the whole family, its verdict the claim's), not from its run alone. Computed once
    per set of runs while their files are unchanged (every page reads them)."""
    key = tuple(_run_key(r) for r in runs)
    if key not in _FINDINGS:
        if len(_FINDINGS) > 16:
            _FINDINGS.clear()
        _FINDINGS[key] = list(_quoted_findings(runs))
    return _FINDINGS[key]


def _quoted_findings(runs: list[Run]) -> Iterator[tuple[Run, Finding]]:
    claims = {c: claim_table(runs, c) for c in dict.fromkeys(r.corpus for r in runs if r.study == CLAIM_STUDY)}
    for run in runs:
        for f in _section(run).findings:
            df, method = claims.get(run.corpus, (None, ""))
            layers = f.what.rsplit(", ", 1)[-1].split(" (")[0] if run.study == CLAIM_STUDY else ""
            entry = f"{run.model}:{layers}"
            if run.study == CLAIM_STUDY and df is not None and entry in df.index and df.loc[entry, "verdict"] != "not run":
                row = df.loc[entry]
                f = dataclasses.replace(f, verdict=str(row["verdict"]).split(" (")[0],
                                        note=f"{layers}; intersection–union p {sig3(row['p_iut'])} ({row['binding']}), "
                                             f"p over the declared claim {sig3(row['p_family'])} "
                                             f"({row.get('family_method', method)})")
            yield run, f


def _headline_frame(runs: list[Run]) -> pd.DataFrame:
    return pd.DataFrame([dict(question=f.question, model=r.model, corpus=r.corpus, verdict=f.verdict, effect=f.effect,
                              what=f.what, ci_low=f.ci[0] if f.ci else None, ci_high=f.ci[1] if f.ci else None, p=f.p,
                              n=f.n, exploratory=bool(f.exploratory), page=f"[{r.study}]({r.study}.md)", study=r.study)
                         for r, f in _findings(runs)])


def agreement(df: pd.DataFrame) -> pd.DataFrame:
    """Per headline (question × model × what) measured on more than one corpus: each corpus' verdict
    with its n, and ``replicated``: ``yes`` (same verdict everywhere, every run with ≥ 32 documents), ``same
    verdict, not a replication`` (a run is exploratory: it could neither confirm nor contradict, docs/method.md
    §8), ``not replicated`` (verdicts differ and a run is exploratory) or ``NO`` (verdicts differ between
    adequately sized runs). ``df``: the headline frame (one row per run and finding)."""
    rows = []
    for (q, m, what), g in df.groupby(["question", "model", "what"], sort=False):
        if g["corpus"].nunique() < 2:
            continue
        said = {c: f"{v} (n = {int(n)}{', exploratory' if e else ''})" if n == n and n is not None else v
                for c, v, n, e in zip(g["corpus"], g["verdict"], g["n"], g["exploratory"])}
        if g["verdict"].nunique() == 1 and g["exploratory"].any():
            small = " and ".join(g.loc[g["exploratory"], "corpus"])
            rep = f"same verdict; not a replication ({small}: fewer than 32 documents)"
        elif g["verdict"].nunique() == 1:
            rep = "yes"
        elif g["exploratory"].any():
            small = ", ".join(g.loc[g["exploratory"], "corpus"])
            rep = f"not replicated (the {small} run is exploratory)"
        else:
            rep = "NO — the corpora disagree"
        rows.append(dict(question=q, model=m, what=what, **{c: said.get(c, "–") for c in dict.fromkeys(df["corpus"])},
                         replicated=rep))
    return pd.DataFrame(rows)


def index_page(runs: list[Run], results: Path | None = None) -> str:
    """``docs/results/index.md``: the primary question answered in one sentence, then per study its question, the
    answer in one sentence and its small table (:func:`top_block`, no figure: each page has its own), then where
    the causal claim holds."""
    used = {r.corpus for r in runs}
    out = ["# Results", "", primary_answer(runs).replace("{prefix}", ""), "",
           "Every number on these pages comes from a study folder under `results/` (the command, commit, options and "
           "wall time are on each study's page) and is regenerated by "
           "`python -m posgen_tl.report.pages --results results --docs docs`. A headline stands only where both corpora "
           "give the same verdict on runs of at least 32 documents each (the *second corpus* column); units and words "
           "are in the [glossary](../glossary.md).", "",
           "<details markdown=\"1\"><summary>The corpora</summary>", "",
           *[f"- **{k}**: {v}." for k, v in CORPORA.items() if k in used], "", *corpus_lines(results, used),
           "</details>", ""]
    studies = [s for s in registry.ORDER if any(r.study == s for r in runs)]
    for study in studies:
        if not _study_rows(study, runs) and study != CLAIM_STUDY:
            continue
        out += [f"## [{TITLES.get(study, study)}]({study}.md)", "", *top_block(study, runs, None, link_prefix="")]
    out += claim_discussion(runs)
    return "\n".join(out).rstrip() + "\n"


def _earlier(results: Path) -> list[Path]:
    return sorted(p for p in (Path(results) / EARLIER).rglob("*") if p.is_file())


def _earlier_section(results: Path) -> list[str]:
    files = _earlier(results)
    if not files:
        return []
    out = ["## Earlier runs (version 1, withdrawn)", "",
           "The rows of the first causal runs (written before the study layout; sampling and conditions of that "
           "time, recorded in each run's config) are kept so that their history can be checked. Their verdicts are "
           "withdrawn with those of version 2 (see [causal](causal.md)): their controls were one draw each, matched "
           "on other documents, and no verdict of theirs compares destroy with a control at common damage.", ""]
    return out + ["Files:", "", *[f"- `{_rel(f, Path(results))}`" for f in files], ""]


def readme_headlines(runs: list[Run], link_prefix: str = "docs/results/") -> str:
    """The README's headline block: :func:`primary_answer`, then a small table — one row per question of
    :data:`HEADLINE_ORDER`, from the first corpus (pydoc): the answer (the verdicts, "exploratory" when fewer
    than 32 documents), per model the effect the p tests with its 95 % interval, the p's and unit counts (models
    in the same order), and whether the second corpus replicates it (:func:`agreement`), linking the page."""
    df = _headline_frame(runs)
    lines = [primary_answer(runs).replace("{prefix}", link_prefix), ""]
    if not len(df):
        return "\n".join(lines).rstrip()
    agree, claim_agree = agreement(df), claim_agreement(runs)
    lines += ["| question | answer | effect [95 % interval] per model | p | n | second corpus |",
              "|---|---|---|---|---|---|"]
    for study in HEADLINE_ORDER:
        g = df[df["question"] == study]
        claim_rows = headline_rows(runs) if study == CLAIM_STUDY else []
        if claim_rows:  # one row per declared entry: the p belongs to its effect
            for h in claim_rows:
                conf = "" if h["second"] != "confirmatory: fresh documents" else f" (confirmatory, {h['corpus']})"
                ask = QUESTIONS.get(study, study).split(" (§")[0]
                q = f"[{ask} — {h['entry'].replace(':', ' ')}{conf}]({link_prefix}{study}.md)"
                lines.append(f"| {q} | {h['answer']} | {h['effect']} | {h['p']} | {h['n']} | {h['second']} |")
            continue
        if not len(g):
            continue
        first = sorted(g["corpus"].unique(), key=lambda c: (c != "pydoc", c))[0]
        rows = list(g[g["corpus"] == first].sort_values("model").itertuples())
        if study != CLAIM_STUDY:  # the study's primary measure (its first finding); its page has the others
            rows = [r for r in rows if r.what == rows[0].what]
        answers = list(dict.fromkeys(f"{r.verdict}{' (exploratory)' if r.exploratory else ''}" for r in rows))
        effects, ps, ns, reps = [], [], [], []
        for r in rows:
            ci = "" if r.ci_low is None or r.ci_low != r.ci_low else f" [{sig3(r.ci_low)}, {sig3(r.ci_high)}]"
            val = f"{sig3(r.effect)}{ci}" if r.effect is not None and r.effect == r.effect else "–"
            effects.append(f"{r.model}: {val}")
            ps.append(sig3(r.p) if r.p is not None else "–")
            ns.append("–" if r.n is None or r.n != r.n else str(int(r.n)))
            if study == CLAIM_STUDY:  # the claim's entries agree or not by verdict (their deciding contrasts differ)
                layers = str(r.what).rsplit(", ", 1)[-1].split(" (")[0]  # as _quoted_findings reads the entry
                reps.append(claim_agree.get(f"{r.model}:{layers}", "one corpus only"))
                continue
            rep = agree[(agree["question"] == study) & (agree["model"] == r.model) & (agree["what"] == r.what)] \
                if len(agree) else agree
            reps.append(rep.iloc[0]["replicated"] if len(rep) else "not run")
        whats = list(dict.fromkeys(r.what for r in rows))
        q = f"[{QUESTIONS.get(study, study)}]({link_prefix}{rows[0].study}.md)"
        eff = f"{'; '.join(whats)} — " + "; ".join(effects)
        lines.append(f"| {q} | {' / '.join(answers)} | {eff} | {' / '.join(ps)} | {' / '.join(ns)} | "
                     f"{' / '.join(dict.fromkeys(reps))} |")
    return "\n".join(lines)


def fill_block(text: str, name: str, content: str) -> str:
    """``text`` with the lines between ``<!-- name:start -->`` and ``<!-- name:end -->`` replaced by ``content``.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"the text has no '{start}' … '{end}' block")
    return text[: i + len(start)] + "\n" + content.strip("\n") + ("\n" if content.strip() else "") + text[j:]


def pages(results: Path) -> tuple[dict[str, str], dict[str, bytes], list[str]]:
    """``({relative page path: markdown}, {figure name: png}, [cited result files])`` of every page."""
    runs = find_runs(results)
    texts, figs, cited = {}, {}, []
    for study in registry.ORDER:
        rs = [r for r in runs if r.study == study]
        old = withdrawn_runs(results, study)
        if not rs and not old:
            continue
        text, f = study_page(study, rs, old)
        texts[f"results/{study}.md"] = text
        figs.update(f)
        for r in rs:
            cited += [_rel(r.folder / name, r.folder.parents[2]) for name in (*r.meta["files"], f"{study}.json", f"{study}.md")]
        for r in old:
            cited += [_rel(r.folder / name, r.folder.parents[3]) for name in (*r.meta["files"], f"{study}.json", f"{study}.md")]
    texts["results/index.md"] = index_page(runs, results).rstrip("\n") + "\n\n" + "\n".join(_earlier_section(results))
    texts["results/index.md"] = texts["results/index.md"].rstrip("\n") + "\n"
    cited += [_rel(f, Path(results)) for f in _earlier(results)]
    cited += [_rel(f, Path(results)) for f in sorted((Path(results) / "corpora").glob("*.json"))]
    return texts, figs, sorted(set(cited))


def _readme(results: Path, readme: Path | None, docs: Path | None = None) -> dict[str, str]:
    """The README's headline block and the docs home's findings block (the primary answer), where those files
    exist."""
    out = {}
    if readme is not None and Path(readme).exists():
        out[str(readme)] = fill_block(Path(readme).read_text(), "headlines", readme_headlines(find_runs(results)))
    home = Path(docs) / "index.md" if docs is not None else None
    if home is not None and home.exists() and "<!-- findings:start -->" in home.read_text():
        answer = primary_answer(find_runs(results)).replace("{prefix}", "results/")
        out[str(home)] = fill_block(home.read_text(), "findings", f"{answer} Every study's answer: "
                                    "[results](results/index.md).")
    return out


def write_pages(results: Path, docs: Path, readme: Path | None = None) -> list[Path]:
    """Write every page, its figures, ``<results>/MANIFEST.txt`` and (if given) the README's headline
    block; returns the pages written."""
    texts, figs, cited = pages(results)
    for path, text in _readme(results, readme, docs).items():
        Path(path).write_text(text)
    img = docs / "results" / "img"
    img.mkdir(parents=True, exist_ok=True)
    written = []
    for rel, text in texts.items():
        (docs / rel).write_text(text)
        written.append(docs / rel)
    for name, png in figs.items():
        (img / name).write_bytes(png)
    for old in img.glob("*.png"):  # a figure no page shows any more goes with its page
        if old.name not in figs:
            old.unlink()
    (Path(results) / "MANIFEST.txt").write_text("\n".join(cited) + "\n")
    return written


def stale(results: Path, docs: Path, readme: Path | None = None) -> list[str]:
    """The pages (the manifest, the README's headlines) whose committed text differs from a
    regeneration, with a diff."""
    texts, _, cited = pages(results)
    texts = {**{str(docs / k): v for k, v in texts.items()}, str(Path(results) / "MANIFEST.txt"): "\n".join(cited) + "\n",
             **_readme(results, readme, docs)}
    out = []
    for path, text in texts.items():
        old = Path(path).read_text() if Path(path).exists() else ""
        if old != text:
            diff = "".join(list(difflib.unified_diff(old.splitlines(True), text.splitlines(True), path, "regenerated"))[:40])
            out.append(diff or f"{path}: missing")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m posgen_tl.report.pages", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="results", help="the folder of study outputs")
    p.add_argument("--docs", default="docs", help="the documentation folder")
    p.add_argument("--readme", default="README.md", help="README whose headlines block is rewritten ('' for none)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page or the manifest is stale")
    a = p.parse_args(argv)
    readme = Path(a.readme) if a.readme else None
    if a.check:
        bad = stale(Path(a.results), Path(a.docs), readme)
        for d in bad:
            print(d)
        return 1 if bad else 0
    for path in write_pages(Path(a.results), Path(a.docs), readme):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
