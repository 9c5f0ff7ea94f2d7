#!/usr/bin/env bash
# The compute floor of the loss's exp on this CPU (x86 with AVX2 and FMA): builds
# benchmarks/exp_floor.c with the system C compiler and runs it on one thread
# (and its 512-bit loops where the CPU has AVX-512).
# Read its ns per element beside ce-tvm bench's x.sum() and copy probes.
set -euo pipefail
grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo || { echo "needs AVX2 and FMA"; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"${CC:-cc}" -O2 -mavx2 -mfma "$(dirname "$0")/exp_floor.c" -o "$out/exp_floor" -lm
taskset -c 0 "$out/exp_floor" 2>/dev/null || "$out/exp_floor"
