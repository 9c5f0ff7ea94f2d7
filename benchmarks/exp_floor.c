/* The compute floor of the fused loss's exp on an x86 CPU with AVX2 and FMA
   (benchmarks/exp_floor.sh builds and runs it; one thread, all in L1).

   Prints, per 256-bit vector instruction: the FMA throughput (12 independent
   chains, distinct inputs so the compiler cannot merge them) and latency (one
   chain); then the time per element of a loop that sums exp(x - max) as the
   kernels do (ce_tvm/kernels/fastmath.py, float32: one FMA to round x log2(e), one for
   the reduced argument, a degree-5 Horner polynomial, the 2**k shift, a
   multiply-add into the sum), written by hand with intrinsics. 8 of its 12
   vector instructions per 8 lanes are FMAs or multiplies, so its floor is
   FMA throughput * 8 / 8 per element. Compare both with the x.sum() and copy
   probes of ce-tvm bench (ns per element per core).

   On a CPU with AVX-512 the same is measured for 512-bit vectors (16 lanes):
   the zmm FMA throughput, and the exp-sum loop with the polynomial of a
   float32 result (degree 5) and of a 16-bit one (degree 4,
   fastmath._POLY["half"]). A CPU that splits a zmm instruction in two 256-bit
   halves (Zen 4) gains lanes but no FMAs per nanosecond. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define KEEP(v) __asm__ volatile("" : "+x"(v))

static double fma_throughput_ns(long reps) {
  __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  __m256 a[12];
  for (int j = 0; j < 12; j++) a[j] = _mm256_set1_ps(1.0f + 0.1f * j);
  __m256 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3], a4 = a[4], a5 = a[5];
  __m256 a6 = a[6], a7 = a[7], a8 = a[8], a9 = a[9], a10 = a[10], a11 = a[11];
  double t0 = now();
  for (long i = 0; i < reps; i++) {
    a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c);
    a2 = _mm256_fmadd_ps(a2, m, c); a3 = _mm256_fmadd_ps(a3, m, c);
    a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c);
    a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c);
    a8 = _mm256_fmadd_ps(a8, m, c); a9 = _mm256_fmadd_ps(a9, m, c);
    a10 = _mm256_fmadd_ps(a10, m, c); a11 = _mm256_fmadd_ps(a11, m, c);
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3); KEEP(a4); KEEP(a5);
    KEEP(a6); KEEP(a7); KEEP(a8); KEEP(a9); KEEP(a10); KEEP(a11);
  }
  return (now() - t0) / (reps * 12.0) * 1e9;
}

static double fma_latency_ns(long reps) {
  __m256 a = _mm256_set1_ps(1.0f), m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  double t0 = now();
  for (long i = 0; i < reps; i++) {
    a = _mm256_fmadd_ps(a, m, c);
    KEEP(a);
  }
  return (now() - t0) / reps * 1e9;
}

static inline __m256 exp_shifted(__m256 x, __m256 top) {
  const __m256 rounder = _mm256_set1_ps(12583039.0f); /* 1.5 * 2**23 + 127 */
  __m256 t = _mm256_max_ps(_mm256_set1_ps(-88.0f), _mm256_sub_ps(x, top));
  __m256 y = _mm256_fmadd_ps(t, _mm256_set1_ps(1.44269504f), rounder);
  __m256 k = _mm256_sub_ps(y, rounder);
  __m256 r = _mm256_fmadd_ps(k, _mm256_set1_ps(-0.693147181f), t);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(8.2902722061e-03f), r, _mm256_set1_ps(4.1898161173e-02f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6667638719e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.9999147654e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.9999970198e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(y), 23)));
}

static double exp_sum_ns_per_element(int n, int sweeps) {
  float *x = aligned_alloc(64, n * sizeof(float));
  for (int i = 0; i < n; i++) x[i] = 6.0f * rand() / RAND_MAX - 3.0f;
  __m256 top = _mm256_set1_ps(3.0f);
  double best = 1e30;
  float total = 0;
  for (int rep = 0; rep < 10; rep++) {
    double t0 = now();
    for (int s = 0; s < sweeps; s++) {
      __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
      for (int i = 0; i < n; i += 16) {
        acc0 = _mm256_add_ps(acc0, exp_shifted(_mm256_load_ps(x + i), top));
        acc1 = _mm256_add_ps(acc1, exp_shifted(_mm256_load_ps(x + i + 8), top));
      }
      __m256 acc = _mm256_add_ps(acc0, acc1);
      total += acc[0];
    }
    double t = (now() - t0) / ((double)sweeps * n);
    if (t < best) best = t;
  }
  free(x);
  if (total != total) printf("(nan)\n");
  return best * 1e9;
}

#define ZMM __attribute__((target("avx512f")))

ZMM static double zmm_fma_throughput_ns(long reps) {
  __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  __m512 a0 = _mm512_set1_ps(1.0f), a1 = _mm512_set1_ps(1.1f), a2 = _mm512_set1_ps(1.2f);
  __m512 a3 = _mm512_set1_ps(1.3f), a4 = _mm512_set1_ps(1.4f), a5 = _mm512_set1_ps(1.5f);
  __m512 a6 = _mm512_set1_ps(1.6f), a7 = _mm512_set1_ps(1.7f), a8 = _mm512_set1_ps(1.8f);
  __m512 a9 = _mm512_set1_ps(1.9f), a10 = _mm512_set1_ps(2.0f), a11 = _mm512_set1_ps(2.1f);
  double t0 = now();
  for (long i = 0; i < reps; i++) {
    a0 = _mm512_fmadd_ps(a0, m, c); a1 = _mm512_fmadd_ps(a1, m, c);
    a2 = _mm512_fmadd_ps(a2, m, c); a3 = _mm512_fmadd_ps(a3, m, c);
    a4 = _mm512_fmadd_ps(a4, m, c); a5 = _mm512_fmadd_ps(a5, m, c);
    a6 = _mm512_fmadd_ps(a6, m, c); a7 = _mm512_fmadd_ps(a7, m, c);
    a8 = _mm512_fmadd_ps(a8, m, c); a9 = _mm512_fmadd_ps(a9, m, c);
    a10 = _mm512_fmadd_ps(a10, m, c); a11 = _mm512_fmadd_ps(a11, m, c);
    KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3); KEEP(a4); KEEP(a5);
    KEEP(a6); KEEP(a7); KEEP(a8); KEEP(a9); KEEP(a10); KEEP(a11);
  }
  return (now() - t0) / (reps * 12.0) * 1e9;
}

/* degree 5 (a float32 result) or 4 (a 16-bit one): fastmath._POLY */
ZMM static inline __m512 zmm_exp_shifted(__m512 x, __m512 top, int half) {
  const __m512 rounder = _mm512_set1_ps(12583039.0f);
  __m512 t = _mm512_max_ps(_mm512_set1_ps(-88.0f), _mm512_sub_ps(x, top));
  __m512 y = _mm512_fmadd_ps(t, _mm512_set1_ps(1.44269504f), rounder);
  __m512 k = _mm512_sub_ps(y, rounder);
  __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(-0.693147181f), t);
  __m512 p;
  if (half) {
    p = _mm512_fmadd_ps(_mm512_set1_ps(4.1513489222e-02f), r, _mm512_set1_ps(1.6787414118e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0003014061e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.9996687006e-01f));
  } else {
    p = _mm512_fmadd_ps(_mm512_set1_ps(8.2902722061e-03f), r, _mm512_set1_ps(4.1898161173e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6667638719e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.9999147654e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.9999970198e-01f));
  }
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(y), 23)));
}

ZMM static double zmm_exp_sum_ns_per_element(int n, int sweeps, int half) {
  float *x = aligned_alloc(64, n * sizeof(float));
  for (int i = 0; i < n; i++) x[i] = 6.0f * rand() / RAND_MAX - 3.0f;
  __m512 top = _mm512_set1_ps(3.0f);
  double best = 1e30;
  float total = 0;
  for (int rep = 0; rep < 10; rep++) {
    double t0 = now();
    for (int s = 0; s < sweeps; s++) {
      __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
      for (int i = 0; i < n; i += 32) {
        acc0 = _mm512_add_ps(acc0, zmm_exp_shifted(_mm512_load_ps(x + i), top, half));
        acc1 = _mm512_add_ps(acc1, zmm_exp_shifted(_mm512_load_ps(x + i + 16), top, half));
      }
      total += _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
    double t = (now() - t0) / ((double)sweeps * n);
    if (t < best) best = t;
  }
  free(x);
  if (total != total) printf("(nan)\n");
  return best * 1e9;
}

int main(void) {
  double thr = fma_throughput_ns(100000000L), lat = fma_latency_ns(100000000L);
  double loop = exp_sum_ns_per_element(4096, 4000);
  printf("ymm FMA: %.3f ns each at full throughput, %.3f ns latency\n", thr, lat);
  printf("exp floor (8 FMA-class instructions per 8 float32 lanes): %.3f ns per element per core\n", thr);
  printf("exp-sum loop by hand (intrinsics, L1): %.3f ns per element per core\n", loop);
  if (__builtin_cpu_supports("avx512f")) {
    double zthr = zmm_fma_throughput_ns(100000000L);
    printf("zmm FMA: %.3f ns each at full throughput (%.3f ns per lane; ymm %.3f)\n",
           zthr, zthr / 16, thr / 8);
    printf("zmm exp floor (8 FMA-class instructions per 16 lanes, degree 5): %.3f ns per element per core\n",
           zthr / 2);
    printf("zmm exp-sum loop by hand, degree 5 (float32 result): %.3f ns per element per core\n",
           zmm_exp_sum_ns_per_element(4096, 4000, 0));
    printf("zmm exp-sum loop by hand, degree 4 (16-bit result): %.3f ns per element per core\n",
           zmm_exp_sum_ns_per_element(4096, 4000, 1));
  }
  return 0;
}
