#!/usr/bin/env bash
# One command for a lent GPU: walrus_1b forward, 2D 128x128, 6 frames, bf16, B=1,2,4,8,
# eager and compiled, sdpa and chunked temporal kernels; JSON in benchmarks/results/gpu.json.
# Pass --tiny for a CPU smoke run (tiny preset, 32x32): benchmarks/results/gpu_tiny.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
exec timeout 470 "$PY" -m benchmarks.gpu "$@"
