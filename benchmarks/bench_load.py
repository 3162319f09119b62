"""Model load time, cold (GGUF → float32 → safetensors cache) and cached, in fresh processes.

    python benchmarks/bench_load.py --model smollm2-135m

Each measurement runs in a new Python process (imports included in 'process' time) with
POSGEN_TL_CACHE pointing to a fresh temporary directory, so 'cold' really converts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import time, sys, warnings
warnings.simplefilter("ignore")
t0 = time.time()
from posgen_tl import load_model
t1 = time.time()
m = load_model(sys.argv[1])
t2 = time.time()
print(f"{t1 - t0:.3f} {t2 - t1:.3f}")
"""


def run(model: str, cache: str) -> tuple[float, float, float]:
    env = dict(os.environ, POSGEN_TL_CACHE=cache, HF_HUB_OFFLINE="1")
    t = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True)
    wall = time.time() - t
    imp, load = map(float, out.stdout.strip().splitlines()[-1].split())
    return imp, load, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cold = run(args.model, cache)
        warm = run(args.model, cache)
    print(json.dumps({
        "model": args.model,
        "cold_load_s": round(cold[1], 1), "cached_load_s": round(warm[1], 1),
        "import_s": round(warm[0], 1), "cold_process_wall_s": round(cold[2], 1), "cached_process_wall_s": round(warm[2], 1),
    }))


if __name__ == "__main__":
    main()
