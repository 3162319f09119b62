"""Subpackages resolve their modules on first attribute access (PEP 562): ``pg.maths.rope``."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any


def lazy_modules(package: str, path: list[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: a public module name imports that module."""
    names = {m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_")}

    def getattr_(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return importlib.import_module(f"{package}.{name}")

    def dir_() -> list[str]:
        return sorted(names)

    return getattr_, dir_
