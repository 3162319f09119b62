"""A/B in one process: decomposition and feature statistics with and without the per-batch malloc_trim
(SmolLM2 8 x 512, batch 4, 2 threads), modes alternating, 3 repeats each."""
import statistics, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
import torch
torch.set_num_threads(2)
import suite
import posgen_tl.capture as cap
real = cap.release_freed_memory
b = suite.Bench("smollm2-135m", 8, 512)
b.geometry(); b.kbar()
res = {}
for r in range(3):
    for mode in (("trim", "none") if r % 2 == 0 else ("none", "trim")):
        cap.release_freed_memory = real if mode == "trim" else (lambda: False)
        for step in ("forward", "decomposition", "pattern"):
            t = time.perf_counter(); getattr(b, step)(); dt = time.perf_counter() - t
            res.setdefault((mode, step), []).append(dt)
            print(r, mode, step, f"{dt:.2f}", flush=True)
for k, v in sorted(res.items()):
    print(k, [round(x, 2) for x in v], "median", round(statistics.median(v), 2))
