#!/bin/bash
# Idle-machine measurements after the Gemma3 causal runs (nothing else running):
#   1. the default report's wall time on 2 cores (issue #11 item 6);
#   2. the benchmark suite at the full sizes for SmolLM2, 2 torch threads (issue #16).
cd /work/main
echo "=== report start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
rm -rf /tmp/report_idle
/usr/bin/time -v .venv/bin/posgen-tl report --model smollm2-135m --out /tmp/report_idle > results/powered/report_idle.log 2>&1
echo "=== report end $(date -u +%T) rc=$?"
echo "=== suite start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
.venv/bin/python benchmarks/suite.py --models smollm2-135m --parts sizes --sizes 8x512,4x2048 --threads 2 --repeats 3 \
  --out benchmarks/results_sizes_idle.json > results/powered/suite_sizes.log 2>&1
echo "=== suite end $(date -u +%T) rc=$?"
