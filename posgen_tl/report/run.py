"""``posgen-tl report``: every experiment of :data:`posgen_tl.experiments.registry.REPORT` → one
self-contained HTML page + results.json + CSVs. It defines no experiment: each one's options,
computation and section come from its module (:mod:`posgen_tl.experiments`).

Interruption-safe: every experiment writes its outputs into ``<out>/.work/`` and marks itself
done only after all of them are written (atomic renames). The final ``report.html``,
``results.json`` and CSVs appear in ``<out>/`` only when every experiment is done; a rerun with
the same arguments resumes from the finished ones (different arguments start afresh).

The page opens with a summary box — one line per question, each with its verdict word, effect,
CI, p and n — before any section.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posgen_tl.experiments import registry
from posgen_tl.io.defaults import DEFAULT_MODEL
from posgen_tl.report.context import Context, Work, atomic_write, jsonable
from posgen_tl.report.html import render_html

__all__ = ["ReportSettings", "run_report"]


@dataclass
class ReportSettings:
    """What ``posgen-tl report`` was asked for: the model, the output folder, a preset, the size flags
    given (``None`` = each experiment's own default) and ``--param`` text (``[experiment.]key → value``)."""

    model: Any = DEFAULT_MODEL
    out: str = "posgen_report"
    preset: str = "default"
    sizes: dict[str, Any] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    experiments: tuple[str, ...] = registry.REPORT
    #: ``load_model`` options of a named model (``device``, ``dtype``, ``unchecked``), recorded in the outputs
    load: dict[str, Any] = field(default_factory=dict)

    def configs(self) -> dict[str, Any]:
        """``{experiment: Config}`` — each built by :func:`posgen_tl.experiments.registry.make_config`.

        Raises:
            ValueError: an unknown experiment, preset, option or unparsable value (naming it)."""
        routed = registry.split_params(self.params, list(self.experiments))
        return {n: registry.make_config(n, self.preset, routed[n], self.sizes) for n in self.experiments}


def full_size_hint(name: str, model_name: str, preset: str) -> str:
    """The sentence a report section ends with when it ran below the powered sizes: the command
    that runs the same experiment at its ``full`` preset."""
    return (f"This section ran at the '{preset}' sizes (exploratory where it says so). The powered run: "
            f"posgen-tl study {name} --model {model_name} --full --out results/{name}")


def _device(model: Any) -> str:
    from posgen_tl.hooks.capture import model_device  # noqa: PLC0415

    return str(model_device(model))


def _dtype(model: Any) -> str:
    from posgen_tl.hooks.capture import model_dtype  # noqa: PLC0415

    return str(model_dtype(model)).removeprefix("torch.")


def report_sections(work_dir: Path, names: list[str], *, preset: str, model_name: str,
                    configs: dict[str, dict[str, Any]] | None = None) -> tuple[list, list, dict]:
    """Each experiment's section rendered from its saved Result in ``work_dir`` (its own ``render``), in ``names``'
    order; below the full preset each section ends with how to run it at full size. ``configs``: the report's
    record of each stage's config, for a stage saved before Results kept their own (whose config reads back empty).

    Returns:
        ``(sections, findings, {name: section results})``.
    """
    sections, findings, per = [], [], {}
    for name in names:
        result = registry.load(name, work_dir)
        if not result.config and configs and configs.get(name):
            result = type(result)(result.tables, dict(configs[name]), result.meta)
        sec = registry.experiment(name).render(result)
        if preset != "full":
            sec.paragraphs.append(full_size_hint(name, model_name, preset))
        sections.append(sec)
        per[name] = sec.results
        findings += sec.findings
    return sections, findings, per


def rerender(out: Path | str) -> Path:
    """Write ``out/report.html`` again from a finished report's saved results (``out/.work``, ``out/results.json``)
    with the current code — no model is loaded, nothing is recomputed. Returns the page's path.

    Raises:
        FileNotFoundError: ``out`` holds no finished report.
    """
    out = Path(out)
    if not (out / "results.json").exists() or not (out / ".work").is_dir():
        raise FileNotFoundError(f"{out} holds no finished report (results.json and .work/ are needed)")
    res = json.loads((out / "results.json").read_text())
    names = list(res["configs"])
    sections, findings, _ = report_sections(out / ".work", names, preset=res["preset"], model_name=res["model"],
                                            configs=res["configs"])
    first = res["configs"][names[0]]
    meta = {"model": res["model"], "corpus": first.get("corpus") or "pydoc_data.topics (stdlib)",
            "preset": res["preset"], "seed": first.get("seed"), "device": res.get("device"), "dtype": res.get("dtype")}
    unchecked = res.get("unchecked")
    title = f"posgen_tl report — {res['model']}" + (" — UNCHECKED" if unchecked else "")
    atomic_write(out / "report.html", render_html(title, meta, sections, findings=findings).encode())
    return out / "report.html"


def run_report(settings: ReportSettings) -> int:
    """Run every experiment (resuming finished ones) and write the report; returns an exit code."""
    from posgen_tl.hooks.capture import probe_hooks  # noqa: PLC0415
    from posgen_tl.io.models import load_model  # noqa: PLC0415

    configs = settings.configs()  # an unknown or malformed option fails here, before the model loads
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("report.html", "results.json"):
        (out / stale).unlink(missing_ok=True)  # never leave an old, complete-looking report beside a new run
    model_name = settings.model if isinstance(settings.model, str) else type(settings.model).__name__
    from posgen_tl.hooks.gate import unchecked_reason  # noqa: PLC0415

    placement = {k: str(v).removeprefix("torch.") for k, v in settings.load.items()}
    stamp = {"model": model_name, "preset": settings.preset, "configs": {n: c.as_dict() for n, c in configs.items()},
             **({"load": placement} if placement else {})}
    work = Work(out, stamp)
    t0 = time.time()
    model = load_model(settings.model, verbose=True, **settings.load) if isinstance(settings.model, str) \
        else settings.model
    spec, _ = probe_hooks(model)
    unchecked = unchecked_reason(model)
    seed = next(iter(configs.values())).seed
    ctx = Context(model, work, spec.model_name, seed=seed)
    timings: dict[str, float] = {}
    results: dict[str, Any] = {"model": spec.model_name, "preset": settings.preset, "configs": stamp["configs"],
                               "stage_seconds": timings, "device": _device(model), "dtype": _dtype(model),
                               "unchecked": unchecked}
    mods = {n: registry.experiment(n) for n in configs}
    from posgen_tl.hooks.edits import shared_means  # noqa: PLC0415

    with shared_means():  # the report owns its model and twin: a k̄ of the same reference windows is computed once
        _run_stages(model, configs, mods, work, ctx, timings)
    sections, findings, per = report_sections(work.dir, list(configs), preset=settings.preset, model_name=model_name)
    results.update(per)
    results["findings"] = [f.as_dict() for f in findings]
    results["total_seconds"] = time.time() - t0
    first = next(iter(configs.values()))
    meta = {"model": spec.model_name, "corpus": first.corpus or "pydoc_data.topics (stdlib)",
            "preset": settings.preset, "seed": seed, "device": _device(model), "dtype": _dtype(model),
            "generated": time.strftime("%Y-%m-%d %H:%M:%S")}
    if unchecked:
        meta = {"UNCHECKED": f"layers whose exactness check did not pass were analysed ({unchecked}): these numbers "
                             "are not shown to be the model's", **meta}
    for f in sorted(work.dir.glob("*.csv")):
        shutil.copyfile(f, out / f.name)
    atomic_write(out / "results.json", json.dumps(results, indent=1, default=jsonable).encode())
    title = f"posgen_tl report — {spec.model_name}" + (" — UNCHECKED" if unchecked else "")
    page = render_html(title, meta, sections, findings=findings)
    atomic_write(out / "report.html", page.encode())
    print(f"[posgen-tl] wrote {out / 'report.html'} ({time.time() - t0:.0f} s)")
    return 0


def _run_stages(model: Any, configs: dict[str, Any], mods: dict[str, Any], work: Work, ctx: Context,
                timings: dict[str, float]) -> None:
    """Run each experiment not yet done (resuming finished ones), save its Result and record its seconds."""
    for name, cfg in configs.items():
        if not work.done(name):
            print(f"[posgen-tl] {name} ...", flush=True)
            ts = time.time()
            partial = work.path(f".partial_{name}")  # a resumable experiment's checkpoint
            upstream = {d: registry.load(d, work.dir) for d in mods[name].NEEDS}
            result = registry.run_or_skip(name, model, cfg, **registry.inputs(
                name, checkpoint=partial, twin=ctx.twin, upstream=upstream))
            registry.save(name, result, work.dir)
            shutil.rmtree(partial, ignore_errors=True)
            work.mark(name)
            timings[name] = time.time() - ts
            print(f"[posgen-tl] {name}: {timings[name]:.0f} s", flush=True)
        else:
            print(f"[posgen-tl] {name}: already done (resuming)")
