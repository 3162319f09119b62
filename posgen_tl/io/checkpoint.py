"""A folder that keeps a long run's finished pieces, so an interrupted run continues where it stopped.

Every piece is written atomically (to a temporary name, then renamed): a piece that exists is complete. Tables
are CSV read back with exact floats (``float_precision="round_trip"``), records are JSON. What a piece means and
which design a folder belongs to is the experiment's business (:mod:`posgen_tl.experiments.causal`,
:mod:`posgen_tl.experiments.patching`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["RunFolder"]


class RunFolder:
    """The pieces of one run in ``folder`` (created if missing).

    ``name`` below is a file name without its suffix (``.json`` for records, ``.csv`` for tables)."""

    def __init__(self, folder: str | Path):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _write(self, path: Path, text: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)

    def read_json(self, name: str) -> Any | None:
        """The record ``name``, or ``None`` when it was never (completely) written."""
        f = self.dir / f"{name}.json"
        return json.loads(f.read_text()) if f.exists() else None

    def write_json(self, name: str, obj: Any, **dumps: Any) -> None:
        """Write the record ``name`` (``dumps``: options of :func:`json.dumps`; non-JSON values as floats)."""
        self._write(self.dir / f"{name}.json", json.dumps(obj, **{"default": float, **dumps}))

    def read_rows(self, name: str) -> pd.DataFrame | None:
        """The table ``name`` with its exact floats, or ``None``."""
        f = self.dir / f"{name}.csv"
        return pd.read_csv(f, float_precision="round_trip") if f.exists() else None

    def write_rows(self, name: str, rows: pd.DataFrame) -> None:
        """Write the table ``name`` (without the index)."""
        tmp = self.dir / f"{name}.csv.tmp"
        rows.to_csv(tmp, index=False)
        tmp.replace(self.dir / f"{name}.csv")

    def has(self, *names: str, suffix: str = ".csv") -> bool:
        """Whether every piece ``names`` (with ``suffix``) exists."""
        return all((self.dir / f"{n}{suffix}").exists() for n in names)

    def drop(self, *patterns: str) -> None:
        """Remove the pieces matching the glob ``patterns`` (e.g. ``"batch_*"``)."""
        for pat in patterns:
            for f in self.dir.glob(pat):
                f.unlink(missing_ok=True)

    def records(self, pattern: str) -> list[Any]:
        """The JSON records matching ``pattern`` whose table of the same name exists, in name order."""
        return [json.loads(f.read_text()) for f in sorted(self.dir.glob(f"{pattern}.json"))
                if f.with_suffix(".csv").exists()]
