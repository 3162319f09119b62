"""Documentation pages regenerated from study output folders — never edited by hand.

    python -m posgen_tl.report.pages --results results --docs docs          # write the pages (and README headlines)
    python -m posgen_tl.report.pages --results results --docs docs --check  # fail if a page is stale

A study folder is what ``posgen-tl study NAME --out DIR`` writes (tables, figures, ``NAME.json``);
the folders live at ``<results>/<model>/<corpus>/<study>/``. For each experiment, its page
``<docs>/results/<study>.md`` is rebuilt by the experiment's OWN ``render`` from the folder's tables
(so a page cannot say what its tables do not), with the command, commit, preset, options, sizes and
wall time of every run it cites; figures are copied to ``<docs>/results/img/`` (not versioned: the
docs build writes them). ``<docs>/results/index.md`` lists every headline, and the two corpora side
by side: a headline stands only where both agree. ``<results>/MANIFEST.txt`` lists every file a page
cites; nothing else belongs in the results folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from posgen_tl.experiments import registry
from posgen_tl.report.html import QUESTIONS, Finding, Section
from posgen_tl.report.text import md_table, section_markdown, sig3

__all__ = ["Run", "find_runs", "study_page", "index_page", "readme_headlines", "fill_block", "pages", "write_pages",
           "main"]

#: the studies whose first finding per model makes a README headline, in this order (at most five lines)
HEADLINE_ORDER = ("causal", "tolerance", "decomposition", "pattern", "sufficiency", "length", "taxonomy")
#: rows of the first causal runs (before the study layout; withdrawn verdicts), kept because the results index
#: cites them
EARLIER = "v1"

#: what each corpus is, as the pages say it
CORPORA = {
    "pydoc": "the Python standard library's pydoc topics (the language reference: 79 documents of formal prose)",
    "readmes": "the long descriptions of the installed Python distributions (package READMEs: install guides, "
               "feature lists, changelogs — Markdown/reStructuredText with code). Chosen as the second corpus because "
               "its genre differs from the language reference's formal prose while it ships with every Python "
               "environment, so it is rebuilt offline by `posgen_tl.io.corpus.package_readmes` (each document's "
               "version and SHA-256 are recorded)",
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One study output folder: ``folder = <results>/<model>/<corpus>/<study>``, its record ``meta``."""

    study: str
    model: str
    corpus: str
    folder: Path
    meta: dict

    @property
    def key(self) -> str:
        return f"{self.model} · {self.corpus}"


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


def _section(run: Run) -> Section:
    """The experiment's own render of the run's folder (cached while its files are unchanged)."""
    state = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(run.folder.iterdir()) if p.is_file())
    key = (str(run.folder.resolve()), run.study, run.model, state)
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
    out = [f"## Earlier runs ({folder}, withdrawn)", "", why, ""]
    for run in runs:
        out += [f"### {run.key} ({folder})", "", *_provenance(run, depth=3), ""]
        vpath = run.folder / f"{study}_verdicts.csv"
        if vpath.exists():
            v = pd.read_csv(vpath).rename(columns={"verdict": "verdict printed then (withdrawn)"})
            out += [md_table(v, ["layers", "verdict printed then (withdrawn)", "n_docs"]), ""]
    return out


def study_page(study: str, runs: list[Run], earlier: list[Run] | None = None) -> tuple[str, dict[str, bytes]]:
    """The markdown of ``docs/results/<study>.md`` and the figures it shows (``{file name: png}``): the claim (the
    causal study), every run's section, then the withdrawn ``earlier`` runs (:func:`withdrawn_section`)."""
    mod = registry.experiment(study)
    out = [f"# {study}", "", f"*{mod.ABOUT}.* Regenerated by `python -m posgen_tl.report.pages` from the study "
           "folders listed under each run; never edited by hand.", ""]
    figs: dict[str, bytes] = {}
    if study == CLAIM_STUDY:
        out += claim_section(runs)
    for run in runs:
        sec = _section(run)
        out += [f"## {run.key}", "", *_provenance(run), ""]
        out += section_markdown(sec, level=2, fold_details=True)
        for i, (png, cap) in enumerate(sec.figures):
            name = _figure_name(run, i)
            figs[name] = png
            out += [f"![{cap}](img/{name})", "", f"*{cap}*", ""]
    if not runs and study == CLAIM_STUDY:
        out += ["No run of the dose–response test has been published yet: its re-runs are under way.", ""]
    out += withdrawn_section(study, earlier or [])
    return "\n".join(out).rstrip() + "\n", figs


#: the study whose runs make up the causal claim (the dose–response test, docs/method.md §5, §8 v3)
CLAIM_STUDY = "causal"


def claim_table(runs: list[Run], corpus: str) -> tuple[pd.DataFrame | None, str]:
    """The causal claim of ``corpus``'s :data:`CLAIM_STUDY` runs: one row per declared entry (model × layer group)
    with its run's destroy − none at common damage (``estimate``, ``ci_low``, ``ci_high``, ``p``), its
    intersection–union ``p_iut`` and binding contrast, the run's own verdict (``run_verdict``), ``p_family`` (Holm
    over the WHOLE declared claim of each entry's ``p_test`` — its intersection–union p, or 1 where its contrasts
    point different ways; entries not run or not testable count as p = 1, which keeps the adjustment valid) and
    the claim's ``verdict``: "depends" where the entry's own test rejected (``iut_rejects``, before any family
    step) and ``p_family`` < the runs' α.

    Returns ``(table indexed by entry, method text)``; ``(None, reason)`` when no run declares a claim or the runs
    declare different claims."""
    from posgen_tl.stats.verdicts import family_adjust  # noqa: PLC0415

    rows, claims, alphas = [], set(), set()
    for r in (r for r in runs if r.corpus == corpus and r.study == CLAIM_STUDY):
        claim = tuple(r.meta["config"].get("claim") or ())
        if not claim:
            continue
        claims.add(tuple(json.loads((r.folder / f"{CLAIM_STUDY}_result.json").read_text())["meta"].get("claim")
                         or claim))
        alphas.add(float(r.meta["config"].get("test_alpha", 0.05)))
        v = pd.read_csv(r.folder / f"{CLAIM_STUDY}_verdicts.csv")
        con = pd.read_csv(r.folder / f"{CLAIM_STUDY}_contrasts.csv").set_index(["layers", "contrast"])
        for x in v.itertuples():
            b = con.loc[(x.layers, x.binding)] if isinstance(x.binding, str) and (x.layers, x.binding) in con.index \
                else None
            rows.append(dict(entry=f"{r.model}:{x.layers}", model=r.model, layers=x.layers, estimate=x.estimate,
                             ci_low=x.ci_low, ci_high=x.ci_high, p=x.p, p_iut=x.p_iut, p_test=x.p_test,
                             iut_rejects=bool(x.iut_rejects), binding=x.binding, run_verdict=x.verdict, mde=x.mde,
                             n_docs=x.n_docs, reason=str(x.reason),
                             binding_estimate=np.nan if b is None else float(b["estimate"]),
                             binding_ci_low=np.nan if b is None else float(b["ci_low"]),
                             binding_ci_high=np.nan if b is None else float(b["ci_high"])))
    if not rows:
        return None, "no run declares a claim"
    if len(claims) != 1 or len(alphas) != 1:
        return None, "The runs declare different claims (or levels α): no family verdict."
    claim, alpha = list(next(iter(claims))), next(iter(alphas))
    df = pd.DataFrame(rows).set_index("entry").reindex(claim)
    missing = [e for e in claim if pd.isna(df.loc[e, "run_verdict"])]
    p_adj, method = family_adjust(df["p_test"].fillna(1.0).to_numpy(), "holm", claim)
    df["p_family"] = p_adj
    verdicts = []
    for e, q, rv, n in zip(claim, p_adj, df["run_verdict"], df["n_docs"].fillna(0)):
        if e in missing:
            verdicts.append("not run")
        elif rv == "not testable":
            verdicts.append("not testable")
        else:
            rejects = bool(df.loc[e, "iut_rejects"])  # the entry's own test, before any family adjustment
            verdicts.append(("depends" if rejects and q < alpha else "not detected")
                            + (" (exploratory)" if n < 32 else ""))
    df["verdict"] = verdicts
    return df, method + (f" (not run: {', '.join(missing)}, counted as p = 1)" if missing else "")


def claim_section(runs: list[Run]) -> list[str]:
    """The causal claim across runs, per corpus (:func:`claim_table`); the verdict of the claim is
    this table's, and the headlines quote it."""
    out: list[str] = []
    for corpus in dict.fromkeys(r.corpus for r in runs):
        df, method = claim_table(runs, corpus)
        if df is None:
            if method.startswith("The runs"):
                out += [f"## The declared claim · {corpus}", "", method, ""]
            continue
        out += [f"## The declared claim · {corpus}", "",
                f"Declared before the runs: {', '.join(df.index)}. Per entry: destroy − none at the common damage "
                "levels (estimate, 95 % document-bootstrap interval, its own sign-flip p); the verdict's p is the "
                "intersection–union p (p_iut: the largest of destroy − none and destroy − every control at common "
                f"damage; `binding` names it), adjusted by {method} (p_family); α = 0.05. The per-run sections below "
                "give each entry's figure, contrasts, power and grids.", "",
                md_table(df.reset_index(), ["entry", "estimate", "ci_low", "ci_high", "p", "p_iut", "binding",
                                            "p_family", "mde", "n_docs", "verdict"]), ""]
    return out


def _findings(runs: list[Run]) -> Iterator[tuple[Run, Finding]]:
    """Every run's headline findings; a causal entry of a declared claim is quoted from the claim
    table (its p adjusted over the whole family, its verdict the claim's), not from its run alone."""
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
                                             f"p over the declared claim {sig3(row['p_family'])} ({method})")
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


def _signed(x: Any) -> str:
    t = sig3(x)
    return t if t.startswith(("-", "–")) else "+" + t


def claim_discussion(runs: list[Run]) -> list[str]:
    """Where the causal claim holds and where it does not, per declared entry, written from the runs' tables:
    the hypothesis; per corpus, the entry's destroy − none at common damage, what decided its verdict (the
    binding contrast of the intersection–union test, or why it is not testable) and the verdict over the
    claim; whether the corpora agree."""
    corpora = list(dict.fromkeys(r.corpus for r in runs if r.study == CLAIM_STUDY))
    tables = {c: claim_table(runs, c)[0] for c in corpora}
    tables = {c: t for c, t in tables.items() if t is not None}
    if not tables:
        return []
    first = min(tables, key=lambda c: (c != "pydoc", c))
    out = ["## Where the causal claim holds and where it does not", "",
           "The hypothesis under test: a model's tolerance of swapped context tokens relies on the key offset "
           "in the fast RoPE bands (the pattern), so removing that offset (`destroy`) raises the cost of swaps "
           "(the area under ΔNLL over the swap fraction p) by more than edits that do the SAME damage to the clean "
           "text but leave the pattern alone (controls C1–C4), compared along dose–response curves. Per declared "
           "entry, from the runs' own tables:", ""]
    stands, fails, single, untestable, not_run = [], [], [], [], []
    for entry in tables[first].index:
        model, layers = entry.split(":", 1)
        lines, verdicts = [], {}
        for c, t in tables.items():
            if entry not in t.index or t.loc[entry, "verdict"] == "not run":
                continue
            row = t.loc[entry]
            run = next(r for r in runs if r.study == CLAIM_STUDY and r.model == model and r.corpus == c)
            v = pd.read_csv(run.folder / f"{CLAIM_STUDY}_verdicts.csv").set_index("layers").loc[layers]
            verdicts[c] = str(row["verdict"])
            lines.append(
                f"  - {c} ({int(row['n_docs'])} documents): destroy − none at common damage {_signed(row['estimate'])} "
                f"nats × p [{_signed(row['ci_low'])}, {_signed(row['ci_high'])}], sign-flip p {sig3(float(row['p']))}. "
                f"Decided by: {v['reason']}. Over the claim: **{row['verdict']}** (p {sig3(float(row['p_family']))}).")
        words = {w.split(" (")[0] for w in verdicts.values()}
        if not verdicts:
            state = "not run yet"
            not_run.append(entry)
        elif len(verdicts) < 2:
            state = "measured on one corpus only: not claimed"
            single.append(entry)
        elif words == {"depends"}:
            state = "**the claim holds here** (both corpora)"
            stands.append(entry)
        elif "not testable" in words:
            state = "not testable on at least one corpus: not claimed"
            untestable.append(entry)
        elif len(words) == 1:
            state = "the claim is not supported here (not detected on either corpus)"
            fails.append(entry)
        else:
            state = "the corpora disagree: not claimed"
            fails.append(entry)
        out += [f"- **{model}, layers {layers}** — {state}.", *lines]
    said = [f"{what} {', '.join(es)}" for what, es in (("the claim holds (both corpora) for", stands),
                                                        ("it is not supported for", fails),
                                                        ("it is not testable for", untestable),
                                                        ("only one corpus has been run for", single),
                                                        ("not run yet:", not_run)) if es]
    out += ["", "In short: " + "; ".join(said) + ". 'Not detected' is not evidence of no effect: each run's page gives "
            "the minimum detectable effect of the whole test.", ""]
    return out


def _corpus_line(results: Path | None) -> list[str]:
    if results is None:
        return []
    out = []
    for prov in sorted((Path(results) / "corpora").glob("*.json")):
        docs = json.loads(prov.read_text())
        out.append(f"The **{prov.stem}** corpus of these runs: {len(docs)} documents ({sum(d['chars'] for d in docs):,} "
                   f"characters), each named with its version and SHA-256 in `{_rel(prov, Path(results))}`.")
    return out + ([""] if out else [])


def index_page(runs: list[Run], results: Path | None = None) -> str:
    """``docs/results/index.md``: every headline of every run, and the corpora side by side."""
    df = _headline_frame(runs)
    out = ["# Results", "", "Every number on these pages comes from a study folder under `results/` (the command, "
           "commit, options and wall time are on each study's page) and is regenerated by "
           "`python -m posgen_tl.report.pages --results results --docs docs`.", "",
           "Corpora: " + "; ".join(f"**{k}** — {v}" for k, v in CORPORA.items()) + ".", "", *_corpus_line(results),
           "## Headlines", "", md_table(df, ["question", "model", "corpus", "verdict", "what", "effect", "ci_low",
                                             "ci_high", "p", "n", "page"]) if len(df) else "No study has headline findings yet.", ""]
    out += claim_discussion(runs)
    agree = agreement(df) if len(df) else pd.DataFrame()
    if len(agree):
        out += ["## Replication on a second corpus", "",
                "A headline stands only where both corpora give the same verdict. Where they differ, it is not claimed: "
                "`not replicated` when one run is exploratory (fewer than 32 documents: too small to confirm or "
                "contradict), `NO` when adequately sized runs disagree.", "", md_table(agree), ""]
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


def primary_answer(runs: list[Run]) -> str:
    """One plain sentence answering the primary question (does tolerance depend on the pattern?) from the
    causal claim on the corpora that ran it — or saying that it has no published answer yet."""
    q = "Does position tolerance depend on the key pattern in the fast RoPE bands?"
    corpora = list(dict.fromkeys(r.corpus for r in runs if r.study == CLAIM_STUDY))
    tables = {c: t for c in corpora if (t := claim_table(runs, c)[0]) is not None}
    if not tables:
        return (f"**{q}** No published answer yet: the earlier verdicts were withdrawn (their controls never did "
                "destroy's damage), and the dose–response re-runs that replace them are under way "
                f"([causal]({{prefix}}causal.md)).")
    entries = list(next(iter(tables.values())).index)
    words = {e: {c: str(t.loc[e, "verdict"]).split(" (")[0] for c, t in tables.items() if e in t.index
                 and t.loc[e, "verdict"] != "not run"} for e in entries}
    holds = [e for e, w in words.items() if len(w) >= 2 and set(w.values()) == {"depends"}]
    ran = [e for e, w in words.items() if w]
    if holds:
        ans = f"Yes for {', '.join(holds)} (on both corpora); not established for the other {len(ran) - len(holds)} entries run"
    else:
        ans = (f"Not established: no entry of the claim shows a dependence on both corpora ({len(ran)} of "
               f"{len(entries)} entries run)")
    clauses = [_entry_clause(e, c, t.loc[e]) for c, t in tables.items() for e in t.index
               if t.loc[e, "verdict"] != "not run"]
    per = (" " + "; ".join(clauses) + ".") if clauses else ""
    return f"**{q}** {ans} ([causal]({{prefix}}causal.md)).{per}"


def _interval(est: float, lo: float, hi: float) -> str:
    return f"{sig3(est)} [{sig3(lo)}, {sig3(hi)}]"


def _entry_clause(entry: str, corpus: str, row: pd.Series) -> str:
    """One entry of the claim in words, derived from its verdict: what removing the pattern did (destroy − none at
    common damage) and what decided (the binding contrast, or why the entry is not testable)."""
    name = f"{entry.replace(':', ' ')} ({corpus})"
    verdict = str(row["verdict"])
    dn = f"destroy − none {_interval(row['estimate'], row['ci_low'], row['ci_high'])} nats × p"
    if verdict.startswith("not testable"):
        why = str(row.get("reason", "")).split(":")[0].strip() or "the rule's preconditions failed"
        return f"{name}: not testable — {why}"
    costs = row["ci_low"] > 0
    b = (f"{row['binding']} {_interval(row['binding_estimate'], row['binding_ci_low'], row['binding_ci_high'])}"
         if row["binding_estimate"] == row["binding_estimate"] else str(row["binding"]))
    if verdict.startswith("depends"):
        return f"{name}: depends — {dn}, beyond every control at common damage (weakest: {b}, p {sig3(row['p_iut'])})"
    mde = f"the whole test's MDE {sig3(row['mde'])}"
    if str(row["binding"]) == "destroy − none" or not costs:
        return f"{name}: {verdict} — no change of tolerance by removing the pattern is detected ({dn}; {mde})"
    return (f"{name}: {verdict} — removing the pattern costs tolerance ({dn}), but not detectably more than a "
            f"control with the same damage ({b}; {mde})")


def readme_headlines(runs: list[Run], link_prefix: str = "docs/results/") -> str:
    """The README's headline block: :func:`primary_answer`, then a small table — one row per question of
    :data:`HEADLINE_ORDER`, from the first corpus (pydoc): the answer (the verdicts, "exploratory" when fewer
    than 32 documents), per model the effect the p tests with its 95 % interval, the p's and unit counts (models
    in the same order), and whether the second corpus replicates it (:func:`agreement`), linking the page."""
    df = _headline_frame(runs)
    lines = [primary_answer(runs).replace("{prefix}", link_prefix), ""]
    if not len(df):
        return "\n".join(lines).rstrip()
    agree = agreement(df)
    lines += ["| question | answer | effect [95 % interval] per model | p | n | second corpus |",
              "|---|---|---|---|---|---|"]
    for study in HEADLINE_ORDER:
        g = df[df["question"] == study]
        if not len(g):
            continue
        first = sorted(g["corpus"].unique(), key=lambda c: (c != "pydoc", c))[0]
        rows = list(g[g["corpus"] == first].sort_values("model").itertuples())
        answers = list(dict.fromkeys(f"{r.verdict}{' (exploratory)' if r.exploratory else ''}" for r in rows))
        effects, ps, ns, reps = [], [], [], []
        for r in rows:
            ci = "" if r.ci_low is None or r.ci_low != r.ci_low else f" [{sig3(r.ci_low)}, {sig3(r.ci_high)}]"
            val = f"{sig3(r.effect)}{ci}" if r.effect is not None and r.effect == r.effect else "–"
            effects.append(f"{r.model}: {val}")
            ps.append(sig3(r.p) if r.p is not None else "–")
            ns.append("–" if r.n is None or r.n != r.n else str(int(r.n)))
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


def _readme(results: Path, readme: Path | None) -> dict[str, str]:
    if readme is None or not Path(readme).exists():
        return {}
    return {str(readme): fill_block(Path(readme).read_text(), "headlines", readme_headlines(find_runs(results)))}


def write_pages(results: Path, docs: Path, readme: Path | None = None) -> list[Path]:
    """Write every page, its figures, ``<results>/MANIFEST.txt`` and (if given) the README's headline
    block; returns the pages written."""
    texts, figs, cited = pages(results)
    for path, text in _readme(results, readme).items():
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
             **_readme(results, readme)}
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
