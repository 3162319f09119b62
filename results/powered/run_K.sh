#!/bin/bash
# issue #16: 4 x 2048 peak memory of the steps not measured before + per-batch memory diagnosis (beside the
# fresh-clone test run: memory only)
cd /work/main
echo "=== start $(date -u +%T) commit $(git rev-parse --short HEAD)"
.venv/bin/python results/powered/run_K.py
.venv/bin/python results/powered/mem_batches.py decomposition 2>/dev/null | tail -1
.venv/bin/python results/powered/mem_batches.py pattern 2>/dev/null | tail -1
echo "=== done $(date -u +%T)"
