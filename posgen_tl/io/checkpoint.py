"""A folder that keeps a long run's finished pieces, so an interrupted run continues where it stopped.

Every piece is written atomically (to a temporary name, then renamed): a piece that exists is complete. Tables
are CSV read back with exact floats (``float_precision="round_trip"``), records are JSON. What a piece means and
which design a folder belongs to is the experiment's business (:mod:`posgen_tl.experiments.causal`;
:class:`Pieces` serves the experiments whose pieces are independent tables).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["RunFolder", "Pieces"]


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


class Pieces:
    """The finished tables of one run design, each computed once: ``rows(name, compute)`` returns the table kept
    under ``name`` or computes, keeps and returns it. Without a folder (``folder=None``) nothing is kept and
    ``compute`` always runs, so an experiment writes one code path for both.

    ``fingerprint`` (JSON-able: the options that change a number, the model, its dtype, the windows) names the
    design, together with the package's version (``code``: pieces computed by another release are not mixed with
    this one's — a release-level check: between two commits of one development version pieces are shared, so a
    change that moves numbers must bump the version or clear the folder); a folder holding another design's pieces
    is refused — ``what`` names the experiment in the error.

    Raises:
        ValueError: ``folder`` keeps pieces of another design."""

    def __init__(self, folder: str | Path | None, fingerprint: dict[str, Any], what: str):
        from posgen_tl._version import __version__  # noqa: PLC0415

        self.folder: RunFolder | None = None
        if folder is None:
            return
        self.folder = RunFolder(folder)
        key = json.loads(json.dumps({**fingerprint, "code": __version__}, sort_keys=True, default=str))
        old = self.folder.read_json("fingerprint")
        if old is not None and old != key:
            why = (f"it was computed by posgen_tl {old['code']}" if "code" in old else
                   "it was computed by an earlier build, which recorded no version")
            why = (why
                   if {k: v for k, v in old.items() if k != "code"} == {k: v for k, v in key.items() if k != "code"}
                   else "config, model or windows differ")
            raise ValueError(f"{what}: {self.folder.dir} holds a checkpoint of another {what} design ({why}); remove "
                             "it or choose another output folder")
        self.folder.write_json("fingerprint", key, indent=1, sort_keys=True)

    def get(self, name: str) -> pd.DataFrame | None:
        """The table ``name`` where it was kept, else ``None`` (nothing is computed; always ``None`` without a
        folder)."""
        return None if self.folder is None else self.folder.read_rows(name)

    def rows(self, name: str, compute: Callable[[], pd.DataFrame]) -> pd.DataFrame:
        """The table ``name`` of this design: read back exactly where it was kept, else ``compute()`` (kept)."""
        if self.folder is None:
            return compute()
        got = self.folder.read_rows(name)
        if got is None:
            got = compute()
            self.folder.write_rows(name, got)
        return got

    def kept(self) -> list[str]:
        """The names of the tables kept so far (none without a folder)."""
        return [] if self.folder is None else sorted(f.stem for f in self.folder.dir.glob("*.csv"))
