"""One recipe layer: every experiment is a *study* — the same function the report stage runs —
and ``posgen-tl study NAME --model … --out …`` runs one of them alone.

A study is a ``compute(ctx)`` that writes its tables (CSV) and figures (PNG) through
``ctx.work`` and, optionally, a ``render(ctx) -> (Section, dict)`` that reads them back into
a report section. The report (:mod:`posgen_tl.report.run`) runs every stage of
:data:`posgen_tl.report.stages.STAGES` into its resumable work folder; a study runs ONE of
them (plus the studies it ``needs``) straight into ``--out`` and writes beside the tables:

* ``<out>/<name>.md`` — the command line, git commit, configuration, wall time, the
  findings (verdict, effect, CI, p, n) and the section's tables and figures;
* ``<out>/<name>.json`` — the same as data (``config``, ``command``, ``git_commit``,
  ``wall_seconds``, ``findings``, ``results``, ``files``).

Sizes are the report's (:class:`~posgen_tl.report.context.ReportConfig`: ``--seq-len``,
``--n-seq``, ``--seed``, ``--quick``, ``--no-twin``, ``--corpus``), so a study and the report
stage of the same name, run with the same options, write identical tables.

Adding a recipe (one line):

* a new report stage appended to ``STAGES`` is a study automatically;
* a study that is not a report stage: ``register("gap_probe", gap_probe_compute,
  gap_probe_render, needs=(), about="…")`` at the bottom of this module (or in the
  recipe's own module, imported below), with ``compute(ctx)`` writing through
  ``ctx.work.save_df/save_fig/save_json`` and ``render`` returning a
  :class:`~posgen_tl.report.html.Section` (set ``Section.findings`` for the summary).

``ctx`` gives ``ctx.model``, ``ctx.twin()`` (the random twin, built once), ``ctx.tokens(n_seq,
seq_len)``, ``ctx.cfg`` (the sizes) and ``posgen_tl.report.context.layers_for(ctx)``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from posgen_tl.report.context import Context, OutFolder, ReportConfig, _atomic_write, _jsonable
from posgen_tl.report.findings import stage_findings
from posgen_tl.report.html import Finding, Section, sig3
from posgen_tl.report.stages import STAGES

__all__ = ["Study", "STUDIES", "register", "run_study", "study_names"]


@dataclass(frozen=True)
class Study:
    """A named recipe: ``compute(ctx)`` writes its outputs; ``render(ctx)`` (optional) reads them
    back as a report Section; ``needs`` are studies whose outputs it reads (run first)."""

    name: str
    compute: Callable[[Context], None]
    render: Callable[[Context], tuple[Section, dict]] | None = None
    needs: tuple[str, ...] = ()
    about: str = ""


STUDIES: dict[str, Study] = {}


def register(name: str, compute: Callable[[Context], None],
             render: Callable[[Context], tuple[Section, dict]] | None = None, *,
             needs: Sequence[str] = (), about: str = "") -> Study:
    """Add (or replace) the study ``name``; returns it."""
    study = Study(name, compute, render, tuple(needs), about or (compute.__doc__ or "").strip().split("\n")[0])
    STUDIES[name] = study
    return study


_NEEDS = {"pattern": ("decomposition",)}  # pattern links its heads to the decomposition's rows
_ABOUT = {
    "exactness": "captured q/k reproduce the model's rotation and scores (METHOD §1)",
    "decomposition": "D1/D2/D3 decompositions, trained beside the random twin (METHOD §2)",
    "pattern": "feature pattern in the RoPE planes and its link to D3 (METHOD §3)",
    "tolerance": "T1/T2 position tolerance and the causal test with matched controls (METHOD §4–§5)",
    "heads": "positional vs symbolic head taxonomy (METHOD §6)",
    "length": "longer texts: gap probe and (sliding-window models) window removal, vanilla / LM-Infinite / disentangled (METHOD §7)",
    "sufficiency": "substitute the logits by f + g (D3, global k̄) per layer group, with D1 and wrong-k̄ controls (METHOD §5)",
}
for _name, _compute, _render in STAGES:  # every report stage is a study with the same code path
    register(_name, _compute, _render, needs=_NEEDS.get(_name, ()), about=_ABOUT.get(_name, ""))


def study_names() -> list[str]:
    """Registered study names, report order first."""
    return list(STUDIES)


def _git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"
    if sha.returncode != 0:
        return "unknown (not a git checkout)"
    return sha.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")


def _md_table(df: Any) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(sig3(v) for v in row) + " |")
    return "\n".join(lines)


def _markdown(name: str, meta: dict[str, Any], sec: Section | None, findings: list[Finding], files: list[str]) -> str:
    out = [f"# posgen-tl study {name} — {meta['model']}", "",
           f"- command: `{meta['command']}`", f"- git commit: {meta['git_commit']}",
           f"- wall time: {meta['wall_seconds']:.1f} s", f"- configuration: `{json.dumps(meta['config'], default=_jsonable)}`", ""]
    if findings:
        out += ["## Findings", ""] + [f"- {f.line()}" + (f" — {f.note}" if f.note else "") for f in findings] + [""]
    if sec is not None:
        out += [f"## {sec.title}", ""]
        if sec.verdict:
            out += [f"> {sec.verdict}", ""]
        out += [p + "\n" for p in sec.paragraphs]
        for cap, df in [*sec.tables, *sec.details]:
            out += [f"### {cap}", "", _md_table(df), ""]
    figs = [f for f in files if f.endswith(".png")]
    if figs:
        out += ["## Figures", ""] + [f"![{f}]({f})" for f in figs] + [""]
    out += ["## Files", ""] + [f"- `{f}`" for f in files] + [""]
    return "\n".join(out)


def run_study(name: str, cfg: ReportConfig, *, model: Any = None, command: str | None = None) -> Path:
    """Run study ``name`` (after the studies it needs) into ``cfg.out``; returns ``<out>/<name>.md``.

    ``model``: an already-loaded model (default: ``load_model(cfg.model)``). ``command``: the
    command line to record (default: this process's ``sys.argv``).

    Raises:
        KeyError: unknown study (the message lists the registered ones).
        ValueError: a study parameter (``cfg.params``) this study does not declare, or one that
            does not parse (:mod:`posgen_tl.report.params`).
    """
    from posgen_tl.hooks.capture import probe_hooks  # noqa: PLC0415

    if name not in STUDIES:
        raise KeyError(f"unknown study {name!r}; registered: {', '.join(study_names())}")
    study = STUDIES[name]
    from posgen_tl.report.params import check_params  # noqa: PLC0415

    check_params(cfg.params, [name, *study.needs])  # ValueError naming an unknown or malformed parameter
    t0 = time.time()
    if model is None:
        from posgen_tl.io.models import load_model  # noqa: PLC0415

        model = load_model(cfg.model, verbose=True)
    out = Path(cfg.out)
    folder = OutFolder(out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    ctx = Context(cfg, folder, model, probe_hooks(model)[0].model_name)
    for dep in study.needs:
        print(f"[posgen-tl] {name} needs {dep}: running it first", flush=True)
        STUDIES[dep].compute(ctx)
    print(f"[posgen-tl] {name} ...", flush=True)
    study.compute(ctx)
    sec, res = study.render(ctx) if study.render else (None, {})
    findings = stage_findings(name, ctx, sec) if sec is not None else []
    wall = time.time() - t0
    files = sorted(p.name for p in out.iterdir() if p.is_file() and not p.name.startswith(".")
                   and before.get(p.name) != p.stat().st_mtime_ns and p.suffix in (".csv", ".png", ".json"))
    files = [f for f in files if f != f"{name}.json"]
    meta = {"study": name, "model": ctx.model_name, "command": command or shlex.join(["posgen-tl", *sys.argv[1:]]),
            "git_commit": _git_commit(), "config": cfg.__dict__, "wall_seconds": wall}
    md = _markdown(name, meta, sec, findings, files)
    _atomic_write(out / f"{name}.md", md.encode())
    payload = {**meta, "findings": [f.as_dict() for f in findings], "results": res, "files": files}
    _atomic_write(out / f"{name}.json", json.dumps(payload, indent=1, default=_jsonable).encode())
    print(f"[posgen-tl] wrote {out / (name + '.md')} ({wall:.0f} s)")
    return out / f"{name}.md"


# ----------------------------------------------------------------------------- studies that are not report stages


def gap_attention_compute(ctx: Context) -> None:
    """Per head, the attention change under the gap G, by head class (METHOD §7 item 4)."""
    import pandas as pd  # noqa: PLC0415

    from posgen_tl.experiments import length as L  # noqa: PLC0415
    from posgen_tl.experiments.decomposition import analysis_windows, reference_key_means  # noqa: PLC0415
    from posgen_tl.report.params import stage_params  # noqa: PLC0415

    P = stage_params(ctx.cfg.params, "gap_attention")
    half = max(16, ctx.cfg.seq_len // 2)
    pre, suf = P.get("prefix_len", half), P.get("suffix_len", half)
    win, ref = analysis_windows(ctx.model, ctx.cfg.corpus, n_seq=ctx.cfg.n_seq, seq_len=pre + suf,
                                n_ref=P.get("n_ref", 8), seed=ctx.cfg.seed)
    km = reference_key_means(ctx.model, ref.tokens, sink=1, progress=False)
    n_ctx = int(ctx.model.cfg.n_ctx)
    gap = P.get("gap", 2.0)
    rows = L.gap_attention(ctx.model, win, prefix_len=pre, suffix_len=suf, gap=int(round(gap * n_ctx)), k_means=km,
                           skip=P.get("skip", min(16, suf // 4)))
    classes = L.classes_from_taxonomy(pd.read_csv(P["classes"])) if "classes" in P else None
    ctx.work.save_df("gap_attention_rows.csv", rows)
    ctx.work.save_df("gap_attention_summary.csv", L.head_class_test(rows, classes))
    ctx.work.save_json("gap_attention_meta.json", dict(n_seq=len(win), n_docs=win.n_docs, gap=gap, n_ctx=n_ctx,
                                                       prefix_len=pre, suffix_len=suf, classes=P.get("classes")))


def gap_attention_render(ctx: Context) -> tuple[Section, dict]:
    summ = ctx.work.load_df("gap_attention_summary.csv")
    meta = ctx.work.load_json("gap_attention_meta.json")
    src = summ["classes"].iloc[0] if len(summ) else "?"
    sec = Section(
        "Attention change under the gap, by head class (METHOD §7, seed 003)",
        verdict=(f"G = {meta['gap']:g}·n_ctx; head classes: {src} ({int(summ['n_heads_positional'].iloc[0])} "
                 f"positional, {int(summ['n_heads_symbolic'].iloc[0])} symbolic heads)." if len(summ) else "no contrast"),
        paragraphs=[f"{meta['n_seq']} sequences from {meta['n_docs']} documents: prefix {meta['prefix_len']} ‖ suffix "
                    f"{meta['suffix_len']} tokens, the suffix moved G ids away. Per sequence, the mean over the heads of "
                    "each class; contrasts positional − symbolic over sequences (document bootstrap, sign-flip p, "
                    "Holm). A positive KL contrast supports seed 003 (symbolic heads extrapolate better)."],
        tables=[("Contrasts", summ)])
    return sec, {"summary": summ.to_dict("records"), "meta": meta}


register("gap_attention", gap_attention_compute, gap_attention_render,
         about="attention change per head under the gap, positional vs symbolic heads (METHOD §7 item 4)")
