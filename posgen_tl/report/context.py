"""What every report stage and every study gets: the configuration, the model (and its random
twin, built once), token sets, and a folder to write tables and figures into.

``report`` and ``study`` share these classes; only the folder differs (``Work``: the report's
resumable ``.work`` folder; ``OutFolder``: a study's ``--out`` folder, written directly).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from posgen_tl.report.html import figure_to_png

__all__ = ["ReportConfig", "Work", "OutFolder", "Context", "layers_for"]


@dataclass
class ReportConfig:
    model: str = "smollm2-135m"
    corpus: str | None = None
    seq_len: int = 256
    n_seq: int = 8
    out: str = "posgen_report"
    quick: bool = False
    twin: bool = True
    seed: int = 0
    #: study parameters ``KEY → text`` (``--param KEY=VALUE``; parsed per stage by
    #: :func:`posgen_tl.report.params.stage_params`)
    params: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "ReportConfig":
        from posgen_tl.report.params import parse_param_args  # noqa: PLC0415

        quick = bool(a.quick)
        return cls(
            model=a.model, corpus=a.corpus, out=a.out, quick=quick, twin=not a.no_twin, seed=a.seed,
            seq_len=a.seq_len or (96 if quick else 256), n_seq=a.n_seq or (2 if quick else 8),
            params=parse_param_args(getattr(a, "param", None)),
        )

    def key(self) -> str:
        d = {k: v for k, v in self.__dict__.items() if k != "out" and not (k == "params" and not v)}
        return hashlib.sha1(json.dumps(d, sort_keys=True, default=_jsonable).encode()).hexdigest()[:12]


class Work:
    """The ``.work`` folder: stage outputs written atomically, a ``done`` marker per stage."""

    def __init__(self, out: Path, cfg: ReportConfig):
        self.dir = out / ".work"
        stamp = self.dir / "config.json"
        if self.dir.exists():
            try:
                same = json.loads(stamp.read_text()).get("key") == cfg.key()
            except (OSError, json.JSONDecodeError):
                same = False
            if not same:
                shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not stamp.exists():
            _atomic_write(stamp, json.dumps({"key": cfg.key(), "config": cfg.__dict__}, indent=1).encode())

    def done(self, stage: str) -> bool:
        return (self.dir / f"{stage}.done").exists()

    def mark(self, stage: str) -> None:
        _atomic_write(self.dir / f"{stage}.done", b"ok")

    def path(self, name: str) -> Path:
        return self.dir / name

    def save_df(self, name: str, df: pd.DataFrame) -> None:
        tmp = self.dir / f".{name}.tmp"
        df.to_csv(tmp, index=False)
        os.replace(tmp, self.dir / name)

    def load_df(self, name: str) -> pd.DataFrame:
        return pd.read_csv(self.dir / name)

    def save_fig(self, name: str, fig: Any) -> None:
        _atomic_write(self.dir / name, figure_to_png(fig))

    def save_json(self, name: str, obj: Any) -> None:
        _atomic_write(self.dir / name, json.dumps(obj, indent=1, default=_jsonable).encode())

    def load_json(self, name: str) -> Any:
        return json.loads((self.dir / name).read_text())


def _jsonable(x: Any) -> Any:
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def _atomic_write(path: Path, data: bytes) -> None:
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
    cfg: ReportConfig
    work: Work
    model: Any
    model_name: str
    _twin: Any = None
    _est_windows: Any = None  # (analysed, reference, note) shared by the decomposition and pattern stages

    def twin(self):
        """``random_twin(model, cfg.seed)``, built once per report run and shared by every stage."""
        if self._twin is None:
            from posgen_tl.io.models import random_twin  # noqa: PLC0415

            self._twin = random_twin(self.model, self.cfg.seed)
        return self._twin

    def tokens(self, n_seq: int | None = None, seq_len: int | None = None):
        from posgen_tl.io.corpus import corpus_tokens  # noqa: PLC0415

        return corpus_tokens(self.model, self.cfg.corpus, seq_len=seq_len or self.cfg.seq_len,
                             n_seq=n_seq or self.cfg.n_seq)


def layers_for(ctx: Context) -> list[int] | None:
    """All layers; in --quick mode every 5th layer (plus the last) to stay within ~2 minutes."""
    from posgen_tl.hooks.capture import probe_hooks  # noqa: PLC0415

    n = probe_hooks(ctx.model)[0].n_layers
    if not ctx.cfg.quick:
        return None
    return sorted(set(range(0, n, 5)) | {n - 1})




_layers = layers_for  # the name stages used before the split (kept for code written against it)
