"""The benchmark suite: every analysis as a RATIO to the plain forward pass of the same tokens.

    python benchmarks/suite.py                 # full sizes: 8 × 512 and 4 × 2048, scaling 256 … 4096
    python benchmarks/suite.py --small         # quick check: 2 × 128 and 1 × 512, scaling 128 … 512
    python benchmarks/suite.py --models smollm2-135m,gemma3-270m --repeats 5 --out benchmarks/results/results.json
    python benchmarks/suite.py --parts scaling --axes count --out benchmarks/results/results_counts.json   # one axis
    python benchmarks/suite.py --parts sizes --threads 1 --skip-memory --out benchmarks/results/results_1thread.json
    python benchmarks/suite.py --merge A.json B.json --out benchmarks/results/results.json   # later files replace
                                                  # the sizes / scaling axes they measured; commits kept per part

Writes ``--out`` (default ``benchmarks/results/results.json``) and prints a table with the targets, met or not.

How it measures (all in fresh subprocesses of this script, ``--threads`` torch threads, default 1):

* **time** — one worker process per (model, size) loads the model once and runs, ``--repeats``
  times, every step over the same tokens, steps interleaved (forward, capture, …, forward, …) so
  that load drift on a shared machine hits every step alike. Each figure is ``step / forward`` of
  the same repeat, reported as min and median over repeats (and the raw seconds).
  ``forward`` = ``model(tokens)`` under ``no_grad`` in the same batches the analyses use (the full
  forward, logits included). Steps that need several forwards (a tolerance curve, a causal
  condition) are divided by that many forwards.
* **memory** — one process PER STEP: model loaded, tokens built, a tiny warm-up forward, then the
  kernel's peak-RSS counter is reset (``/proc/self/clear_refs`` = 5) and the step runs once; the
  figure is ``VmHWM − VmRSS`` before the step (MiB; ``ru_maxrss`` is recorded too). That is the
  real resident peak of the step (torch CPU tensors included), not an estimate.
* **naive baseline** — ``model.run_with_cache`` of every hook the analysis needs (all layers, all
  sequences at once, as a notebook would), then the SAME analysis code fed from the cache
  (:func:`posgen_tl.hooks.stream.stream_qk` replaced, in this benchmark only, by a replay of the cached
  layers) — so the difference to the streaming step is exactly what streaming saves.
* **scaling** — time (min over repeats) and peak memory of forward / feature statistics /
  decomposition vs sequence length (1 sequence) and vs number of sequences (fixed length), one
  process per point and step, with the least-squares log-log exponent.

Targets (issue #16; speed targets live here as ratios, never as timed unit tests):
decomposition ≤ 1.3× (k̄ given; the k̄ reference pass is shown apart and included); pattern
statistics ≤ 1.0×; each tolerance / causal condition ≤ 1.1× the forwards it needs; peak memory of
each analysis ≤ the forward's + 1 GiB at the long size; streaming memory independent of the number
of sequences (|log-log exponent| < 0.1).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:  # the suite's two halves sit beside it (also when loaded from its path)
    sys.path.insert(0, str(HERE))

from suite_steps import FRACS, TARGET_LEN, Bench, reset_peak, status_mib  # noqa: E402  (what is measured)
from suite_tables import (  # noqa: E402  (targets, verdicts, tables)
    evaluate,
    fit_exponent,
    markdown,
    merge_results,
    print_table,
    save_results,
)

#: counts start at the batch size of the count series, so every point streams full batches
FULL = {"sizes": [(8, 512), (4, 2048)], "lengths": [256, 512, 1024, 2048, 4096], "counts": [4, 8, 16, 32],
        "count_len": 512, "count_batch": 4}
SMALL = {"sizes": [(2, 128), (1, 512)], "lengths": [128, 256, 512], "counts": [2, 4, 8],
         "count_len": 64, "count_batch": 2}


def _run_timing(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    b = Bench(spec["model"], spec["n_seq"], spec["seq_len"], device=spec.get("device", "cpu"))
    steps = b.steps()
    b.sync()
    t = time.perf_counter()
    b.geometry()
    b.sync()
    geometry_s = time.perf_counter() - t
    b.kbar()
    b.causal_inputs()
    times: dict[str, list[float]] = {k: [] for k in steps}
    cuda = b.device.startswith("cuda")
    gpu_peak: dict[str, float] = {}  # on a GPU: each step's peak of allocated memory above its start (MiB)
    for _ in range(spec["repeats"]):
        for name, (fn, _) in steps.items():
            gc.collect()
            b.sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                m0 = torch.cuda.memory_allocated()
            t = time.perf_counter()
            fn()
            b.sync()
            times[name].append(time.perf_counter() - t)
            if cuda:
                gpu_peak[name] = max(gpu_peak.get(name, 0.0), (torch.cuda.max_memory_allocated() - m0) / 2**20)
    ratios = {}
    for name, (_, n_fwd) in steps.items():
        r = [x / (n_fwd * f) for x, f in zip(times[name], times["forward"])]
        ratios[name] = {"min": min(r), "median": statistics.median(r), "forwards": n_fwd}
    return {"seconds": times, "ratios": ratios, "geometry_s": geometry_s, "n_ref": b.n_ref, "batch_size": b.bs,
            "layers": b.spec.n_layers, "heads": b.spec.n_heads, "load_avg_1min_end": os.getloadavg()[0],
            **({"gpu": torch.cuda.get_device_name(), "gpu_peak_mib": gpu_peak} if cuda else {})}


def _run_memory(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    b = Bench(spec["model"], spec["n_seq"], spec["seq_len"], device=spec.get("device", "cpu"))
    steps = b.steps()
    if spec["step"] not in steps:
        return {"skipped": f"{spec['step']} is not available in this version of posgen_tl"}
    fn = steps[spec["step"]][0]
    if spec["step"] in ("decomposition", "sufficiency") or spec["step"].startswith("naive"):
        b.geometry()
        b.kbar()
    if spec["step"] == "causal_condition":
        b.causal_inputs()
    gc.collect()
    ok = reset_peak()
    rss0 = status_mib("VmRSS")
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    return {"peak_delta_mib": (status_mib("VmHWM") - rss0) if ok else float("nan"), "rss_before_mib": rss0,
            "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, "seconds": dt,
            "clear_refs": ok}


def _run_point(spec: dict) -> dict:
    """One scaling point: ``step`` run ``repeats`` times; the first run's peak memory."""
    import torch

    torch.set_num_threads(spec["threads"])
    b = Bench(spec["model"], spec["n_seq"], spec["seq_len"], spec.get("batch_size"), device=spec.get("device", "cpu"))
    fn = b.steps()[spec["step"]][0]
    if spec["step"] == "decomposition":
        b.geometry()
        b.kbar()
    gc.collect()
    ok = reset_peak()
    rss0 = status_mib("VmRSS")
    times = []
    for r in range(spec["repeats"]):
        b.sync()
        t = time.perf_counter()
        fn()
        b.sync()
        times.append(time.perf_counter() - t)
        if r == 0:
            peak = status_mib("VmHWM") - rss0 if ok else float("nan")
    return {"seconds": times, "min_s": min(times), "peak_delta_mib": peak}


def _run_report(spec: dict) -> dict:
    """The whole ``posgen-tl report --quick``, and a forward over the report's own tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import torch

    from posgen_tl.io.corpus import corpus_tokens
    from posgen_tl.io.models import load_model
    from posgen_tl.report.run import ReportSettings, run_report

    torch.set_num_threads(spec["threads"])
    model = load_model(spec["model"])
    seq_len, n_seq = 96, 2
    toks = corpus_tokens(model, None, seq_len=seq_len, n_seq=n_seq)
    with torch.no_grad():
        model(toks[:1, :16])
    fwd, rep = [], []
    for _ in range(spec["repeats"]):
        t = time.perf_counter()
        with torch.no_grad():
            model(toks)
        fwd.append(time.perf_counter() - t)
        with tempfile.TemporaryDirectory() as out:
            t = time.perf_counter()
            with contextlib.redirect_stdout(sys.stderr):
                run_report(ReportSettings(model=model, out=out, preset="quick", sizes=dict(seq_len=seq_len, n_seq=n_seq)))
            rep.append(time.perf_counter() - t)
    r = [a / b for a, b in zip(rep, fwd)]
    return {"seconds": {"forward": fwd, "report_quick": rep}, "tokens": [n_seq, seq_len],
            "ratio": {"min": min(r), "median": statistics.median(r)}}


WORKERS = {"timing": _run_timing, "memory": _run_memory, "point": _run_point, "report": _run_report}


# ============================================================================ orchestrator side


def _spawn(kind: str, spec: dict, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, json.dumps(spec)]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-1500:]}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = time.perf_counter() - t
    return out


def _log(msg: str) -> None:
    print(f"[suite {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _ints_arg(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise SystemExit(f"--{what} {text!r}: expected comma-separated integers") from e
    if not vals or min(vals) < 1:
        raise SystemExit(f"--{what} {text!r}: expected positive integers")
    return vals


def sizes_config(args: argparse.Namespace) -> dict:
    """The size grid: ``--small`` or the full one, with ``--sizes`` / ``--lengths`` / ``--counts``
    replacing its parts (recorded in results.json, so a table always says what it measured)."""
    cfg = dict(SMALL if args.small else FULL)
    if getattr(args, "sizes", None):
        try:
            cfg["sizes"] = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes.split(",") if s.strip()]
        except ValueError as e:
            raise SystemExit(f"--sizes {args.sizes!r}: expected e.g. 8x512,4x2048") from e
        if not cfg["sizes"] or any(len(s) != 2 or min(s) < 1 for s in cfg["sizes"]):
            raise SystemExit(f"--sizes {args.sizes!r}: expected e.g. 8x512,4x2048")
    if getattr(args, "lengths", None):
        cfg["lengths"] = _ints_arg(args.lengths, "lengths")
    if getattr(args, "counts", None):
        cfg["counts"] = _ints_arg(args.counts, "counts")
    return cfg


def _commit() -> str | None:
    """The commit of the code measured (``git rev-parse`` in this checkout; ``None`` outside git)."""
    try:
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "posgen_tl",
                            "benchmarks"], capture_output=True, text=True, timeout=10).stdout.strip()
    return (p.stdout.strip() + ("+modified" if dirty else "")) if p.returncode == 0 else None


def run_suite(args: argparse.Namespace) -> dict:
    cfg = sizes_config(args)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    parts = {p.strip() for p in args.parts.split(",")}
    base = {"threads": args.threads, "repeats": args.repeats, "device": args.device}
    res: dict[str, Any] = {
        "config": {"small": args.small, "models": models, "repeats": args.repeats, "threads": args.threads,
                   "device": args.device,
                   "report_repeats": args.report_repeats, "parts": sorted(parts), "axes": sorted(args.axes),
                   "skip_memory": args.skip_memory, **cfg, "fracs": FRACS,
                   "target_len": TARGET_LEN},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_start": os.getloadavg()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": _commit(),
        "models": {},
    }
    mem_steps = ["forward", "capture", "decomposition", "pattern", "tolerance_curve", "causal_condition",
                 "sufficiency", "naive_decomposition", "naive_pattern"]
    for model in models:
        mres: dict[str, Any] = {"sizes": {}, "scaling": {}}
        for n_seq, seq_len in (cfg["sizes"] if "sizes" in parts else []):
            key = f"{n_seq}x{seq_len}"
            spec = dict(base, model=model, n_seq=n_seq, seq_len=seq_len)
            _log(f"{model} {key}: timing ({args.repeats} repeats)")
            entry = {"timing": _spawn("timing", spec, args.timeout), "memory": {}}
            for step in ([] if args.skip_memory else mem_steps):
                _log(f"{model} {key}: memory of {step}")
                entry["memory"][step] = _spawn("memory", dict(spec, step=step), args.timeout)
            mres["sizes"][key] = entry
            save_results(res | {"partial": True}, args.out, model, mres)
        if "scaling" in parts:
            axes = {"length": [(1, n) for n in cfg["lengths"]], "count": [(c, cfg["count_len"]) for c in cfg["counts"]]}
            for axis, points in axes.items():
                if axis not in args.axes:
                    continue
                series: dict[str, Any] = {}
                for step in ("forward", "pattern", "decomposition"):
                    rows = []
                    for n_seq, seq_len in points:
                        _log(f"{model} scaling vs {axis}: {step} {n_seq}x{seq_len}")
                        bs = cfg["count_batch"] if axis == "count" else None
                        r = _spawn("point", dict(base, model=model, n_seq=n_seq, seq_len=seq_len, step=step,
                                                 batch_size=bs), args.timeout)
                        rows.append(dict(n_seq=n_seq, seq_len=seq_len, **r))
                    xs = [r["seq_len"] if axis == "length" else r["n_seq"] for r in rows]
                    series[step] = {
                        "points": rows,
                        "time_exponent": fit_exponent(xs, [r.get("min_s") for r in rows]),
                        "memory_exponent": fit_exponent(xs, [r.get("peak_delta_mib") for r in rows]),
                    }
                mres["scaling"][axis] = series
                save_results(res | {"partial": True}, args.out, model, mres)
        if "report" in parts:
            _log(f"{model}: whole report --quick ({args.report_repeats} repeats)")
            mres["report_quick"] = _spawn("report", dict(base, model=model, repeats=args.report_repeats),
                                          args.timeout * 3)
        res["models"][model] = mres
    res["machine"]["load_avg_end"] = os.getloadavg()
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    res["targets"] = evaluate(res)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="quick sizes (2×128, 1×512; scaling 128 … 512)")
    ap.add_argument("--models", default="smollm2-135m", help="comma-separated: smollm2-135m,gemma3-270m")
    ap.add_argument("--sizes", default=None, help="replace the size grid, e.g. 8x512,4x2048")
    ap.add_argument("--lengths", default=None, help="replace the sequence lengths of the scaling series, e.g. 256,512,1024")
    ap.add_argument("--counts", default=None, help="replace the sequence counts of the scaling series, e.g. 4,8,16")
    ap.add_argument("--axes", default="length,count", type=lambda t: {a.strip() for a in t.split(",")},
                    help="scaling axes to run: length, count or both (merging replaces only the axes run)")
    ap.add_argument("--skip-memory", action="store_true",
                    help="sizes: timing only (no peak-memory worker per step), e.g. for a 1-thread timing run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report-repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu",
                    help="where the model and tokens live (cuda: timers read after torch.cuda.synchronize())")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per worker process, seconds")
    ap.add_argument("--parts", default="sizes,scaling,report",
                    help="which parts to run (comma-separated); run parts as separate jobs and --merge their files")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge results files of separate --parts runs into --out")
    ap.add_argument("--out", default=str(HERE / "results" / "results.json"))
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    ap.add_argument("--print", dest="print_only", metavar="RESULTS_JSON", help="print the table of a results file")
    ap.add_argument("--markdown", action="store_true", help="with --print: README-ready markdown")
    args = ap.parse_args(argv)
    if args.worker:
        kind, spec = args.worker
        with contextlib.redirect_stdout(sys.stderr):
            out = WORKERS[kind](json.loads(spec))
        print(json.dumps(out))
        return 0
    if args.print_only:
        res = json.loads(Path(args.print_only).read_text())
        if "targets" not in res:
            res["targets"] = evaluate(res)
        print(markdown(res) if args.markdown else "", end="")
        if not args.markdown:
            print_table(res)
        return 0
    if args.merge:
        res = merge_results([json.loads(Path(f).read_text()) for f in args.merge])
        Path(args.out).write_text(json.dumps(res, indent=1))
        print_table(res)
        print(f"\nwrote {args.out}")
        return 0
    if not args.axes or not args.axes <= {"length", "count"}:
        raise SystemExit(f"--axes {sorted(args.axes)}: expected length, count or length,count")
    if args.repeats < 3:
        print("suite: note: fewer than 3 repeats; min/median are weak", file=sys.stderr)
    res = run_suite(args)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print_table(res)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
