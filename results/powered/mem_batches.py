"""RSS / high-water mark after each streamed batch of a 32 x 512 decomposition and feature pattern (1 thread)."""
import gc, json, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
import torch
torch.set_num_threads(1)
import suite
import posgen_tl.capture as cap
step = sys.argv[1]
b = suite.Bench("smollm2-135m", 32, 512, 4)
if step == "decomposition":
    b.geometry(); b.kbar()
gc.collect(); suite._reset_peak()
rss0 = suite._status_mib("VmRSS")
rec = []
real = cap.release_freed_memory
def rel():
    hwm = suite._status_mib("VmHWM"); rss_pre = suite._status_mib("VmRSS")
    r = real()
    rec.append((round(hwm - rss0), round(rss_pre - rss0), round(suite._status_mib("VmRSS") - rss0)))
    return r
cap.release_freed_memory = rel
t = time.time()
getattr(b, step)()
print(step, "rss0", round(rss0), "per batch (hwm, rss before trim, rss after trim) above rss0:", rec, f"{time.time()-t:.0f}s", flush=True)
