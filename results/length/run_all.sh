# README runs for longer texts + sufficiency (one CPU slot, 1 thread); code snapshot in /tmp/len_snap
export PYTHONPATH=/tmp/len_snap
PY=/work/main/.venv/bin/python
cd /work/wt-length
O=results/length
run() { name=$1; shift; echo "=== $name start $(date -u +%T)"; /usr/bin/time -v $PY /tmp/len_snap/scripts/length_results.py "$@" --out $O > $O/log_$name.txt 2>&1; echo "=== $name end $(date -u +%T) rc=$?"; }
run gap_smollm2 gap --model smollm2-135m --n-seq 32 --prefix-len 128 --suffix-len 128 --skip 16 --batch-size 4
run window_gemma3 window --model gemma3-270m --n-seq 4 --seq-len 2048 --bucket 256
run suff_smollm2 sufficiency --model smollm2-135m --n-seq 24 --seq-len 256 --target-len 64
run attention_smollm2 attention --model smollm2-135m --n-seq 6 --prefix-len 128 --suffix-len 128 --skip 16 --gap 2
run suff_gemma3 sufficiency --model gemma3-270m --n-seq 8 --seq-len 256 --target-len 64
