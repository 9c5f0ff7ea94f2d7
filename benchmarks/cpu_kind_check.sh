#!/usr/bin/env bash
# Everything the CPU kernels' speed is judged by, measured on this machine's kind
# of CPU in one run, into benchmarks/results/<CPU key>/ (llvm-znver5-2c, ...):
#   1. bfloat16 rounding against torch's, bit for bit (AVX-512 BF16 hosts; skipped elsewhere);
#   2. each schedule lever against the kernel without it (cpu_levers.py -> levers.json);
#   3. the bench table with the records shipped for this CPU (cpu_bench_before_retune.json);
#   4. the tuning records retuned for this CPU (regenerate_tuning_logs.sh -> tuning_logs/);
#   5. the bench table again with them (cpu_bench.json), the floors in the same run;
#   6. and at label smoothing 0 (cpu_bench_eps0.json): the kernels most calls run.
# Run it on a quiet machine (nothing else running: the floors and kernels are timed
# interleaved, but a neighbour still moves both); steps 4-5 take the longest, so
# `STEPS="1 2 3"` runs the first three alone. Each step has a time limit and its
# log in the results folder (CE_TVM_RESULTS, to put them elsewhere); a failed step is
# reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${CE_TVM_PYTHON:-.venv/bin/python}
CLI=${CE_TVM_CLI:-.venv/bin/ce-tvm}
STEPS=${STEPS:-1 2 3 4 5 6}
KEY=$("$PY" -c "from ce_tvm.store import records, targets; print(records.target_key(targets.target_description('llvm')))")
OUT=${CE_TVM_RESULTS:-benchmarks/results/$KEY}
mkdir -p "$OUT"
BENCH=(--dtypes float32,bfloat16 --modes train,forward --reps 7 --no-compile --no-trl)
failed=0

step() {  # step NUMBER LIMIT_SECONDS NAME COMMAND...
  local number=$1 limit=$2 name=$3
  shift 3
  [[ " $STEPS " == *" $number "* ]] || return 0
  echo "== $number. $name ($(date -u +%H:%M:%S), limit ${limit}s, log $OUT/$name.log)"
  if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
    tail -n 3 "$OUT/$name.log"
  else
    echo "!! $name failed (exit $?): see $OUT/$name.log"
    failed=1
  fi
}

step 1 600 rounding "$PY" -m pytest -q -p no:cacheprovider \
  tests/schedules/test_cpu_narrowing.py -k rounding_as_torch_on_this_cpu -rs
step 2 3600 levers "$PY" benchmarks/cpu_levers.py --json "$OUT/levers.json"
step 3 2400 bench_before_retune "$CLI" bench "${BENCH[@]}" --json "$OUT/cpu_bench_before_retune.json"
step 4 14400 retune bash benchmarks/regenerate_tuning_logs.sh
step 5 2400 bench "$CLI" bench "${BENCH[@]}" --json "$OUT/cpu_bench.json"
step 6 2400 bench_eps0 "$CLI" bench "${BENCH[@]}" --label-smoothing 0 \
  --json "$OUT/cpu_bench_eps0.json"
echo "== done ($(date -u +%H:%M:%S)); results in $OUT"
exit $failed
