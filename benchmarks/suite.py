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
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: counts start at the batch size of the count series, so every point streams full batches
FULL = {"sizes": [(8, 512), (4, 2048)], "lengths": [256, 512, 1024, 2048, 4096], "counts": [4, 8, 16, 32],
        "count_len": 512, "count_batch": 4}
SMALL = {"sizes": [(2, 128), (1, 512)], "lengths": [128, 256, 512], "counts": [2, 4, 8],
         "count_len": 64, "count_batch": 2}
TARGETS = {"decomposition": 1.3, "pattern": 1.0, "tolerance_curve": 1.1, "causal_condition": 1.1,
           "sufficiency": 1.1}
MEM_SLACK_MIB = 1024.0
FRACS, TARGET_LEN = (0.0, 0.1, 0.2), 64


# ============================================================================ worker side


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _reset_peak() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim``: otherwise memory freed by the setup
    — k̄ pass, fit operators — stays resident and hides the step's own peak), then reset VmHWM."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _batch_size(seq_len: int) -> int:
    return max(1, min(4, 2048 // seq_len))


class Bench:
    """The model, the tokens and every step of the suite as a zero-argument callable."""

    def __init__(self, model_name: str, n_seq: int, seq_len: int, batch_size: int | None = None,
                 device: str = "cpu") -> None:
        import torch

        from posgen_tl.hooks.capture import probe_hooks
        from posgen_tl.io.corpus import corpus_tokens
        from posgen_tl.io.models import load_model

        self.torch = torch
        self.device = device
        self.model = load_model(model_name, device=device)
        self.spec, self.info = probe_hooks(self.model)
        self.n_ref = max(1, n_seq // 2)
        # the tokens live where the model does: a CUDA timing never includes a host-to-device copy
        toks = corpus_tokens(self.model, None, seq_len=seq_len, n_seq=n_seq + self.n_ref).to(device)
        self.tokens, self.ref = toks[:n_seq], toks[n_seq:]
        self.bs = batch_size or _batch_size(seq_len)
        self.n_seq, self.seq_len = n_seq, seq_len
        self._kbar = None
        self._km = None
        self._base = None
        with torch.no_grad():
            self.model(toks[:1, :16])  # warm-up: hook probe done, allocator primed

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA runs asynchronously: a timer read without it measures
        only the launches); a no-op on the CPU."""
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    # ------------------------------------------------------------ shared inputs (not timed)

    def kbar(self):
        if self._kbar is None:
            from posgen_tl.experiments.decomposition import reference_key_means

            self._kbar = reference_key_means(self.model, self.ref, sink=1, batch_size=self.bs, progress=False)
        return self._kbar

    def causal_inputs(self):
        if self._km is None:
            from posgen_tl.engine.swaps import nll_on_target
            from posgen_tl.hooks.edits import key_means

            n = self.tokens.shape[1]
            self._km = key_means(self.model, self.tokens[:, : n - TARGET_LEN])
            self._base = nll_on_target(self.model, self.tokens, target_len=TARGET_LEN, batch_size=self.bs)
        return self._km, self._base

    def intervention(self):
        from posgen_tl.hooks.edits import Intervention
        from posgen_tl.maths.groups import layer_groups

        nb, n = self.spec.layer(0).n_bands, self.spec.n_layers
        q = max(1, nb // 4)
        return Intervention("destroy", bands=list(range(q)), layers=layer_groups(n)["middle"], alpha=0.5,
                            label="destroy fast-band key offset")

    def geometry(self) -> None:
        from posgen_tl.maths import moments as _moments

        _moments._GEOMS.clear()
        windows = {self.spec.layer(i).sliding_window for i in range(self.spec.n_layers)}
        for s in (0, 1):
            for w in windows:
                _moments.geometry(self.seq_len, s, w)

    # ------------------------------------------------------------ steps

    def forward(self) -> None:
        with self.torch.no_grad():
            for i in range(0, self.n_seq, self.bs):
                out = self.model(self.tokens[i : i + self.bs])
                del out

    def capture(self) -> None:
        from posgen_tl.hooks.stream import stream_qk

        stream_qk(self.model, self.tokens, lambda c: None, batch_size=self.bs, progress=False)

    def kbar_pass(self) -> None:
        from posgen_tl.experiments.decomposition import reference_key_means

        reference_key_means(self.model, self.ref, sink=1, batch_size=self.bs, progress=False)

    def decomposition(self) -> None:
        from posgen_tl.experiments.decomposition import decompose_model

        decompose_model(self.model, self.tokens, reference=self.ref, k_mean=self.kbar(), batch_size=self.bs,
                        progress=False)

    def pattern(self) -> None:
        from posgen_tl.experiments.pattern import feature_pattern

        feature_pattern(self.model, self.tokens, batch_size=self.bs, progress=False)

    def tolerance_curve(self) -> None:
        from posgen_tl.engine.swaps import transposition_curve

        transposition_curve(self.model, self.tokens, fracs=FRACS, seeds=(0,), target_len=TARGET_LEN,
                            modes=("T1",), batch_size=self.bs, progress=False)

    def causal_condition(self) -> None:
        """One condition of the causal study (:func:`posgen_tl.engine.conditions.condition_rows`): the clean
        pass under the intervention and one pass per swap fraction > 0."""
        from posgen_tl.engine.conditions import Condition, condition_rows
        from posgen_tl.io.sampling import Windows

        km, _ = self.causal_inputs()
        n = self.n_seq
        win = Windows(self.tokens, self.torch.arange(n), self.torch.zeros(n, dtype=self.torch.long),
                      [f"row{i}" for i in range(n)])
        cond = Condition("destroy", self.intervention())
        for s in range(0, n, self.bs):
            condition_rows(self.model, win.subset(range(s, min(s + self.bs, n))), cond, k_means=km,
                           target_len=TARGET_LEN, fracs=FRACS, seeds=(0,))

    def sufficiency(self) -> None:
        raise NotImplementedError  # replaced in steps() when posgen_tl.experiments.sufficiency exists

    # ------------------------------------------------------------ naive: run_with_cache, then the same analysis

    def _cached_captures(self):
        from posgen_tl.hooks.capture import _make_capture, _to_bshd

        info, spec, torch = self.info, self.spec, self.torch
        need = [info.q_hook, info.k_hook] + (["hook_rot_q", "hook_rot_k"] if info.rot_fires else [])
        names = {info.name(layer, h): (layer, h) for layer in range(spec.n_layers) for h in need}
        with torch.no_grad():
            _, cache = self.model.run_with_cache(self.tokens, names_filter=lambda nm: nm in names)
        pos = torch.arange(self.seq_len).expand(self.n_seq, -1)
        caps = []
        for layer in range(spec.n_layers):
            d = {}
            for h in need:
                x = cache[info.name(layer, h)]
                if h in ("hook_q_normed", "hook_k_normed"):
                    x = _to_bshd(x, info.normed_layout)
                d[h] = x.float()
            caps.append(_make_capture(layer, d, spec.layer(layer), info, pos, 0, 0))
        del cache
        return caps

    @contextlib.contextmanager
    def _replay(self, module):
        caps = self._cached_captures()
        orig = module.stream_qk

        def replay(model, tokens, fn, layers=None, **kw):
            for c in caps:
                if layers is None or c.layer in set(layers):
                    fn(c)

        module.stream_qk = replay
        try:
            yield
        finally:
            module.stream_qk = orig

    def naive_decomposition(self) -> None:
        from posgen_tl.experiments import decomposition as dec

        km = self.kbar()
        with self._replay(dec):
            dec.decompose_model(self.model, self.tokens, reference=self.ref, k_mean=km, batch_size=self.n_seq,
                                progress=False)

    def naive_pattern(self) -> None:
        from posgen_tl.experiments import pattern as pat

        with self._replay(pat):
            pat.feature_pattern(self.model, self.tokens, batch_size=self.n_seq, progress=False)

    def steps(self) -> dict[str, tuple[Callable[[], None], int]]:
        """``{name: (callable, forwards it is compared with)}``."""
        out = {
            "forward": (self.forward, 1), "capture": (self.capture, 1), "kbar_pass": (self.kbar_pass, 1),
            "decomposition": (self.decomposition, 1), "pattern": (self.pattern, 1),
            "tolerance_curve": (self.tolerance_curve, len(FRACS)),
            "causal_condition": (self.causal_condition, len(FRACS)),
            "naive_decomposition": (self.naive_decomposition, 1), "naive_pattern": (self.naive_pattern, 1),
        }
        suff = _sufficiency_step(self)
        if suff is not None:
            out["sufficiency"] = suff
        return out


def _sufficiency_step(b: Bench):
    """One sufficiency condition (docs/method.md §5): the logits of the middle third of the layers
    SUBSTITUTED by ``f + g`` (global k̄) and the clean target NLL read — one forward. ``None`` when
    ``posgen_tl.experiments.sufficiency`` is not installed (older versions)."""
    import importlib.util

    if importlib.util.find_spec("posgen_tl.experiments.sufficiency") is None:
        return None
    from posgen_tl.engine.swaps import nll_on_target
    from posgen_tl.experiments.sufficiency import sufficiency_hooks_for

    n = b.spec.n_layers
    layers = list(range(n // 3, (2 * n) // 3))

    def run() -> None:
        hooks = sufficiency_hooks_for(b.model, "d3", layers, b.kbar())
        nll_on_target(b.model, b.tokens, target_len=TARGET_LEN, fwd_hooks=hooks, batch_size=b.bs)

    return (run, 1)


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
    for _ in range(spec["repeats"]):
        for name, (fn, _) in steps.items():
            gc.collect()
            b.sync()
            t = time.perf_counter()
            fn()
            b.sync()
            times[name].append(time.perf_counter() - t)
    ratios = {}
    for name, (_, n_fwd) in steps.items():
        r = [x / (n_fwd * f) for x, f in zip(times[name], times["forward"])]
        ratios[name] = {"min": min(r), "median": statistics.median(r), "forwards": n_fwd}
    return {"seconds": times, "ratios": ratios, "geometry_s": geometry_s, "n_ref": b.n_ref, "batch_size": b.bs,
            "layers": b.spec.n_layers, "heads": b.spec.n_heads, "load_avg_1min_end": os.getloadavg()[0]}


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
    ok = _reset_peak()
    rss0 = _status_mib("VmRSS")
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    return {"peak_delta_mib": (_status_mib("VmHWM") - rss0) if ok else float("nan"), "rss_before_mib": rss0,
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
    ok = _reset_peak()
    rss0 = _status_mib("VmRSS")
    times = []
    for r in range(spec["repeats"]):
        b.sync()
        t = time.perf_counter()
        fn()
        b.sync()
        times.append(time.perf_counter() - t)
        if r == 0:
            peak = _status_mib("VmHWM") - rss0 if ok else float("nan")
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


def _fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    import numpy as np

    pts = [(x, y) for x, y in zip(xs, ys) if y is not None and y == y and y > 0]
    if len(pts) < 2:
        return None
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(lx, ly, 1)[0])


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
            _save(res | {"partial": True}, args.out, model, mres)
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
                        "time_exponent": _fit_exponent(xs, [r.get("min_s") for r in rows]),
                        "memory_exponent": _fit_exponent(xs, [r.get("peak_delta_mib") for r in rows]),
                    }
                mres["scaling"][axis] = series
                _save(res | {"partial": True}, args.out, model, mres)
        if "report" in parts:
            _log(f"{model}: whole report --quick ({args.report_repeats} repeats)")
            mres["report_quick"] = _spawn("report", dict(base, model=model, repeats=args.report_repeats),
                                          args.timeout * 3)
        res["models"][model] = mres
    res["machine"]["load_avg_end"] = os.getloadavg()
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    res["targets"] = evaluate(res)
    return res


def merge_results(parts: list[dict]) -> dict:
    """One results object from several ``--parts`` runs (per model: sizes, scaling, report united)."""
    parts = [json.loads(json.dumps(p)) for p in parts]  # the inputs stay untouched
    for p in parts:  # each size and scaling axis keeps the commit that measured it
        for m in p.get("models", {}).values():
            for entry in m.get("sizes", {}).values():
                entry.setdefault("commit", p.get("commit"))
            m["scaling_commit"] = {axis: m.get("scaling_commit", {}).get(axis, p.get("commit"))
                                   for axis in m.get("scaling", {})}
    out = parts[0]
    out["parts"] = [{"started": p.get("started"), "finished": p.get("finished"), "machine": p.get("machine"),
                     "commit": p.get("commit"), "config": p.get("config"),
                     "measured": {m: {"sizes": sorted(v.get("sizes", {})), "scaling": sorted(v.get("scaling", {}))}
                                  for m, v in p.get("models", {}).items()}}
                    for p in parts]
    for p in parts[1:]:
        for model, m in p["models"].items():
            dst = out["models"].setdefault(model, {"sizes": {}, "scaling": {}})
            dst.setdefault("sizes", {}).update(m.get("sizes", {}))
            dst.setdefault("scaling", {}).update(m.get("scaling", {}))
            dst.setdefault("scaling_commit", {}).update(m.get("scaling_commit", {}))
            if "report_quick" in m:
                dst["report_quick"] = m["report_quick"]
    out["targets"] = evaluate(out)
    return out


def _save(res: dict, out: str, model: str, mres: dict) -> None:
    snap = dict(res)
    snap["models"] = dict(res["models"], **{model: mres})
    Path(out).write_text(json.dumps(snap, indent=1))


def _ratio_of_minima(t: dict, step: str) -> float:
    """``min(step seconds) / (forwards · min(forward seconds))``: robust to a contention spike that
    hits one repeat's forward but not its step (which makes a per-repeat ratio absurdly small)."""
    return min(t["seconds"][step]) / (t["ratios"][step]["forwards"] * min(t["seconds"]["forward"]))


def _over_capture(t: dict, step: str) -> float | None:
    """Median over repeats of ``step / (forwards · capture)``: the cost over the pass the analysis
    streams from (the forward up to the last layer, no unembedding). Beside the ratio to the full
    forward because a large vocabulary (Gemma3: 262 144 tokens) makes the forward's unembedding —
    which no analysis needs — most of the forward. ``None`` without a capture step."""
    if "capture" not in t["seconds"] or step not in t["seconds"]:
        return None
    n = t["ratios"][step]["forwards"]
    return statistics.median(x / (n * c) for x, c in zip(t["seconds"][step], t["seconds"]["capture"]))


def evaluate(res: dict) -> list[dict]:
    """Every target of issue #16, per model and size: value, limit, met (None = not measured)."""
    out = []
    for model, mres in res["models"].items():
        sizes = list(mres["sizes"])
        long_key = sizes[-1] if sizes else None
        for key, entry in mres["sizes"].items():
            rat = entry["timing"].get("ratios", {})
            for step, limit in TARGETS.items():
                if step not in rat:
                    out.append(dict(model=model, size=key, target=f"{step} ≤ {limit}× forward", value=None,
                                    met=None, note="not measured" if step != "sufficiency" else
                                    "posgen_tl.experiments.sufficiency does not exist on this branch"))
                    continue
                v = rat[step]["median"]
                unit = "× the forwards it needs" if rat[step]["forwards"] > 1 else "× forward"
                out.append(dict(model=model, size=key, target=f"{step} ≤ {limit}{unit} (median ratio)", value=v,
                                met=v <= limit, ratio_of_minima=_ratio_of_minima(entry["timing"], step)))
            if "kbar_pass" in rat and "decomposition" in rat:
                v = rat["decomposition"]["median"] + rat["kbar_pass"]["median"]
                out.append(dict(model=model, size=key, target="decomposition + its k̄ reference pass ≤ 1.3× forward",
                                value=v, met=v <= 1.3,
                                note=f"k̄ from n_ref = {entry['timing']['n_ref']} other sequences"))
            if key == long_key:
                mem = entry["memory"]
                fwd = mem.get("forward", {}).get("peak_delta_mib")
                for step in ("capture", "decomposition", "pattern", "tolerance_curve", "causal_condition", "sufficiency"):
                    v = mem.get(step, {}).get("peak_delta_mib")
                    ok = None if v is None or fwd is None else v <= fwd + MEM_SLACK_MIB
                    out.append(dict(model=model, size=key, target=f"peak memory of {step} ≤ forward + 1 GiB",
                                    value=v, limit=None if fwd is None else fwd + MEM_SLACK_MIB, met=ok))
        cnt = mres.get("scaling", {}).get("count", {})
        for step in ("pattern", "decomposition"):
            e = cnt.get(step, {}).get("memory_exponent")
            out.append(dict(model=model, size="vs n_seq", target=f"{step} memory independent of n_seq (|exp| < 0.1)",
                            value=e, met=None if e is None else abs(e) < 0.1))
    return out


def print_table(res: dict) -> None:
    for model, mres in res["models"].items():
        for key, entry in mres["sizes"].items():
            t, mem = entry["timing"], entry["memory"]
            print(f"\n== {model}  {key} tokens  (ratios to the plain forward; min / median of "
                  f"{res['config']['repeats']} runs; peak = RSS high-water mark of the step, own process)")
            if "error" in t:
                print(f"   timing failed: {t['error'][-300:]}")
                continue
            f = min(t["seconds"]["forward"])
            print(f"   forward: {f:.2f} s (min); k̄ geometry one-time: {t['geometry_s']:.2f} s")
            print(f"   {'step':<26}{'ratio min':>10}{'median':>9}{'min/min':>9}{'seconds min':>13}{'peak MiB':>10}")
            for step, r in t["ratios"].items():
                pk = mem.get(step, {}).get("peak_delta_mib")
                pks = "" if pk is None else f"{pk:10.0f}"
                div = f" (/{r['forwards']} fwd)" if r["forwards"] > 1 else ""
                print(f"   {step + div:<26}{r['min']:>10.3f}{r['median']:>9.3f}{_ratio_of_minima(t, step):>9.3f}"
                      f"{min(t['seconds'][step]):>13.2f}{pks}")
        for axis, series in mres.get("scaling", {}).items():
            print(f"\n== {model} scaling vs {axis}: log-log exponents (time, peak memory)")
            for step, s in series.items():
                pts = ", ".join(f"{p['n_seq']}x{p['seq_len']}: {p.get('min_s', float('nan')):.2f}s/"
                                f"{p.get('peak_delta_mib', float('nan')):.0f}MiB" for p in s["points"])
                te, me = s["time_exponent"], s["memory_exponent"]
                print(f"   {step:<14} time^{te if te is None else round(te, 2)}  memory^{me if me is None else round(me, 2)}"
                      f"   [{pts}]")
        if "report_quick" in mres:
            r = mres["report_quick"]
            if "error" in r:
                print(f"\n== {model} report --quick failed: {r['error'][-300:]}")
            else:
                print(f"\n== {model} whole report --quick ({r['tokens'][0]}×{r['tokens'][1]} tokens): "
                      f"{min(r['seconds']['report_quick']):.1f} s = {r['ratio']['min']:.0f}× (min) / "
                      f"{r['ratio']['median']:.0f}× (median) a forward of its tokens")
    print("\n== targets")
    for t in res.get("targets", []):
        v = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        met = {True: "MET", False: "NOT MET", None: "—"}[t["met"]]
        print(f"   {t['model']:<14}{t['size']:<10}{t['target']:<58}{v:>10}  {met}  {t.get('note', '')}")


def markdown(res: dict) -> str:
    """README-ready markdown: per model and size the ratio table, the targets and the exponents."""
    lines = []
    for model, mres in res["models"].items():
        for key, entry in mres["sizes"].items():
            t, mem = entry["timing"], entry["memory"]
            if "error" in t:
                lines.append(f"**{model} {key}**: timing failed ({t['error'][-200:]})\n")
                continue
            f = min(t["seconds"]["forward"])
            commit = entry.get("commit") or res.get("commit")
            at = f"commit {commit}; " if commit else ""
            lines += [f"**{model}, {key.replace('x', ' × ')} tokens** ({at}forward {f:.2f} s min; ratios min / median of "
                      f"{len(t['seconds']['forward'])} runs; peak = RSS high-water mark above the step's start, own process)",
                      "", "| step | ratio min | ratio median | ratio of minima | median ÷ capture | seconds (each run) "
                      "| peak MiB |", "|---|---:|---:|---:|---:|---|---:|"]
            for step, r in t["ratios"].items():
                pk = mem.get(step, {}).get("peak_delta_mib")
                div = f" (per forward, {r['forwards']} needed)" if r["forwards"] > 1 else ""
                secs = ", ".join(f"{x:.2f}" for x in t["seconds"][step])
                vc = _over_capture(t, step)
                lines.append(f"| {step}{div} | {r['min']:.3f} | {r['median']:.3f} | {_ratio_of_minima(t, step):.3f} | "
                             f"{'' if vc is None else f'{vc:.3f}'} | {secs} | {'' if pk is None else f'{pk:.0f}'} |")
            lines.append("")
        for axis, series in mres.get("scaling", {}).items():
            commit = mres.get("scaling_commit", {}).get(axis) or res.get("commit")
            at = f" (commit {commit})" if commit else ""
            lines += [f"**{model}: scaling vs {'sequence length (1 sequence)' if axis == 'length' else 'number of sequences'}**{at}",
                      "", "| step | time exponent | memory exponent | points (size: min s / peak MiB) |", "|---|---:|---:|---|"]
            for step, sr in series.items():
                pts = "; ".join(f"{p['n_seq']}×{p['seq_len']}: {p.get('min_s', float('nan')):.2f} / "
                                f"{p.get('peak_delta_mib', float('nan')):.0f}" for p in sr["points"])
                te, me = sr["time_exponent"], sr["memory_exponent"]
                lines.append(f"| {step} | {'n/a' if te is None else f'{te:.2f}'} | {'n/a' if me is None else f'{me:.2f}'} | {pts} |")
            lines.append("")
        r = mres.get("report_quick")
        if r and "error" not in r:
            lines += [f"**{model}: whole report `--quick`** ({r['tokens'][0]} × {r['tokens'][1]} tokens): "
                      f"{min(r['seconds']['report_quick']):.1f} s min = {r['ratio']['min']:.0f}× (min) / "
                      f"{r['ratio']['median']:.0f}× (median) the forward of its tokens "
                      f"({len(r['seconds']['report_quick'])} runs)", ""]
    lines += ["**Targets**", "", "| model | size | target | value | ratio of minima | met |", "|---|---|---|---:|---:|---|"]
    for tg in res.get("targets", []):
        v = "n/a" if tg["value"] is None else f"{tg['value']:.3g}"
        rm = f"{tg['ratio_of_minima']:.3g}" if tg.get("ratio_of_minima") is not None else ""
        met = {True: "met", False: "**not met**", None: "not measured"}[tg["met"]]
        note = f" ({tg['note']})" if tg.get("note") else ""
        lines.append(f"| {tg['model']} | {tg['size']} | {tg['target']}{note} | {v} | {rm} | {met} |")
    return "\n".join(lines) + "\n"


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
