"""Target names users pass (``llvm``, ``cuda``, ``ascend``) and the TVM targets behind them."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

from tvm.target import Target
from tvm.target.codegen import llvm_get_system_cpu

TARGETS = ("llvm", "cuda", "ascend")
DEFAULT_CUDA_ARCH = "sm_90"


@functools.cache
def host_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@functools.cache
def tvm_target(name: str, arch: str | None = None) -> Target:
    """The TVM target for a target name.

    ``llvm`` and ``ascend`` (which is validated through LLVM) compile for this
    host's CPU; ``cuda`` for ``arch`` (default ``sm_90``).
    """
    if name in ("llvm", "ascend"):
        return Target({"kind": "llvm", "mcpu": llvm_get_system_cpu(), "num-cores": host_cores()})
    if name == "cuda":
        return Target({"kind": "cuda", "arch": arch or DEFAULT_CUDA_ARCH})
    raise ValueError(f"target must be one of {TARGETS}, got {name!r}")


_CPU_SCHEDULE = contextvars.ContextVar("ce_tvm_cpu_schedule", default=("llvm", ()))


@contextlib.contextmanager
def schedule(name: str, **options):
    """Run CPU kernels with schedule ``name`` inside the block.

    ``with ce_tvm.schedule("ascend", profile="910b"): ...`` makes CPU calls of
    every ce_tvm op use the Ascend-style tiled schedule (compiled through
    LLVM); ``"llvm"`` is the default CPU schedule.
    """
    if name not in ("llvm", "ascend"):
        raise ValueError(f"CPU tensors can use the 'llvm' or 'ascend' schedule, got {name!r}")
    token = _CPU_SCHEDULE.set((name, tuple(sorted((k, str(v)) for k, v in options.items()))))
    try:
        yield
    finally:
        _CPU_SCHEDULE.reset(token)


def cpu_schedule() -> tuple:
    """``(target name, schedule options)`` that CPU tensors use here and now."""
    return _CPU_SCHEDULE.get()
