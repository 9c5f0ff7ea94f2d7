#!/usr/bin/env bash
# Builds and runs benchmarks/train_overlap.c (a CPU with AVX-512 BF16; gcc with OpenMP)
# at the bench's shapes (50257 classes rounded to 50240: the model takes multiples of 32).
set -euo pipefail
cd "$(dirname "$0")"
out=$(mktemp -d)
gcc -O2 -march=native -fopenmp train_overlap.c -o "$out/train_overlap"
for shape in "4096 32000" "8192 50240" "2048 128256"; do
  OMP_NUM_THREADS=${THREADS:-2} "$out/train_overlap" $shape
done
rm -rf "$out"
