"""Where the analyses wait for the device: host synchronisations per call, by source line (diagnostic).

    python benchmarks/profile_syncs.py [--model smollm2-135m] [--n-seq 4] [--seq-len 128] [--device cpu|cuda]
        [--steps decomposition,pattern,sufficiency] [--top 15] [--out syncs.json] [--ops [--lines]] [--stack N]
        [--kernels] [--moments auto|maps|factored]

On ``cuda`` the count is the driver's own: :func:`torch.cuda.set_sync_debug_mode` warns at every operation that
makes the host wait for the GPU (``.item()``, ``.tolist()``, a copy to the CPU, a boolean-mask index, …), and each
warning is tallied at the innermost frame of ``posgen_tl`` on the stack.
On the CPU nothing waits, so the same sites are found by proxy: the tensor methods that WOULD wait on a GPU
(``item``, ``tolist``, ``numpy``, ``cpu``, ``__bool__`` / ``__float__`` / ``__int__`` / ``__index__``, ``nonzero``)
are wrapped for the duration of the step and tallied the same way (boolean-mask indexing and ``torch.unique`` are
not caught by the proxy; ``cuda`` catches them).
Each step runs once for warm-up (untallied: loading, hook probes, cached operators) and once tallied.

``--kernels``: instead, a :mod:`torch.profiler` trace of the step (CPU, and CUDA where it runs): wall time, the
device's busy time, and the operations taking most device (or CPU) time — where a GPU analysis spends it.

``--ops``: count instead every tensor operation dispatched (a ``TorchDispatchMode``; on a GPU each is at least one
kernel launch, a view excepted), by module. ``--stack N``: layers stacked on the head axis as a GPU would
(:mod:`posgen_tl.hooks.stacking`; 0 = the device's own choice, one layer on the CPU).

``--gpu-paths``: on the CPU, the decomposition takes the choices it takes on a GPU with ``--gpu-free-gib`` GiB free
(default 139, an H200) — the same operations a GPU would dispatch, counted without one: layers stacked by
:func:`~posgen_tl.hooks.stacking.stack_size`'s GPU budget, the D1/D2 fits solved together as
:func:`~posgen_tl.engine.decompose_scores.fit_batch` allows there (where the package has it), direct fits up to
``DIRECT_MAX_GPU`` tokens, chunked forwards only to save memory, whole maps up to ``STREAM_ABOVE`` tokens, the moments
from the factors from ``FACTORED_FROM`` tokens and the bound rows in the GPU's steps. Only the counts mean anything
there (a CPU's times on a GPU's path say nothing of either), and they have not been compared with a GPU's own count of
the same code: read them as close to it, not equal. Only with ``--steps decomposition[,forward]`` (the other analyses
keep their CPU choices).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import sys
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROXY = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "nonzero")


def _site() -> str:
    """The innermost ``posgen_tl`` frame of the current stack as ``module.py:line (function)``."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/posgen_tl/" in fr.filename.replace("\\", "/"):
            return f"{fr.filename.rsplit('posgen_tl/', 1)[-1]}:{fr.lineno} ({fr.name})"
    return "outside posgen_tl"


@contextlib.contextmanager
def tally(device: str, counts: collections.Counter):
    """Count host synchronisations (cuda) or their CPU proxies into ``counts`` by :func:`_site`."""
    import torch

    if device.startswith("cuda"):
        old = warnings.showwarning

        def show(message, category, *a, **k):
            if "synchroniz" in str(message):
                counts[_site()] += 1
            else:
                old(message, category, *a, **k)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode(1)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
        return
    originals = {name: getattr(torch.Tensor, name) for name in PROXY}
    busy = [False]  # a proxied method calling another (e.g. tolist -> item) counts once

    def wrap(f):
        def g(self, *a, **k):
            if busy[0]:
                return f(self, *a, **k)
            busy[0] = True
            try:
                counts[_site()] += 1
                return f(self, *a, **k)
            finally:
                busy[0] = False

        return g

    for name, f in originals.items():
        setattr(torch.Tensor, name, wrap(f))
    try:
        yield
    finally:
        for name, f in originals.items():
            setattr(torch.Tensor, name, f)


@contextlib.contextmanager
def count_ops(counts: collections.Counter, by_line: bool = False):
    """Count every dispatched tensor operation into ``counts`` by the ``posgen_tl`` module it came from (``by_line``:
    by its source line)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            site = _site()
            counts[site if by_line else site.split(":")[0]] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        yield


def kernel_profile(fn, device: str, top: int) -> dict:
    """One run of ``fn`` under :mod:`torch.profiler`: ``{"wall_s", "device_busy_s", "ops": [...]}`` — the device's
    busy time is the sum of its kernels' times; the ops (by name: operators, and the kernels they launched) sorted by
    their own device time (CPU time on the CPU), each with calls and own CPU / device time."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "self_cuda_time_total", 0)
        rows.append({"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                     "self_device_ms": dev_us / 1e3})
    key = "self_device_ms" if cuda else "self_cpu_ms"
    rows.sort(key=lambda r: -r[key])
    busy = sum(e.self_device_time_total for e in prof.key_averages() if str(e.device_type).endswith("CUDA")) if cuda else 0
    return {"wall_s": wall, "device_busy_s": busy / 1e6, "ops": rows[:top]}


def take_gpu_paths(free_gib: float) -> None:
    """Make the decomposition take, on the CPU, the choices it takes on a GPU with ``free_gib`` GiB free (see the
    module's ``--gpu-paths``); for the rest of the process."""
    import functools
    from types import SimpleNamespace

    import torch

    import posgen_tl.engine.decompose_scores as dec
    import posgen_tl.hooks.stacking as stacking
    import posgen_tl.maths.moments as mo
    from posgen_tl.hooks import chunked
    from posgen_tl.maths.additive import DIRECT_MAX_GPU

    gpu, free = torch.device("cuda"), int(free_gib * 2**30)
    # stacking.stack_size's own GPU branch, wherever it is called from: it sees a cuda model with ``free`` bytes free
    stacking.model_device = lambda model: gpu  # type: ignore[assignment]
    stacking.free_bytes = lambda device: free  # type: ignore[assignment]
    # where the bound check's row chunk is chosen: its own module from 2026-12-04 on, decompose_scores before (named
    # _bound_chunk up to f24534a)
    owner = importlib.import_module("posgen_tl.engine.decompose_bound") if hasattr(dec, "bound_checks") else dec
    chunk_name = "bound_chunk" if hasattr(owner, "bound_chunk") else "_bound_chunk"
    real_chunk = getattr(owner, chunk_name)

    def bound_chunk(c, n_rows: int) -> int:  # the package's choice for the capture's shapes off the CPU (no tensor
        # made: every operation here would be counted)
        return real_chunk(SimpleNamespace(q=SimpleNamespace(device=gpu), k=c.k, rope=c.rope), n_rows)

    if hasattr(dec, "fit_batch"):  # (a package from before fit_batch solved FIT_BATCH entries at a time on a GPU too)
        # fit_batch's own GPU branch: asked of a cuda device, which has ``free`` bytes free
        real_fit_batch = dec.fit_batch
        dec.free_bytes = lambda device: free  # type: ignore[assignment]
        dec.fit_batch = lambda device: real_fit_batch(gpu)  # type: ignore[attr-defined]
    mo.DIRECT_MAX = DIRECT_MAX_GPU  # type: ignore[attr-defined]
    dec.auto_chunk = functools.partial(chunked.auto_chunk, memory_only=True)  # type: ignore[assignment]
    setattr(owner, chunk_name, bound_chunk)
    real_rows, real_factored = dec.rows_per_block, getattr(dec, "use_factored", None)  # (none before 6c7ae2a)
    dec.rows_per_block = lambda device, maps, n, row_block=0: real_rows(gpu, maps, n, row_block)  # type: ignore
    if real_factored is not None:
        dec.use_factored = lambda device, n: real_factored(gpu, n)  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a zoo name or a model folder")
    ap.add_argument("--n-seq", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", default="decomposition,pattern,sufficiency")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default=None, help="write {step: {site: count}} as JSON, the settings under \"config\"")
    ap.add_argument("--ops", action="store_true", help="count tensor operations by module instead of synchronisations")
    ap.add_argument("--kernels", action="store_true", help="a torch.profiler trace: device time by operation")
    ap.add_argument("--lines", action="store_true", help="with --ops: count by source line, not by module")
    ap.add_argument("--stack", type=int, default=0, help="layers stacked on the head axis (0: the device's choice)")
    ap.add_argument("--moments", choices=("auto", "maps", "factored"), default="auto",
                    help="the decomposition's moments from the maps or from their factors (auto: the device's choice)")
    ap.add_argument("--gpu-paths", action="store_true",
                    help="on the CPU, the decomposition's choices on a GPU (counts only; see the module's docstring)")
    ap.add_argument("--gpu-free-gib", type=float, default=139.0, help="with --gpu-paths: the GPU's free memory")
    a = ap.parse_args()
    from suite_steps import Bench

    if a.gpu_paths:
        if a.device != "cpu":
            ap.error("--gpu-paths stands in for a GPU on the CPU; on a GPU its own paths are taken")
        other = {s.strip() for s in a.steps.split(",") if s.strip()} - {"decomposition", "forward"}
        if other:
            ap.error(f"--gpu-paths takes the decomposition's GPU choices only; {', '.join(sorted(other))} would mix a "
                     "CPU's and a GPU's: use --steps decomposition[,forward]")
        take_gpu_paths(a.gpu_free_gib)

    if a.moments != "auto":
        import posgen_tl.engine.decompose_scores as dec

        dec.use_factored = lambda device, n: a.moments == "factored"  # type: ignore[assignment]

    if a.stack:
        import posgen_tl.engine.decompose_scores as dec
        import posgen_tl.experiments.pattern as pat
        import posgen_tl.hooks.stream as stream

        dec.stack_size = pat.stack_size = stream.stack_size = lambda *args: a.stack  # type: ignore[assignment]

    b = Bench(a.model, a.n_seq, a.seq_len, device=a.device)
    steps = b.steps()
    b.kbar()
    result: dict[str, dict[str, int]] = {}
    for name in [s.strip() for s in a.steps.split(",") if s.strip()]:
        fn = steps[name][0]
        fn()  # warm-up: cached operators, hook probes
        if a.kernels:
            prof = kernel_profile(fn, a.device, a.top)
            result[name] = prof  # type: ignore[assignment]
            print(f"\n{name}: {prof['wall_s'] * 1e3:.1f} ms wall, device busy {prof['device_busy_s'] * 1e3:.1f} ms "
                  f"({a.device}; {a.n_seq} x {a.seq_len})")
            for r in prof["ops"]:
                print(f"  {r['calls']:7d} calls  cpu {r['self_cpu_ms']:8.2f} ms  device {r['self_device_ms']:8.2f} ms  "
                      f"{r['op']}")
            continue
        counts: collections.Counter = collections.Counter()
        with count_ops(counts, a.lines) if a.ops else tally(a.device, counts):
            fn()
        result[name] = dict(counts.most_common())
        what = "tensor operations" if a.ops else "host synchronisations"
        print(f"\n{name}: {sum(counts.values())} {what} ({a.device}; {a.n_seq} x {a.seq_len}, "
              f"{b.spec.n_layers} layers x {b.spec.n_heads} heads{f', stacks of {a.stack}' if a.stack else ''})")
        for site, c in counts.most_common(a.top):
            print(f"  {c:7d}  {site}")
    if a.out:
        result["config"] = {k: v for k, v in vars(a).items() if k != "out"}  # type: ignore[assignment]
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
