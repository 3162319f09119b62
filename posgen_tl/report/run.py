"""``posgen-tl report``: the whole analysis → one self-contained HTML page + results.json + CSVs.

Interruption-safe: every stage writes its outputs into ``<out>/.work/`` and marks itself
done only after all of them are written (atomic renames). The final ``report.html``,
``results.json`` and CSVs appear in ``<out>/`` only when every stage is done; a rerun with
the same arguments resumes from the finished stages (different arguments start afresh).

The page opens with a summary box — one line per question of METHOD.md, each with its verdict
word, effect, CI, p and n (:mod:`posgen_tl.report.findings`) — before any section.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from posgen_tl.report.context import Context, ReportConfig, Work, _atomic_write, _jsonable, layers_for
from posgen_tl.report.findings import stage_findings
from posgen_tl.report.html import render_html
from posgen_tl.report.stages import STAGES

__all__ = ["run_report", "ReportConfig", "STAGES"]

_layers = layers_for  # kept: code written against report.run._layers


def run_report(args: argparse.Namespace | ReportConfig) -> int:
    """Run every stage (resuming finished ones) and write the report; returns an exit code."""
    from posgen_tl.hooks.capture import probe_hooks  # noqa: PLC0415
    from posgen_tl.io.models import load_model  # noqa: PLC0415

    from posgen_tl.report.params import check_params  # noqa: PLC0415

    cfg = args if isinstance(args, ReportConfig) else ReportConfig.from_args(args)
    check_params(cfg.params, [name for name, _, _ in STAGES])  # an unknown or malformed --param: a clear error
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
    sections, findings = [], []
    results = {"config": cfg.__dict__, "model": spec.model_name, "stage_seconds": timings}
    for name, _, render in STAGES:
        sec, res = render(ctx)
        sections.append(sec)
        results[name] = res
        findings += stage_findings(name, ctx, sec)
    results["findings"] = [f.as_dict() for f in findings]
    results["total_seconds"] = time.time() - t0
    meta = {"model": spec.model_name, "corpus": cfg.corpus or "pydoc_data.topics (stdlib)",
            "seq_len": cfg.seq_len, "n_seq": cfg.n_seq, "quick": cfg.quick, "seed": cfg.seed,
            "generated": time.strftime("%Y-%m-%d %H:%M:%S")}
    for f in sorted(work.dir.glob("*.csv")):
        shutil.copyfile(f, out / f.name)
    _atomic_write(out / "results.json", json.dumps(results, indent=1, default=_jsonable).encode())
    page = render_html(f"posgen_tl report — {spec.model_name}", meta, sections, findings=findings)
    _atomic_write(out / "report.html", page.encode())
    print(f"[posgen-tl] wrote {out / 'report.html'} ({time.time() - t0:.0f} s)")
    return 0
