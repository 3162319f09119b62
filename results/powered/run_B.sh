#!/bin/bash
# Issue #12/#13/#11 runs, one 1-thread process at a time, code snapshot of commit c85e171 in /tmp/snap.
export PYTHONPATH=/tmp/snap POSGEN_THREADS=1
PY=/work/main/.venv/bin/python
cd /work/main
L=results/length_n16; H=results/heads_n32; C=results/causal_n64
mkdir -p $L $H $C
run() { name=$1; dir=$2; shift 2; echo "=== $name start $(date -u +%T)"; /usr/bin/time -v $PY "$@" > $dir/log_$name.txt 2>&1; echo "=== $name end $(date -u +%T) rc=$?"; }
run window_gemma3 $L /tmp/snap/scripts/length_results.py window --model gemma3-270m --n-seq 16 --seq-len 2048 --bucket 256 --out $L
run suff_smollm2 $L /tmp/snap/scripts/length_results.py sufficiency --model smollm2-135m --n-seq 32 --seq-len 256 --target-len 64 --tolerance "d3:all,d3:20–29" --out $L
run suff_gemma3 $L /tmp/snap/scripts/length_results.py sufficiency --model gemma3-270m --n-seq 16 --seq-len 256 --target-len 64 --tolerance "d3:all,d3:12–17" --out $L
run heads_smollm2_trained $H /tmp/snap/scripts/heads_results.py --model smollm2-135m --n-prompts 32 --seq-len 256 --twin trained --out $H
run heads_smollm2_random $H /tmp/snap/scripts/heads_results.py --model smollm2-135m --n-prompts 32 --seq-len 256 --twin random --out $H
run heads_smollm2_merge $H /tmp/snap/scripts/heads_results.py --model smollm2-135m --from-csv --n-prompts 32 --out $H
run heads_gemma3 $H /tmp/snap/scripts/heads_results.py --model gemma3-270m --n-prompts 16 --seq-len 256 --out $H
run t12_smollm2 $C /tmp/snap/scripts/causal_study.py --model smollm2-135m --n-seq 64 --t12-only --tag smollm2_n64 --out $C
