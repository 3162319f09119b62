"""How much of the default report's forward work repeats a forward the same report ran before, ACROSS its stages —
the sharing a cache of forwards between experiments could buy.

    python benchmarks/report_repeats.py [--model smollm2-135m] [--preset default] [--out FILE]

Runs ``posgen-tl report`` in this process (its defaults, in a scratch folder) with every forward of its models logged
(:class:`ForwardLog`: the models' ``forward`` wrapped while it runs): the stage, each batch row's input — its token ids,
or the residual a resumed forward starts from — and position ids as hashes, the start layer, the hook points that
carry hooks, and the forward's seconds, split evenly over its rows. :func:`repeats` then sorts each forward into

* ``plain``: no hooks but the final norm's read (``ln_final.hook_out``, where the target NLL takes its rows);
* ``recording``: hooks only on a block's input residual (``blocks.L.hook_resid_pre`` / ``blocks.L.hook_in``, where a
  resumable forward records it) besides that — read by name: a hook that WROTE a block's residual would be misread, and
  none of the report's does (a TransformerLens 3.x bridge resumes a forward by writing it there, so the log refuses
  such a model);
* ``hooked``: any other hook (edits, substitutions, patches, captures) — never counted as a repeat: the tool cannot
  tell two hooks' arguments apart, and such a forward computes something no other one does;

and counts a row of a ``plain`` forward as REPEATED when an earlier plain or recording forward of the same model ran the
same row (same input, same position ids — none and ``0 … n−1`` alike —, same start layer): everything that row needs up
to the final norm was computed before. A recording forward repeated later is counted apart (sharing it would need its
recordings kept as well). Prints and writes the repeated seconds per (first stage, repeating stage) and their share
of all forward seconds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
#: the hook point whose hook reads the target rows' final residual (posgen_tl.hooks.positions.final_residual_hook)
FINAL = "ln_final.hook_out"
#: the hook points of a block's input residual, where a resumable forward records it
RESIDUAL = re.compile(r"blocks\.\d+\.(hook_resid_pre|hook_in)")


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def kind_of(hook_names: Sequence[str]) -> str:
    """``plain``, ``recording`` or ``hooked`` for a forward whose hooks sit on ``hook_names`` (see the module text)."""
    names = {n for n in hook_names if n != FINAL}
    if not names:
        return "plain"
    return "recording" if all(RESIDUAL.fullmatch(n) for n in names) else "hooked"


def _refuse_unless_resumable(model: Any) -> None:
    """ValueError for a model whose forward takes no ``start_at_layer`` (a TransformerLens 3.x bridge)."""
    from posgen_tl.hooks.reentry import takes_start_at_layer

    if not takes_start_at_layer(model):
        raise ValueError(f"{type(model).__name__}: its forward takes no start_at_layer (a TransformerLens 3.x "
                         "bridge): a resumed forward there is a whole forward with the residual written in, "
                         "which this log cannot tell from a whole one; run it on TransformerLens 4.x")


class ForwardLog:
    """While active, every forward of ``models`` (``{label: model}``, TransformerLens 3.x ``HookedTransformer`` or 4.x
    ``TransformerBridge``: their classes' ``forward`` is wrapped and put back on exit) appends one record to
    ``records``: ``stage`` (set ``self.stage`` between stages), ``model`` (the label), ``rows`` (one hash per batch row
    of the input), ``pos`` (one hash per row of the position ids, ``None`` for ``0 … n−1`` or none given), ``start``
    (the ``start_at_layer``, 0 for a whole forward), ``hooks`` (the hook points carrying hooks), ``stopped`` (ended by
    an exception, e.g. the final-residual read's early stop) and ``seconds``. Models not in ``models`` are not logged.

    Raises:
        ValueError: a model whose forward does not take ``start_at_layer`` (a TransformerLens 3.x bridge): it resumes
            by writing the residual into a whole forward of the tokens, which the log would take for that forward."""

    def __init__(self, models: dict[str, Any]) -> None:
        self.labels = {id(m): label for label, m in models.items()}
        self.models = list(models.values())
        self.stage = ""
        self.records: list[dict[str, Any]] = []
        self._saved: list[tuple[type, Any]] = []

    def add(self, label: str, model: Any) -> None:
        """Log ``model`` too from now on (a model the run builds later, e.g. the random twin)."""
        _refuse_unless_resumable(model)
        self.labels[id(model)] = label
        self.models.append(model)
        self._wrap(model)

    def _wrap(self, model: Any) -> None:
        cls = type(model)
        if any(c is cls for c, _ in self._saved):
            return
        orig = getattr(cls, "forward")  # noqa: B009 - the class's own, put back on exit (mypy: a `type`)
        log = self

        def forward(model: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
            label = log.labels.get(id(model))
            if label is None or not isinstance(input, torch.Tensor):
                return orig(model, input, *args, **kwargs)
            hooks = sorted(name for name, hp in model.hook_dict.items() if hp._forward_hooks)
            pos = kwargs.get("position_ids")
            b, n = input.shape[0], input.shape[1]
            if pos is not None:
                pos = pos.expand(b, -1) if pos.ndim == 1 else pos
                ar = torch.arange(n, device=pos.device)
            rec = {"stage": log.stage, "model": label, "rows": [_digest(input[i]) for i in range(b)],
                   "pos": [None if pos is None or torch.equal(pos[i], ar) else _digest(pos[i]) for i in range(b)],
                   "start": int(kwargs.get("start_at_layer") or 0), "hooks": hooks, "stopped": True}
            t = time.perf_counter()
            try:
                out = orig(model, input, *args, **kwargs)
                rec["stopped"] = False
                return out
            finally:
                rec["seconds"] = time.perf_counter() - t
                log.records.append(rec)

        self._saved.append((cls, orig))
        setattr(cls, "forward", forward)  # noqa: B010

    def __enter__(self) -> ForwardLog:
        for m in self.models:  # every model checked before any class's forward is replaced
            _refuse_unless_resumable(m)
        for m in self.models:
            self._wrap(m)
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, orig in reversed(self._saved):
            setattr(cls, "forward", orig)  # noqa: B010
        self._saved.clear()


def repeats(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The repeated work in ``records`` (:class:`ForwardLog`'s), in seconds (a forward's seconds split evenly over its
    rows).

    Returns:
        ``{"forward_seconds", "by_kind": {kind: seconds}, "repeated_plain_seconds", "repeated_plain_share" (of all
        forward seconds), "repeated_recording_seconds", "pairs": [{"first", "then", "kind", "rows", "seconds"}, …]
        (largest first; ``first`` / ``then``: the stages of the earlier and the repeating forward)}``.
    """
    seen: dict[tuple, str] = {}
    by_kind: collections.Counter[str] = collections.Counter()
    pairs: dict[tuple[str, str, str], list[float]] = {}
    for r in records:
        kind = kind_of(r["hooks"])
        per_row = r["seconds"] / max(len(r["rows"]), 1)
        by_kind[kind] += r["seconds"]
        if kind == "hooked":
            continue
        for row, pos in zip(r["rows"], r["pos"]):
            key = (r["model"], row, pos, r["start"])
            if key in seen:
                cell = pairs.setdefault((seen[key], r["stage"], kind), [0, 0.0])
                cell[0] += 1
                cell[1] += per_row
            else:
                seen[key] = r["stage"]
    total = sum(by_kind.values())
    rep = {k: sum(v[1] for (_, _, kk), v in pairs.items() if kk == k) for k in ("plain", "recording")}
    rows: list[dict[str, Any]] = [{"first": a, "then": b, "kind": k, "rows": int(v[0]), "seconds": float(v[1])}
                                  for (a, b, k), v in pairs.items()]
    rows.sort(key=lambda x: -float(x["seconds"]))
    return {"forward_seconds": total, "by_kind": dict(by_kind), "repeated_plain_seconds": rep["plain"],
            "repeated_plain_share": rep["plain"] / total if total else float("nan"),
            "repeated_recording_seconds": rep["recording"], "pairs": rows}


@contextlib.contextmanager
def _staged(log: ForwardLog) -> Iterator[None]:
    """Name each record by the experiment the report runs (``registry.run_or_skip``), and log the twin once built."""
    from posgen_tl.experiments import registry
    from posgen_tl.report import context

    run_or_skip, twin_of = registry.run_or_skip, context.Context.twin

    def staged(name: str, *args: Any, **kwargs: Any) -> Any:
        log.stage = name
        return run_or_skip(name, *args, **kwargs)

    def twin(self: Any, seed: int | None = None) -> Any:
        t = twin_of(self, seed)
        if id(t) not in log.labels:
            log.add("twin" if seed is None else f"twin (seed {seed})", t)
        return t

    registry.run_or_skip = staged
    context.Context.twin = twin  # type: ignore[method-assign]
    try:
        yield
    finally:
        registry.run_or_skip = run_or_skip
        context.Context.twin = twin_of  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--preset", default="default", choices=("quick", "default", "full"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from posgen_tl.io.models import load_model
    from posgen_tl.io.provenance import git_commit
    from posgen_tl.report.run import ReportSettings, run_report

    commit, started = git_commit(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    model = load_model(a.model)
    work = Path(tempfile.mkdtemp(prefix="posgen_report_repeats_"))
    t = time.perf_counter()
    try:
        with ForwardLog({"trained": model}) as log, _staged(log):
            run_report(ReportSettings(model=model, out=str(work / "report"), preset=a.preset))
        stages = json.loads((work / "report" / "results.json").read_text())["stage_seconds"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = repeats(log.records)
    rec = {"what": "the default report's forwards that repeat an earlier one across its stages",
           "command": f"python benchmarks/report_repeats.py --model {a.model} --preset {a.preset}",
           "commit": commit, "started": started, "wall_s": time.perf_counter() - t, "threads": torch.get_num_threads(),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_end": os.getloadavg()},
           "stage_seconds": stages, "forwards": len(log.records), **out}
    print(f"{len(log.records)} forwards, {out['forward_seconds']:.0f} s: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in out["by_kind"].items()))
    print(f"plain rows that repeat an earlier forward: {out['repeated_plain_seconds']:.1f} s "
          f"({100 * out['repeated_plain_share']:.1f} %); recording forwards repeated: "
          f"{out['repeated_recording_seconds']:.1f} s")
    for p in out["pairs"]:
        print(f"  {p['first']:>14} → {p['then']:<14} {p['kind']:<9} {p['rows']:4d} rows {p['seconds']:7.1f} s")
    path = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"report_repeats_{str(commit)[:7]}.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
