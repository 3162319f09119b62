"""The decomposition's whole-map scoring of one stack of layers (a GPU's path up to 2 048 tokens), its buffers warm.

    python benchmarks/bench_maps.py [--n-seq 4] [--seq-len 512] [--layers 30] [--repeats 5] [--threads 2]
        [--out benchmarks/results/maps_<size>_<commit>.json]

On a GPU the decomposition of 4 × 2 048 tokens is bound by passes over its ``[maps, n, n]`` float32 maps (the H200
profile in docs/performance.md). This times that part alone, on random q/k of SmolLM2's shape (9 query heads, 3
kv-heads, d_head 64, per layer; ``--layers`` stacked on the head axis as a GPU stacks them), in one process and
alternating, two ways:

* ``shift pass`` — W as its own map, shifted by the maps' μ into the target's buffer, and each ``f + g`` shifted in
  place: the way :func:`posgen_tl.engine.decompose_maps.whole_moments` worked up to commit cfd9de2, rebuilt here from
  the package's functions;
* ``shift in products`` — :func:`~posgen_tl.engine.decompose_maps.whole_moments`: ``W − μ`` and ``f + g − μ`` written
  by their products (μ a column of the queries, 1 a row of the keys).

Both keep their buffers from one call to the next (a GPU's caching allocator does; a fresh CPU buffer would cost page
faults that no GPU pays). Seconds on this CPU are a proxy of the memory traffic, not a GPU's time; the two ways'
moments are compared (float32 rounding apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def capture(n_seq: int, n: int, layers: int):
    """A stacked capture of random q/k of SmolLM2's shape (theta 100 000, d_head 64), float32."""
    import torch

    from posgen_tl.hooks.capture import QKCapture
    from posgen_tl.maths.rope import LayerRope, rotate

    g = torch.Generator().manual_seed(0)
    h, kv, d = 9 * layers, 3 * layers, 64
    rope = LayerRope(inv_freq=1.0 / 100_000.0 ** (torch.arange(0, d, 2).float() / d), rotary_dim=d,
                     score_scale=d**-0.5, kind="full")
    pos = torch.arange(n)[None].expand(n_seq, n)
    q = torch.randn(n_seq, n, h, d, generator=g) + 0.5
    k = torch.randn(n_seq, n, kv, d, generator=g) * 0.8 - 0.3
    return QKCapture(layer=0, q=q, k=k, rot_q=rotate(q, pos, rope), rot_k=rotate(k, pos, rope), positions=pos,
                     rope=rope, rot_source="computed", layers=tuple(range(layers)))


def shift_pass(c, q2, kbars, mu, geoms, cache):
    """The moments as computed up to cfd9de2: W as a map (the run's map buffer), shifted into the target; each
    ``f + g`` shifted in place."""
    from posgen_tl.engine.decompose_maps import d3_map, map_buffer, row_maps
    from posgen_tl.maths.moments import Target, d3_moments

    n = c.k.shape[1]
    w = row_maps(c, q2, out=map_buffer(cache, c).view(-1))(0, n, n)
    t = Target(w, geoms[0], mu, cache)
    return t, {kind: d3_moments(t, d3_map(c, q2, kb, cache), geoms) for kind, kb in kbars.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-seq", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from posgen_tl.engine.decompose_maps import query_operand, whole_moments
    from posgen_tl.io.provenance import git_commit
    from posgen_tl.maths.decompose import sequence_key_mean
    from posgen_tl.maths.moments import geometry

    torch.set_num_threads(a.threads)
    c = capture(a.n_seq, a.seq_len, a.layers)
    kbars = {"global": c.k.mean((0, 1)).double(), "per_sequence": sequence_key_mean(c.k, 1)}
    mu = torch.randn(a.n_seq * c.q.shape[2], generator=torch.Generator().manual_seed(1)) * 0.1
    geoms = {s: geometry(a.seq_len, s, None) for s in (0, 1)}
    ways = {"shift pass": lambda *args: shift_pass(c, query_operand(c), *args),
            "shift in products": lambda *args: whole_moments(c, None, *args)}
    caches: dict[str, dict] = {w: {} for w in ways}
    secs: dict[str, list[float]] = {w: [] for w in ways}
    out: dict[str, tuple] = {}
    for r in range(a.repeats + 1):  # the first round warms the buffers: not timed
        for way, fn in ways.items():
            t0 = time.perf_counter()
            out[way] = fn(kbars, mu, geoms, caches[way])  # each builds its own query operand
            if r:
                secs[way].append(time.perf_counter() - t0)
        if r:
            print(f"round {r}: " + ", ".join(f"{w} {secs[w][-1]:.3f} s" for w in ways), flush=True)
    (t_a, d_a), (t_b, d_b) = out["shift pass"], out["shift in products"]
    diff = {"target sums": max(float((getattr(t_a, f) - getattr(t_b, f)).abs().max() / getattr(t_a, f).abs().max())
                               for f in ("sx", "sxx", "col", "diag")),
            "D3 sums": max(float((getattr(d_a[k][s], f) - getattr(d_b[k][s], f)).abs().max()
                                 / getattr(d_a[k][s], f).abs().max())
                           for k in d_a for s in d_a[k] for f in ("sy", "syy", "sxy"))}
    maps = a.n_seq * c.q.shape[2]
    res = {"commit": git_commit(short=True), "n_seq": a.n_seq, "seq_len": a.seq_len, "layers": a.layers, "maps": maps,
           "map_gib": round(maps * a.seq_len**2 * 4 / 2**30, 3), "threads": a.threads, "repeats": a.repeats,
           "seconds": secs, "median_s": {w: statistics.median(v) for w, v in secs.items()},
           "after_over_before": statistics.median(secs["shift in products"]) / statistics.median(secs["shift pass"]),
           "max_relative_difference": diff}
    print(json.dumps({k: v for k, v in res.items() if k != "seconds"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
