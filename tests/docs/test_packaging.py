"""Packaging conventions: one version source, a typed wheel with its licence, metadata that twine accepts."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import posgen_tl

ROOT = Path(__file__).resolve().parents[2]


def test_one_version_everywhere():
    v = posgen_tl.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", v), v
    assert importlib.metadata.version("posgen_tl") == v  # pyproject reads it from posgen_tl/_version.py
    assert f'version: "{v}"' in (ROOT / "CITATION.cff").read_text()
    assert f"## {v}" in (ROOT / "CHANGELOG.md").read_text()
    assert not re.search(r'^version\s*=\s*"', (ROOT / "pyproject.toml").read_text(), re.M)  # no hand-written copy


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_wheel_is_typed_licensed_and_passes_twine(tmp_path):
    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--sdist", "--no-isolation", "--outdir", str(out),
                        str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = out.glob("*.whl")
    assert wheel.name.startswith(f"posgen_tl-{posgen_tl.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "posgen_tl/py.typed" in names and any(n.endswith("licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "results/", "benchmarks/")) for n in names)  # code only
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Typing :: Typed" in meta and "License-Expression: MIT" in meta
    assert "Project-URL" not in meta  # no public home yet: no address that does not exist (issue #37)
    r = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, out.iterdir())],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.count("PASSED") == 2, r.stdout + r.stderr
