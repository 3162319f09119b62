#!/usr/bin/env bash
# Re-lock: build both CI environments from scratch WITHOUT constraints (the newest releases the package's
# bounds admit), then write their exact versions to constraints/tl4.txt and constraints/tl3.txt.
# Run the whole suite on the new lock before committing it (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
for env in tl4 tl3; do
  venv=.venv-lock-$env
  rm -rf "$venv"
  if [ $env = tl4 ]; then POSGEN_UNLOCKED=1 POSGEN_VENV=$venv bash scripts/setup.sh >/dev/null
  else POSGEN_UNLOCKED=1 POSGEN_TL3_VENV=$venv bash scripts/setup_tl3.sh >/dev/null; fi
  { echo "# The exact versions CI tests ($env environment: scripts/setup$( [ $env = tl3 ] && echo _tl3 ).sh installs with -c this file)."
    echo "# Regenerate after a tested upgrade: bash scripts/lock.sh (fresh unlocked environments, then pip freeze)."
    "$venv/bin/python" -m pip freeze --exclude-editable | sed -E 's/\+cpu$//' | grep -v '^posgen'
  } > constraints/$env.txt
  rm -rf "$venv"
done
echo "constraints/tl4.txt and constraints/tl3.txt rewritten; now run: bash scripts/setup.sh && .venv/bin/python -m pytest"
