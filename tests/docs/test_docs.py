"""The docs build (mkdocs, strict: any warning fails) with the API from docstrings and the notebooks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists(),
                    reason="docs extra not installed")
def test_docs_build_strict(tmp_path):
    exe = Path(sys.executable).parent / "mkdocs"
    cmd = [str(exe) if exe.exists() else "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "WARNING" not in r.stderr, r.stderr[-3000:]
    site = tmp_path / "site"
    api = (site / "api" / "index.html").read_text()
    for name in ("load_model", "stream_qk", "fit_additive", "d3_split", "BandStats", "decompose_head", "plot_head_maps",
                 "verdict_table", "run_study", "Finding"):
        assert name in api, name
    assert (site / "concepts" / "index.html").exists()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):  # every course notebook is in the nav
        assert (site / "notebooks" / nb.stem / "index.html").exists(), f"{nb.name} is not in mkdocs.yml's nav"
