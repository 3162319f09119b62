"""``posgen-tl report``: the whole analysis → one self-contained HTML page + results.json + CSVs.

Interruption-safe: every stage writes its outputs into ``<out>/.work/`` and marks itself
done only after all of them are written (atomic renames). The final ``report.html``,
``results.json`` and CSVs appear in ``<out>/`` only when every stage is done; a rerun with
the same arguments resumes from the finished stages (different arguments start afresh).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from .html import figure_to_png, render_html

__all__ = ["run_report", "ReportConfig", "STAGES"]


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

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "ReportConfig":
        quick = bool(a.quick)
        return cls(
            model=a.model, corpus=a.corpus, out=a.out, quick=quick, twin=not a.no_twin, seed=a.seed,
            seq_len=a.seq_len or (96 if quick else 256), n_seq=a.n_seq or (2 if quick else 8),
        )

    def key(self) -> str:
        d = {k: v for k, v in self.__dict__.items() if k != "out"}
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


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


# ----------------------------------------------------------------------------- stages

Stage = Callable[[Any, "Context"], None]


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
            from ..models import random_twin  # noqa: PLC0415

            self._twin = random_twin(self.model, self.cfg.seed)
        return self._twin

    def tokens(self, n_seq: int | None = None, seq_len: int | None = None):
        from ..corpus import corpus_tokens  # noqa: PLC0415

        return corpus_tokens(self.model, self.cfg.corpus, seq_len=seq_len or self.cfg.seq_len,
                             n_seq=n_seq or self.cfg.n_seq)


def _layers(ctx: Context) -> list[int] | None:
    """All layers; in --quick mode every 5th layer (plus the last) to stay within ~2 minutes."""
    from ..capture import probe_hooks  # noqa: PLC0415

    n = probe_hooks(ctx.model)[0].n_layers
    if not ctx.cfg.quick:
        return None
    return sorted(set(range(0, n, 5)) | {n - 1})


from .stages import STAGES  # noqa: E402


def run_report(args: argparse.Namespace | ReportConfig) -> int:
    """Run every stage (resuming finished ones) and write the report; returns an exit code."""
    from ..capture import probe_hooks  # noqa: PLC0415
    from ..models import load_model  # noqa: PLC0415

    cfg = args if isinstance(args, ReportConfig) else ReportConfig.from_args(args)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("report.html", "results.json"):
        (out / stale).unlink(missing_ok=True)  # never leave an old, complete-looking report beside a new run
    work = Work(out, cfg)
    t0 = time.time()
    model = load_model(cfg.model, verbose=True)
    spec, _ = probe_hooks(model)
    ctx = Context(cfg, work, model, spec.model_name)
    timings: dict[str, float] = {}
    for name, fn, _ in STAGES:
        if work.done(name):
            print(f"[posgen-tl] {name}: already done (resuming)")
            continue
        ts = time.time()
        print(f"[posgen-tl] {name} ...", flush=True)
        fn(ctx)
        work.mark(name)
        timings[name] = time.time() - ts
        print(f"[posgen-tl] {name}: {timings[name]:.0f} s", flush=True)
    sections, results = [], {"config": cfg.__dict__, "model": spec.model_name, "stage_seconds": timings}
    for name, _, render in STAGES:
        sec, res = render(ctx)
        sections.append(sec)
        results[name] = res
    results["total_seconds"] = time.time() - t0
    meta = {"model": spec.model_name, "corpus": cfg.corpus or "pydoc_data.topics (stdlib)",
            "seq_len": cfg.seq_len, "n_seq": cfg.n_seq, "quick": cfg.quick, "seed": cfg.seed,
            "generated": time.strftime("%Y-%m-%d %H:%M:%S")}
    for f in sorted(work.dir.glob("*.csv")):
        shutil.copyfile(f, out / f.name)
    _atomic_write(out / "results.json", json.dumps(results, indent=1, default=_jsonable).encode())
    _atomic_write(out / "report.html", render_html(f"posgen_tl report — {spec.model_name}", meta, sections).encode())
    print(f"[posgen-tl] wrote {out / 'report.html'} ({time.time() - t0:.0f} s)")
    return 0
