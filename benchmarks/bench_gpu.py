"""On a GPU: the analyses at the scale researchers use, and one long sequence, each as a ratio to a plain forward of
the same tokens in the same process, with the GPU's peak memory (random-init models of real shapes,
:mod:`random_shapes`).

    python benchmarks/bench_gpu.py scale --shape llama3-8b --dtype bfloat16 --seq-len 2048 [--repeats 3]
    python benchmarks/bench_gpu.py long --shape smollm2-135m@16384 --seq-len 16384 [--repeats 1]

``scale``: the exactness check (``posgen-tl check``'s comparison of every layer with the model's own scores), the
decomposition of every head of ONE layer (the middle one; D1/D2/D3, its own k̄), and one causal condition (an
intervention on the middle third of the layers: its clean pass and one pass per swap fraction, compared with that
many forwards).
``long``: the decomposition of one sequence of ``--seq-len`` tokens (every layer and head, its own k̄) — the package's
defaults for long sequences: the forward in chunks through the model's key/value cache, the moments from the maps'
factors (on a GPU from 1 024 tokens; the maps in row blocks before 6c7ae2a).
Timers read after ``torch.cuda.synchronize()``; memory is ``torch.cuda.max_memory_allocated`` above the step's start
(the model's weights excluded). Medians (and minima) over ``--repeats`` after one untimed warm-up run of each step.
Writes ``--out`` (JSON) and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(fn, repeats: int, warm: bool = True) -> dict:
    """``fn()`` timed ``repeats`` times (after one untimed run if ``warm``); on a GPU with its peak memory."""
    import torch

    cuda = torch.cuda.is_available()
    if warm:
        fn()
    secs, peaks = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            m0 = torch.cuda.memory_allocated()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated() - m0) / 2**30)
        secs.append(time.perf_counter() - t)
    return {"seconds": secs, "median_s": statistics.median(secs), "min_s": min(secs),
            "peak_gib": max(peaks) if peaks else None}


def scale(a: argparse.Namespace, model, tokens) -> dict:
    from suite_steps import FRACS, Bench

    from posgen_tl.experiments.decomposition import decompose_model
    from posgen_tl.experiments.exactness import exactness_table
    from posgen_tl.hooks.capture import probe_hooks

    mid = probe_hooks(model)[0].n_layers // 2
    out: dict = {}
    table = exactness_table(model, tokens)
    out["check_passed_layers"] = int(table["passed"].sum())
    out["check_layers"] = len(table)
    out["check"] = measure(lambda: exactness_table(model, tokens), a.repeats, warm=False)
    out["decompose_one_layer"] = measure(
        lambda: decompose_model(model, tokens, k_mean="per_sequence", layers=[mid], batch_size=tokens.shape[0],
                                progress=False), a.repeats)
    # the suite's causal step: its intervention (fast-band key offsets destroyed in the middle third, α 0.5), its
    # swap fractions and target span, on the same number of sequences of the same length
    b = Bench(model, tokens.shape[0], tokens.shape[1], device=a.device)
    b.causal_inputs()
    out["causal_condition"] = measure(b.causal_condition, a.repeats)
    out["causal_condition"]["forwards"] = len(FRACS)
    return out


def long(a: argparse.Namespace, model, tokens) -> dict:
    from posgen_tl.experiments.decomposition import decompose_model
    from posgen_tl.hooks.chunked import auto_chunk

    out: dict = {"chunk": auto_chunk(model, tokens.shape[1], memory_only=True)}
    out["decompose"] = measure(lambda: decompose_model(model, tokens, k_mean="per_sequence", batch_size=1,
                                                       progress=False), a.repeats, warm=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["scale", "long"])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--n-seq", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test of this script, no memory figures)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch
    from random_shapes import build

    from posgen_tl.io.corpus import corpus_tokens
    from posgen_tl.io.provenance import git_commit

    t = time.perf_counter()
    cuda = a.device.startswith("cuda")
    model = build(a.shape, device=a.device, dtype=getattr(torch, a.dtype))
    if cuda:
        torch.cuda.synchronize()
    res: dict = {"what": a.what, "shape": a.shape, "dtype": a.dtype, "tokens": [a.n_seq, a.seq_len],
                 "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                 "commit": git_commit(), "build_s": time.perf_counter() - t,
                 "weights_gib": torch.cuda.memory_allocated() / 2**30 if cuda else None}
    tokens = corpus_tokens(model, None, seq_len=a.seq_len, n_seq=a.n_seq).to(a.device)

    def forward() -> None:
        with torch.no_grad():
            model(tokens)

    res["forward"] = measure(forward, a.repeats)
    res.update((scale if a.what == "scale" else long)(a, model, tokens))
    fwd = res["forward"]["median_s"]
    res["ratios"] = {k: v["median_s"] / (fwd * v.get("forwards", 1)) for k, v in res.items()
                     if isinstance(v, dict) and "median_s" in v and k != "forward"}
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
