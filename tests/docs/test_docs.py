"""The docs build (mkdocs, strict: any warning fails) with the API from docstrings and the notebooks."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


NO_MKDOCS = shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """``mkdocs build --strict``: the built site's folder (the notebooks show their committed outputs; their
    execution is tested in tests/docs/test_notebooks.py)."""
    if NO_MKDOCS:
        pytest.skip("docs extra not installed")
    out = tmp_path_factory.mktemp("docs") / "site"
    exe = Path(sys.executable).parent / "mkdocs"
    cmd = [str(exe) if exe.exists() else "mkdocs", "build", "--strict", "--site-dir", str(out)]
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", POSGEN_NB_SMALL="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    # mkdocs' own warnings (strict mode fails on them anyway); the notebook kernel's log lines are not the docs'
    assert not re.search(r"^WARNING\s+-", r.stderr, flags=re.M), r.stderr[-3000:]
    return out


def test_docs_build_strict(site):
    api = (site / "api" / "index.html").read_text()
    for name in ("load_model", "stream_qk", "fit_additive", "d3_split", "BandStats", "decompose_head", "plot_head_maps",
                 "dose_verdict", "run_study", "Finding"):
        assert name in api, name
    assert (site / "concepts" / "index.html").exists()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):  # every course notebook is in the nav
        assert (site / "notebooks" / nb.stem / "index.html").exists(), f"{nb.name} is not in mkdocs.yml's nav"


def _images(html: str) -> list[str]:
    return re.findall(r"<img[^>]+src=\"([^\"]+)\"", html)


def test_results_pages_show_their_tables_and_figures(site):
    pages = sorted((ROOT / "docs" / "results").glob("*.md"))
    assert pages, "no results pages"
    for md in pages:
        page = site / "results" / (md.stem if md.stem != "index" else "") / "index.html"
        html = page.read_text()
        assert "<table>" in html, f"{md.name}: no table rendered"
        if md.stem == "index":
            continue
        srcs = [x for x in _images(html) if not x.startswith("data:")]
        assert len(srcs) >= md.read_text().count("!["), f"{md.name}: a figure of the page is not rendered"
        for src in srcs:  # every figure the page shows exists in the built site
            assert (page.parent / src).resolve().is_file(), (md.name, src)


def test_notebooks_are_executed_with_their_figures(site):
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        html = (site / "notebooks" / nb.stem / "index.html").read_text()
        assert "data:image/png;base64," in html, f"{nb.name}: the site shows no executed figure"


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium not installed")
def test_a_results_page_shows_figures_in_a_browser(site, tmp_path):
    from PIL import Image

    md = next(p for p in sorted((ROOT / "docs" / "results").glob("*.md")) if "![" in p.read_text())
    page = site / "results" / md.stem / "index.html"
    shot = tmp_path / "shot.png"
    r = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'prof'}",
         "--window-size=1200,6000", f"--screenshot={shot}", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-500:]
    im = Image.open(shot).convert("L")
    hist = im.histogram()
    # text alone leaves the page > 97 % white; the figures (axes, curves, fills) make it darker
    assert sum(hist[:250]) / sum(hist) > 0.04, sum(hist[:250]) / sum(hist)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium not installed")
def test_results_pages_fit_a_1280px_window_with_the_answer_first(site, tmp_path):
    """Laid out by headless Chromium at 1280 px, as a reader opens them: on every results page no table a reader
    sees is wider than the content column (cut off or scrolling sideways) and the answer sentence is above the
    first table."""
    from browser import layout, layout_problems

    for md in sorted((ROOT / "docs" / "results").glob("*.md")):
        page = site / "results" / (md.stem if md.stem != "index" else "") / "index.html"
        m = layout(page, tmp_path, width=1280)
        unfolded = re.sub(r"<details.*?</details>", "", md.read_text(), flags=re.S)
        shown = "\n|" in unfolded  # a table outside every folded block
        assert bool(m["tables"]) == shown, f"{md.name}: {len(m['tables'])} tables visible"  # folded ones are not
        assert not layout_problems(m), (md.name, layout_problems(m))


def test_api_reference_covers_every_public_module():
    api = (ROOT / "docs" / "api.md").read_text()
    listed = set(re.findall(r"^::: (posgen_tl[\w.]*)$", api, flags=re.M))
    pkg = ROOT / "posgen_tl"
    modules = set()
    for f in pkg.rglob("*.py"):
        rel = f.relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if any(p.startswith("_") for p in parts):
            continue
        modules.add(".".join(parts))
    packages_only = {m for m in modules if (ROOT / m.replace(".", "/") / "__init__.py").exists()}
    missing = sorted(modules - packages_only - listed)
    assert not missing, f"docs/api.md does not document {missing}"
    assert len(listed) == len(re.findall(r"^::: ", api, flags=re.M)), "a module is listed twice"


def test_the_screenshots_show_the_current_pages():
    """docs/img's screenshots of the causal page and the example report were taken from the pages as they are now
    (``python scripts/screenshots.py`` records each source's SHA-1), are 1280 px wide PNGs, and the docs home
    shows them."""
    import importlib.util
    import struct

    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "scripts" / "screenshots.py")
    shots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shots)
    assert shots.stale() == [], f"stale screenshots {shots.stale()}: run python scripts/screenshots.py"
    home = (ROOT / "docs" / "index.md").read_text()
    for name in shots.SHOTS:
        png = (ROOT / "docs" / "img" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", png[16:24])
        assert width == shots.WIDTH and height == shots.SHOTS[name][2], (name, width, height)
        assert f"img/{name}" in home, f"docs/index.md does not show {name}"
