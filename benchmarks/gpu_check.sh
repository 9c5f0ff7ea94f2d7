#!/usr/bin/env bash
# The prepared GPU check: run benchmarks/gpu_check.py, the GPU-marked tests, then
# its small grid under compute-sanitizer (memcheck, racecheck).
#   benchmarks/gpu_check.sh [--json F] [--quick] [--bundle DIR]...
# Without --bundle, TVM (apache-tvm) compiles the kernels on this host, through
# NVRTC (pip install cuda-bindings) or nvcc (TVM_CUDA_COMPILE_MODE=nvcc, nvcc on
# PATH). With --bundle DIR (ce-tvm bundle --target cuda --arch sm_XY ...), the
# kernels, their nvcc-built binaries and the TVM runtime come from DIR: the host
# needs torch (CUDA) and apache-tvm-ffi, not apache-tvm (README, "Bundles").
set -euo pipefail
cd "$(dirname "$0")/.."
export TVM_CUDA_COMPILE_MODE="${TVM_CUDA_COMPILE_MODE:-nvcc}"
status=0
python benchmarks/gpu_check.py "$@" || status=1
bundle=()
for ((i = 1; i <= $#; i++)); do
  if [ "${!i}" = "--bundle" ]; then j=$((i + 1)); bundle+=(--bundle "${!j}"); fi
done
# The GPU-marked tests (the training kernel against the float64 reference, NaN
# rows, CUDA-graph replay and side streams, N = 0 and offset views), where the
# compiler and the tests are here (not with --bundle).
if [ ${#bundle[@]} -eq 0 ] && [ -d tests ] && python -c "import pytest" 2>/dev/null; then
  python -m pytest -q -m gpu tests/ || status=1
fi
# Memory errors (out-of-bounds, misaligned) and shared-memory races on a small
# grid, where compute-sanitizer is installed (CUDA toolkit, or next to nvcc);
# each tool gets SANITIZE_TIMEOUT_S seconds (900).
sanitizer="$(command -v compute-sanitizer || true)"
if [ -z "$sanitizer" ] && command -v nvcc >/dev/null; then
  candidate="$(dirname "$(readlink -f "$(command -v nvcc)")")/compute-sanitizer"
  [ -x "$candidate" ] && sanitizer="$candidate"
fi
if [ -n "$sanitizer" ]; then
  for tool in memcheck racecheck; do
    echo "compute-sanitizer --tool $tool"
    timeout "${SANITIZE_TIMEOUT_S:-900}" "$sanitizer" --tool "$tool" --error-exitcode 1 \
      python benchmarks/gpu_check.py --sanitize "${bundle[@]}" || status=1
  done
else
  echo "compute-sanitizer not found: memcheck/racecheck skipped"
fi
exit $status
