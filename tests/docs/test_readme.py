"""The README as a new user reads it: short, its two fresh-machine commands true, its quickstart runs,
every link it shows exists, nothing outside the repository referenced."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_is_a_front_page():
    assert len(README.splitlines()) <= 150
    for heading in ("## Run it on a fresh machine", "## Quickstart", "## What it finds", "## What is supported",
                    "## Citation"):
        assert heading in README, heading


def test_the_two_fresh_machine_commands_are_the_ones_ci_and_setup_use():
    bash = [b.strip() for b in _blocks("bash")]
    report, tests = bash[0], bash[1]
    assert report == "bash scripts/setup.sh && .venv/bin/posgen-tl report --model smollm2-135m --out posgen_report"
    assert tests == "bash scripts/setup.sh && .venv/bin/python -m pytest"
    assert tests in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command verbatim
    assert (ROOT / "scripts" / "setup.sh").exists()
    assert 'posgen-tl = "posgen_tl.cli:main"' in (ROOT / "pyproject.toml").read_text()


def test_every_relative_link_exists():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    local = [x for x in links if not x.startswith(("http://", "https://"))]
    assert local, "no links found: the pattern is wrong"
    missing = [x for x in local if not (ROOT / x).exists()]
    assert not missing, missing


def test_nothing_outside_the_repository_is_referenced():
    """The project's docs stand alone: no sibling folders or design notes that are not in the repo."""
    files = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.sh", "*.yml", "*.toml", "*.cff"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    bad = []
    for f in files:
        if f == "tests/docs/test_readme.py":
            continue
        text = (ROOT / f).read_text(errors="replace")
        for needle in ("../shared", "MODELS.md", "DESIGN.md", "METHOD.md"):
            if needle in text:
                bad.append((f, needle))
    assert not bad, bad


@pytest.mark.real
def test_the_quickstart_runs_and_shows_what_it_says(smollm2, monkeypatch):
    import matplotlib
    import matplotlib.pyplot as plt
    import torch

    import posgen_tl as pg

    code = _blocks("python")[0]
    assert code.count("\n") <= 12  # a quickstart, not a script
    monkeypatch.setattr(pg, "load_model", lambda name: smollm2)  # the session's model (same weights, loaded once)
    ns: dict = {}
    exec(compile(code, "README quickstart", "exec"), ns)  # noqa: S102
    assert isinstance(ns["fig"], matplotlib.figure.Figure) and len(ns["fig"].axes) >= 2
    nll = ns["nll"]
    assert isinstance(nll, torch.Tensor) and nll.shape[0] == 4 and torch.isfinite(nll).all()
    assert float(nll.mean()) > 0
    plt.close("all")
