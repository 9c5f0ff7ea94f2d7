#!/usr/bin/env bash
# The prepared GPU check: install (if needed) and run benchmarks/gpu_check.py.
# On the GPU host TVM compiles CUDA through NVRTC (pip install cuda-bindings)
# or nvcc (TVM_CUDA_COMPILE_MODE=nvcc, nvcc on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
export TVM_CUDA_COMPILE_MODE="${TVM_CUDA_COMPILE_MODE:-nvcc}"
python benchmarks/gpu_check.py --json "${1:-gpu_check.json}"
