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

/* Time per FMA at full throughput: 12 independent chains, distinct inputs so
   the compiler cannot merge them. */
#define FMA_THROUGHPUT(ATTR, NAME, T, SET1, FMADD)                              \
  ATTR static double NAME(long reps) {                                          \
    T m = SET1(0.999999f), c = SET1(1e-7f);                                     \
    T a0 = SET1(1.0f), a1 = SET1(1.1f), a2 = SET1(1.2f), a3 = SET1(1.3f);       \
    T a4 = SET1(1.4f), a5 = SET1(1.5f), a6 = SET1(1.6f), a7 = SET1(1.7f);       \
    T a8 = SET1(1.8f), a9 = SET1(1.9f), a10 = SET1(2.0f), a11 = SET1(2.1f);     \
    double t0 = now();                                                          \
    for (long i = 0; i < reps; i++) {                                           \
      a0 = FMADD(a0, m, c); a1 = FMADD(a1, m, c); a2 = FMADD(a2, m, c);         \
      a3 = FMADD(a3, m, c); a4 = FMADD(a4, m, c); a5 = FMADD(a5, m, c);         \
      a6 = FMADD(a6, m, c); a7 = FMADD(a7, m, c); a8 = FMADD(a8, m, c);         \
      a9 = FMADD(a9, m, c); a10 = FMADD(a10, m, c); a11 = FMADD(a11, m, c);     \
      KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3); KEEP(a4); KEEP(a5);               \
      KEEP(a6); KEEP(a7); KEEP(a8); KEEP(a9); KEEP(a10); KEEP(a11);             \
    }                                                                           \
    return (now() - t0) / (reps * 12.0) * 1e9;                                 \
  }

#define ZMM __attribute__((target("avx512f")))

FMA_THROUGHPUT(, fma_throughput_ns, __m256, _mm256_set1_ps, _mm256_fmadd_ps)
FMA_THROUGHPUT(ZMM, zmm_fma_throughput_ns, __m512, _mm512_set1_ps, _mm512_fmadd_ps)

static double fma_latency_ns(long reps) {
  __m256 a = _mm256_set1_ps(1.0f), m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  double t0 = now();
  for (long i = 0; i < reps; i++) {
    a = _mm256_fmadd_ps(a, m, c);
    KEEP(a);
  }
  return (now() - t0) / reps * 1e9;
}

/* exp(x - top) as the kernels compute it, with the polynomial of a float32
   result (degree 5) or of a 16-bit one (degree 4): fastmath._POLY; and the
   time per element of a loop summing it over n floats in L1 (two
   accumulators), best of 10. P: the intrinsics' prefix (_mm256, _mm512), SI
   their integer vector's suffix, W the lanes. */
#define EXP_LOOP(ATTR, PREFIX, T, P, SI, W)                                      \
  ATTR static inline T PREFIX##exp_shifted(T x, T top, int half) {              \
    const T rounder = P##_set1_ps(12583039.0f); /* 1.5 * 2**23 + 127 */         \
    T t = P##_max_ps(P##_set1_ps(-88.0f), P##_sub_ps(x, top));                  \
    T y = P##_fmadd_ps(t, P##_set1_ps(1.44269504f), rounder);                   \
    T k = P##_sub_ps(y, rounder);                                               \
    T r = P##_fmadd_ps(k, P##_set1_ps(-0.693147181f), t);                       \
    T p;                                                                        \
    if (half) {                                                                 \
      p = P##_fmadd_ps(P##_set1_ps(4.1513489222e-02f), r, P##_set1_ps(1.6787414118e-01f)); \
      p = P##_fmadd_ps(p, r, P##_set1_ps(5.0003014061e-01f));                   \
      p = P##_fmadd_ps(p, r, P##_set1_ps(9.9996687006e-01f));                   \
    } else {                                                                    \
      p = P##_fmadd_ps(P##_set1_ps(8.2902722061e-03f), r, P##_set1_ps(4.1898161173e-02f)); \
      p = P##_fmadd_ps(p, r, P##_set1_ps(1.6667638719e-01f));                   \
      p = P##_fmadd_ps(p, r, P##_set1_ps(4.9999147654e-01f));                   \
      p = P##_fmadd_ps(p, r, P##_set1_ps(9.9999970198e-01f));                   \
    }                                                                           \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f));                                  \
    return P##_mul_ps(p, P##_castsi##SI##_ps(P##_slli_epi32(P##_castps_si##SI(y), 23))); \
  }                                                                             \
  ATTR static double PREFIX##exp_sum_ns_per_element(int n, int sweeps, int half) { \
    float *x = aligned_alloc(64, n * sizeof(float));                            \
    for (int i = 0; i < n; i++) x[i] = 6.0f * rand() / RAND_MAX - 3.0f;         \
    T top = P##_set1_ps(3.0f);                                                  \
    double best = 1e30;                                                         \
    float total = 0;                                                            \
    for (int rep = 0; rep < 10; rep++) {                                        \
      double t0 = now();                                                        \
      for (int s = 0; s < sweeps; s++) {                                        \
        T acc0 = P##_setzero_ps(), acc1 = acc0;                                 \
        for (int i = 0; i < n; i += 2 * W) {                                    \
          acc0 = P##_add_ps(acc0, PREFIX##exp_shifted(P##_load_ps(x + i), top, half)); \
          acc1 = P##_add_ps(acc1, PREFIX##exp_shifted(P##_load_ps(x + i + W), top, half)); \
        }                                                                       \
        total += P##_add_ps(acc0, acc1)[0];                                     \
      }                                                                         \
      double t = (now() - t0) / ((double)sweeps * n);                           \
      if (t < best) best = t;                                                   \
    }                                                                           \
    free(x);                                                                    \
    if (total != total) printf("(nan)\n");                                      \
    return best * 1e9;                                                          \
  }

EXP_LOOP(, , __m256, _mm256, 256, 8)
EXP_LOOP(ZMM, zmm_, __m512, _mm512, 512, 16)

int main(void) {
  double thr = fma_throughput_ns(100000000L), lat = fma_latency_ns(100000000L);
  double loop = exp_sum_ns_per_element(4096, 4000, 0);
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
