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

import pandas as pd

from posgen_tl.experiments import registry
from posgen_tl.report.context import Context, OutFolder
from posgen_tl.report.html import QUESTIONS, Finding, Section
from posgen_tl.report.text import md_table, section_markdown, sig3

__all__ = ["Run", "find_runs", "study_page", "index_page", "readme_headlines", "fill_block", "pages", "write_pages",
           "main"]

#: the studies whose first finding per model makes a README headline, in this order (at most five lines)
HEADLINE_ORDER = ("causal", "tolerance", "decomposition", "pattern", "sufficiency", "length", "taxonomy")
#: rows of the first causal runs (before the study layout), kept because the results index cites them:
#: ``tests/unit/stats/test_reanalysis.py`` re-analyses them under the v2 verdict rule
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


def _config(run: Run) -> Any:
    """The run's Config, rebuilt from its recorded options (lists back to tuples)."""
    cls = registry.experiment(run.study).Config
    kinds = {o.name: o.kind for o in cls.options()}
    vals = {}
    for k, v in run.meta["config"].items():
        if k not in kinds:
            continue
        if isinstance(v, list):
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        vals[k] = v
    return cls(**vals)


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
        mod = registry.experiment(run.study)
        if run.study in registry.PROTOCOL:
            _RENDERED[key] = mod.render(mod.load(run.folder))
        else:
            ctx = Context(model=None, work=OutFolder(run.folder), model_name=run.model, seed=0)
            _RENDERED[key] = mod.render(ctx, _config(run))
    return _RENDERED[key]


def _provenance(run: Run) -> list[str]:
    m = run.meta
    opts = ", ".join(f"{k}={v}" for k, v in m["config"].items())
    return [f"- command: `{m['command']}`",
            f"- code: commit `{str(m['git_commit'])[:12]}`{' (uncommitted changes)' if 'uncommitted' in str(m['git_commit']) else ''}"
            f", preset `{m.get('preset', 'default')}`, wall time {m['wall_seconds'] / 60:.1f} min",
            f"- corpus: {CORPORA.get(run.corpus, run.corpus)}",
            f"- options: {opts}",
            f"- outputs: `{_rel(run.folder, run.folder.parents[2])}/` ({len(m['files'])} files)"]


def _rel(path: Path, results: Path) -> str:
    """``path`` as the pages and the manifest name it: from the results folder's name on (never a
    machine path)."""
    root = Path(results).resolve()
    return (Path(root.name) / Path(path).resolve().relative_to(root)).as_posix()


def _figure_name(run: Run, i: int) -> str:
    return f"{run.model}__{run.corpus}__{run.study}__{i}.png"


def study_page(study: str, runs: list[Run]) -> tuple[str, dict[str, bytes]]:
    """The markdown of ``docs/results/<study>.md`` and the figures it shows (``{file name: png}``)."""
    mod = registry.experiment(study)
    out = [f"# {study}", "", f"*{mod.ABOUT}.* Regenerated by `python -m posgen_tl.report.pages` from the study "
           "folders listed under each run; never edited by hand.", ""]
    figs: dict[str, bytes] = {}
    if study == "causal":
        out += claim_section(runs)
    for run in runs:
        sec = _section(run)
        out += [f"## {run.key}", "", *_provenance(run), ""]
        out += section_markdown(sec, level=2, fold_details=True)
        for i, (png, cap) in enumerate(sec.figures):
            name = _figure_name(run, i)
            figs[name] = png
            out += [f"![{cap}](img/{name})", "", f"*{cap}*", ""]
    return "\n".join(out).rstrip() + "\n", figs


def claim_table(runs: list[Run], corpus: str) -> tuple[pd.DataFrame | None, str]:
    """The causal claim of ``corpus``'s runs: one row per declared entry (model × layer group) with
    its run's intersection–union ``p``, ``p_family`` (adjusted over the WHOLE declared family; entries
    not run count as p = 1, which keeps the adjustment valid) and the claim's ``verdict``.

    Returns ``(table indexed by entry, method text)``; ``(None, reason)`` when no run declares a claim
    or the runs declare different claims."""
    from posgen_tl.stats.verdicts import family_adjust  # noqa: PLC0415

    rows, claims = [], set()
    for r in (r for r in runs if r.corpus == corpus and r.study == "causal"):
        cfg = json.loads((r.folder / "causal_config.json").read_text())
        if "claim_family" not in cfg:
            continue
        claims.add(tuple(cfg["claim_family"]["claim"]))
        v = pd.read_csv(r.folder / "causal_verdicts.csv")
        rows += [dict(entry=f"{r.model}:{x.layers}", model=r.model, layers=x.layers, estimate=x.estimate,
                      ci_low=x.ci_low, ci_high=x.ci_high, p=x.p, counted_controls=x.counted_controls,
                      n_docs=x.n_docs, n_seqs=x.n_seqs) for x in v.itertuples()]  # fmt: skip
    if not rows:
        return None, "no run declares a claim"
    if len(claims) != 1:
        return None, "The runs declare different claims: no family verdict."
    claim = list(next(iter(claims)))
    df = pd.DataFrame(rows).set_index("entry").reindex(claim)
    missing = [e for e in claim if pd.isna(df.loc[e, "p"])]
    p_adj, method = family_adjust(df["p"].fillna(1.0).to_numpy(), "holm", claim)
    df["p_family"] = p_adj
    df["verdict"] = ["not run" if e in missing else ("depends" if q < 0.05 else "no evidence")
                     + (" (exploratory)" if n < 32 else "") for e, q, n in zip(claim, p_adj, df["n_docs"].fillna(0))]
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
                f"Declared before the runs: {', '.join(df.index)}. Each entry's p is the intersection–union p of its run "
                f"(destroy − none and destroy − every counted control, the AUC of ΔNLL over the swap fraction); "
                f"{method}; α = 0.05. "
                "The per-run sections below give each entry's components, damage equivalence, per-fraction "
                "contrasts and figures.", "",
                md_table(df.reset_index(), ["entry", "estimate", "ci_low", "ci_high", "p", "p_family", "counted_controls",
                                            "n_docs", "n_seqs", "verdict"]), ""]
    return out


def _findings(runs: list[Run]) -> Iterator[tuple[Run, Finding]]:
    """Every run's headline findings; a causal entry of a declared claim is quoted from the claim
    table (its p adjusted over the whole family, its verdict the claim's), not from its run alone."""
    claims = {c: claim_table(runs, c) for c in dict.fromkeys(r.corpus for r in runs if r.study == "causal")}
    for run in runs:
        for f in _section(run).findings:
            df, method = claims.get(run.corpus, (None, ""))
            entry = f"{run.model}:{f.note.split(';', 1)[0]}"
            if run.study == "causal" and df is not None and entry in df.index and df.loc[entry, "verdict"] != "not run":
                row = df.loc[entry]
                f = dataclasses.replace(f, p=float(row["p_family"]), verdict=str(row["verdict"]).split(" (")[0],
                                        note=f"{f.note.split(';', 1)[0]}; intersection–union p {row['p']:.3g}; "
                                             f"{method} (the declared claim)")
            yield run, f


def _headline_frame(runs: list[Run]) -> pd.DataFrame:
    return pd.DataFrame([dict(question=f.question, model=r.model, corpus=r.corpus, verdict=f.verdict, effect=f.effect,
                              what=f.what, ci_low=f.ci[0] if f.ci else None, ci_high=f.ci[1] if f.ci else None, p=f.p,
                              n=f.n, exploratory=bool(f.exploratory), page=f"[{r.study}]({r.study}.md)")
                         for r, f in _findings(runs)])


def agreement(df: pd.DataFrame) -> pd.DataFrame:
    """Per headline (question × model × what) measured on more than one corpus: each corpus' verdict
    with its n, and ``replicated``: ``yes`` (same verdict everywhere), ``not replicated`` (verdicts differ
    and a run is exploratory, n < 32: too small to confirm or contradict) or ``NO`` (verdicts differ
    between adequately sized runs). ``df``: the headline frame (one row per run and finding)."""
    rows = []
    for (q, m, what), g in df.groupby(["question", "model", "what"], sort=False):
        if g["corpus"].nunique() < 2:
            continue
        said = {c: f"{v} (n = {int(n)}{', exploratory' if e else ''})" if n == n and n is not None else v
                for c, v, n, e in zip(g["corpus"], g["verdict"], g["n"], g["exploratory"])}
        if g["verdict"].nunique() == 1:
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


def _per_fraction(run: Run, layers: str) -> str:
    """``+0.013 (2 %, Holm p 0.0061), …``: destroy − none ΔNLL per swap fraction of one entry."""
    c = pd.read_csv(run.folder / "causal_contrasts.csv")
    c = c[(c["layers"] == layers) & (c["contrast"] == "destroy − none") & (c["estimator"] == "dnll")].sort_values("frac")
    return ", ".join(f"{_signed(r.estimate)} at p = {r.frac:g} (Holm p {sig3(float(r.p_holm))})"
                     for r in c.itertuples())


def claim_discussion(runs: list[Run]) -> list[str]:
    """Where the causal claim holds and where it does not, per declared entry, written from the runs'
    tables: the hypothesis; each entry's destroy − none AUC and per-fraction ΔNLL, what decided its
    verdict (the intersection–union components, controls that move tolerance by themselves), the
    verdict over the claim on each corpus, and whether the corpora agree."""
    corpora = list(dict.fromkeys(r.corpus for r in runs if r.study == "causal"))
    tables = {c: claim_table(runs, c)[0] for c in corpora}
    tables = {c: t for c, t in tables.items() if t is not None}
    if not tables:
        return []
    first = min(tables, key=lambda c: (c != "pydoc", c))
    out = ["## Where the causal claim holds and where it does not", "",
           "The hypothesis under test: a model's tolerance of swapped context tokens relies on the key offset "
           "in the fast RoPE bands (the pattern), so removing that offset (`destroy`) raises the cost of swaps "
           "(ΔNLL over the swap fraction p) by more than equally damaging edits that leave the pattern alone "
           "(controls C1–C4). Per declared entry, from the runs' own tables:", ""]
    stands, fails, single = [], [], []
    for entry in tables[first].index:
        model, layers = entry.split(":", 1)
        lines = []
        verdicts = {}
        for c, t in tables.items():
            if entry not in t.index or t.loc[entry, "verdict"] == "not run":
                continue
            row = t.loc[entry]
            run = next(r for r in runs if r.study == "causal" and r.model == model and r.corpus == c)
            v = pd.read_csv(run.folder / "causal_verdicts.csv").set_index("layers").loc[layers]
            parts = [x for x in str(v["label"]).split("; ") if not x.startswith(("MDE", "random controls"))]
            verdicts[c] = str(row["verdict"])
            lines.append(
                f"  - {c} ({int(row['n_docs'])} documents): destroy − none AUC {_signed(row['estimate'])} "
                f"nats × p [{_signed(row['ci_low'])}, {_signed(row['ci_high'])}]; "
                f"per fraction {_per_fraction(run, layers)}. Decided by: {'; '.join(parts)}. "
                f"Over the claim: **{row['verdict']}** (p {sig3(float(row['p_family']))}).")
        words = {w.split(" (")[0] for w in verdicts.values()}
        if len(verdicts) < 2:
            state = "measured on one corpus only: not claimed"
            single.append(entry)
        elif len(words) == 1 and words == {"depends"}:
            state = "**the claim holds here** (both corpora)"
            stands.append(entry)
        elif len(words) == 1:
            state = "the claim does not hold here (no evidence on either corpus)"
            fails.append(entry)
        else:
            state = "the corpora disagree: not claimed"
            fails.append(entry)
        out += [f"- **{model}, layers {layers}** — {state}.", *lines]
    said = [f"{what} {', '.join(es)}" for what, es in (("the claim holds (both corpora) for", stands),
                                                        ("it is not supported for", fails),
                                                        ("only one corpus has been run for", single)) if es]
    out += ["", "In short: " + "; ".join(said) + ". 'No evidence' is not evidence of no effect: each run's page gives "
            "the minimal detectable effect.", ""]
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


#: the v1 causal runs as one family (rows, config), re-analysed on the results index
EARLIER_RUNS = (
    ("causal_n64/causal_smollm2_L10-19_n64_rows.csv", "causal_n64/causal_smollm2_L10-19_n64_config.json"),
    ("causal_n64/causal_smollm2_L20-29_n64_rows.csv", "causal_n64/causal_smollm2_L20-29_n64_config.json"),
    ("causal_gemma3_n32/gemma3_L6-11_n32/causal_rows.csv", "causal_gemma3_n32/gemma3_L6-11_n32/causal_config.json"),
    ("causal_gemma3_n32/gemma3_L12-17_n32/causal_rows.csv", "causal_gemma3_n32/gemma3_L12-17_n32/causal_config.json"),
)


def _earlier_section(results: Path) -> list[str]:
    files = _earlier(results)
    if not files:
        return []
    out = ["## Earlier runs, re-analysed", "",
           "The rows of the first causal runs (written before the study layout; sampling and conditions of that "
           "time, recorded in each run's config) are kept so that their re-analysis under the current verdict rule "
           "can be re-checked (`pytest tests/unit/stats/test_reanalysis.py` pins these numbers). Their random "
           "controls were one draw each and their family and damage margin are stated after the data: the labels "
           "say so, and the verdicts are secondary to the re-runs above.", ""]
    base = Path(results) / EARLIER
    if all((base / r).exists() and (base / c).exists() for r, c in EARLIER_RUNS):
        from posgen_tl.stats.verdicts import reanalyse_committed  # noqa: PLC0415

        res = reanalyse_committed([(base / r, base / c) for r, c in EARLIER_RUNS])
        v = res["verdicts"]
        out += ["**Verdicts (one family of four entries; AUC of ΔNLL over the swap fraction, nats × p)**", "",
                md_table(v, ["model", "layers", "estimate", "ci_low", "ci_high", "p", "p_holm", "counted_controls",
                             "n_docs", "n_seqs", "verdict"]), ""]
        pf = res["per_fraction"]
        pf = pf[(pf["contrast"] == "destroy − none") & (pf["estimator"] == "dnll")]
        out += ["**destroy − none per swap fraction (ΔNLL, nats; Holm over the fractions)**", "",
                md_table(pf, ["model", "layers", "frac", "estimate", "ci_low", "ci_high", "p", "p_holm", "n_docs"]), ""]
    return out + ["Files:", "", *[f"- `{_rel(f, Path(results))}`" for f in files], ""]


def readme_headlines(runs: list[Run], link_prefix: str = "docs/results/") -> str:
    """At most five markdown lines for the README: per study of :data:`HEADLINE_ORDER` that has runs,
    its question and every finding of each model's run on the first corpus (pydoc), each followed by
    whether the second corpus gives the same verdict (:func:`agreement`), linking the study page. A causal
    entry of a declared claim quotes the claim table (p over the whole family)."""
    df = _headline_frame(runs)
    if not len(df):
        return ""
    agree = agreement(df)
    lines = []
    for study in HEADLINE_ORDER:
        g = df[df["question"] == study]
        if not len(g):
            continue
        first = sorted(g["corpus"].unique(), key=lambda c: (c != "pydoc", c))[0]
        per_model = []
        for model, gm in g[g["corpus"] == first].groupby("model", sort=True):
            said = []
            for r in gm.itertuples():
                f = Finding(study, r.verdict, r.effect, r.what, None if r.ci_low != r.ci_low or r.ci_low is None
                            else (r.ci_low, r.ci_high), r.p, None if r.n != r.n or r.n is None else int(r.n), exploratory=bool(r.exploratory))
                text = f.line().split(": ", 1)[-1]
                rep = agree[(agree["question"] == study) & (agree["model"] == model) & (agree["what"] == r.what)] \
                    if len(agree) else agree
                if len(rep):
                    others = [c for c in df["corpus"].unique() if c != first]
                    text += f" · {'/'.join(others)}: {rep.iloc[0]['replicated']}"
                said.append(text)
            per_model.append(f"{model} ({first}) " + "; ".join(said))
        lines.append(f"- **{QUESTIONS.get(study, study)}** " + " — ".join(per_model)
                     + f" ([{study}]({link_prefix}{study}.md))")
    return "\n".join(lines[:5])


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
        if not rs:
            continue
        text, f = study_page(study, rs)
        texts[f"results/{study}.md"] = text
        figs.update(f)
        for r in rs:
            cited += [_rel(r.folder / name, r.folder.parents[2]) for name in (*r.meta["files"], f"{study}.json", f"{study}.md")]
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
