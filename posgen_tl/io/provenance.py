"""Where a result came from: the git commit of the code that computed it (one lookup for every output)."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["git_commit"]


def git_commit(short: bool = False) -> str:
    """The commit of the posgen_tl checkout (``" (uncommitted changes)"`` appended when the package's
    code or ``pyproject.toml`` differ from it — regenerated docs or results beside a run do not
    count); ``"unknown (...)"`` outside a git checkout or without git."""
    here = Path(__file__).resolve().parent
    package = here.parent
    try:
        sha = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], cwd=here,
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", str(package),
                                str(package.parent / "pyproject.toml")], cwd=here, capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"
    if sha.returncode != 0:
        return "unknown (not a git checkout)"
    return sha.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")
