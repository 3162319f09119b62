"""Benchmark: the causal study's dose–response passes on one long text, through chunks (docs/method.md §5).

    python benchmarks/bench_dose_long.py [--model gemma3-270m] [--seq-len 16384] [--threads 2]
        [--out benchmarks/results/results_dose_long_<model>_<n>.json]

One sequence, the destroy condition of the middle third of the layers on their fastest quarter of bands at α ∈ {0, 1},
swap fractions (0, 0.2), one seed: :func:`posgen_tl.engine.dose.dose_rows` runs the unedited clean pass, its swapped
pass, the paired clean pass (the sequence unedited and edited side by side: the attention change read row by row) and
the edited swapped pass — five sequence-forwards, every one a chunk of 512 positions at a time through the model's
cache. The unit is one unedited target-NLL pass of the same sequence in the same process (also in chunks: at these
lengths no whole forward fits). Recorded: seconds, units, the process's peak resident memory, and what the whole run
(stored attention patterns of the edited layers) would have had to keep.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from posgen_tl.engine.conditions import build_conditions
    from posgen_tl.engine.dose import dose_rows
    from posgen_tl.engine.swaps import nll_on_target
    from posgen_tl.hooks.capture import probe_hooks
    from posgen_tl.hooks.chunked import forward_chunk
    from posgen_tl.hooks.edits import key_means
    from posgen_tl.io.corpus import corpus_tokens
    from posgen_tl.io.models import load_model
    from posgen_tl.io.provenance import git_commit
    from posgen_tl.io.sampling import Windows

    model = load_model(a.model)
    spec, _ = probe_hooks(model)
    toks = corpus_tokens(model, None, seq_len=a.seq_len, n_seq=1)
    target = 64
    w = Windows(tokens=toks, doc_ids=torch.zeros(1, dtype=torch.long), starts=torch.zeros(1, dtype=torch.long),
                doc_names=["d0"])
    mid = list(range(spec.n_layers // 3, 2 * spec.n_layers // 3))
    nb = spec.layer(mid[0]).n_bands
    conds = build_conditions(mid, fast=list(range(max(1, nb // 4))), slow=[nb - 1], alpha=1.0, controls=())
    km = key_means(model, toks[:, : a.seq_len - target], mid)
    chunk = forward_chunk(model, a.seq_len)
    t = time.perf_counter()
    nll_on_target(model, toks, target_len=target, batch_size=1)
    unit = time.perf_counter() - t
    t = time.perf_counter()
    rows = dose_rows(model, w, conds, {"destroy": (0.0, 1.0)}, k_means=km, target_len=target, fracs=(0.0, 0.2),
                     seeds=(0,), batch_size=1, progress=False)
    sec = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    stored = len(mid) * spec.n_heads * a.seq_len**2 * 4  # the whole run's unedited patterns, float32, one sequence
    edited = rows[rows["alpha"] > 0]
    out = {"commit": git_commit(), "model": spec.model_name, "seq_len": a.seq_len, "threads": a.threads,
           "chunk": chunk, "edited_layers": mid, "target_len": target, "unit_s": unit, "dose_s": sec,
           "units": sec / unit, "sequence_forwards": 5, "peak_rss_mib": peak,
           "whole_run_pattern_store_gib": stored / 2**30,
           "damage": float(edited["clean_nll"].iloc[0] - edited["base_clean_nll"].iloc[0]),
           "attn_kl": float(edited["attn_kl"].iloc[0]),
           "rows": rows[["alpha", "frac", "clean_nll", "nll", "delta", "attn_kl"]].to_dict("records")}
    print(f"{spec.model_name} 1 × {a.seq_len}: unit (chunked unedited NLL) {unit:.1f} s; dose passes {sec:.1f} s = "
          f"{sec / unit:.2f} units; peak RSS {peak / 1024:.2f} GiB; the whole run would keep "
          f"{stored / 2**30:.1f} GiB of patterns; damage {out['damage']:.4f} nats, attention KL {out['attn_kl']:.4f}",
          flush=True)
    path = Path(a.out or f"benchmarks/results/results_dose_long_{a.model}_{a.seq_len}.json")
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
