"""The commit a run records (posgen_tl.io.provenance.git_commit): 'uncommitted changes' means the
package's code differs from the commit, not that regenerated docs or results sit beside the run."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

import posgen_tl.io.provenance as prov

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_only_the_package_and_pyproject_make_a_run_uncommitted(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg" / "io").mkdir(parents=True)
    shutil.copy(prov.__file__, repo / "pkg" / "io" / "provenance.py")
    (repo / "pkg" / "core.py").write_text("x = 1\n")
    (repo / "pyproject.toml").write_text("[project]\nname = 'pkg'\n")
    (repo / "README.md").write_text("results\n")
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.email=a@b", "-c", "user.name=a", "add", ".")
    _git(repo, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "init")
    spec = importlib.util.spec_from_file_location("copied_provenance", repo / "pkg" / "io" / "provenance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    head = _git(repo, "rev-parse", "HEAD")
    assert mod.git_commit() == head
    (repo / "README.md").write_text("regenerated results\n")  # docs beside a run: still the commit's code
    (repo / "results.csv").write_text("a\n")  # an untracked result
    assert mod.git_commit() == head
    (repo / "pkg" / "core.py").write_text("x = 2\n")  # the code itself changed
    assert mod.git_commit() == f"{head} (uncommitted changes)"
    _git(repo, "checkout", "-q", "--", "pkg/core.py")
    (repo / "pyproject.toml").write_text("[project]\nname = 'pkg2'\n")
    assert mod.git_commit() == f"{head} (uncommitted changes)"
