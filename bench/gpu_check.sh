#!/usr/bin/env bash
# The GPU checks in one call of at most ten minutes (docs/serving.md, "Checking a GPU"): the CUDA side of the
# device tests (every registered analysis on the GPU against the CPU in float64, the engine functions), then the
# GPU bench (bench/gpu.py, what `make bench-gpu` runs). Run from the repository root on a machine with a CUDA GPU
# and a Python environment holding qkov's dependencies with a CUDA build of torch (PYTHON=..., default .venv's).
# Quote its whole output, with the GPU named (its first lines), wherever the figures are cited.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
echo "== $(date -u +%FT%TZ) $(hostname); load average $(cut -d' ' -f1-3 /proc/loadavg)"
nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "devices", torch.cuda.device_count())'
echo "== CUDA tests"
# 4 workers, each with its share of the host's cores as torch threads: with torch's default (every core in each
# worker) 6-8 workers on 16 cores oversubscribed the host, and 6 of 44 tests did not finish in the call's time
WORKERS=4
THREADS=$(( $(nproc) / WORKERS )); [ "$THREADS" -ge 1 ] || THREADS=1
OMP_NUM_THREADS=$THREADS QKOV_STORE_URL=off timeout 170 "$PY" -m pytest -q -p no:cacheprovider -n "$WORKERS" \
  tests/app/test_device_clean.py tests/core/test_device_clean_engine.py -k cuda
echo "== bench-gpu (rc of the tests: $?)"
# QKOV_BENCH_PROFILE=DIR: each missed goal is run again under cProfile and torch.profiler (stats saved in DIR)
timeout 380 "$PY" -m bench.gpu
echo "== done (rc $?)"
