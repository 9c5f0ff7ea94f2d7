#!/bin/bash
# Build GPGPU-Sim (accel-sim's fork, branch dev, pinned commit) with ce-tvm's patch into
# $GSIM (a folder outside the repository), from pip wheels and Debian packages only, then
# run its self-check. About 20 min on 2 cores; not part of CI.
#
#   GSIM=~/gpgpu-sim benchmarks/gpgpu_sim/build.sh
#
# GSIM_SOURCE: where to clone the simulator from (a URL or a local git directory).
# PYTHON: a Python with ce-tvm installed, for the self-check (default python3).
# CUDA13: the CUDA 13 toolkit whose nvcc the project uses (default /usr/local/cuda-13.0).
# Re-running it is cheap: the clone, the wheels and unchanged objects are kept.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${GSIM:?set GSIM to a folder outside the repository}"
GSIM_SOURCE=${GSIM_SOURCE:-https://github.com/accel-sim/gpgpu-sim_distribution.git}
CUDA13=${CUDA13:-/usr/local/cuda-13.0}
COMMIT=667834cfe5214523edd7769aeab77f91b7137686   # branch dev
mkdir -p "$GSIM"; GSIM=$(cd "$GSIM" && pwd)

echo "== Debian packages"
need=(); for p in bison flex zlib1g-dev xutils-dev g++ make; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
[ ${#need[@]} = 0 ] || { apt-get update -qq && apt-get install -y -qq "${need[@]}"; }

echo "== pip wheels: the CUDA 11.8 runtime and headers the simulator builds against, cuobjdump"
[ -x "$GSIM/venv/bin/pip" ] || python3 -m venv "$GSIM/venv"
"$GSIM/venv/bin/pip" install -q nvidia-cuda-runtime-cu11==11.8.89 \
  nvidia-cuda-nvcc-cu11==11.8.89 nvidia-cuda-cuobjdump==13.4.92
site=$("$GSIM/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

echo "== CUDA_INSTALL_PATH=$GSIM/cuda11: CUDA 11.8 headers and runtime, CUDA 13 tools"
cu=$GSIM/cuda11; rm -rf "$cu"; mkdir -p "$cu/include" "$cu/lib64" "$cu/bin"
ln -s "$site"/nvidia/cuda_runtime/include/* "$cu/include/"
ln -s "$site"/nvidia/cuda_nvcc/include/* "$cu/include/" 2>/dev/null || true
for h in cudaProfiler.h cuda_profiler_api.h; do
  [ -e "$cu/include/$h" ] || ln -s "$CUDA13/include/$h" "$cu/include/$h"; done
ln -s "$site"/nvidia/cuda_runtime/lib/libcudart.so.11.0 "$cu/lib64/"
# bin/: nvcc (version shim), ptxas and cuobjdump (output rewritten for the simulator: ptx-rewrite)
for t in nvcc ptxas cuobjdump ptx-rewrite; do
  sed -e "s#@CUDA13@#$CUDA13#g" -e "s#@CUOBJDUMP@#$site/nvidia/cu13/bin/cuobjdump#g" \
    "$here/bin/$t" > "$cu/bin/$t"; chmod +x "$cu/bin/$t"; done
cp "$here/cuda13_launch_shim.cpp" "$GSIM/"
echo "$CUDA13" > "$GSIM/cuda13"

echo "== the simulator: $COMMIT + gpgpu-sim.patch"
if [ ! -d "$GSIM/gpgpu-sim/.git" ]; then git clone -q "$GSIM_SOURCE" "$GSIM/gpgpu-sim"; fi
cd "$GSIM/gpgpu-sim"
git fetch -q "$GSIM_SOURCE" dev 2>/dev/null || true
# the pinned commit with exactly this patch applied (files untouched when it already is)
if [ "$(git rev-parse HEAD)" != "$COMMIT" ] \
   || ! git apply --reverse --check "$here/gpgpu-sim.patch" 2>/dev/null \
   || [ "$(git diff | git patch-id)" != "$(git patch-id < "$here/gpgpu-sim.patch")" ]; then
  git checkout -q -f "$COMMIT"; git apply "$here/gpgpu-sim.patch"; fi
export CUDA_INSTALL_PATH=$cu PATH=$cu/bin:$PATH
set +u; source setup_environment release >/dev/null; set -u
nice -n 19 make -j"$(nproc)" >"$GSIM/build.log" 2>&1 || { tail -30 "$GSIM/build.log"; exit 1; }
echo "built: $GPGPUSIM_ROOT/lib/$GPGPUSIM_CONFIG/libcudart.so"

echo "== self-check"
cd "$here/../.." && GSIM=$GSIM "${PYTHON:-python3}" -m ce_tvm.testing.gpgpu_sim selfcheck
