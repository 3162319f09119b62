"""issue #16: peak memory (not time) of the 4 x 2048 steps the sizes run stopped for time (2 threads, one
process per step via the suite's memory worker); run beside the fresh-clone test run (peak RSS does not
depend on CPU load). Writes benchmarks/results_4x2048_memory.json."""
import json, subprocess, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
out = {"commit": commit, "command": "python results/powered/run_K.py", "size": "4x2048", "threads": 2, "steps": {}}
for step in ("forward", "causal_condition", "sufficiency", "naive_decomposition", "naive_pattern"):
    spec = {"threads": 2, "model": "smollm2-135m", "n_seq": 4, "seq_len": 2048, "step": step}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/suite.py"), "--worker", "memory", json.dumps(spec)],
                       capture_output=True, text=True)
    out["steps"][step] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-500:]}
    print(time.strftime("%H:%M:%S"), step, out["steps"][step], flush=True)
    (ROOT / "benchmarks/results_4x2048_memory.json").write_text(json.dumps(out, indent=1))
