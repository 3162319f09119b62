#!/bin/bash
# issue #16: 2 ranks x 1 thread vs 1 process x 2 threads (and 1 x 1), idle machine; code snapshot /tmp/snapI
cd /work/main
echo "=== start $(date -u +%T) commit $(git -C /tmp/snapI rev-parse --short HEAD) load $(cut -d' ' -f1-3 /proc/loadavg)"
.venv/bin/python /tmp/snapI/benchmarks/bench_distributed.py --kinds 2x1,1x2,1x1 --repeats 3 > benchmarks/results_distributed.json
echo "=== done $(date -u +%T) rc=$?"
