"""Benchmark: feature_pattern (docs/method.md §3) vs a plain forward pass, time and peak memory.

    python benchmarks/bench_pattern.py --n-seq 64 --seq-len 512 [--small 16]

In one process, over the same tokens of SmolLM2-135M (all layers, batch 8, 1 thread):
1. plain forward ``model(tokens)`` per batch — full forward INCLUDING the final norm and the
   logits (vocab 49 152), the output discarded per batch;
2. ``feature_pattern`` over the same tokens (its stream stops after the last layer, so no
   logits are computed);
and the ratio 2/1 (target ≤ 1.5). For reference, a no-op ``stream_qk`` over the first
``--small`` sequences (hooks + capture, no statistics, no logits) is timed too. Peak memory is VmHWM from /proc/self/status, reset before
each measured stage via /proc/self/clear_refs (value 5), so each stage's peak is its own; the
pattern pass is run on ``--small`` sequences and on ``--n-seq`` sequences to show that its
peak does not grow with the corpus.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

torch.set_num_threads(1)


def vm_kb(field: str = "VmHWM") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=64)
    ap.add_argument("--small", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()

    from posgen_tl.experiments.pattern import feature_pattern
    from posgen_tl.io.corpus import corpus_tokens
    from posgen_tl.io.models import load_model

    model = load_model(args.model)
    tokens = corpus_tokens(model, None, seq_len=args.seq_len, n_seq=args.n_seq)
    feature_pattern(model, tokens[:1, :32], progress=False)  # warm-up (hook probe, allocator)
    res: dict = {"model": args.model, "tokens": list(tokens.shape), "batch_size": args.batch_size,
                 "threads": torch.get_num_threads(), "clear_refs": reset_peak()}
    res["rss_after_load_mb"] = vm_kb("VmRSS") / 1024

    reset_peak()
    t = time.perf_counter()
    with torch.no_grad():
        for i in range(0, tokens.shape[0], args.batch_size):
            logits = model(tokens[i : i + args.batch_size])
            del logits
    res["forward_with_logits_s"] = time.perf_counter() - t
    res["forward_peak_mb"] = vm_kb() / 1024

    from posgen_tl.hooks.stream import stream_qk

    t = time.perf_counter()
    stream_qk(model, tokens[: args.small], lambda c: None, batch_size=args.batch_size, progress=False)
    res[f"noop_capture_{args.small}seq_s"] = time.perf_counter() - t

    reset_peak()
    t = time.perf_counter()
    small = feature_pattern(model, tokens[: args.small], batch_size=args.batch_size, progress=False)
    res[f"pattern_{args.small}seq_s"] = time.perf_counter() - t
    res[f"pattern_{args.small}seq_peak_mb"] = vm_kb() / 1024

    reset_peak()
    t = time.perf_counter()
    full = feature_pattern(model, tokens, batch_size=args.batch_size, progress=False)
    res[f"pattern_{args.n_seq}seq_s"] = time.perf_counter() - t
    res[f"pattern_{args.n_seq}seq_peak_mb"] = vm_kb() / 1024
    res["ratio_pattern_over_forward"] = res[f"pattern_{args.n_seq}seq_s"] / res["forward_with_logits_s"]
    res["n_tokens_per_layer"] = full.n_tokens
    del small
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
