"""One published study run as the pages see it (a study output folder and its record)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

__all__ = ["Run"]


@dataclasses.dataclass(frozen=True)
class Run:
    """One study output folder: ``folder = <results>/<model>/<corpus>/<study>``, its record ``meta``."""

    study: str
    model: str
    corpus: str
    folder: Path
    meta: dict

    @property
    def key(self) -> str:
        """``"<model> · <corpus>"``: how the pages name the run."""
        return f"{self.model} · {self.corpus}"
