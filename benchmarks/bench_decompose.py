"""Speed / memory of the docs/method.md §2 decomposition as ratios to a plain forward pass.

    python benchmarks/bench_decompose.py [--n-seq 8] [--seq-len 512] [--model smollm2-135m]

Same process, same 8×512 tokens, one thread:

* ``forward_s``: ``model(tokens, return_type=None)`` under ``no_grad`` on the whole batch
  (the bridge still runs the unembedding; no loss);
* ``capture_s``: :func:`stream_qk` over all layers with a no-op callback (hooks, no unembedding);
* ``reference_s``: the k̄ pass (:func:`reference_key_means`) on ``n_ref`` OTHER sequences;
* ``geometry_s``: one-time fit operators for the two masks (cached for the rest of a session);
* ``decompose_s``: :func:`decompose_model` given k̄ (all layers and heads, D1/D2/D3, sink kept and
  excluded, 64 bound rows) — includes its own forward pass;
* peak memory: the process's peak RSS (``VmHWM``), reset through ``/proc/self/clear_refs``
  before each phase, minus the RSS at its start (``peak_rss_delta_mib``; memory freed by an earlier phase can be
  reused without raising it), and the absolute high-water mark reached in each phase (``peak_rss_mib``).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

torch.set_num_threads(1)


def _status(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # MiB
    return float("nan")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


PEAKS: dict[str, float] = {}  # the process's resident high-water mark (MiB) reached in each phase


def measure(fn, name: str = ""):
    """``(result, seconds, peak RSS delta MiB)`` of ``fn()``; the absolute peak goes to ``PEAKS[name]``."""
    import gc

    gc.collect()
    ok = _reset_peak()
    rss0 = _status("VmRSS")
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    peak = _status("VmHWM") if ok else float("nan")
    PEAKS[name] = peak
    return out, dt, peak - rss0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--n-ref", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args()

    import posgen_tl.maths.moments as moments
    from posgen_tl import load_model
    from posgen_tl.experiments import decomposition as dec
    from posgen_tl.hooks.capture import probe_hooks
    from posgen_tl.hooks.stream import stream_qk
    from posgen_tl.io.corpus import corpus_tokens
    from posgen_tl.io.provenance import git_commit

    model = load_model(args.model)
    spec, _ = probe_hooks(model)
    toks = corpus_tokens(model, None, seq_len=args.seq_len, n_seq=args.n_seq + args.n_ref)
    tokens, ref = toks[: args.n_seq], toks[args.n_seq :]
    with torch.no_grad():
        model(tokens[:1, :16], return_type=None)  # warm-up

    def forward():
        with torch.no_grad():
            return model(tokens, return_type=None)

    _, t_fwd, m_fwd = measure(forward, "forward")
    _, t_cap, m_cap = measure(lambda: stream_qk(model, tokens, lambda c: None, batch_size=args.batch_size, progress=False), "capture")
    kms, t_ref, m_ref = measure(lambda: dec.reference_key_means(model, ref, sink=1, batch_size=args.batch_size, progress=False), "reference")
    moments._GEOMS.clear()
    windows = {spec.layer(i).sliding_window for i in range(spec.n_layers)}
    _, t_geo, m_geo = measure(lambda: [moments.geometry(args.seq_len, s, w) for s in (0, 1) for w in windows], "geometry")
    df, t_dec, m_dec = measure(lambda: dec.decompose_model(
        model, tokens, reference=ref, k_mean=kms, batch_size=args.batch_size, progress=False), "decompose")
    _, t_fwd2, _ = measure(forward)
    t_f = min(t_fwd, t_fwd2)
    print(json.dumps({
        "model": args.model, "tokens": [args.n_seq, args.seq_len], "layers": spec.n_layers, "heads": spec.n_heads,
        "threads": torch.get_num_threads(), "load_avg_1min": os.getloadavg()[0],
        "forward_s": [round(t_fwd, 2), round(t_fwd2, 2)], "capture_s": round(t_cap, 2), "reference_s": round(t_ref, 2),
        "geometry_s": round(t_geo, 2), "decompose_s": round(t_dec, 2),
        "ratio_decompose_to_forward": round(t_dec / t_f, 3),
        "ratio_decompose_plus_geometry_to_forward": round((t_dec + t_geo) / t_f, 3),
        "ratio_all_incl_reference_to_forward": round((t_dec + t_geo + t_ref) / t_f, 3),
        "peak_rss_delta_mib": {"forward": round(m_fwd, 1), "capture": round(m_cap, 1), "reference": round(m_ref, 1),
                               "geometry": round(m_geo, 1), "decompose": round(m_dec, 1)},
        "peak_rss_mib": {k: round(v, 1) for k, v in PEAKS.items()},  # absolute: the process's high-water mark
        "rows": len(df), "d3_bound_holds_min": float(df["d3_bound_holds"].min()),
        "commit": git_commit(),  # of the package imported (a worktree's when run through its PYTHONPATH)
    }, indent=1))


if __name__ == "__main__":
    main()
