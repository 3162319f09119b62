"""The decomposition's two ways to its moments, A/B in one process: from the logit maps (float32 maps, whole or in
query-row blocks: the CPU's path) and from the maps' factors (no map: :func:`posgen_tl.engine.decompose_maps.
factored_moments`, the GPU's path) — each as a ratio to the plain forward of the same tokens, and how far their
scores differ.

    python benchmarks/bench_factored.py --model smollm2-135m --sizes 8x512,4x2048 --repeats 3
    python benchmarks/bench_factored.py --model random:smollm2-135m --device cuda --sizes 8x512,4x2048 --repeats 5 \\
        --out benchmarks/results/factored_gpu_h200.json

The same :class:`suite_steps.Bench` steps as ``benchmarks/suite.py`` (the forward, the decomposition given k̄, tokens
on the model's device, timers read after the device's queue drains); per repeat the steps run interleaved (forward,
maps, factored), after one untimed warm-up of each. ``--layers`` restricts the decomposition to some layers (the
forward stays whole: the ratio then reads per analysed share). On a GPU the peak memory above each step's start.
Writes ``--out`` (JSON) and prints it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def run_size(model_name: str, n_seq: int, seq_len: int, device: str, repeats: int, layers: str | None) -> dict:
    import numpy as np
    import torch
    from suite_steps import Bench

    from posgen_tl.experiments.decomposition import decompose_model

    b = Bench(model_name, n_seq, seq_len, device=device)
    lay = None if layers is None else [int(x) for x in layers.split(",")]

    def decomposition(factored: bool):
        return decompose_model(b.model, b.tokens, reference=b.ref, k_mean=b.kbar(), batch_size=b.bs, progress=False,
                               factored=factored, **({} if lay is None else {"layers": lay}))

    steps = {"forward": b.forward, "maps": lambda: decomposition(False), "factored": lambda: decomposition(True)}
    cuda = device.startswith("cuda")
    frames = {k: steps[k]() for k in ("maps", "factored")}  # the warm-up runs: their scores are compared
    b.forward()
    secs: dict[str, list[float]] = {k: [] for k in steps}
    peaks: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            b.sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                m0 = torch.cuda.memory_allocated()
            t = time.perf_counter()
            fn()
            b.sync()
            secs[name].append(time.perf_counter() - t)
            if cuda:
                peaks[name].append((torch.cuda.max_memory_allocated() - m0) / 2**30)
    fwd = secs["forward"]
    out: dict = {"n_seq": n_seq, "seq_len": seq_len, "layers": layers or "all", "forward_s": fwd}
    for name in ("maps", "factored"):
        ratios = [s / f for s, f in zip(secs[name], fwd)]
        out[name] = {"seconds": secs[name], "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                     "ratio_of_medians": statistics.median(secs[name]) / statistics.median(fwd)}
        if cuda:
            out[name]["peak_gib"] = max(peaks[name])
    a, c = frames["maps"], frames["factored"]
    keys = ["layer", "head", "seq", "estimator", "k_mean", "sink_excluded"]
    a, c = (d.sort_values(keys).reset_index(drop=True) for d in (a, c))
    assert a[keys].equals(c[keys]), "the two paths scored different rows"
    out["max_abs_diff"] = {k: float(np.nanmax(np.abs(a[k].to_numpy(float) - c[k].to_numpy(float))))
                           for k in ("r", "r2", "r_within")}
    out["nan_agree"] = bool(all((a[k].isna() == c[k].isna()).all() for k in ("r", "r2", "r_within")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default="8x512,4x2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", default=None, help="comma-separated layers to decompose (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from posgen_tl.io.provenance import git_commit

    res = {"commit": git_commit(short=True), "model": args.model, "device": args.device, "threads": args.threads,
           "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
           "repeats": args.repeats, "sizes": []}
    for size in args.sizes.split(","):
        n_seq, seq_len = (int(x) for x in size.split("x"))
        res["sizes"].append(run_size(args.model, n_seq, seq_len, args.device, args.repeats, args.layers))
        print(json.dumps(res["sizes"][-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
