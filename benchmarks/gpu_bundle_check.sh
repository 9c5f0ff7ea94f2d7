#!/usr/bin/env bash
# The GPU check on a host without apache-tvm (torch with CUDA, no TVM, no
# network), with the kernels from bundles.
#   benchmarks/gpu_bundle_check.sh prepare [DIR]  # here (apache-tvm, nvcc): kernels + wheels
#   benchmarks/gpu_bundle_check.sh run [DIR]      # there, from the repository root
# DIR (default .gpu) holds one bundle per dtype (ce-tvm bundle with the
# log-prob, statistics and, for bf16 and fp32, distillation kernels), in
# DIR/extra every other kernel gpu_check.py loads (found by a rehearsal of all
# its sections on the CPU, which must pass), and the wheels of apache-tvm-ffi
# (for the host's Python, PY, default 3.12), liger-kernel and trl (the timed
# peers). The kernels travel packed (DIR/kernels.tar.gz: a module keeps its
# CUDA source, some hundreds of KB, which packs tenfold); run unpacks them.
# The device run takes the working tree and DIR (carry it: git ignores .gpu/),
# at most 64 MiB together: prepare prints both sizes and fails above that.
set -uo pipefail
cd "$(dirname "$0")/.."
step="${1:?prepare or run}"
dir="${2:-.gpu}"
arch="${ARCH:-sm_90}"
if [ "$step" = prepare ]; then
  set -e
  bundle() { ce-tvm bundle --target cuda --arch "$arch" --dtype "$1" "${@:3}" --out "$dir/$2"; }
  bundle bfloat16 bf16 --classes 32000 --classes 128256 --log-probs 1 --stats --distill
  bundle float32 fp32 --classes 32000 --log-probs 1 --stats --distill
  bundle float16 fp16 --classes 32000 --log-probs 1 --stats
  rm -f "$dir/rehearsal.jsonl"
  python benchmarks/gpu_check.py --device cpu --sections checks,timings,sanitize --arch "$arch" \
    --bundle "$dir/bf16" --bundle "$dir/fp32" --bundle "$dir/fp16" --export "$dir/extra" \
    --json "$dir/rehearsal.jsonl"
  python -m pip download -q --no-deps --only-binary=:all: --python-version "${PY:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$dir/whl" \
    "apache-tvm-ffi==0.1.14.post1" "liger-kernel==0.8.5" "trl==1.16.0"
  du -sh "$dir"/*
  kernels=(bf16 fp32 fp16 extra)
  tar -C "$dir" -czf "$dir/kernels.tar.gz" "${kernels[@]}"
  (cd "$dir" && rm -rf "${kernels[@]}")
  mib() { echo $((($1 + 1048575) / 1048576)); }
  prepared=$(du -sb "$dir" | cut -f1)
  tree=$(git ls-files -z -co --exclude-standard | grep -zv "^${dir#./}/" |
    du -cb --files0-from=- | tail -1 | cut -f1)
  total=$((tree + prepared))
  echo "$dir: $(mib "$prepared") MiB; with the working tree: $(mib "$total") MiB (at most 64)"
  [ "$total" -le $((64 * 1048576)) ] ||
    { echo "too large (kernels of an older prepare stay in DIR: start from an empty one)"; exit 1; }
  exit 0
fi
[ "$step" = run ] || { echo "usage: $0 prepare|run [DIR]"; exit 2; }
export PYTHONUNBUFFERED=1 GPU_CHECK_TRACE_EVERY_S="${GPU_CHECK_TRACE_EVERY_S:-60}"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
site=/tmp/ce_tvm_site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
  "$dir"/whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
  --target "$site" .
export PYTHONPATH="$site"
# gpu_check.sh calls `python`: the python3 that holds torch (a venv's, kept as one).
mkdir -p /tmp/ce_tvm_bin
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >/tmp/ce_tvm_bin/python
chmod +x /tmp/ce_tvm_bin/python
export PATH="/tmp/ce_tvm_bin:$PATH"
# libtvm_runtime_cuda.so links libcudart.so.13: torch's wheel or the toolkit has it.
cudart=$(python3 -c "import glob, os, site; print(':'.join(sorted({os.path.dirname(p) for d in
  site.getsitepackages() + ['/usr/local/cuda'] for p in glob.glob(d + '/**/libcudart.so.13*',
  recursive=True)})))")
export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -f "$dir/kernels.tar.gz" ] && tar -C "$dir" -xzf "$dir/kernels.tar.gz"
chmod -R go-w "$dir"
dirs=() kernels=()
for b in "$dir"/*/bundle.json; do dirs+=("$(dirname "$b")"); done
for d in "${dirs[@]}"; do kernels+=(--bundle "$d"); done
[ -d "$dir/extra" ] && dirs+=("$dir/extra") && kernels+=(--modules "$dir/extra")
# A one-call smoke test first (its own time limit): a run that fails or hangs
# here costs a minute of device time, not the whole check.
CE_TVM_MODULE_DIR="$(IFS=:; echo "${dirs[*]}")" timeout "${SMOKE_TIMEOUT_S:-90}" python3 -P -X \
  faulthandler -c "
import faulthandler, torch, torch.nn.functional as F
faulthandler.dump_traceback_later(30, repeat=True)
import ce_tvm
x = torch.randn(64, 32000, device='cuda').to(torch.bfloat16).requires_grad_()
y = torch.randint(0, 32000, (64,), device='cuda')
loss = ce_tvm.cross_entropy(x, y)
loss.backward()
print('smoke: loss', loss.item(), 'torch', F.cross_entropy(x.float(), y).item())
" || { echo "smoke test failed: the check is skipped"; exit 1; }
# The steps' own limits add up to more: this keeps the whole run near 8 minutes.
CHECK_TIMEOUT_S="${CHECK_TIMEOUT_S:-420}" bash benchmarks/gpu_check.sh "${kernels[@]}" \
  --json "${OUT:-.}/gpu_check.jsonl"
echo "gpu_check.sh: exit $?"
