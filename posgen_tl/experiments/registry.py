"""Every experiment, by name — what ``posgen-tl study NAME``, ``posgen-tl report``, the library's
``pg.run(NAME, model, cfg)`` and the results pages derive from. Nothing here defines an experiment: each
module of :mod:`posgen_tl.experiments` does (its ``Config``, ``Result``, a pure ``run(model, cfg, *, …) ->
Result``, ``render(result) -> Section``, ``NAME``, ``ABOUT``, ``NEEDS``, and ``FILES`` where its tables keep
published file names); this module lists them in report order, builds their configs from command-line text,
runs them (:func:`run`, the experiments they need first), and saves / loads their Results (:func:`save`,
:func:`load`).

Adding an experiment: a module ``posgen_tl/experiments/<name>.py`` with those names, its name in
:data:`ORDER` (and in :data:`REPORT` if the report runs it), a plot module of the same name and a test
module of the same name.
"""

from __future__ import annotations

import importlib
import json
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from posgen_tl.experiments.base import PRESETS, Config
from posgen_tl.io.defaults import DEFAULT_MODEL

__all__ = ["ORDER", "REPORT", "PROTOCOL", "SIZES", "experiment", "names", "make_config", "split_params", "run_study",
           "run_experiment", "run", "run_or_skip", "save", "load", "resumable", "inputs"]

#: every experiment, in the order the report runs and numbers them
ORDER = ("exactness", "decomposition", "pattern", "tolerance", "causal", "sufficiency", "taxonomy", "length",
         "patching", "gap_attention")
#: the experiments ``posgen-tl report`` runs (``gap_attention`` needs a taxonomy table: a study of its own)
REPORT = tuple(n for n in ORDER if n != "gap_attention")
#: the experiments in the protocol shape — all of them: ``run(model, cfg, *, …) -> Result`` (no file I/O),
#: ``render(result) -> Section``; :func:`save` / :func:`load` keep a Result in a folder
PROTOCOL = ORDER
#: the options every Config has (``base.Config``): the report's size flags set them for every experiment
SIZES = ("n_seq", "seq_len", "seed", "corpus", "twin")
#: size flags an experiment does not take from the report (it keeps its own default); e.g. the exactness
#: check always compares 2 × 64 tokens
_OWN_SIZES: dict[str, tuple[str, ...]] = {"exactness": ("n_seq", "seq_len")}


def experiment(name: str) -> ModuleType:
    """The module of experiment ``name``.

    Raises:
        KeyError: an unknown name (the message lists the known ones)."""
    if name not in ORDER:
        raise KeyError(f"unknown experiment {name!r}; one of: {', '.join(ORDER)}")
    return importlib.import_module(f"posgen_tl.experiments.{name}")


def names() -> list[str]:
    """Experiment names, report order."""
    return list(ORDER)


def split_params(params: Mapping[str, str], experiments: Sequence[str]) -> dict[str, dict[str, str]]:
    """Route report-level ``--param`` text to experiments: ``causal.layers=10-19`` goes to ``causal``;
    a bare ``n_ref=8`` goes to every experiment in ``experiments`` that declares ``n_ref``.

    Raises:
        ValueError: a key no experiment declares, or a qualified key naming an unknown experiment."""
    out: dict[str, dict[str, str]] = {n: {} for n in experiments}
    for key, text in params.items():
        exp, dot, opt = key.rpartition(".")
        if dot:
            if exp not in out:
                raise ValueError(f"--param {key}: unknown experiment {exp!r}; one of {', '.join(experiments)}")
            out[exp][opt] = text
            continue
        takers = [n for n in experiments if key in {o.name for o in experiment(n).Config.options()}]
        if not takers:
            raise ValueError(f"--param {key}: no experiment of this run has an option {key!r}")
        for n in takers:
            out[n][key] = text
    return out


def make_config(name: str, preset: str = "default", params: Mapping[str, str] | None = None,
                sizes: Mapping[str, Any] | None = None) -> Config:
    """The Config of experiment ``name``: ``preset``, then the report/study ``sizes`` (typed; ``None``
    values ignored; sizes the experiment keeps to itself skipped), then ``params`` (command-line text).

    Raises:
        ValueError: an unknown preset, option or unparsable value (naming it)."""
    cls = experiment(name).Config
    own = _OWN_SIZES.get(name, ())
    typed = {k: v for k, v in (sizes or {}).items() if v is not None and k not in own}
    return cls.from_text(dict(params or {}), preset, **typed)


def run(name: str, model: Any, cfg: Config | None = None, *, upstream: Mapping[str, Any] | None = None,
        **kw: Any) -> Any:
    """``experiment(name).run(model, cfg, **kw)`` — the library's one door to every experiment
    (``pg.run("sufficiency", model, cfg)``); returns the experiment's Result. The Results of the experiments it
    NEEDS come from ``upstream`` or are run first, with the options their Configs share with ``cfg`` (sizes,
    layers, …)."""
    from posgen_tl.hooks.edits import shared_means  # noqa: PLC0415

    mod = experiment(name)
    ups = dict(upstream or {})
    with shared_means():  # an experiment and those it needs read the k̄ of the same reference windows once
        for dep in mod.NEEDS:
            if dep not in ups:
                own = cfg if cfg is not None else mod.Config()
                shared = {o.name for o in experiment(dep).Config.options()} & {o.name for o in own.options()}
                dep_cfg = experiment(dep).Config(**{k: getattr(own, k) for k in shared})
                ups[dep] = run(dep, model, dep_cfg, **({"progress": kw["progress"]} if "progress" in kw else {}))
        return mod.run(model, cfg, **({"upstream": ups} if mod.NEEDS else {}), **kw)


def run_or_skip(name: str, model: Any, cfg: Config, **kw: Any) -> Any:
    """:func:`run`, or a Result with ``meta["skipped"]`` when the corpus cannot give the windows or the library
    refuses the model by name (:func:`posgen_tl.experiments.base.run_or_skip`); any other error propagates."""
    from posgen_tl.experiments import base  # noqa: PLC0415

    mod = experiment(name)
    return base.run_or_skip(mod.run, mod.Result, f"the {name} study", model, cfg, **kw)


def save(name: str, result: Any, folder: str | Path) -> list[Path]:
    """Write experiment ``name``'s Result into ``folder`` (its tables as CSVs, named by the module's ``FILES``
    where it has them, and ``<name>_result.json``). Returns the written paths."""
    from posgen_tl.experiments import base  # noqa: PLC0415

    mod = experiment(name)
    return base.save_tables(name, result.tables, result.config, result.meta, folder, getattr(mod, "FILES", None))


def load(name: str, folder: str | Path) -> Any:
    """The Result of experiment ``name`` that :func:`save` (or a study run before the Result existed) wrote into
    ``folder``. Text columns the module lists in ``TEXT_COLUMNS`` read back as ``""`` where empty.

    Raises:
        FileNotFoundError: no result of ``name`` there."""
    from posgen_tl.experiments import base  # noqa: PLC0415

    mod = experiment(name)
    tables, config, meta = base.load_tables(name, folder, getattr(mod, "FILES", None), getattr(mod, "LEGACY_META", None))
    for t in tables.values():
        for col in getattr(mod, "TEXT_COLUMNS", ()):
            if col in t.columns:
                t[col] = t[col].fillna("")
    return mod.Result(tables, config, meta)


def resumable(name: str) -> bool:
    """Whether experiment ``name`` keeps a checkpoint (its ``run`` takes ``checkpoint=``): an interrupted study or
    report continues where it stopped instead of starting again."""
    import inspect  # noqa: PLC0415

    return "checkpoint" in inspect.signature(experiment(name).run).parameters


def inputs(name: str, *, checkpoint: Path | None = None, twin: Any = None,
           upstream: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The keyword inputs a report or study passes to experiment ``name``'s ``run``, as far as it takes them:
    ``checkpoint`` (a folder that makes it resumable), ``twin`` (a callable giving the shared random-init twin)
    and the Results of its ``NEEDS`` (keyword ``upstream``)."""
    import inspect  # noqa: PLC0415

    params = inspect.signature(experiment(name).run).parameters
    out: dict[str, Any] = {}
    if checkpoint is not None and "checkpoint" in params:
        out["checkpoint"] = checkpoint
    if twin is not None and "twin" in params:
        out["twin"] = twin
    if upstream and "upstream" in params:
        out["upstream"] = dict(upstream)
    return out


class _Folder(Protocol):
    @property
    def dir(self) -> Path: ...


class StageContext(Protocol):
    """What :func:`run_experiment` needs of a report's or a study's context (``posgen_tl.report.context.Context``):
    the model, the folder it writes into, the shared random twin and the Results already run, by name."""

    model: Any
    results: dict

    @property
    def work(self) -> _Folder: ...

    def twin(self, seed: int | None = None) -> Any: ...


def run_experiment(name: str, ctx: StageContext, cfg: Config) -> tuple[Any, float]:
    """Run experiment ``name`` in ``ctx`` (a study's folder, model and shared twin) and render it; returns
    ``(Section, seconds of the run)``. The run resumes from ``<folder>/.partial`` where the experiment keeps a
    checkpoint (removed once the Result is saved); the Result is saved into the folder and kept in
    ``ctx.results`` for the experiments that need it; the section's figures are written beside it."""
    import shutil  # noqa: PLC0415

    mod = experiment(name)
    t0 = time.time()
    partial = ctx.work.dir / ".partial"
    result = run_or_skip(name, ctx.model, cfg, **inputs(name, checkpoint=partial, twin=ctx.twin, upstream=ctx.results))
    seconds = time.time() - t0
    save(name, result, ctx.work.dir)
    shutil.rmtree(partial, ignore_errors=True)
    ctx.results[name] = result
    sec = mod.render(result)
    for i, (png, _) in enumerate(sec.figures):
        (ctx.work.dir / f"fig_{name}_{i}.png").write_bytes(png)
    return sec, seconds


def _markdown(name: str, meta: dict[str, Any], sec: Any, files: list[str]) -> str:
    from posgen_tl.report.text import section_markdown  # noqa: PLC0415

    stamp = [f"> **UNCHECKED** — layers whose exactness check did not pass were analysed ({meta['unchecked']}): "
             "these numbers are not shown to be the model's.", ""] if meta.get("unchecked") else []
    out = [f"# posgen-tl study {name} — {meta['model']}" + (" — UNCHECKED" if meta.get("unchecked") else ""), "",
           *stamp,
           f"- command: `{meta['command']}`", f"- git commit: {meta['git_commit']}",
           f"- wall time: {meta['wall_seconds']:.1f} s", f"- configuration: `{json.dumps(meta['config'])}`",
           *([f"- statistics recomputed from the kept rows: `{meta['restat']['command']}` (commit "
              f"{meta['restat']['git_commit']})"] if meta.get("restat") else []), ""]
    out += section_markdown(sec, level=2, fold_details=False)
    figs = [f for f in files if f.endswith(".png")]
    if figs:
        out += ["## Figures", ""] + [f"![{f}]({f})" for f in figs] + [""]
    out += ["## Files", ""] + [f"- `{f}`" for f in files] + [""]
    return "\n".join(out)


def restat_study(name: str, out: str | Path, *, command: str, **options: Any) -> Path:
    """Recompute the statistics of the study ``name`` in the folder ``out`` from its kept per-document rows
    (``<module>.restat(result, **options)``; no model is loaded, no forward runs) and rewrite its tables, figures,
    ``<name>.md`` and ``<name>.json``. The run's command, commit, configuration and wall time stay; ``restat``
    records this ``command`` and the commit that recomputed. Returns the markdown's path.

    Raises:
        ValueError: the experiment cannot recompute its statistics. FileNotFoundError: no study ``name`` there."""
    from posgen_tl.io.provenance import git_commit  # noqa: PLC0415

    mod, out = experiment(name), Path(out)
    if not hasattr(mod, "restat"):
        raise ValueError(f"the {name} study keeps no per-document rows to recompute its statistics from")
    old = json.loads((out / f"{name}.json").read_text())
    result = mod.restat(load(name, out), **options)
    save(name, result, out)
    sec = mod.render(result)
    for i, (png, _) in enumerate(sec.figures):
        (out / f"fig_{name}_{i}.png").write_bytes(png)
    meta = {k: v for k, v in old.items() if k not in ("findings", "results", "files", "restat")}
    meta["restat"] = {"command": command, "git_commit": git_commit()}
    return _write_study(name, out, meta, sec, list(old["files"]))


def _write_study(name: str, out: Path, meta: dict[str, Any], sec: Any, files: list[str]) -> Path:
    """Write ``<name>.md`` and ``<name>.json`` (``meta`` with the section's findings and results, ``files``) into
    ``out``; returns the markdown's path."""
    from posgen_tl.report.context import atomic_write, jsonable  # noqa: PLC0415

    atomic_write(out / f"{name}.md", _markdown(name, meta, sec, files).encode())
    payload = {**meta, "findings": [f.as_dict() for f in sec.findings], "results": sec.results, "files": files}
    atomic_write(out / f"{name}.json", json.dumps(payload, indent=1, default=jsonable).encode())
    return out / f"{name}.md"


def run_study(name: str, cfg: Config, out: str | Path, *, model: Any = DEFAULT_MODEL, preset: str = "default",
              params: Mapping[str, str] | None = None, command: str | None = None,
              load: Mapping[str, Any] | None = None) -> Path:
    """Run experiment ``name`` (after the experiments it needs, built from the same preset, sizes and
    params) into the folder ``out``; writes its tables and figures and beside them ``<name>.md`` /
    ``<name>.json`` (command, git commit, configuration, wall time, findings, results). Returns the
    markdown's path.

    ``model``: a loaded model or a name for :func:`posgen_tl.io.models.load_model` (with ``load``: its
    ``device``/``dtype``/``unchecked``). The device, dtype and an UNCHECKED stamp are recorded in the outputs.
    A run that fails leaves no folder it created empty behind (a checkpoint it wrote stays, to resume from)."""
    out = Path(out)
    created = not out.exists()
    try:
        return _run_study(name, cfg, out, model=model, preset=preset, params=params, command=command, load=load)
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):  # a failed run leaves no empty folder behind
            out.rmdir()
        raise


def _run_study(name: str, cfg: Config, out: Path, *, model: Any, preset: str, params: Mapping[str, str] | None,
               command: str | None, load: Mapping[str, Any] | None) -> Path:
    from posgen_tl.hooks.capture import probe_hooks  # noqa: PLC0415
    from posgen_tl.io.provenance import git_commit  # noqa: PLC0415
    from posgen_tl.report.context import Context, OutFolder  # noqa: PLC0415

    mod = experiment(name)
    t0 = time.time()
    commit = git_commit()  # the code that runs: taken before, not after, a long run
    if isinstance(model, (str, Path)):
        from posgen_tl.io.models import load_model  # noqa: PLC0415

        model = load_model(str(model), verbose=True, **dict(load or {}))
    folder = OutFolder(out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    ctx = Context(model, folder, probe_hooks(model)[0].model_name, seed=cfg.seed)
    sizes = {k: getattr(cfg, k) for k in SIZES}
    from posgen_tl.hooks.edits import shared_means  # noqa: PLC0415

    with shared_means():  # the study owns its model: a k̄ of the same reference windows is computed once
        for dep in mod.NEEDS:
            print(f"[posgen-tl] {name} needs {dep}: running it first", flush=True)
            run_experiment(dep, ctx, make_config(dep, preset, split_params(params or {}, [dep, name])[dep], sizes))
        print(f"[posgen-tl] {name} ...", flush=True)
        sec, _ = run_experiment(name, ctx, cfg)
    wall = time.time() - t0
    files = sorted(p.name for p in out.iterdir() if p.is_file() and not p.name.startswith(".")
                   and before.get(p.name) != p.stat().st_mtime_ns and p.suffix in (".csv", ".png", ".json"))
    files = [f for f in files if f != f"{name}.json"]
    from posgen_tl.hooks.capture import model_device, model_dtype  # noqa: PLC0415
    from posgen_tl.hooks.gate import unchecked_reason  # noqa: PLC0415

    meta = {"study": name, "model": ctx.model_name, "preset": preset,
            "command": command or shlex.join(["posgen-tl", *sys.argv[1:]]), "git_commit": commit,
            "config": cfg.as_dict(), "wall_seconds": wall, "device": str(model_device(model)),
            "dtype": str(model_dtype(model)).removeprefix("torch."), "unchecked": unchecked_reason(model)}
    path = _write_study(name, out, meta, sec, files)
    print(f"[posgen-tl] wrote {path} ({wall:.0f} s)")
    return path


def presets() -> tuple[str, ...]:
    """The named presets every Config has."""
    return PRESETS
