"""ce_tvm through the API on torch's OpenMP threads vs TVM's own pool, in one run.

Usage: python benchmarks/thread_pools.py N C DTYPE

Loads the forward and training kernels, then times each rep in turn: the
probes (``x.sum()``, ``dst.copy_(x)``), and the no-grad forward and a training
step with every loaded module pointed at the OpenMP launcher
(``ce_tvm.runtime.omp_pool``), then at TVM's ``TVMBackendParallelLaunch``. Prints the
best of 7 reps and the ratios to the probes.
"""

import ctypes
import sys
import time

import torch

import ce_tvm
from ce_tvm.runtime import omp_pool
from ce_tvm.runtime import registry as runtime
from ce_tvm.runtime.cache import module_path
from ce_tvm.store import tvmlib


def main(n: int, c: int, dtype: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(n, c).to(getattr(torch, dtype))
    y = torch.randint(0, c, (n,))
    y[::17] = -100
    dst, xr = torch.empty_like(x), x.clone().requires_grad_()

    def forward():
        with torch.no_grad():
            ce_tvm.cross_entropy(x, y, label_smoothing=0.1)

    def train():
        xr.grad = None
        ce_tvm.cross_entropy(xr, y, label_smoothing=0.1).backward()

    forward(), train()
    launchers = {"omp": omp_pool.launcher_address(),
                 "tvm": ctypes.cast(tvmlib._loaded["libtvm_runtime.so"].TVMBackendParallelLaunch,
                                    ctypes.c_void_p).value}
    if launchers["omp"] is None:
        sys.exit("no OpenMP launcher here (no C compiler, or torch without OpenMP)")
    pointers = [ctypes.c_void_p.in_dll(ctypes.CDLL(str(module_path(s))),
                                       omp_pool.LAUNCH_POINTER)
                for s in runtime.loaded_specs() if s.target == "llvm"]
    best: dict = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        fn()
        best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t0) * 1e3)

    for _ in range(7):
        timed("x.sum", x.sum)
        timed("copy", lambda: dst.copy_(x))
        for pool, address in launchers.items():
            for p in pointers:
                p.value = address
            timed(f"forward/{pool}", forward)
            timed(f"train/{pool}", train)
    print(f"{n}x{c} {dtype}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in best.items()))
    for pool in launchers:
        print(f"  {pool:3s} pool: forward at {best['x.sum'] / best[f'forward/{pool}']:.0%} of "
              f"x.sum, training step {best[f'train/{pool}'] / best['copy']:.2f}x copy")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
