#!/bin/bash
# Gemma3 T1/T2 at 32 sequences (issue #11 item 5), 2 threads, code snapshot of HEAD at /tmp/snapF.
export POSGEN_THREADS=2
export PYTHONPATH=/tmp/snapF
cd /work/main
O=results/causal_gemma3_n32
echo "=== gemma3_t12 start $(date -u +%T) (commit $(git -C /tmp/snapF rev-parse --short HEAD))"
/usr/bin/time -v .venv/bin/python /tmp/snapF/scripts/causal_study.py --model gemma3-270m --n-seq 32 --t12-only --tag gemma3_n32 --out $O > $O/log_gemma3_t12.txt 2>&1
echo "=== gemma3_t12 end $(date -u +%T) rc=$?"
