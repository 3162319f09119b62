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
