#!/usr/bin/env bash
# The GPU figures of docs/performance.md in ONE command, most important first, within a total time limit: on a machine
# with a CUDA card and posgen_tl installed beside a CUDA build of torch (random-init models of real shapes: no weights
# travel). Writes into OUT (the first argument, or $POSGEN_GPU_OUT) one JSON per step and one log of them all:
#   suite.json     benchmarks/suite.py --parts sizes: decomposition and feature statistics as ratios to a forward
#                  (the GPU targets of docs/performance.md; check them with benchmarks/targets.py)
#   (the log)      the GPU test tier, python -m pytest -m gpu (every test that needs CUDA carries the mark)
#   ops.json       benchmarks/profile_syncs.py --ops --lines at the largest size: the operations a GPU dispatched, to
#                  compare with the CPU's count of the same paths (--gpu-paths)
#   factored.json  benchmarks/bench_factored.py: the moments from the maps against from their factors
#   long.json      benchmarks/bench_gpu.py long: one sequence of LONG tokens decomposed, time and GPU peak
#   gpu_checks.log every step's output and return code
#
#   bash scripts/gpu_checks.sh OUT
# Settings (environment): PYTHON (python3), DEVICE (cuda), MODEL (random:smollm2-135m), SIZES (8x512,4x2048),
# REPEATS (3), THREADS (8), LONG (16384; empty: no long step), TOTAL_S (540: the steps stop there, a step that would
# start with under 30 s left is skipped and says so). A step that fails is logged with its return code; the rest run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:smollm2-135m}
SIZES=${SIZES:-8x512,4x2048}
REPEATS=${REPEATS:-3}
THREADS=${THREADS:-8}
LONG=${LONG-16384}
TOTAL_S=${TOTAL_S:-540}
OUT=${1:-${POSGEN_GPU_OUT:-}}
if [ -z "$OUT" ]; then
  echo "gpu_checks.sh: name the folder for the results (bash scripts/gpu_checks.sh OUT, or POSGEN_GPU_OUT)" >&2
  exit 2
fi
mkdir -p "$OUT"
LOG="$OUT/gpu_checks.log"
: >"$LOG"
END=$((SECONDS + TOTAL_S))
export PYTHONUNBUFFERED=1
LARGEST=${SIZES##*,}

step() {  # step NAME COMMAND…: run COMMAND with what is left of the time, its output and return code in the log
  local name=$1 left=$((END - SECONDS)) rc
  shift
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped, ${left} s left of TOTAL_S=${TOTAL_S}" | tee -a "$LOG"
    return
  fi
  echo "== $name ($(date -u +%H:%M:%S), ${left} s left): $*" | tee -a "$LOG"
  timeout "$left" "$@" >>"$LOG" 2>&1
  rc=$?
  echo "== $name: rc $rc after $((TOTAL_S - END + SECONDS)) s of the run" | tee -a "$LOG"
}

"$PY" -c "import torch, posgen_tl; print('posgen_tl', posgen_tl.__version__, '| torch', torch.__version__, \
'| device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')" 2>&1 | tee -a "$LOG"
step suite "$PY" benchmarks/suite.py --models "$MODEL" --device "$DEVICE" --parts sizes --sizes "$SIZES" \
  --threads "$THREADS" --repeats "$REPEATS" --skip-memory --out "$OUT/suite.json"
step gpu_tier "$PY" -m pytest -q -p no:cacheprovider -m gpu
step ops "$PY" benchmarks/profile_syncs.py --model "$MODEL" --device "$DEVICE" --n-seq "${LARGEST%x*}" \
  --seq-len "${LARGEST#*x}" --steps decomposition --ops --lines --top 25 --out "$OUT/ops.json"
step factored "$PY" benchmarks/bench_factored.py --model "$MODEL" --device "$DEVICE" --sizes "$SIZES" \
  --repeats "$REPEATS" --threads "$THREADS" --out "$OUT/factored.json"
if [ -n "$LONG" ]; then
  step long "$PY" benchmarks/bench_gpu.py long --shape "smollm2-135m@$LONG" --seq-len "$LONG" --repeats 1 \
    --device "$DEVICE" --out "$OUT/long.json"
fi
echo "results in $OUT" | tee -a "$LOG"
