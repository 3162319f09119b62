"""Where the analyses wait for the device: host synchronisations per call, by source line (diagnostic).

    python benchmarks/profile_syncs.py [--model smollm2-135m] [--n-seq 4] [--seq-len 128] [--device cpu|cuda]
        [--steps decomposition,pattern,sufficiency] [--top 15] [--out syncs.json] [--ops] [--stack N]

On ``cuda`` the count is the driver's own: :func:`torch.cuda.set_sync_debug_mode` warns at every operation that
makes the host wait for the GPU (``.item()``, ``.tolist()``, a copy to the CPU, a boolean-mask index, …), and each
warning is tallied at the innermost frame of ``posgen_tl`` on the stack.
On the CPU nothing waits, so the same sites are found by proxy: the tensor methods that WOULD wait on a GPU
(``item``, ``tolist``, ``numpy``, ``cpu``, ``__bool__`` / ``__float__`` / ``__int__`` / ``__index__``, ``nonzero``)
are wrapped for the duration of the step and tallied the same way (boolean-mask indexing and ``torch.unique`` are
not caught by the proxy; ``cuda`` catches them).
Each step runs once for warm-up (untallied: loading, hook probes, cached operators) and once tallied.

``--ops``: count instead every tensor operation dispatched (a ``TorchDispatchMode``; on a GPU each is at least one
kernel launch), by module. ``--stack N``: layers stacked on the head axis as a GPU would (:mod:`posgen_tl.hooks.stacking`;
0 = the device's own choice, one layer on the CPU).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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
def count_ops(counts: collections.Counter):
    """Count every dispatched tensor operation into ``counts`` by the ``posgen_tl`` module it came from."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[_site().split(":")[0]] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a zoo name or a model folder")
    ap.add_argument("--n-seq", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", default="decomposition,pattern,sufficiency")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default=None, help="write {step: {site: count}} as JSON")
    ap.add_argument("--ops", action="store_true", help="count tensor operations by module instead of synchronisations")
    ap.add_argument("--stack", type=int, default=0, help="layers stacked on the head axis (0: the device's choice)")
    a = ap.parse_args()
    from suite_steps import Bench

    if a.stack:
        import posgen_tl.engine.decompose_scores as dec
        import posgen_tl.experiments.pattern as pat

        dec.stack_size = pat.stack_size = lambda *args: a.stack  # type: ignore[assignment]

    b = Bench(a.model, a.n_seq, a.seq_len, device=a.device)
    steps = b.steps()
    b.kbar()
    result: dict[str, dict[str, int]] = {}
    for name in [s.strip() for s in a.steps.split(",") if s.strip()]:
        fn = steps[name][0]
        fn()  # warm-up: cached operators, hook probes
        counts: collections.Counter = collections.Counter()
        with count_ops(counts) if a.ops else tally(a.device, counts):
            fn()
        result[name] = dict(counts.most_common())
        what = "tensor operations" if a.ops else "host synchronisations"
        print(f"\n{name}: {sum(counts.values())} {what} ({a.device}; {a.n_seq} x {a.seq_len}, "
              f"{b.spec.n_layers} layers x {b.spec.n_heads} heads{f', stacks of {a.stack}' if a.stack else ''})")
        for site, c in counts.most_common(a.top):
            print(f"  {c:7d}  {site}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
