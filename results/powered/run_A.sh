#!/bin/bash
# Powered causal runs (issue #11), one 1-thread process, code snapshot of commit c85e171 in /tmp/snap.
export PYTHONPATH=/tmp/snap POSGEN_THREADS=1
PY=/work/main/.venv/bin/python
cd /work/main
O=results/causal_n64
mkdir -p $O
run() { name=$1; shift; echo "=== $name start $(date -u +%T)"; /usr/bin/time -v $PY /tmp/snap/scripts/causal_study.py "$@" --out $O > $O/log_$name.txt 2>&1; echo "=== $name end $(date -u +%T) rc=$?"; }
run smollm2_L10-19 --model smollm2-135m --n-seq 64 --layers 10-19 --tag smollm2_L10-19_n64
run smollm2_L20-29 --model smollm2-135m --n-seq 64 --layers 20-29 --tag smollm2_L20-29_n64
