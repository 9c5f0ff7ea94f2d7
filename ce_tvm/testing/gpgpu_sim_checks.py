"""Micro-programs that pin down what ce-tvm's patch to GPGPU-Sim fixes, each
against an answer computed here, independently of the simulator:

- ``warp shuffles``: xor, down, up and idx at widths 32 and 16, over several
  warps of several blocks (the unpatched simulator took a lane's number from
  a counter shared between cores);
- ``bf16 conversions`` and ``half conversions``: every 16-bit pattern widened
  to float32 bit for bit; every finite value, every tie between neighbours and
  the float32 values just beside each tie narrowed with round to nearest even
  (the unpatched simulator had no bf16 and rounded half ties away from zero);
- ``bf16 pairs``: the same values narrowed two at a time (``cvt.rn.bf16x2.f32``,
  Triton's stores; the first operand goes to the high half), each in its half
  (the patch's first bf16 support wrote one value, the high one, to the low half);
- ``64-bit integer conversions``: int64 and uint64 to float32 and float64,
  rounded to nearest even (the unpatched simulator converted an unset register:
  TVM's ``(float)N`` for a mean over rows gave 0);
- ``exp2f and __expf``: within CUDA's documented error bounds of float64;
- ``dynamic shared memory``: placed after each kernel's static shared memory,
  aligned as declared, for two kernels with different static sizes and beyond
  48 KB (the unpatched simulator put it at address 0, over the static arrays).

``run_all(simulator)`` runs them in functional mode and returns one ``Check``
each; ``python -m ce_tvm.testing.gpgpu_sim selfcheck`` prints them.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_IO = r"""
#include <cstdio>
#include <cstdlib>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(3); } } while (0)
template <class T> static T *load(const char *f, size_t n) {
  T *h = (T *)malloc(n * sizeof(T)), *d; FILE *F = fopen(f, "rb");
  if (!F || fread(h, sizeof(T), n, F) != n) { fprintf(stderr, "short %s\n", f); exit(2); }
  fclose(F); CK(cudaMalloc(&d, n * sizeof(T)));
  CK(cudaMemcpy(d, h, n * sizeof(T), cudaMemcpyHostToDevice)); free(h); return d; }
template <class T> static T *alloc(size_t n) { T *d; CK(cudaMalloc(&d, n * sizeof(T)));
  CK(cudaMemset(d, 0xff, n * sizeof(T))); return d; }
template <class T> static void save(const char *f, T *d, size_t n) {
  T *h = (T *)malloc(n * sizeof(T)); CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(h, d, n * sizeof(T), cudaMemcpyDeviceToHost));
  FILE *F = fopen(f, "wb"); fwrite(h, sizeof(T), n, F); fclose(F); free(h); }
"""


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


def _run(sim, name: str, source: str, inputs: dict) -> dict:
    """Compile ``source`` (after the I/O helpers), write ``inputs`` (file name ->
    array), run it; returns the ``out*.bin`` files it wrote, as bytes."""
    exe = sim.compile(_IO + source, name)
    work = sim.root / "run"
    work.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        folder = Path(tmp)
        for file, array in inputs.items():
            (folder / file).write_bytes(np.ascontiguousarray(array).tobytes())
        sim.execute(exe, folder)
        return {f.name: f.read_bytes() for f in folder.glob("out*.bin")}


# --- warp shuffles -----------------------------------------------------------------

_BLOCKS, _THREADS = 3, 128
_SHUFFLE = f"#define BLOCKS {_BLOCKS}\n#define THREADS {_THREADS}\n" + r"""
__global__ void shuffles(const float *x, float *out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x, n = gridDim.x * blockDim.x;
  int lane = threadIdx.x & 31;
  float v = x[i], s = v, d = v, h = v;
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o, 32);
  for (int o = 16; o > 0; o >>= 1) d += __shfl_down_sync(0xffffffffu, d, o, 32);
  for (int o = 8; o > 0; o >>= 1) h += __shfl_xor_sync(0xffffffffu, h, o, 16);
  out[i] = s; out[n + i] = d; out[2 * n + i] = h;
  out[3 * n + i] = __shfl_up_sync(0xffffffffu, v, 3, 32);
  out[4 * n + i] = __shfl_sync(0xffffffffu, v, (7 * lane + 3) & 31, 32);
  out[5 * n + i] = __shfl_down_sync(0xffffffffu, v, 5, 16);
}
int main() {
  const int n = BLOCKS * THREADS; float *x = load<float>("x.bin", n), *o = alloc<float>(6 * n);
  shuffles<<<BLOCKS, THREADS>>>(x, o); CK(cudaGetLastError()); save("out.bin", o, 6 * n);
  printf("CE_CHECK_DONE\n"); return 0; }
"""


def _down(v: np.ndarray, delta: int, width: int) -> np.ndarray:
    lane = np.arange(32)
    src = lane + delta
    keep = (src // width) != (lane // width)  # past the segment: the lane's own value
    return np.where(keep, v, v[np.minimum(src, 31)])


def _shuffle_answers(x: np.ndarray) -> np.ndarray:
    lane = np.arange(32)
    out = []
    for warp in x.reshape(-1, 32):
        s, d, h = warp.copy(), warp.copy(), warp.copy()
        for o in (16, 8, 4, 2, 1):
            s = s + s[lane ^ o]
            d = d + _down(d, o, 32)
        for o in (8, 4, 2, 1):
            h = h + h[lane ^ o]
        up = np.where(lane >= 3, warp[np.maximum(lane - 3, 0)], warp)
        idx = warp[(7 * lane + 3) & 31]
        out.append([s, d, h, up, idx, _down(warp, 5, 16)])
    per_warp = np.asarray(out)  # warps x 6 x 32
    return per_warp.transpose(1, 0, 2).reshape(6, -1)


def check_shuffles(sim) -> Check:
    n = _BLOCKS * _THREADS
    x = ((np.arange(n) * 37) % 101 + 0.25 * (np.arange(n) // 32)).astype(np.float32)
    got = np.frombuffer(_run(sim, "shuffles", _SHUFFLE, {"x.bin": x})["out.bin"],
                        np.float32).reshape(6, n)
    want = _shuffle_answers(x.astype(np.float64))
    names = ("xor 32", "down 32", "xor 16", "up 3", "idx", "down 5 width 16")
    bad = [name for name, g, w in zip(names, got, want) if not np.array_equal(g, w)]
    return Check("warp shuffles", not bad, "wrong: " + ", ".join(bad) if bad else
                 f"xor, down, up, idx at widths 32 and 16 exact over {n // 32} warps")


# --- conversions -----------------------------------------------------------------

_CONVERT = r"""
__global__ void widen(const unsigned short *b, float *bf, float *hf, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;
  bf[i] = __bfloat162float(__ushort_as_bfloat16(b[i]));
  hf[i] = __half2float(__ushort_as_half(b[i]));
}
__global__ void narrow(const float *x, unsigned short *b, unsigned short *h, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;
  b[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
  h[i] = __half_as_ushort(__float2half_rn(x[i]));
}
__global__ void narrow_pairs(const float *x, __nv_bfloat162 *b2, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x; if (2 * i + 1 >= n) return;
  b2[i] = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);  // cvt.rn.bf16x2.f32
}
int main() {
  FILE *F = fopen("n.txt", "r"); int m; if (!F || fscanf(F, "%d", &m) != 1) return 2;
  const int p = 65536;
  unsigned short *bits = load<unsigned short>("bits.bin", p);
  float *bf = alloc<float>(p), *hf = alloc<float>(p), *x = load<float>("x.bin", m);
  unsigned short *b = alloc<unsigned short>(m), *h = alloc<unsigned short>(m);
  __nv_bfloat162 *b2 = alloc<__nv_bfloat162>(m / 2);
  widen<<<p / 256, 256>>>(bits, bf, hf, p); CK(cudaGetLastError());
  narrow<<<(m + 255) / 256, 256>>>(x, b, h, m); CK(cudaGetLastError());
  narrow_pairs<<<(m / 2 + 255) / 256, 256>>>(x, b2, m); CK(cudaGetLastError());
  save("out_bf.bin", bf, p); save("out_hf.bin", hf, p); save("out_b.bin", b, m);
  save("out_h.bin", h, m); save("out_b2.bin", b2, m / 2); printf("CE_CHECK_DONE\n");
  return 0; }
"""


def _narrowing_inputs() -> np.ndarray:
    """Every finite bf16 and half value, every tie between neighbours, and the
    float32 values one step beside each tie, as float32."""
    bits = np.arange(65536, dtype=np.uint32)
    values = []
    for wide in ((bits << 16).view(np.float32),
                 bits.astype(np.uint16).view(np.float16).astype(np.float32)):
        finite = np.sort(np.unique(wide[np.isfinite(wide)]))
        ties = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
        values += [finite, ties, np.nextafter(ties, np.float32(np.inf)),
                   np.nextafter(ties, np.float32(-np.inf))]
    return np.concatenate(values + [np.float32([np.inf, -np.inf, 0.0, -0.0])])


def check_conversions(sim) -> list[Check]:
    bits = np.arange(65536, dtype=np.uint16)
    x = _narrowing_inputs()
    out = _run(sim, "conversions", _CONVERT,
               {"bits.bin": bits, "x.bin": x, "n.txt": np.frombuffer(f"{x.size}\n".encode(),
                                                                    np.uint8)})
    bf = np.frombuffer(out["out_bf.bin"], np.uint32)
    hf = np.frombuffer(out["out_hf.bin"], np.float32)
    b = np.frombuffer(out["out_b.bin"], np.uint16)
    h = np.frombuffer(out["out_h.bin"], np.uint16)
    pairs = np.frombuffer(out["out_b2.bin"], np.uint16)  # element 2i low, 2i + 1 high
    # the answers: a bf16 pattern widened is its bits << 16; narrowing rounds to
    # nearest even (torch's bfloat16 and NumPy's float16 conversions)
    want_b = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    with np.errstate(over="ignore"):  # past the largest half: infinity, as the GPU's
        want_h = x.astype(np.float16).view(np.uint16)
    want_hf = bits.view(np.float16).astype(np.float32)
    checks = []
    for name, widen_ok, narrow_bad in (
            ("bf16 conversions", np.array_equal(bf, bits.astype(np.uint32) << 16),
             np.flatnonzero(b != want_b)),
            ("half conversions", np.array_equal(hf, want_hf, equal_nan=True),
             np.flatnonzero(h != want_h))):
        detail = (f"65536 patterns widened {'exactly' if widen_ok else 'WRONG'}; "
                  f"{x.size} values narrowed to nearest even, "
                  f"{narrow_bad.size} wrong")
        if narrow_bad.size:
            i = narrow_bad[0]
            detail += f" (first: {x[i]!r} gave {(b if 'bf16' in name else h)[i]:#06x})"
        checks.append(Check(name, widen_ok and not narrow_bad.size, detail))
    pairs_bad = np.flatnonzero(pairs != want_b[:pairs.size])
    checks.append(Check("bf16 pairs", not pairs_bad.size,
                        f"{pairs.size} values narrowed two at a time (cvt.rn.bf16x2.f32), "
                        f"{pairs_bad.size} wrong or in the wrong half"))
    return checks


# --- 64-bit integers to floating point ------------------------------------------------

_WIDE = r"""
__global__ void wide(const long long *s, const unsigned long long *u, float *sf, double *sd,
                     float *uf, double *ud, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;
  sf[i] = (float)s[i]; sd[i] = (double)s[i]; uf[i] = (float)u[i]; ud[i] = (double)u[i];
}
int main() {
  FILE *F = fopen("n.txt", "r"); int n; if (!F || fscanf(F, "%d", &n) != 1) return 2;
  long long *s = load<long long>("s.bin", n);
  unsigned long long *u = load<unsigned long long>("u.bin", n);
  float *sf = alloc<float>(n), *uf = alloc<float>(n);
  double *sd = alloc<double>(n), *ud = alloc<double>(n);
  wide<<<(n + 127) / 128, 128>>>(s, u, sf, sd, uf, ud, n); CK(cudaGetLastError());
  save("out_sf.bin", sf, n); save("out_sd.bin", sd, n); save("out_uf.bin", uf, n);
  save("out_ud.bin", ud, n); printf("CE_CHECK_DONE\n"); return 0; }
"""


def _nearest_even(value: int, bits: int) -> float:
    """``value`` rounded to ``bits`` significant bits, ties to even (exact, in Python
    integers: a float32 or float64 of a 64-bit integer)."""
    magnitude = abs(value)
    shift = max(0, magnitude.bit_length() - bits)
    q, r = divmod(magnitude, 1 << shift)
    half = (1 << shift) >> 1
    if shift and (r > half or (r == half and q & 1)):
        q += 1
    return float(q << shift) * (-1 if value < 0 else 1)


def _wide_inputs() -> tuple[list, list]:
    rng = np.random.default_rng(64)
    edges = [0, 1, 7, 1 << 24, (1 << 24) + 1, (1 << 24) + 3, (1 << 53) + 1, (1 << 53) + 3,
             (1 << 62) + (1 << 38), (1 << 62) + (3 << 38), (1 << 63) - 1]
    signed = edges + [-v for v in edges] + [-(1 << 63)] + [
        int(v) for v in rng.integers(-(1 << 63), (1 << 63) - 1, 200, dtype=np.int64)]
    unsigned = edges + [(1 << 64) - 1, 1 << 63, (1 << 63) + (1 << 39)] + [
        int(v) for v in rng.integers(0, (1 << 64) - 1, 200, dtype=np.uint64)]
    n = max(len(signed), len(unsigned))
    return (signed + [0] * (n - len(signed)), unsigned + [0] * (n - len(unsigned)))


def check_wide_integers(sim) -> Check:
    signed, unsigned = _wide_inputs()
    n = len(signed)
    out = _run(sim, "wide_integers", _WIDE,
               {"s.bin": np.array(signed, np.int64), "u.bin": np.array(unsigned, np.uint64),
                "n.txt": np.frombuffer(f"{n}\n".encode(), np.uint8)})
    wrong = []
    for name, values, bits, dtype in (
            ("sf", signed, 24, np.float32), ("sd", signed, 53, np.float64),
            ("uf", unsigned, 24, np.float32), ("ud", unsigned, 53, np.float64)):
        got = np.frombuffer(out[f"out_{name}.bin"], dtype)
        want = np.array([_nearest_even(v, bits) for v in values], dtype)
        if not np.array_equal(got, want):
            i = int(np.flatnonzero(got != want)[0])
            wrong.append(f"{name}: {values[i]} gave {got[i]!r}, not {want[i]!r}")
    return Check("64-bit integer conversions", not wrong, "; ".join(wrong) or
                 f"{4 * n} int64/uint64 -> float32/float64 conversions to nearest even, exact")


# --- exp2f and __expf ----------------------------------------------------------------

_EXP_POINTS = 4096
_EXP = f"#define POINTS {_EXP_POINTS}\n" + r"""
__global__ void exps(const float *x, float *e2, float *e, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;
  e2[i] = exp2f(x[i]); e[i] = __expf(x[i] * 0.6875f);
}
int main() {
  const int n = POINTS;
  float *x = load<float>("x.bin", n), *a = alloc<float>(n), *b = alloc<float>(n);
  exps<<<(n + 255) / 256, 256>>>(x, a, b, n); CK(cudaGetLastError());
  save("out_e2.bin", a, n); save("out_e.bin", b, n); printf("CE_CHECK_DONE\n"); return 0; }
"""


def check_exp(sim) -> Check:
    x = np.linspace(-125.0, 127.0, _EXP_POINTS).astype(np.float32)
    out = _run(sim, "exps", _EXP, {"x.bin": x})
    e2 = np.frombuffer(out["out_e2.bin"], np.float32).astype(np.float64)
    e = np.frombuffer(out["out_e.bin"], np.float32).astype(np.float64)
    arg = (x * np.float32(0.6875)).astype(np.float64)
    ulp = 2.0 ** -23
    # CUDA's bounds: exp2f 2 ulp; __expf 2 + floor(|1.173 x|) ulp
    err2 = np.abs(e2 / np.exp2(x.astype(np.float64)) - 1) / ulp
    err = np.abs(e / np.exp(arg) - 1) / ulp
    bound = 2 + np.floor(np.abs(1.173 * arg))
    ok = bool(err2.max() <= 2 and (err <= bound).all())
    return Check("exp2f and __expf", ok, f"exp2f worst {err2.max():.2f} ulp (bound 2); "
                 f"__expf worst {(err / bound).max():.2f} of its bound")


# --- dynamic shared memory ---------------------------------------------------------------

_DYNAMIC = r"""
template <int STATIC>
__global__ void placed(unsigned *out, int dynamic_words) {
  __shared__ unsigned char fixed[STATIC];
  extern __shared__ __align__(64) unsigned dyn[];
  int t = threadIdx.x;
  for (int i = t; i < STATIC; i += blockDim.x) fixed[i] = (unsigned char)(i * 7 + 1);
  for (int i = t; i < dynamic_words; i += blockDim.x) dyn[i] = 0xd0000000u + i;
  __syncthreads();
  unsigned bad = 0;
  for (int i = t; i < STATIC; i += blockDim.x) bad += fixed[i] != (unsigned char)(i * 7 + 1);
  for (int i = t; i < dynamic_words; i += blockDim.x) bad += dyn[i] != 0xd0000000u + i;
  atomicAdd(&out[0], bad);
  if (t == 0) {
    out[1] = (unsigned)__cvta_generic_to_shared(fixed);
    out[2] = (unsigned)__cvta_generic_to_shared(dyn);
  }
}
template <int STATIC> static void launch(const char *file, int bytes) {
  unsigned *o; CK(cudaMalloc(&o, 12)); CK(cudaMemset(o, 0, 12));
  if (bytes > 48 * 1024)
    CK(cudaFuncSetAttribute((const void *)placed<STATIC>,
                            cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  placed<STATIC><<<2, 128, bytes>>>(o, bytes / 4); CK(cudaGetLastError()); save(file, o, 3);
}
int main() {
  launch<1000>("out_a.bin", 4096); launch<5003>("out_b.bin", 4096);
  launch<2048>("out_c.bin", 64 * 1024); printf("CE_CHECK_DONE\n"); return 0; }
"""


def check_dynamic_shared(sim) -> Check:
    out = _run(sim, "dynamic_shared", _DYNAMIC, {})
    problems, seen = [], []
    for file, static, dynamic in (("out_a.bin", 1000, 4096), ("out_b.bin", 5003, 4096),
                                  ("out_c.bin", 2048, 64 * 1024)):
        bad, fixed, dyn = (int(v) for v in np.frombuffer(out[file], np.uint32))
        seen.append(f"static {static} B at {fixed:#x}, dynamic {dynamic} B at {dyn:#x}")
        if bad:
            problems.append(f"{bad} words overwritten (static {static} B)")
        if dyn < fixed + static or dyn % 64:
            problems.append(f"dynamic at {dyn:#x} overlaps or misaligned (static {static} B "
                            f"at {fixed:#x})")
    return Check("dynamic shared memory", not problems,
                 "; ".join(problems) if problems else "; ".join(seen))


def run_all(sim) -> list[Check]:
    """Every check, in functional mode."""
    if sim.perf:
        raise ValueError("the self-check runs in functional mode (perf=False)")
    return [check_shuffles(sim), *check_conversions(sim), check_wide_integers(sim),
            check_exp(sim), check_dynamic_shared(sim)]
