set -x
export PYTHONPATH=/work/wt-length
PY=/work/main/.venv/bin/python
cd /work/wt-length
$PY scripts/length_results.py gap --n-seq 4 --gaps 0,2 --out results/tmp --tag t > results/tmp/gap_t.log 2>&1
$PY scripts/length_results.py window --model gemma3-270m --n-seq 1 --seq-len 2048 --n-ref 4 --out results/tmp --tag t > results/tmp/win_t.log 2>&1
$PY scripts/length_results.py sufficiency --n-seq 4 --n-ref 4 --tolerance d3:all --fracs 0,0.1,0.2 --out results/tmp --tag t > results/tmp/suf_t.log 2>&1
