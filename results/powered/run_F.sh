#!/bin/bash
# Gemma3 T1/T2 at 32 sequences (issue #11 item 5), 2 threads, after the idle-machine timings (run_E.sh).
export POSGEN_THREADS=2
cd /work/main
O=results/causal_gemma3_n32
echo "=== gemma3_t12 start $(date -u +%T) (commit $(git rev-parse --short HEAD))"
/usr/bin/time -v .venv/bin/python scripts/causal_study.py --model gemma3-270m --n-seq 32 --t12-only --tag gemma3_n32 --out $O > $O/log_gemma3_t12.txt 2>&1
echo "=== gemma3_t12 end $(date -u +%T) rc=$?"
