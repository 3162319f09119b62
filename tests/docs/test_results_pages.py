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
    runs = pages.find_runs(RESULTS)
    if not runs:
        pytest.skip("no study folders committed")
    run = runs[0]
    res, docs = tmp_path / "results", tmp_path / "docs"
    dst = res / run.model / run.corpus / run.study
    shutil.copytree(run.folder, dst)
    pages.write_pages(res, docs)
    assert pages.stale(res, docs) == []
    csvs = sorted(p for p in dst.glob("*.csv") if p.stat().st_size)
    changed = False
    for p in csvs:  # the first table the page shows: change one of its numbers
        df = pd.read_csv(p)
        num = [c for c in df.columns if pd.api.types.is_float_dtype(df[c]) and df[c].notna().any()]
        if not num:
            continue
        df.loc[df[num[0]].first_valid_index(), num[0]] += 1.0
        df.to_csv(p, index=False)
        if pages.stale(res, docs):
            changed = True
            break
    assert changed, "no table change reached the page"


def test_fill_block_replaces_only_between_its_markers():
    text = "a\n<!-- x:start -->\nold\n<!-- x:end -->\nb\n"
    assert pages.fill_block(text, "x", "new 1\nnew 2") == "a\n<!-- x:start -->\nnew 1\nnew 2\n<!-- x:end -->\nb\n"
    assert pages.fill_block(text, "x", "") == "a\n<!-- x:start -->\n<!-- x:end -->\nb\n"
    with pytest.raises(ValueError, match="y:start"):
        pages.fill_block(text, "y", "z")
