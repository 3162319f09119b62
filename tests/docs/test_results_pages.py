"""The results pages are regenerated from the study folders they cite, never edited by hand, and
``results/`` holds only what a page cites."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from posgen_tl.report import pages

ROOT = Path(__file__).resolve().parents[2]
RESULTS, DOCS, README = ROOT / "results", ROOT / "docs", ROOT / "README.md"


def test_committed_pages_equal_their_regeneration():
    bad = pages.stale(RESULTS, DOCS, README)
    assert not bad, ("stale results pages; run python -m posgen_tl.report.pages --results results --docs docs\n"
                     + "\n".join(bad))


def test_results_folder_holds_only_what_a_page_cites():
    tracked = set(subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    manifest = set((RESULTS / "MANIFEST.txt").read_text().split())
    assert manifest, "empty manifest"
    assert tracked - {"results/MANIFEST.txt"} == manifest, (
        f"tracked but not cited: {sorted(tracked - manifest - {'results/MANIFEST.txt'})[:10]}; "
        f"cited but not tracked: {sorted(manifest - tracked)[:10]}")
    assert not any(p.endswith((".log", ".running")) or "partial" in p for p in tracked)


def test_every_study_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (DOCS / "results").glob("*.md"):
        assert f"results/{page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"


def test_a_changed_table_makes_its_page_stale(tmp_path):
    """Every measured value of a study's tables shifted by one: the regenerated page differs from the written one
    (the page is built from those tables, not from anything else)."""
    runs = [r for r in pages.find_runs(RESULTS) if r.study == "tolerance"] or pages.find_runs(RESULTS)
    if not runs:
        pytest.skip("no study folders committed")
    run = runs[0]
    res, docs = tmp_path / "results", tmp_path / "docs"
    dst = res / run.model / run.corpus / run.study
    shutil.copytree(run.folder, dst)
    pages.write_pages(res, docs)
    assert pages.stale(res, docs) == []
    for p in sorted(dst.glob("*.csv")):
        if not p.stat().st_size:
            continue
        df = pd.read_csv(p)
        for c in ("estimate",):  # the summaries' estimates (the per-sequence rows are checked by the curves code)
            if c in df.columns:
                df[c] = df[c] + 1.0
        df.to_csv(p, index=False)
    bad = pages.stale(res, docs)
    assert bad and any(f"{run.study}.md" in b for b in bad), bad


def test_fill_block_replaces_only_between_its_markers():
    text = "a\n<!-- x:start -->\nold\n<!-- x:end -->\nb\n"
    assert pages.fill_block(text, "x", "new 1\nnew 2") == "a\n<!-- x:start -->\nnew 1\nnew 2\n<!-- x:end -->\nb\n"
    assert pages.fill_block(text, "x", "") == "a\n<!-- x:start -->\n<!-- x:end -->\nb\n"
    with pytest.raises(ValueError, match="y:start"):
        pages.fill_block(text, "y", "z")


def _headlines(**cols):
    n = len(cols["corpus"])
    base = dict(question=["causal"] * n, model=["m"] * n, what=["w"] * n, n=[40] * n, exploratory=[False] * n)
    return pd.DataFrame({**base, **cols})


def test_agreement_says_yes_only_for_the_same_verdict_and_names_an_exploratory_run():
    same = pages.agreement(_headlines(corpus=["pydoc", "readmes"], verdict=["depends", "depends"]))
    assert same["replicated"].tolist() == ["yes"]
    assert same.loc[0, "readmes"] == "depends (n = 40)"
    small = pages.agreement(_headlines(corpus=["pydoc", "readmes"], verdict=["depends", "no evidence"],
                                       n=[40, 12], exploratory=[False, True]))
    assert small["replicated"].tolist() == ["not replicated (the readmes run is exploratory)"]
    assert small.loc[0, "readmes"] == "no evidence (n = 12, exploratory)"
    bad = pages.agreement(_headlines(corpus=["pydoc", "readmes"], verdict=["depends", "no evidence"]))
    assert bad["replicated"].tolist() == ["NO — the corpora disagree"]
    assert pages.agreement(_headlines(corpus=["pydoc"], verdict=["depends"])).empty  # one corpus: nothing to compare


def test_causal_headline_quotes_the_claim_table_not_its_run(tmp_path):
    """An entry's headline p is its Holm p over the WHOLE declared claim (the claim table's), which differs
    from its run's own Bonferroni bound once a second entry is small."""
    runs = [r for r in pages.find_runs(RESULTS) if r.study == "causal" and r.corpus == "pydoc"]
    if len(runs) < 2:
        pytest.skip("the causal runs of both models are not committed")
    res = tmp_path / "results"
    for r in runs:
        shutil.copytree(r.folder, res / r.model / r.corpus / r.study)
    vpath = res / "smollm2-135m" / "pydoc" / "causal" / "causal_verdicts.csv"
    v = pd.read_csv(vpath)
    v.loc[v["layers"] == "L20-29", "p"] = 0.01
    v.to_csv(vpath, index=False)
    runs = pages.find_runs(res)
    table, method = pages.claim_table(runs, "pydoc")
    assert method.startswith("Holm over the 4 entries")
    ps = table["p"].to_numpy()
    assert table.loc["smollm2-135m:L20-29", "p_family"] == pytest.approx(3 * 0.01)  # second smallest of 4: × 3
    assert table.loc["gemma3-270m:L12-17", "p_family"] == pytest.approx(4 * ps.min())
    head = pages._headline_frame(runs)
    row = head[(head["model"] == "smollm2-135m") & head["what"].str.contains("L20-29")].iloc[0]
    assert row["p"] == pytest.approx(0.03) and row["verdict"] == "depends"
    text = pages.readme_headlines(runs)
    assert "p = 0.03 " in text and text.count("depends") == 2


def test_claim_discussion_says_where_the_claim_holds_from_both_corpora(tmp_path):
    """The 'where the claim holds' section is written from the claim tables of both corpora: an entry holds
    only where both say 'depends'; a second corpus that disagrees withdraws it."""
    runs = [r for r in pages.find_runs(RESULTS) if r.study == "causal" and r.corpus == "pydoc"]
    if len(runs) < 2:
        pytest.skip("the causal runs of both models are not committed")
    res = tmp_path / "results"
    for r in runs:
        for corpus in ("pydoc", "readmes"):
            shutil.copytree(r.folder, res / r.model / corpus / r.study)
    text = "\n".join(pages.claim_discussion(pages.find_runs(res)))
    holds = pages.claim_table(pages.find_runs(res), "pydoc")[0]
    depends = [e for e, v in holds["verdict"].items() if v == "depends"]
    assert depends, "the committed runs have no 'depends' entry to check against"
    for e in holds.index:
        model, layers = e.split(":")
        line = next(x for x in text.splitlines() if x.startswith(f"- **{model}, layers {layers}**"))
        assert ("the claim holds here" in line) == (e in depends), line
    assert f"the claim holds (both corpora) for {', '.join(depends)}" in text
    # the second corpus loses the effect: nothing holds any more, and the page says the corpora disagree
    model, layers = depends[0].split(":")
    vpath = res / model / "readmes" / "causal" / "causal_verdicts.csv"
    v = pd.read_csv(vpath)
    v.loc[v["layers"] == layers, "p"] = 0.5
    v.to_csv(vpath, index=False)
    text = "\n".join(pages.claim_discussion(pages.find_runs(res)))
    assert "the claim holds" not in text.replace("where the causal claim holds", "")
    assert f"- **{model}, layers {layers}** — the corpora disagree: not claimed." in text
    # the per-fraction destroy − none changes are quoted from the run's contrasts table
    c = pd.read_csv(res / model / "pydoc" / "causal" / "causal_contrasts.csv")
    first = c[(c["layers"] == layers) & (c["contrast"] == "destroy − none") & (c["estimator"] == "dnll")].iloc[0]
    assert f"at p = {first['frac']:g} (Holm p" in text and pages._signed(first["estimate"]) in text
