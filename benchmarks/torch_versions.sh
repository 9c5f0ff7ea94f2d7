#!/usr/bin/env bash
# The core suite under other torch releases (not CI): for each version given, a
# fresh venv outside the repository with that torch, the project's [project]
# dependencies and the core test tools (no transformers/TRL/DeepSpeed extras),
# ce-tvm itself installed with --no-deps (pip never replaces the torch), then
# the core suite. One line per version; each version's pytest output is kept.
#   benchmarks/torch_versions.sh [--keep] VERSION...
#   e.g. benchmarks/torch_versions.sh 2.4.1 2.6.0 2.13.0
# The core suite: tests/losses tests/kernels tests/runtime tests/distributed,
# -m "not slow" (CORE_MARK overrides), without the tests that need TRL
# (-k "not trl"). Environment:
#   TORCH_VERSIONS_DIR  venvs and results (default /tmp/ce-tvm-torch-versions);
#                       results in $TORCH_VERSIONS_DIR/results/torch-VERSION.txt
#   PYTHON              the interpreter the venvs are made from (default python3)
#   CORE_MARK           pytest -m expression (default "not slow")
#   PYTEST_WORKERS      pytest -n (default 2; 0 runs in one process)
#   MIN_FREE_GB         refuse to install a version with less free disk (default 15)
#   CE_TVM_CACHE        the kernel cache, shared by every version (keyed by TVM,
#                       not torch); default $TORCH_VERSIONS_DIR/kernel-cache
# --keep keeps each venv (by default it is deleted after its run: a CUDA build of
# torch from PyPI is several GB with its nvidia-* wheels). Exit status: 0 when
# every version passed.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
keep=0
if [ "${1:-}" = "--keep" ]; then keep=1; shift; fi
if [ $# -eq 0 ]; then sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
dir=${TORCH_VERSIONS_DIR:-/tmp/ce-tvm-torch-versions}
mkdir -p "$dir/results"
export CE_TVM_CACHE=${CE_TVM_CACHE:-$dir/kernel-cache}
python=${PYTHON:-python3}
mark=${CORE_MARK:-not slow}
workers=${PYTEST_WORKERS:-2}

# The [project] dependencies but torch, and the test extra's pins of the core test tools.
mapfile -t deps < <("$python" - "$root/pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
name = lambda r: re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower()
print(*(r for r in project["dependencies"] if name(r) != "torch"), sep="\n")
tools = {"pytest", "pytest-xdist", "expecttest"}
print(*(r for r in project["optional-dependencies"]["test"] if name(r) in tools), sep="\n")
EOF
)
[ ${#deps[@]} -ge 3 ] || { echo "could not read pyproject.toml's dependencies" >&2; exit 2; }

status=0
for version in "$@"; do
  venv=$dir/venv-$version
  log=$dir/results/torch-$version.txt
  start=$SECONDS
  free=$(df -P --block-size=1G "$dir" | awk 'NR == 2 {print $4}')
  if [ "$free" -lt "${MIN_FREE_GB:-15}" ]; then
    echo "torch $version: not tried, $free GB free in $dir (MIN_FREE_GB=${MIN_FREE_GB:-15})"
    status=1; continue
  fi
  rm -rf "$venv"
  {
    echo "== torch $version, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -m), $("$python" -V)"
    "$python" -m venv "$venv" &&
    # torch==VERSION in the same request: nothing the deps ask for can replace it.
    "$venv/bin/pip" install -q "torch==$version" "${deps[@]}" &&
    "$venv/bin/pip" install -q --no-deps -e "$root" &&
    "$venv/bin/python" -c "import torch, sys; print('torch', torch.__version__)
sys.exit(torch.__version__.split('+')[0] != '$version')"
  } > "$log" 2>&1
  if [ $? -ne 0 ]; then
    echo "torch $version: install failed ($((SECONDS - start)) s), see $log"
    status=1
  else
    installed=$(($(du -sm "$venv" | cut -f1) / 1024))
    xdist=(); [ "$workers" -gt 0 ] && xdist=(-n "$workers")
    tests_start=$SECONDS
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "${xdist[@]}" -m "$mark" -k "not trl" \
      -rfE tests/losses tests/kernels tests/runtime tests/distributed >> "$log" 2>&1
    rc=$?
    summary=$(grep -E '^=*.*[0-9]+ (passed|failed|error|skipped|deselected).* in [0-9.]+s' "$log" |
              tail -1 | sed 's/^=* *//; s/ *=*$//')
    count() { local n; n=$(grep -oE "[0-9]+ $1" <<< "$summary" | head -1); echo "${n:-0}" | cut -d' ' -f1; }
    echo "torch $version: passed $(count passed) failed $(count failed) errors $(count error)" \
      "skipped $(count skipped) | tests $((SECONDS - tests_start)) s," \
      "all $((SECONDS - start)) s, venv ${installed} GB | pytest rc $rc | $log"
    [ $rc -eq 0 ] || status=1
  fi
  if [ $keep -eq 0 ]; then rm -rf "$venv"; fi
done
exit $status
