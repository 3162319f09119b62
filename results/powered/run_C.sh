#!/bin/bash
# The gap-attention head-class link with the §6 taxonomy labels (issue #13), code snapshot /tmp/snap2 (commit fbdc206).
export PYTHONPATH=/tmp/snap2 POSGEN_THREADS=1
PY=/work/main/.venv/bin/python
cd /work/main
L=results/length_n16; H=results/heads_n32
run() { name=$1; dir=$2; shift 2; echo "=== $name start $(date -u +%T)"; /usr/bin/time -v $PY "$@" > $dir/log_$name.txt 2>&1; echo "=== $name end $(date -u +%T) rc=$?"; }
run attention_smollm2 $L /tmp/snap2/scripts/length_results.py attention --model smollm2-135m --n-seq 32 --prefix-len 128 --suffix-len 128 --skip 16 --gap 2 --classes $H/heads_smollm2-135m.csv --out $L
