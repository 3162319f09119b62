"""The D1/D2 least-squares fits of one batch of maps: conjugate gradients vs the direct Schur solve (diagnostic).

    python benchmarks/bench_fits.py [--lengths 512,1024] [--maps 36] [--threads 1] [--repeats 10]

Per length, sink (0, 1) and design (D1, D2): the one-time build of the direct operators, the mean time of a
solve of ``maps`` right-hand sides each way, their largest relative difference and the relative residual the direct
step leaves (``‖XᵀXβ − r‖ / ‖r‖``: conjugate gradients stop at 1e-12).
"""

from __future__ import annotations

import argparse
import time


def _timed(repeats: int, fn, *args, **kw):
    """``(result, mean seconds)`` of ``fn(*args, **kw)`` over ``repeats`` calls after one warm-up call."""
    fn(*args, **kw)
    t = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args, **kw)
    return out, (time.perf_counter() - t) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1024")
    ap.add_argument("--maps", type=int, default=36)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    import torch

    from posgen_tl.maths.additive import band, direct, gram_matvec, solve

    torch.set_num_threads(a.threads)
    print(f"{a.maps} maps, {a.threads} thread(s): build ms | conjugate gradients ms | direct ms | max rel diff | "
          "residual after the direct step")
    for n in (int(x) for x in a.lengths.split(",")):
        for sink in (0, 1):
            for three in (True, False):
                bd = band(n, sink)
                t = time.perf_counter()
                op = direct(bd, three)
                build = time.perf_counter() - t
                z = torch.randn(a.maps, (3 if three else 2) * n, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(n))
                rhs = gram_matvec(bd, z, three)  # the sums of some map: in the design's range

                cg, t_cg = _timed(a.repeats, solve, bd, rhs, three)
                dr, t_dr = _timed(a.repeats, solve, bd, rhs, three, direct_op=op)
                diff = float((cg - dr).abs().max() / cg.abs().max())
                res = float(((gram_matvec(bd, op.apply(rhs), three) - rhs).norm(dim=-1) / rhs.norm(dim=-1)).max())
                print(f"n={n:<5} sink={sink} {'D1' if three else 'D2'}: {build * 1e3:8.1f} | {t_cg * 1e3:8.2f} | "
                      f"{t_dr * 1e3:8.2f} | {diff:.1e} | {res:.1e}")


if __name__ == "__main__":
    main()
