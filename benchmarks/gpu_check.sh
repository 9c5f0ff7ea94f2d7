#!/usr/bin/env bash
# The prepared GPU check: run benchmarks/gpu_check.py, then its small grid under
# compute-sanitizer (memcheck, racecheck).
# On the GPU host TVM compiles CUDA through NVRTC (pip install cuda-bindings)
# or nvcc (TVM_CUDA_COMPILE_MODE=nvcc, nvcc on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
export TVM_CUDA_COMPILE_MODE="${TVM_CUDA_COMPILE_MODE:-nvcc}"
python benchmarks/gpu_check.py --json "${1:-gpu_check.json}"
# Memory errors (out-of-bounds, misaligned) and shared-memory races on a small
# grid, where compute-sanitizer is installed (CUDA toolkit, or next to nvcc).
sanitizer="$(command -v compute-sanitizer || true)"
if [ -z "$sanitizer" ] && command -v nvcc >/dev/null; then
  candidate="$(dirname "$(readlink -f "$(command -v nvcc)")")/compute-sanitizer"
  [ -x "$candidate" ] && sanitizer="$candidate"
fi
if [ -n "$sanitizer" ]; then
  for tool in memcheck racecheck; do
    echo "compute-sanitizer --tool $tool"
    "$sanitizer" --tool "$tool" --error-exitcode 1 python benchmarks/gpu_check.py --sanitize
  done
else
  echo "compute-sanitizer not found: memcheck/racecheck skipped"
fi
