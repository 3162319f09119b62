"""Peak memory and time of the decomposition of ONE long sequence, per length, each length in its own process.

    python benchmarks/bench_long.py --lengths 1024,2048,4096,8192,16384 [--model smollm2-135m] [--threads 1]
        [--forward-max 4096] [--moments auto|maps|factored] [--out benchmarks/results/results_long_chunked.json]

Per length ``n`` (a fresh process, so each high-water mark is that length's alone): :func:`decompose_model` of one
sequence with its own k̄ (``k_mean="per_sequence"``: no reference pass; all layers and heads, D1/D2/D3, sink kept and
excluded), first in the process, with the package's defaults for long sequences — the forward run in chunks of 512 positions
through the model's key/value cache above 2 048 tokens (:mod:`posgen_tl.hooks.chunked`) and the logit maps scored a
block of 256 query rows at a time (:func:`posgen_tl.maths.moments.streamed_moments`). Up to ``--forward-max`` tokens
also the plain forward, after it (it builds every layer's ``[heads, n, n]`` scores: 9.7 GB per SmolLM2 layer at
16 384).
Memory: the process's resident high-water mark (``VmHWM``, MiB, model included) per phase, reset before each
phase through ``/proc/self/clear_refs``, and that mark minus the resident memory at the phase's start; the fitted
exponents in ``n`` of both for the decomposition are printed and stored.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def one(args: argparse.Namespace) -> dict:
    import torch
    from bench_decompose import PEAKS, measure

    from posgen_tl import load_model
    from posgen_tl.experiments import decomposition as dec
    from posgen_tl.hooks.chunked import auto_chunk
    from posgen_tl.hooks.stream import release_freed_memory
    from posgen_tl.io.corpus import corpus_tokens
    from posgen_tl.io.provenance import git_commit

    torch.set_num_threads(args.threads)
    if args.moments != "auto":  # the decomposition's moments from the maps or from their factors
        from posgen_tl.engine import decompose_scores

        decompose_scores.use_factored = lambda device, n: args.moments == "factored"  # type: ignore[assignment]
    n = args.length
    model = load_model(args.model)
    tokens = corpus_tokens(model, None, seq_len=n, n_seq=1)
    with torch.no_grad():
        model(tokens[:, :16], return_type=None)  # warm-up
    delta: dict = {}
    out: dict = {"model": args.model, "tokens": n, "threads": args.threads, "chunk": auto_chunk(model, n),
                 "moments": args.moments}  # the decomposition's
    # the decomposition first, with the heap's freed pages returned (loading leaves some resident; a phase would
    # reuse them without raising the mark, so its rise above the start would understate what it needs)
    release_freed_memory()
    df, out["decompose_s"], delta["decompose"] = measure(
        lambda: dec.decompose_model(model, tokens, k_mean="per_sequence", batch_size=1, progress=False), "decompose")
    if n <= args.forward_max:
        def forward():
            with torch.no_grad():
                model(tokens, return_type=None)
        release_freed_memory()
        _, out["forward_s"], delta["forward"] = measure(forward, "forward")
    out["peak_rss_mib"] = {k: round(v, 1) for k, v in PEAKS.items()}
    out["peak_rss_delta_mib"] = {k: round(v, 1) for k, v in delta.items()}
    out["rows"], out["d3_bound_holds_min"] = len(df), float(df["d3_bound_holds"].min())
    out["commit"] = git_commit()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--forward-max", type=int, default=4096)
    ap.add_argument("--moments", choices=("auto", "maps", "factored"), default="auto",
                    help="the decomposition's moments from the maps or from their factors (auto: the device's choice)")
    ap.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)  # one length (the worker process)
    ap.add_argument("--out", default="benchmarks/results/results_long_chunked.json")
    a = ap.parse_args()
    if a.length:
        print(json.dumps(one(a)))
        return
    rows = []
    for n in (int(x) for x in a.lengths.split(",")):
        t = time.perf_counter()
        cmd = [sys.executable, __file__, "--length", str(n), "--model", a.model, "--threads", str(a.threads),
               "--forward-max", str(a.forward_max), "--moments", a.moments]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            rows.append({"tokens": n, "error": res.stderr.strip().splitlines()[-1:], "wall_s": time.perf_counter() - t})
        else:
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
        Path(a.out).write_text(json.dumps({"rows": rows}, indent=1))
    ok = [r for r in rows if "peak_rss_mib" in r]
    if len(ok) >= 2:
        xs = [math.log(r["tokens"]) for r in ok]
        fits = {}
        for what in ("peak_rss_mib", "peak_rss_delta_mib"):
            ys = [math.log(max(r[what]["decompose"], 1.0)) for r in ok]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            fits[what] = round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 3)
        print(f"decomposition memory exponent in n over {ok[0]['tokens']}…{ok[-1]['tokens']} tokens: "
              f"{fits['peak_rss_delta_mib']} (above the phase's start), {fits['peak_rss_mib']} (process peak)")
        Path(a.out).write_text(json.dumps({"rows": rows, "memory_exponent_decompose": fits}, indent=1))


if __name__ == "__main__":
    main()
