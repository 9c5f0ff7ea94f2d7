#!/usr/bin/env bash
# Regenerate the shipped CPU tuning records (tuning_logs/) for the committed
# shapes, searching and measuring the whole knob grid (--exhaustive), with one
# JSON report per shape in benchmarks/results/<CPU key>/. Run it on a quiet machine of
# the kind the records are for (the records are keyed by CPU and core count).
# CE_TVM_EXHAUSTIVE=0 keeps the tuner's 16-candidate search and skips the whole
# grid: about a minute a shape instead of 25 on a 2-core Zen 4.
set -euo pipefail
cd "$(dirname "$0")/.."
CLI=${CE_TVM_CLI:-.venv/bin/ce-tvm}
PY=${CE_TVM_PYTHON:-.venv/bin/python}
# the reports go beside the records' key (llvm-znver5-2c, ...): one folder per CPU
KEY=$("$PY" -c "from ce_tvm.store import records, targets; print(records.target_key(targets.target_description('llvm')))")
mkdir -p "benchmarks/results/$KEY"
GRID=(--exhaustive)
[[ ${CE_TVM_EXHAUSTIVE:-1} == 0 ]] && GRID=()
for dtype in float32 bfloat16; do
  for shape in 4096x32000 8192x50257 2048x128256; do
    rows=${shape%x*} classes=${shape#*x}
    "$CLI" tune --target llvm --dtype "$dtype" --classes "$classes" --rows "$rows" \
      --trials 16 "${GRID[@]}" --retune --log-dir tuning_logs \
      --json "benchmarks/results/$KEY/tuning-$dtype-$shape.json"
  done
done
