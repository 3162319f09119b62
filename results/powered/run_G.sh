#!/bin/bash
# Benchmarks on the otherwise idle machine (issue #16), code snapshot of HEAD at /tmp/snapG, 2 threads.
export PYTHONPATH=/tmp/snapG
cd /work/main
S=/tmp/snapG/benchmarks/suite.py
echo "=== start $(date -u +%T) commit $(git -C /tmp/snapG rev-parse --short HEAD) load $(cut -d' ' -f1-3 /proc/loadavg)"
.venv/bin/python $S --models smollm2-135m --parts sizes --sizes 8x512 --threads 2 --repeats 3 --out benchmarks/results_8x512.json > results/powered/run_G_8x512.log 2>&1
echo "=== 8x512 done $(date -u +%T) rc=$?"
.venv/bin/python $S --models smollm2-135m --parts scaling --lengths 256,512,1024,2048,4096 --counts 4,8,16,32 --threads 2 --repeats 2 --out benchmarks/results_scaling.json > results/powered/run_G_scaling.log 2>&1
echo "=== scaling done $(date -u +%T) rc=$?"
.venv/bin/python $S --models smollm2-135m --parts sizes --sizes 4x2048 --threads 2 --repeats 3 --out benchmarks/results_4x2048.json > results/powered/run_G_4x2048.log 2>&1
echo "=== 4x2048 done $(date -u +%T) rc=$?"
