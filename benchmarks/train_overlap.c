/* Would the bf16 training step gain from writing a row's gradient while the
   next row's exp is computed? A hand-written model of the one-pass training
   kernel (ce_tvm/kernels/training.py on AVX-512 with AVX-512 BF16; built and
   run by benchmarks/train_overlap.sh), 2 threads, rows of C bf16 logits:

   per row, the max of its first chunk (the shift), then chunk by chunk
   e = exp(x - shift) (fastmath's degree-4 polynomial for 16-bit results) kept
   in a float32 row buffer and summed ("A"); then the gradient e * scale - smooth
   rounded to bf16 by vcvtne2ps2bf16 and stored ("B").

   - sequential: A then B for each row, as the kernel runs; A prefetches the
     gradient's lines for writing (prefetchw) and B the next row's logits, as
     the kernel does;
   - pipelined: B of the row before interleaved with A of this row, a chunk of
     each in turn (B's chunk first: it reads the kept exp before A overwrites it);
   - each with plain stores (the lines read for ownership) and with
     non-temporal ones (vmovntdq);
   - copy: dst.copy_(x)'s floor, a memcpy per row.
   The variants run in turn within each rep; the best of 7 reps is printed. C
   must be a multiple of 32. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHUNK 1600
#define AHEAD 1600 /* elements: the logits' prefetch distance in A */

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __m512 widen(const uint16_t *p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 exp16(__m512 t) { /* fastmath.exp, storage bfloat16 */
  t = _mm512_max_ps(t, _mm512_set1_ps(-88.0f));
  __m512 y = _mm512_fmadd_ps(t, _mm512_set1_ps(1.4426950408889634f), _mm512_set1_ps(12583039.0f));
  __m512 k = _mm512_sub_ps(y, _mm512_set1_ps(12583039.0f));
  __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(-0.6931471805599453f), t);
  __m512 p = _mm512_set1_ps(4.1513489222e-02f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6787414118e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0003014061e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.9996687006e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(y), 23)));
}

static float first_chunk_max(const uint16_t *x) {
  __m512 m = _mm512_set1_ps(-1e30f);
  for (int c = 0; c < CHUNK; c += 16) m = _mm512_max_ps(m, widen(x + c));
  return _mm512_reduce_max_ps(m);
}

/* A on [lo, hi): the kept exp and its sums; prefetchw of `grad` (NULL: none). */
static inline void exp_part(const uint16_t *x, float *keep, int lo, int hi, float shift,
                            __m512 *s0, __m512 *s1, uint16_t *grad) {
  __m512 sh = _mm512_set1_ps(shift);
  for (int c = lo; c < hi; c += 32) {
    _mm_prefetch((const char *)(x + c + AHEAD), _MM_HINT_T0);
    if (grad) _mm_prefetch((const char *)(grad + c), _MM_HINT_ET0);
    __m512 ea = exp16(_mm512_sub_ps(widen(x + c), sh));
    __m512 eb = exp16(_mm512_sub_ps(widen(x + c + 16), sh));
    _mm512_store_ps(keep + c, ea);
    _mm512_store_ps(keep + c + 16, eb);
    *s0 = _mm512_add_ps(*s0, ea);
    *s1 = _mm512_add_ps(*s1, eb);
  }
}

/* B on [lo, hi): the bf16 gradient; prefetches the next row's logits (NULL: none). */
static inline void grad_part(const float *keep, uint16_t *grad, int lo, int hi, float scale,
                             int streamed, const uint16_t *next) {
  __m512 sc = _mm512_set1_ps(scale), sm = _mm512_set1_ps(1e-6f);
  for (int c = lo; c < hi; c += 32) {
    if (next) _mm_prefetch((const char *)(next + c), _MM_HINT_T0);
    __m512 a = _mm512_fmsub_ps(_mm512_load_ps(keep + c), sc, sm);
    __m512 b = _mm512_fmsub_ps(_mm512_load_ps(keep + c + 16), sc, sm);
    __m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    if (streamed)
      _mm512_stream_si512((void *)(grad + c), h);
    else
      _mm512_storeu_si512((void *)(grad + c), h);
  }
}

static float total(__m512 s0, __m512 s1) { return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)); }

static void sequential(const uint16_t *x, uint16_t *grad, int n_rows, int C, int streamed) {
#pragma omp parallel
  {
    float *keep = aligned_alloc(64, (size_t)C * 4);
#pragma omp for schedule(static)
    for (int n = 0; n < n_rows; n++) {
      const uint16_t *row = x + (size_t)n * C;
      uint16_t *out = grad + (size_t)n * C;
      __m512 s0 = _mm512_setzero_ps(), s1 = s0;
      exp_part(row, keep, 0, C, first_chunk_max(row), &s0, &s1, streamed ? NULL : out);
      grad_part(keep, out, 0, C, 1.0f / total(s0, s1), streamed, n + 1 < n_rows ? row + C : NULL);
    }
    free(keep);
  }
}

static void pipelined(const uint16_t *x, uint16_t *grad, int n_rows, int C, int streamed) {
#pragma omp parallel
  {
    int threads = omp_get_num_threads(), id = omp_get_thread_num();
    int lo = (long)n_rows * id / threads, hi = (long)n_rows * (id + 1) / threads;
    float *keep = aligned_alloc(64, (size_t)C * 4), scale = 0;
    uint16_t *before = NULL; /* the gradient row still to write */
    for (int n = lo; n < hi; n++) {
      const uint16_t *row = x + (size_t)n * C;
      float shift = first_chunk_max(row);
      __m512 s0 = _mm512_setzero_ps(), s1 = s0;
      for (int c = 0; c < C; c += CHUNK) {
        int end = c + CHUNK < C ? c + CHUNK : C;
        if (before) grad_part(keep, before, c, end, scale, streamed, NULL);
        exp_part(row, keep, c, end, shift, &s0, &s1, NULL);
      }
      scale = 1.0f / total(s0, s1);
      before = grad + (size_t)n * C;
    }
    if (before) grad_part(keep, before, 0, C, scale, streamed, NULL);
    free(keep);
  }
}

static void copy(const uint16_t *x, uint16_t *dst, int n_rows, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < n_rows; n++) memcpy(dst + (size_t)n * C, x + (size_t)n * C, (size_t)C * 2);
}

int main(int argc, char **argv) {
  if (argc < 3 || atoi(argv[2]) % 32) {
    fprintf(stderr, "usage: %s ROWS CLASSES (a multiple of 32)\n", argv[0]);
    return 2;
  }
  int n_rows = atoi(argv[1]), C = atoi(argv[2]);
  size_t bytes = (size_t)n_rows * C * 2;
  uint16_t *x = aligned_alloc(64, bytes), *grad = aligned_alloc(64, bytes),
           *dst = aligned_alloc(64, bytes);
  for (size_t i = 0; i < (size_t)n_rows * C; i++) {
    float f = (rand() % 1000) / 100.0f - 5.0f;
    uint32_t u;
    memcpy(&u, &f, 4);
    x[i] = u >> 16;
  }
  memset(grad, 0, bytes);
  memset(dst, 0, bytes);
  const char *names[] = {"sequential", "sequential, streamed", "pipelined",
                         "pipelined, streamed", "copy"};
  double best[5] = {1e30, 1e30, 1e30, 1e30, 1e30};
  for (int rep = 0; rep < 7; rep++) {
    for (int v = 0; v < 5; v++) {
      double t0 = now();
      if (v < 2) sequential(x, grad, n_rows, C, v == 1);
      else if (v < 4) pipelined(x, grad, n_rows, C, v == 3);
      else copy(x, dst, n_rows, C);
      double t = now() - t0;
      if (t < best[v]) best[v] = t;
    }
  }
  printf("%d x %d bf16, %d threads:", n_rows, C, omp_get_max_threads());
  for (int v = 0; v < 5; v++) printf(" %s %.2f ms%s", names[v], best[v] * 1e3, v < 4 ? "," : "\n");
  return grad[1] == 12345;
}
