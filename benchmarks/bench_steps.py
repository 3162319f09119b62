"""Analyses against the plain forward pass IN ONE PROCESS, alternating: the ratio to read on a machine whose speed
drifts (a shared host: the suite's separate worker processes can land in different minutes of it).

    python benchmarks/bench_steps.py --n-seq 8 --seq-len 512 --steps decomposition,pattern --repeats 3 [--threads 2]

Each round runs the forward, then each step, on the same tokens (:class:`suite_steps.Bench`, as the suite does);
``--base capture`` divides by the chunked capture pass instead of the plain forward (a length whose whole forward
does not fit in memory), ``--base target_nll`` by the unedited target-NLL pass (chunked there too: the base of the
passes under an edit or a substitution). Prints every round and, per step, the median seconds, the ratio of medians to the base
step's and the ratio of the fastest round to the base step's fastest, with the median process CPU seconds and minor page faults of a call (a page
the kernel had to map and zero-fill: freed memory handed back to the system and touched again); ``--out`` writes them
as JSON.

``--bracket``: a forward also between every two steps of a round and after its last (forward, step, forward, step, …,
forward), and each step's ratio is its seconds over the mean of the forwards just before and just after it
(:func:`bracket_ratios`) — a host whose speed drifts within a round (a shared machine: one round of 8 × 512 lasts a
minute) moves a step and its two neighbours alike, where a step and the round's first forward can lie a minute apart.
The file then holds, per step, the forwards before and after each round's run of it and those ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


#: the instruction-set extensions a CPU's float32 matmuls and reductions run on, as /proc/cpuinfo names them
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def host(cpuinfo: str | None = None) -> dict:
    """The machine a run measured: ``{"cpu": its model name, "cpus": logical CPUs, "isa": which of`` :data:`ISA_FLAGS`
    ``it has, "platform": platform.platform()}`` — ratios to the forward differ between hosts (an analysis's passes over
    memory gain less from a faster core than the forward's matmuls), so a file says where it was measured. ``cpuinfo``:
    the text of /proc/cpuinfo (read when None; empty fields where the system has none)."""
    import os
    import platform

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name") or platform.processor() or "unknown", "cpus": os.cpu_count(),
            "isa": [f for f in ISA_FLAGS if f in flags], "platform": platform.platform()}


def bracket_ratios(step_s: list[float], before_s: list[float], after_s: list[float]) -> list[float]:
    """Each round's step over the mean of the forwards run just before and just after it (``--bracket``): one ratio per
    round. Raises ValueError for lists of different lengths or a forward that took no time."""
    if not len(step_s) == len(before_s) == len(after_s):
        raise ValueError(f"{len(step_s)} steps, {len(before_s)} forwards before and {len(after_s)} after: one each per round")
    if any(f <= 0 for f in [*before_s, *after_s]):
        raise ValueError("a bracketing forward of zero seconds: no ratio")
    return [s / ((b + a) / 2) for s, b, a in zip(step_s, before_s, after_s)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", default="decomposition,pattern")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--bracket", action="store_true",
                    help="a base step between every two steps of a round and after the last: each step's ratio to its "
                         "two neighbours")
    ap.add_argument("--base", default="forward",
                    help="the step the ratios divide by (capture: the chunked pass, where a whole forward does not fit)")
    a = ap.parse_args()
    import torch
    from suite_steps import Bench

    torch.set_num_threads(a.threads)
    b = Bench(a.model, a.n_seq, a.seq_len)
    b.kbar()
    steps = b.steps()
    names = [a.base] + [s for s in a.steps.split(",") if s != a.base]
    unknown = [s for s in names if s not in steps]
    if unknown:
        raise SystemExit(f"unknown steps {unknown}; known: {sorted(steps)}")
    for s in names[1:]:
        steps[s][0]()  # warm-up: fit operators, allocator
    secs: dict[str, list[float]] = {s: [] for s in names}
    cpu: dict[str, list[float]] = {s: [] for s in names}
    faults: dict[str, list[int]] = {s: [] for s in names}

    def timed(s: str) -> float:
        f0, c0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
        steps[s][0]()
        secs[s].append((time.perf_counter() - t) / steps[s][1])
        cpu[s].append((time.process_time() - c0) / steps[s][1])
        faults[s].append(round((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps[s][1]))
        return secs[s][-1]

    around: dict[str, dict[str, list[float]]] = {s: {"before": [], "after": []} for s in names[1:]}
    for r in range(a.repeats):
        before = timed(a.base)
        for s in names[1:]:
            timed(s)
            if a.bracket:  # the forward after this step is the one before the next
                after = timed(a.base)
                around[s]["before"].append(before)
                around[s]["after"].append(after)
                before = after
        print(f"round {r}: " + ", ".join(f"{s} {secs[s][-1]:.2f} s" for s in names)
              + (f" (the {a.base}s: {', '.join(f'{x:.2f}' for x in secs[a.base][-len(names):])} s)" if a.bracket else ""),
              flush=True)
    fwd, fmin = statistics.median(secs[a.base]), min(secs[a.base])
    from posgen_tl.io.provenance import git_commit

    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    out = {"commit": git_commit(), "model": a.model, "n_seq": a.n_seq, "seq_len": a.seq_len, "threads": a.threads,
           "repeats": a.repeats, "base": a.base, "bracketed": a.bracket, "peak_rss_mib": peak_mib, "host": host(),
           "steps": {s: {"seconds": secs[s], "median_s": statistics.median(secs[s]),
                         "ratio_median": statistics.median(secs[s]) / fwd, "ratio_min": min(secs[s]) / fmin,
                         "cpu_s": cpu[s], "minor_faults": faults[s]}
                     for s in names}}
    if a.bracket:
        for s in names[1:]:
            ratios = bracket_ratios(secs[s], around[s]["before"], around[s]["after"])
            out["steps"][s]["bracket"] = {**around[s], "ratios": ratios, "ratio_median": statistics.median(ratios)}
    for s in names:
        v = out["steps"][s]
        br = f"; bracketed {v['bracket']['ratio_median']:.3f}×" if "bracket" in v else ""
        print(f"{s:<16}{v['median_s']:8.2f} s median   {v['ratio_median']:.3f}× the {a.base} (fastest rounds "
              f"{v['ratio_min']:.3f}×{br}); CPU {statistics.median(v['cpu_s']):.2f} s, "
              f"{statistics.median(v['minor_faults']):.0f} page faults")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
