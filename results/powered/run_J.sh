#!/bin/bash
# issue #16, sixth landing: benchmarks on the otherwise idle machine, code snapshot /tmp/snapJ (2 threads unless said).
# a) memory vs number of sequences after the map-buffer reuse + malloc_trim per batch
# b) Gemma3 8 x 512 rows   c) SmolLM2 8 x 512 with this code   d) SmolLM2 8 x 512 at 1 thread (timing only)
export PYTHONPATH=/tmp/snapJ
cd /work/main
S=/tmp/snapJ/benchmarks/suite.py
P=.venv/bin/python
echo "=== start $(date -u +%T) commit $(git -C /tmp/snapJ rev-parse --short HEAD) load $(cut -d' ' -f1-3 /proc/loadavg)"
$P $S --models smollm2-135m --parts scaling --axes count --counts 4,8,16,32 --threads 2 --repeats 2 --out benchmarks/results_counts.json > results/powered/run_J_counts.log 2>&1
echo "=== counts done $(date -u +%T) rc=$?"
$P $S --models gemma3-270m --parts sizes --sizes 8x512 --threads 2 --repeats 3 --out benchmarks/results_gemma3.json > results/powered/run_J_gemma3.log 2>&1
echo "=== gemma3 done $(date -u +%T) rc=$?"
$P $S --models smollm2-135m --parts sizes --sizes 8x512 --threads 2 --repeats 3 --out benchmarks/results_sizes_8x512.json > results/powered/run_J_8x512.log 2>&1
echo "=== smollm2 8x512 done $(date -u +%T) rc=$?"
$P $S --models smollm2-135m --parts sizes --sizes 8x512 --threads 1 --repeats 3 --skip-memory --out benchmarks/results_1thread.json > results/powered/run_J_1thread.log 2>&1
echo "=== 1 thread done $(date -u +%T) rc=$?"
