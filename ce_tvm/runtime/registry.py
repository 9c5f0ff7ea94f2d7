"""Kernel registry: one loaded module per ``KernelSpec`` per process.

Modules are opened with ``tvm_ffi.load_module`` after the TVM runtime
library (``ce_tvm.store.tvmlib``): running a built kernel never imports the ``tvm``
package nor loads the compiler. Torch tensors are passed to the kernels by
DLPack through tvm-ffi, without copies. The kernels check strides exactly, so
a tensor torch calls contiguous but with other strides (an empty one, a
size-1 dimension) is passed as a view with the canonical strides
(``canonical_strides``): the one place every tensor enters the kernels.
CPU kernels run their parallel loops on torch's OpenMP threads
(``ce_tvm.runtime.omp_pool``); where that is not possible, on TVM's thread pool,
sized to the cores this process may use unless ``TVM_NUM_THREADS`` says
otherwise.
"""

from __future__ import annotations

import os
import threading

import torch

from ..store.spec import KernelSpec
from ..store.targets import host_cores
from ..store.tvmlib import load_runtime, provide_cuda_binary
from .cache import cuda_binary_of, module_path
from .omp_pool import use_torch_pool

_lock = threading.Lock()
_kernels: dict = {}
_pool_configured = False


def configure_thread_pool() -> None:
    """One TVM worker per core this process may use, without pinning the caller.

    TVM sizes its pool from ``TVM_NUM_THREADS`` when the pool is first used
    (``runtime.config_threadpool`` does not reach the pool kernels run on, and
    the default here is a single thread), and binds the calling thread to
    core 0, which torch's threads created afterwards would inherit. Unless
    the user set them, ``TVM_NUM_THREADS`` is the usable core count and
    ``TVM_BIND_THREADS`` is 0.
    """
    global _pool_configured
    if not _pool_configured:
        os.environ.setdefault("TVM_NUM_THREADS", str(host_cores()))
        os.environ.setdefault("TVM_BIND_THREADS", "0")
        _pool_configured = True


def kernel(spec: KernelSpec):
    """The callable kernel for ``spec``, loading (and building if needed) on first use."""
    fn = _kernels.get(spec)
    if fn is not None:
        return fn
    with _lock:
        fn = _kernels.get(spec)
        if fn is None:
            configure_thread_pool()
            path = module_path(spec)
            load_runtime(spec.target)
            if spec.target == "cuda" and (compiled := cuda_binary_of(path)) is not None:
                provide_cuda_binary(*compiled)
            import tvm_ffi

            fn = tvm_ffi.load_module(str(path))["main"]
            if spec.target == "llvm":
                use_torch_pool(path)
            _kernels[spec] = fn
    return fn


def row_major_strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``, in elements."""
    strides, step = [], 1
    for size in reversed(shape):  # a loop: half the time of math.prod over suffixes
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def canonical_strides(arg):
    """``arg`` itself, or, for a tensor torch calls contiguous whose strides are
    not the row-major ones, a view of the same elements with those strides.

    Only an empty tensor or one with a size-1 dimension can be contiguous
    with other strides (``torch.tensor(np.zeros((0, 65)))`` has strides
    ``(0, 0)``), so every other tensor is returned at the cost of one check.
    A non-contiguous tensor is returned as it is (the kernels refuse it).
    """
    if not isinstance(arg, torch.Tensor) or (arg.numel() and 1 not in arg.shape):
        return arg
    if not arg.is_contiguous():
        return arg
    stride = row_major_strides(arg.shape)
    return arg if arg.stride() == stride else arg.as_strided(arg.shape, stride)


def call(spec: KernelSpec, *args):
    """Run the kernel for ``spec`` on ``args`` (tensors re-strided by
    ``canonical_strides``); CUDA kernels go on PyTorch's current stream
    (which also makes them capturable in a CUDA graph)."""
    fn = kernel(spec)
    args = [canonical_strides(a) for a in args]
    if spec.target != "cuda":
        return fn(*args)
    import tvm_ffi

    with tvm_ffi.use_torch_stream():
        return fn(*args)


def loaded_specs() -> list[KernelSpec]:
    """Specs whose kernels this process has loaded (for reports and tests)."""
    return list(_kernels)
