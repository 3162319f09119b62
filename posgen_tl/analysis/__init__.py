"""Runners: pure maths applied to a model through :mod:`posgen_tl.capture`, results as DataFrames.

One module per experiment (``decomposition``, ``head``, ``pattern``, ``tolerance``,
``taxonomy``, and those other branches add: ``causal``, ``sufficiency``, ``length``); each is
imported on first attribute access (``pg.analysis.pattern.link_to_decomposition``).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("_") or name not in {m.name for m in pkgutil.iter_modules(__path__)}:
        raise AttributeError(f"module 'posgen_tl.analysis' has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def __dir__() -> list[str]:
    return sorted({*globals(), *(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))})
