#!/usr/bin/env bash
# The prepared GPU check: benchmarks/gpu_check.py's sections in steps, each
# under its own time limit (a step that hangs costs its limit, not the run),
# the GPU-marked tests, then the small grid under compute-sanitizer
# (memcheck, racecheck).
#   benchmarks/gpu_check.sh [--json F] [--bundle DIR]... [--modules DIR]...
# The arguments go to every step; each appends its results to --json (JSON
# lines, default gpu_check.jsonl) as they come. With CHECK_TIMEOUT_S, the
# steps end within that many seconds (the last ones shortened or skipped).
# Without --bundle, TVM (apache-tvm) compiles the kernels on this host,
# through NVRTC (pip install cuda-bindings) or nvcc (TVM_CUDA_COMPILE_MODE=nvcc,
# nvcc on PATH): give the steps more time with STEP_TIME_SCALE (a factor,
# default 1). With --bundle
# DIR (ce-tvm bundle --target cuda --arch sm_XY ...) and --modules DIR
# (gpu_bundle_check.sh prepare), the kernels, their nvcc-built binaries and
# the TVM runtime come from DIR: the host needs torch (CUDA) and
# apache-tvm-ffi, not apache-tvm (docs/bundles.md).
set -uo pipefail
cd "$(dirname "$0")/.."
export TVM_CUDA_COMPILE_MODE="${TVM_CUDA_COMPILE_MODE:-nvcc}"
args=("$@")
status=0
deadline=$((SECONDS + ${CHECK_TIMEOUT_S:-86400}))
step() {  # step SECONDS SECTIONS [PREFIX...]: PREFIX python gpu_check.py on SECTIONS, time-limited
  local limit=$(($1 * ${STEP_TIME_SCALE:-1})) sections=$2
  shift 2
  [ $((deadline - SECONDS)) -lt "$limit" ] && limit=$((deadline - SECONDS))
  if [ "$limit" -le 0 ]; then echo "== step $sections: skipped (CHECK_TIMEOUT_S)"; status=1; return; fi
  echo "== step $sections (at most $limit s)"
  timeout "$limit" "$@" python benchmarks/gpu_check.py --sections "$sections" "${args[@]}" ||
    { echo "step $sections: exit $?"; status=1; }
}
step 120 checks
step 150 time_ce  # two torch.compile builds (bf16, fp32)
step 150 time_log_probs,time_linear,time_distill
step 60 time_training,time_edge
# The GPU-marked tests (the training kernel against the float64 reference, NaN
# rows, CUDA-graph replay and side streams, N = 0 and offset views), where the
# compiler and the tests are here (not with --bundle).
bundled=0
for a in "$@"; do [ "$a" = --bundle ] && bundled=1; done
if [ $bundled = 0 ] && [ -d tests ] && python -c "import pytest" 2>/dev/null; then
  python -m pytest -q -m gpu tests/ || status=1
fi
# Memory errors (out-of-bounds, misaligned) and shared-memory races on a small
# grid of every kernel family, where compute-sanitizer is installed (CUDA
# toolkit, or next to nvcc); each tool gets SANITIZE_TIMEOUT_S seconds (120).
sanitizer="$(command -v compute-sanitizer || true)"
if [ -z "$sanitizer" ] && command -v nvcc >/dev/null; then
  candidate="$(dirname "$(readlink -f "$(command -v nvcc)")")/compute-sanitizer"
  [ -x "$candidate" ] && sanitizer="$candidate"
fi
if [ -n "$sanitizer" ]; then
  for tool in memcheck racecheck; do
    step "${SANITIZE_TIMEOUT_S:-120}" sanitize "$sanitizer" --tool "$tool" --error-exitcode 1
  done
else
  echo "compute-sanitizer not found: memcheck/racecheck skipped"
fi
exit $status
