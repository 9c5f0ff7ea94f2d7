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
   halves (Zen 4) gains lanes but no FMAs per nanosecond. Then the AVX-512
   alternatives weighed for the kernels (below main's loops). */
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

/* ns per element of the statements ``...`` (one sweep over N elements, adding
   to ``total``, which is kept so that nothing is optimised away), best of 10
   reps of SWEEPS sweeps. */
#define BEST_NS(N, SWEEPS, ...)                                                 \
  ({                                                                            \
    double best = 1e30;                                                         \
    float total = 0;                                                            \
    for (int rep = 0; rep < 10; rep++) {                                        \
      double t0 = now();                                                        \
      for (int s = 0; s < (SWEEPS); s++) { __VA_ARGS__ }                        \
      double t = (now() - t0) / ((double)(SWEEPS) * (N));                       \
      if (t < best) best = t;                                                   \
    }                                                                           \
    if (total != total) printf("(nan)\n");                                      \
    best * 1e9;                                                                 \
  })

/* n floats in [-3, 3], 64-byte aligned. */
static float *uniform_floats(int n) {
  float *x = aligned_alloc(64, n * sizeof(float));
  for (int i = 0; i < n; i++) x[i] = 6.0f * rand() / RAND_MAX - 3.0f;
  return x;
}

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

/* Whether OP shares the FMA pipes: 12 zmm FMA chains an iteration, alone and
   with 6 independent OPs beside them (ns per iteration). Where the time does
   not grow, OP issues to other pipes. */
#define ZMM_BESIDE_FMA(NAME, T, SET1, OP)                                       \
  ZMM static double NAME(long reps, int with_op) {                              \
    __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);           \
    __m512 a0 = m, a1 = m, a2 = m, a3 = m, a4 = m, a5 = m;                      \
    __m512 a6 = c, a7 = c, a8 = c, a9 = c, a10 = c, a11 = c;                     \
    T b0 = SET1(1), b1 = SET1(2), b2 = SET1(3), b3 = SET1(4), b4 = SET1(5);     \
    T b5 = SET1(6), k = SET1(7);                                                \
    double t0 = now();                                                          \
    for (long i = 0; i < reps; i++) {                                           \
      a0 = _mm512_fmadd_ps(a0, m, c); a1 = _mm512_fmadd_ps(a1, m, c);           \
      a2 = _mm512_fmadd_ps(a2, m, c); a3 = _mm512_fmadd_ps(a3, m, c);           \
      a4 = _mm512_fmadd_ps(a4, m, c); a5 = _mm512_fmadd_ps(a5, m, c);           \
      a6 = _mm512_fmadd_ps(a6, m, c); a7 = _mm512_fmadd_ps(a7, m, c);           \
      a8 = _mm512_fmadd_ps(a8, m, c); a9 = _mm512_fmadd_ps(a9, m, c);           \
      a10 = _mm512_fmadd_ps(a10, m, c); a11 = _mm512_fmadd_ps(a11, m, c);       \
      if (with_op) {                                                            \
        b0 = OP(b0, k); b1 = OP(b1, k); b2 = OP(b2, k);                         \
        b3 = OP(b3, k); b4 = OP(b4, k); b5 = OP(b5, k);                         \
      }                                                                         \
      KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3); KEEP(a4); KEEP(a5);               \
      KEEP(a6); KEEP(a7); KEEP(a8); KEEP(a9); KEEP(a10); KEEP(a11);             \
      KEEP(b0); KEEP(b1); KEEP(b2); KEEP(b3); KEEP(b4); KEEP(b5);               \
    }                                                                           \
    return (now() - t0) / reps * 1e9;                                           \
  }
#define ZMM_SLLI(v, k) _mm512_slli_epi32(v, 1)
ZMM_BESIDE_FMA(beside_maxps_ns, __m512, _mm512_set1_ps, _mm512_max_ps)
ZMM_BESIDE_FMA(beside_addps_ns, __m512, _mm512_set1_ps, _mm512_add_ps)
ZMM_BESIDE_FMA(beside_mulps_ns, __m512, _mm512_set1_ps, _mm512_mul_ps)
ZMM_BESIDE_FMA(beside_pslld_ns, __m512i, _mm512_set1_epi32, ZMM_SLLI)

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
    float *x = uniform_floats(n);                                               \
    T top = P##_set1_ps(3.0f);                                                  \
    double ns = BEST_NS(n, sweeps,                                              \
      T acc0 = P##_setzero_ps(), acc1 = acc0;                                   \
      for (int i = 0; i < n; i += 2 * W) {                                      \
        acc0 = P##_add_ps(acc0, PREFIX##exp_shifted(P##_load_ps(x + i), top, half)); \
        acc1 = P##_add_ps(acc1, PREFIX##exp_shifted(P##_load_ps(x + i + W), top, half)); \
      }                                                                         \
      total += P##_add_ps(acc0, acc1)[0];);                                     \
    free(x);                                                                    \
    return ns;                                                                  \
  }

EXP_LOOP(, , __m256, _mm256, 256, 8)
EXP_LOOP(ZMM, zmm_, __m512, _mm512, 512, 16)

/* AVX-512 alternatives weighed for the kernels, each timed as the loops above
   (degree 4, two accumulators, n elements in L1, best of 10).
   The exp's 2**k: by vscalefps on the rounded k (no conversion), by
   vrndscaleps and vscalefps (no rounding constant), or added to the result's
   exponent bits (vpaddd: off the FMA pipes, and 2**-126 for -inf unless masked).
   A bfloat16 row's max and sum: each 16 words widened by a zero-extension and a
   shift (TVM's legalised cast), by vpexpandw (in order, from memory) or by
   vpermt2w against zero words (schedules/cpu_widening.py). */
#define ZMM_BW __attribute__((target("avx512f,avx512bw,avx512vbmi2")))
#define S1 _mm512_set1_ps
ZMM static inline __m512 zmm_poly4(__m512 r) {
  __m512 p = _mm512_fmadd_ps(S1(4.1513489222e-02f), r, S1(1.6787414118e-01f));
  p = _mm512_fmadd_ps(p, r, S1(5.0003014061e-01f));
  p = _mm512_fmadd_ps(p, r, S1(9.9996687006e-01f));
  return _mm512_fmadd_ps(p, r, S1(1.0f));
}
ZMM static inline __m512 exp_scalef(__m512 x, __m512 top) {
  const __m512 rounder = S1(12582912.0f); /* 1.5 * 2**23: k itself */
  __m512 t = _mm512_max_ps(S1(-110.0f), _mm512_sub_ps(x, top));
  __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(t, S1(1.44269504f), rounder), rounder);
  return _mm512_scalef_ps(zmm_poly4(_mm512_fmadd_ps(k, S1(-0.693147181f), t)), k);
}
ZMM static inline __m512 exp_rndscale(__m512 x, __m512 top) {
  __m512 t = _mm512_max_ps(S1(-110.0f), _mm512_sub_ps(x, top));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(t, S1(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  return _mm512_scalef_ps(zmm_poly4(_mm512_fmadd_ps(k, S1(-0.693147181f), t)), k);
}
ZMM static inline __m512 exp_exponent_add(__m512 x, __m512 top) {
  const __m512 rounder = S1(12582912.0f);
  __m512 t = _mm512_max_ps(S1(-87.0f), _mm512_sub_ps(x, top));
  __m512 y = _mm512_fmadd_ps(t, S1(1.44269504f), rounder);
  __m512 r = _mm512_fmadd_ps(_mm512_sub_ps(y, rounder), S1(-0.693147181f), t);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(zmm_poly4(r)),
                                              _mm512_slli_epi32(_mm512_castps_si512(y), 23)));
}
/* exp by a 16-entry table of 2**(j/16) held in one register (vpermps takes the
   index's low 4 bits) and a degree-2 polynomial on |r| <= ln2/32 (2.0e-6
   relative error against double over [-80, 0]): two FMA-pipe instructions
   fewer than degree 4, a shuffle and integer instructions instead. Not in the
   kernels: a measure of the lever. */
ZMM static inline __m512 exp_table16(__m512 x, __m512 top) {
  const __m512 rounder = S1(12582912.0f);
  const __m512 table = _mm512_set_ps( /* 2**(j/16), j = 15 .. 0 */
      1.9152065614f, 1.8340080864f, 1.7562521604f, 1.6817928305f,
      1.6104903319f, 1.5422108254f, 1.4768261459f, 1.4142135624f,
      1.3542555469f, 1.2968395547f, 1.2418578121f, 1.1892071150f,
      1.1387886348f, 1.0905077327f, 1.0442737824f, 1.0000000000f);
  __m512 t = _mm512_max_ps(S1(-87.0f), _mm512_sub_ps(x, top));
  __m512 y = _mm512_fmadd_ps(t, S1(23.0831206542f), rounder); /* 16 log2(e) */
  __m512 r = _mm512_fmadd_ps(_mm512_sub_ps(y, rounder), S1(-0.0433216987f), t);
  __m512 p = _mm512_fmadd_ps(_mm512_fmadd_ps(r, S1(0.5f), S1(1.0f)), r, S1(1.0f));
  __m512i n = _mm512_castps_si512(y);
  __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(n, table), p);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(v),
                                              _mm512_slli_epi32(_mm512_srai_epi32(n, 4), 23)));
}
#define ZMM_EXP_SUM(NAME, EXP)                                                   \
  ZMM static double NAME(int n, int sweeps) {                                   \
    float *x = uniform_floats(n);                                               \
    double ns = BEST_NS(n, sweeps,                                              \
      __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;                           \
      for (int i = 0; i < n; i += 32) {                                         \
        acc0 = _mm512_add_ps(acc0, EXP(_mm512_load_ps(x + i), S1(3.0f)));       \
        acc1 = _mm512_add_ps(acc1, EXP(_mm512_load_ps(x + i + 16), S1(3.0f)));  \
      }                                                                         \
      total += _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)););               \
    free(x);                                                                    \
    return ns;                                                                  \
  }
ZMM_EXP_SUM(exp_scalef_ns, exp_scalef)
ZMM_EXP_SUM(exp_rndscale_ns, exp_rndscale)
ZMM_EXP_SUM(exp_exponent_add_ns, exp_exponent_add)
ZMM_EXP_SUM(exp_table16_ns, exp_table16)

/* 32 bfloat16 words at p widened to float32 into *lo (the first 16) and *hi. */
ZMM_BW static inline void widen_shift(const unsigned short *p, __m512 *lo, __m512 *hi) {
  *lo = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i *)p)), 16));
  *hi = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i *)(p + 16))), 16));
}
ZMM_BW static inline void widen_expand(const unsigned short *p, __m512 *lo, __m512 *hi) {
  *lo = _mm512_castsi512_ps(_mm512_maskz_expandloadu_epi16(0xAAAAAAAAu, p));
  *hi = _mm512_castsi512_ps(_mm512_maskz_expandloadu_epi16(0xAAAAAAAAu, p + 16));
}
ZMM_BW static inline void widen_permute(const unsigned short *p, __m512 *lo, __m512 *hi) {
  __m512i to_lo = _mm512_set_epi16(15, 32, 14, 32, 13, 32, 12, 32, 11, 32, 10, 32, 9, 32, 8,
                                   32, 7, 32, 6, 32, 5, 32, 4, 32, 3, 32, 2, 32, 1, 32, 0, 32);
  __m512i to_hi = _mm512_add_epi16(to_lo, _mm512_set_epi16(
      16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0,
      16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0));
  __m512i words = _mm512_load_si512((const void *)p);
  *lo = _mm512_castsi512_ps(_mm512_permutex2var_epi16(words, to_lo, _mm512_setzero_si512()));
  *hi = _mm512_castsi512_ps(_mm512_permutex2var_epi16(words, to_hi, _mm512_setzero_si512()));
}
/* Words 0-3, 8-11, ... into *lo and 4-7, 12-15, ... into *hi: out of order, for
   a max or sum, which does not mind. */
ZMM_BW static inline void widen_unpack(const unsigned short *p, __m512 *lo, __m512 *hi) {
  __m512i words = _mm512_load_si512((const void *)p);
  *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), words));
  *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), words));
}
#define ZMM_WIDEN_MAX_SUM(NAME, WIDEN)                                           \
  ZMM_BW static double NAME(int n, int sweeps) {                                \
    unsigned short *x = aligned_alloc(64, n * sizeof(unsigned short));          \
    for (int i = 0; i < n; i++) x[i] = 0x3f80 + rand() % 256; /* 1 to 2 */     \
    double ns = BEST_NS(n, sweeps,                                              \
      __m512 m0 = _mm512_setzero_ps(), m1 = m0, s0 = m0, s1 = m0, lo, hi;       \
      for (int i = 0; i < n; i += 32) {                                         \
        WIDEN(x + i, &lo, &hi);                                                 \
        m0 = _mm512_max_ps(m0, lo); m1 = _mm512_max_ps(m1, hi);                 \
        s0 = _mm512_add_ps(s0, lo); s1 = _mm512_add_ps(s1, hi);                 \
      }                                                                         \
      total += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1))                      \
               + _mm512_reduce_max_ps(_mm512_max_ps(m0, m1)););                 \
    free(x);                                                                    \
    return ns;                                                                  \
  }
ZMM_WIDEN_MAX_SUM(widen_shift_ns, widen_shift)
ZMM_WIDEN_MAX_SUM(widen_expand_ns, widen_expand)
ZMM_WIDEN_MAX_SUM(widen_permute_ns, widen_permute)
ZMM_WIDEN_MAX_SUM(widen_unpack_ns, widen_unpack)
/* A bfloat16 chunk's exp-sum (the forward's second pass, degree 4), widened each way. */
#define ZMM_WIDEN_EXP_SUM(NAME, WIDEN)                                           \
  ZMM_BW static double NAME(int n, int sweeps) {                                \
    unsigned short *x = aligned_alloc(64, n * sizeof(unsigned short));          \
    for (int i = 0; i < n; i++) x[i] = 0x3f80 + rand() % 256; /* 1 to 2 */     \
    double ns = BEST_NS(n, sweeps,                                              \
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, lo, hi;                         \
      for (int i = 0; i < n; i += 32) {                                         \
        WIDEN(x + i, &lo, &hi);                                                 \
        s0 = _mm512_add_ps(s0, zmm_exp_shifted(lo, S1(3.0f), 1));              \
        s1 = _mm512_add_ps(s1, zmm_exp_shifted(hi, S1(3.0f), 1));              \
      }                                                                         \
      total += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)););                   \
    free(x);                                                                    \
    return ns;                                                                  \
  }
ZMM_WIDEN_EXP_SUM(exp_widen_shift_ns, widen_shift)
ZMM_WIDEN_EXP_SUM(exp_widen_permute_ns, widen_permute)
ZMM_WIDEN_EXP_SUM(exp_widen_unpack_ns, widen_unpack)

/* A bfloat16 row swept as the forward does, in chunks of CHUNK classes: each
   chunk's max (words widened by vpermt2w), then its exp-sum against that max
   (widened again, from L1), merged across chunks; against one loop per chunk
   that takes the max and the exp-sum together, against a shift for the whole
   row taken first (the max of its first chunk: an exp-sum of
   exp(x - shift), valid while the row's max is within 64 of the shift). */
#define CHUNK 4000
ZMM_BW static inline float chunk_max(const unsigned short *p) {
  __m512 m0 = S1(-3.4e38f), m1 = m0, lo, hi;
  for (int i = 0; i < CHUNK; i += 32) {
    widen_permute(p + i, &lo, &hi);
    m0 = _mm512_max_ps(m0, lo); m1 = _mm512_max_ps(m1, hi);
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}
ZMM_BW static float row_two_loops(const unsigned short *x, int n) {
  float top = -3.4e38f, sum = 0;
  for (int c = 0; c < n; c += CHUNK) {
    float m = chunk_max(x + c);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, lo, hi, mv = S1(m);
    for (int i = 0; i < CHUNK; i += 32) {
      widen_shift(x + c + i, &lo, &hi);
      s0 = _mm512_add_ps(s0, zmm_exp_shifted(lo, mv, 1));
      s1 = _mm512_add_ps(s1, zmm_exp_shifted(hi, mv, 1));
    }
    float cs = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)), t = m > top ? m : top;
    sum = sum * __builtin_expf(top - t) + cs * __builtin_expf(m - t);
    top = t;
  }
  return top + __builtin_logf(sum);
}
ZMM_BW static float row_one_loop(const unsigned short *x, int n) {
  __m512 shift = S1(chunk_max(x)), m0 = S1(-3.4e38f), m1 = m0;
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, lo, hi;
  for (int c = 0; c < n; c += CHUNK)
    for (int i = 0; i < CHUNK; i += 32) {
      widen_shift(x + c + i, &lo, &hi);
      m0 = _mm512_max_ps(m0, lo); m1 = _mm512_max_ps(m1, hi);
      s0 = _mm512_add_ps(s0, zmm_exp_shifted(lo, shift, 1));
      s1 = _mm512_add_ps(s1, zmm_exp_shifted(hi, shift, 1));
    }
  float top = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1)), s = shift[0];
  if (top - s > 64) return -1; /* the caller would sweep the row again */
  return s + __builtin_logf(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)));
}
#define ZMM_ROW_SWEEP(NAME, ROW)                                                 \
  ZMM_BW static double NAME(int n, int sweeps) {                                \
    unsigned short *x = aligned_alloc(64, n * sizeof(unsigned short));          \
    for (int i = 0; i < n; i++) x[i] = 0x3f80 + rand() % 256; /* 1 to 2 */     \
    double ns = BEST_NS(n, sweeps, total += ROW(x, n););                        \
    free(x);                                                                    \
    return ns;                                                                  \
  }
ZMM_ROW_SWEEP(row_two_loops_ns, row_two_loops)
ZMM_ROW_SWEEP(row_one_loop_ns, row_one_loop)

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
    printf("12 zmm FMAs: %.3f ns; with 6 vmaxps beside them %.3f, vaddps %.3f, vpslld %.3f, "
           "vmulps %.3f ns (where the time does not grow, the op issues beside the FMAs)\n",
           beside_maxps_ns(50000000L, 0), beside_maxps_ns(50000000L, 1),
           beside_addps_ns(50000000L, 1), beside_pslld_ns(50000000L, 1),
           beside_mulps_ns(50000000L, 1));
    printf("zmm exp-sum loop by hand, degree 5 (float32 result): %.3f ns per element per core\n",
           zmm_exp_sum_ns_per_element(4096, 4000, 0));
    printf("zmm exp-sum loop by hand, degree 4 (16-bit result): %.3f ns per element per core\n",
           zmm_exp_sum_ns_per_element(4096, 4000, 1));
    printf("  its 2**k by vscalefps: %.3f; k by vrndscaleps, 2**k by vscalefps: %.3f; "
           "2**k added to the exponent bits: %.3f ns\n", exp_scalef_ns(4096, 4000),
           exp_rndscale_ns(4096, 4000), exp_exponent_add_ns(4096, 4000));
    printf("  exp by a 16-entry table (vpermps) and a degree-2 polynomial: %.3f ns\n",
           exp_table16_ns(4096, 4000));
  }
  if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi2"))
  {
    printf("zmm bf16 max-and-sum loop, words widened by zero-extension and shift: %.4f, "
           "vpexpandw: %.4f, vpermt2w: %.4f, vpunpck[lh]wd: %.4f ns per element per core\n",
           widen_shift_ns(8192, 4000), widen_expand_ns(8192, 4000), widen_permute_ns(8192, 4000),
           widen_unpack_ns(8192, 4000));
    printf("zmm bf16 exp-sum loop (degree 4), widened by zero-extension and shift: %.4f, "
           "vpermt2w: %.4f, vpunpck[lh]wd: %.4f ns per element per core\n",
           exp_widen_shift_ns(8192, 4000), exp_widen_permute_ns(8192, 4000),
           exp_widen_unpack_ns(8192, 4000));
    printf("zmm bf16 row of 8 chunks of %d (L1 and L2): chunk max then exp-sum: %.4f, "
           "one loop against the first chunk's max: %.4f ns per element per core\n",
           CHUNK, row_two_loops_ns(8 * CHUNK, 1000), row_one_loop_ns(8 * CHUNK, 1000));
    printf("zmm bf16 rows from memory (64 MB): chunk max then exp-sum: %.4f, "
           "one loop: %.4f ns per element per core\n",
           row_two_loops_ns(8000 * CHUNK, 1), row_one_loop_ns(8000 * CHUNK, 1));
  }
  return 0;
}
