#!/usr/bin/env bash
# One command for a lent GPU: walrus_1b forward and train step, 2D 128x128, 6 frames, bf16,
# B=1,2,4,8, eager and whole-model compiled; MFU against a measured bf16 GEMM rate. JSON in
# benchmarks/results/gpu.json, or in DIR with --out DIR (e.g. --out "$OUT" on a lent machine).
# Pass --tiny for a CPU smoke run (tiny preset, 32x32): benchmarks/results/gpu_tiny.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
exec timeout 470 "$PY" -m benchmarks.gpu "$@"
