#!/bin/bash
# Benchmarks on the otherwise idle machine (issue #16), after run_G's scaling part; code snapshot at /tmp/snapH, 2 threads.
export PYTHONPATH=/tmp/snapH
cd /work/main
S=/tmp/snapH/benchmarks/suite.py
while kill -0 23255 2>/dev/null; do sleep 5; done
echo "=== start $(date -u +%T) commit $(git -C /tmp/snapH rev-parse --short HEAD) load $(cut -d' ' -f1-3 /proc/loadavg)"
.venv/bin/python $S --models smollm2-135m --parts sizes --sizes 8x512,4x2048 --threads 2 --repeats 3 --out benchmarks/results_sizes.json > results/powered/run_H_sizes.log 2>&1
echo "=== sizes done $(date -u +%T) rc=$?"
