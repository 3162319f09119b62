#!/bin/bash
# Gemma3 causal study at 32 sequences (issue #11), two 1-thread processes, code snapshot of commit 99fc14e in /tmp/snapD.
export PYTHONPATH=/tmp/snapD POSGEN_THREADS=1 OMP_NUM_THREADS=1
PY=/work/main/.venv/bin/python
cd /work/main
O=results/causal_gemma3_n32
mkdir -p $O
run() { name=$1; shift; echo "=== $name start $(date -u +%T)"; /usr/bin/time -v $PY /tmp/snapD/scripts/causal_study.py "$@" --out $O > $O/log_$name.txt 2>&1; echo "=== $name end $(date -u +%T) rc=$?"; }
case "$1" in
  a) run gemma3_L6-11 --model gemma3-270m --n-seq 32 --layers 6-11 --tag gemma3_L6-11_n32 ;;
  b) run gemma3_L12-17 --model gemma3-270m --n-seq 32 --layers 12-17 --tag gemma3_L12-17_n32
     run gemma3_t12 --model gemma3-270m --n-seq 32 --t12-only --tag gemma3_n32 ;;
esac
