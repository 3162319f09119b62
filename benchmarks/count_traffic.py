"""How much memory traffic and arithmetic the decomposition's moments of ONE layer cost, from the maps and from their
factors — counted, not timed, so it runs on any machine (a proxy of a GPU's cost, where the moments are bound by
passes over memory).

    python benchmarks/count_traffic.py --sizes 8x512,8x1024,4x2048 [--model smollm2-135m] [--layer 5]
        [--out benchmarks/results/traffic_<commit>.json]

Per size: one layer's captured q/k (:func:`posgen_tl.hooks.stream.capture_qk`), its shift μ and bound rows as the
decomposition takes them, both k̄ kinds (the sequences' own and a given one), sink 1; then the GPU's two ways to the
moments — the whole maps (:func:`posgen_tl.engine.decompose_maps.whole_moments`, W recomputed) and the factors
(:func:`~posgen_tl.engine.decompose_maps.factored_moments`) — each once under a ``TorchDispatchMode`` that adds up,
for every tensor operation (views excluded), the bytes of its tensor inputs and outputs, and under
``torch.utils.flop_counter.FlopCounterMode`` (the products' floating-point operations; an FFT is not counted).
Bytes read + written is an upper bound on what a GPU moves (a fused or cached operand moves less). The CPU time of one
untallied call is printed beside them (not a GPU's).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: operations that make views, not data
VIEWS = {"view", "reshape", "as_strided", "expand", "permute", "transpose", "t", "slice", "select", "unsqueeze",
         "squeeze", "alias", "_unsafe_view", "detach", "unbind", "split", "chunk", "narrow", "diagonal", "unfold",
         "view_as_real", "view_as_complex", "_reshape_alias", "lift_fresh", "real", "imag", "conj", "_conj",
         "resolve_conj", "_neg_view"}
#: operations that read no input data (an input only gives the shape, dtype or device): only their outputs count
FACTORIES = {"new_zeros", "new_ones", "new_empty", "new_full", "empty_like", "zeros_like", "ones_like", "full_like"}


def tally(fn) -> dict:
    """``fn()`` run once under the counters: ``{"ops", "bytes", "by_op", "matmul_flops"}``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import FlopCounterMode

    def size(x) -> int:
        return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.by_op: collections.Counter = collections.Counter()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if name not in VIEWS:
                self.ops += 1
                read = 0 if name in FACTORIES else sum(size(a) for a in tree_leaves((args, kwargs)))
                self.by_op[name] += read + sum(size(o) for o in tree_leaves(out))
            return out

    count, flops = Count(), FlopCounterMode(display=False)
    with flops, count:
        fn()
    return {"ops": count.ops, "bytes": sum(count.by_op.values()), "by_op": dict(count.by_op.most_common(10)),
            "matmul_flops": flops.get_total_flops()}


def one_size(model, n_seq: int, seq_len: int, layer: int) -> dict:
    import torch

    from posgen_tl.engine import decompose_maps as M
    from posgen_tl.engine import decompose_scores as D
    from posgen_tl.hooks.stream import capture_qk
    from posgen_tl.io.corpus import corpus_tokens
    from posgen_tl.maths.decompose import sequence_key_mean
    from posgen_tl.maths.moments import geometry

    toks = corpus_tokens(model, None, seq_len=seq_len, n_seq=n_seq)
    c = capture_qk(model, toks, layers=[layer])[layer]
    geoms = {s: geometry(seq_len, s, c.rope.sliding_window) for s in (0, 1)}
    kbars = {"per_sequence": sequence_key_mean(c.k, 1), "given": c.k[:, 1:].double().mean((0, 1))}
    rows = torch.linspace(0, seq_len - 1, 32).round().long().unique()
    check = D.bound_checks if hasattr(D, "bound_checks") else D._bound_checks  # (its own module from 2026-12-04 on)
    _, mu, _ = check(c, kbars, rows, geoms, rows.tolist(), {})
    cache: dict = {}
    paths = {"maps": lambda: M.whole_moments(c, None, kbars, mu[:, 0].float(), geoms, cache),
             "factored": lambda: M.factored_moments(c, kbars, mu[:, 0], geoms)}
    out: dict = {"n_seq": n_seq, "seq_len": seq_len, "layer": layer, "maps": c.q.shape[0] * c.n_heads}
    for name, fn in paths.items():
        fn()  # warm-up: cached operators
        t = time.perf_counter()
        fn()
        out[name] = {"cpu_s": time.perf_counter() - t, **tally(fn)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", default="8x512,8x1024,4x2048")
    ap.add_argument("--layer", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from posgen_tl.io.models import load_model
    from posgen_tl.io.provenance import git_commit

    torch.set_num_threads(a.threads)
    model = load_model(a.model)
    res = {"commit": git_commit(), "model": a.model, "sizes": []}
    for size in a.sizes.split(","):
        n_seq, seq_len = (int(x) for x in size.split("x"))
        r = one_size(model, n_seq, seq_len, a.layer)
        res["sizes"].append(r)
        print(f"{n_seq} x {seq_len}: " + "; ".join(
            f"{k} {r[k]['bytes'] / 1e9:.2f} GB read+written, {r[k]['matmul_flops'] / 1e9:.1f} GFLOP, {r[k]['ops']} ops, "
            f"{r[k]['cpu_s']:.2f} s CPU" for k in ("maps", "factored")), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
