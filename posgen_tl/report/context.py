"""What every experiment's ``compute``/``render`` gets in a report or study run: the model (and its
random twin, built once) and a folder to write tables and figures into.

``report`` and ``study`` share these classes; only the folder differs (``Work``: the report's
resumable ``.work`` folder; ``OutFolder``: a study's ``--out`` folder, written directly).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from posgen_tl.report.html import figure_to_png

__all__ = ["Work", "OutFolder", "Context", "atomic_write", "jsonable"]


class Work:
    """The ``.work`` folder: stage outputs written atomically, a ``done`` marker per stage."""

    def __init__(self, out: Path, config: dict[str, Any]):
        """``config``: the run's whole configuration (model, preset, every experiment's options); a
        folder written under another configuration is discarded, so a resume never mixes runs."""
        self.dir = out / ".work"
        stamp = self.dir / "config.json"
        key = hashlib.sha1(json.dumps(config, sort_keys=True, default=jsonable).encode()).hexdigest()[:12]
        if self.dir.exists():
            try:
                same = json.loads(stamp.read_text()).get("key") == key
            except (OSError, json.JSONDecodeError):
                same = False
            if not same:
                shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not stamp.exists():
            atomic_write(stamp, json.dumps({"key": key, "config": config}, indent=1, default=jsonable).encode())

    def done(self, stage: str) -> bool:
        return (self.dir / f"{stage}.done").exists()

    def mark(self, stage: str) -> None:
        atomic_write(self.dir / f"{stage}.done", b"ok")

    def path(self, name: str) -> Path:
        return self.dir / name

    def save_df(self, name: str, df: pd.DataFrame) -> None:
        tmp = self.dir / f".{name}.tmp"
        df.to_csv(tmp, index=False)
        os.replace(tmp, self.dir / name)

    def load_df(self, name: str) -> pd.DataFrame:
        return pd.read_csv(self.dir / name)

    def save_fig(self, name: str, fig: Any) -> None:
        atomic_write(self.dir / name, figure_to_png(fig))

    def save_json(self, name: str, obj: Any) -> None:
        atomic_write(self.dir / name, json.dumps(obj, indent=1, default=jsonable).encode())

    def load_json(self, name: str) -> Any:
        return json.loads((self.dir / name).read_text())


def jsonable(x: Any) -> Any:
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class OutFolder(Work):
    """A study's output folder: the same interface as :class:`Work`, files written straight into
    ``out`` (no ``.work`` folder, no resume markers)."""

    def __init__(self, out: Path):  # noqa: D107 — no config stamp, nothing to resume
        self.dir = Path(out)
        self.dir.mkdir(parents=True, exist_ok=True)

    def done(self, stage: str) -> bool:
        return False

    def mark(self, stage: str) -> None:
        return None


@dataclass
class Context:
    """What a report or a study run holds while it runs experiments: the model, its random twin (built once,
    seeded), the folder to write into, and ``results`` — the Results of the experiments already run, by name
    (what a later experiment's ``run`` takes as ``upstream``)."""

    model: Any
    work: Work
    model_name: str
    seed: int = 0
    results: dict = field(default_factory=dict)
    _twins: dict = field(default_factory=dict)

    def twin(self, seed: int | None = None) -> Any:
        """``random_twin(model, seed)`` (``seed``: an experiment's own, default the run's), built once per seed and
        shared by every experiment of that seed — so an experiment given another seed (``--param NAME.seed=…``)
        measures the twin its config records, not the run's."""
        seed = self.seed if seed is None else int(seed)
        if seed not in self._twins:
            from posgen_tl.io.models import random_twin  # noqa: PLC0415

            self._twins[seed] = random_twin(self.model, seed)
        return self._twins[seed]
