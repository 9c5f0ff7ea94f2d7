"""Target names users pass (``llvm``, ``cuda``, ``ascend``) and the TVM targets behind them."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import os
import platform
from pathlib import Path

from .files import CacheWriteError, ModuleIntegrityError, make_private_dir, write_file
from .paths import cache_dir, check_permissions, module_dirs
from .tvmlib import INSTALL_HINT, CompilerNotInstalledError, compiler_installed

TARGETS = ("llvm", "cuda", "ascend")
DEFAULT_CUDA_ARCH = "sm_90"
log = logging.getLogger("ce_tvm")


@functools.cache
def host_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def target_description(name: str, arch: str | None = None) -> dict:
    """The TVM target for a target name, as the JSON dict TVM builds it from.

    ``llvm`` and ``ascend`` (which is validated through LLVM) compile for this
    host's CPU; ``cuda`` for ``arch`` (default ``sm_90``).
    """
    if name in ("llvm", "ascend"):
        return {"kind": "llvm", "mcpu": host_cpu(), "num-cores": host_cores()}
    if name == "cuda":
        return {"kind": "cuda", "arch": arch or DEFAULT_CUDA_ARCH}
    raise ValueError(f"target must be one of {TARGETS}, got {name!r}")


@functools.cache
def tvm_target(name: str, arch: str | None = None):
    """The ``tvm.target.Target`` of ``target_description`` (imports the compiler)."""
    from tvm.target import Target

    return Target(target_description(name, arch))


def cpu_fingerprint() -> str:
    """A hash of what LLVM reads to name this host's CPU (vendor, family, model,
    feature flags), computed without LLVM."""
    fields = {"machine": platform.machine()}
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        for line in first.splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("vendor_id", "cpu family", "model", "flags", "Features",
                                "CPU implementer", "CPU part"):
                fields[name.strip()] = value.strip()
    except OSError:
        fields["processor"] = platform.processor()
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def host_descriptor_name() -> str:
    """File name of this CPU's descriptor in a module directory or the cache."""
    return f"host-{cpu_fingerprint()}.json"


@functools.cache
def host_cpu() -> str:
    """LLVM's name of this host's CPU (``znver5``).

    Read from the descriptor a build wrote for this CPU (in a module directory
    or the cache), so that a kernel already built is found without TVM; else
    asked of TVM's LLVM once and written to the cache for the next process.
    """
    name = host_descriptor_name()
    for directory in [*module_dirs(), cache_dir()]:
        path = directory / name
        if path.is_file():
            check_permissions(path)
            try:
                return _read_host_descriptor(path)
            except (OSError, ValueError) as err:
                if directory != cache_dir():
                    raise ModuleIntegrityError(
                        f"refusing to use {path}: {err}. The directory is damaged: make it "
                        "again with `ce-tvm bundle` (or `ce-tvm compile --out`)") from None
                log.warning("ce_tvm: rewriting the damaged host descriptor %s: %s", path, err)
    if not compiler_installed():
        raise CompilerNotInstalledError(
            f"no kernel for this CPU is available: no {name} (written with the kernels built "
            f"for it) in CE_TVM_MODULE_DIR or the cache; {INSTALL_HINT}")
    from tvm.target.codegen import llvm_get_system_cpu

    cpu = str(llvm_get_system_cpu())
    try:
        write_host_descriptor(cache_dir(), cpu)
    except CacheWriteError as err:  # it only saves the next process asking LLVM
        log.info("ce_tvm: host descriptor not written: %s", err)
    return cpu


def _read_host_descriptor(path: Path) -> str:
    """The CPU name in the descriptor ``path``; ``ValueError`` when it is not one of ours."""
    found = json.loads(path.read_text())
    if (not isinstance(found, dict) or found.get("fingerprint") != cpu_fingerprint()
            or not isinstance(found.get("mcpu"), str) or not found["mcpu"]):
        raise ValueError("not a descriptor of this CPU")
    return found["mcpu"]


def write_host_descriptor(directory: Path, cpu: str | None = None) -> Path:
    """Record this CPU's LLVM name in ``directory`` (``files.write_file``, mode 0600)."""
    make_private_dir(directory)
    path = directory / host_descriptor_name()
    descriptor = {"mcpu": cpu or host_cpu(), "fingerprint": cpu_fingerprint()}
    write_file(path, json.dumps(descriptor).encode())
    return path


_CPU_SCHEDULE = contextvars.ContextVar("ce_tvm_cpu_schedule", default=("llvm", ()))
_CUDA_OPTIONS = contextvars.ContextVar("ce_tvm_cuda_options", default=())


@contextlib.contextmanager
def schedule(name: str, **options):
    """Run kernels with schedule ``name`` and its ``options`` inside the block.

    ``with ce_tvm.schedule("ascend", profile="910b"): ...`` makes CPU calls of
    every ce_tvm op use the Ascend-style tiled schedule (compiled through
    LLVM); ``"llvm"`` is the default CPU schedule. ``"cuda"`` sets knobs of the
    CUDA schedule for CUDA calls (``ce_tvm.schedules.cuda.CUDAKnobs``:
    ``with ce_tvm.schedule("cuda", threads=512): ...``): each set of options is
    a kernel of its own, compiled (or loaded) once like any other.
    """
    if name not in ("llvm", "ascend", "cuda"):
        raise ValueError(f"a schedule is 'llvm' or 'ascend' (CPU tensors) or 'cuda' (the CUDA "
                         f"schedule's knobs), got {name!r}")
    chosen = options_of(options)
    var, value = (_CUDA_OPTIONS, chosen) if name == "cuda" else (_CPU_SCHEDULE, (name, chosen))
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def options_of(options: dict) -> tuple:
    """Schedule options as a kernel's spec keeps them: ``(name, str(value))`` pairs,
    sorted by name."""
    return tuple(sorted((k, str(v)) for k, v in options.items()))


def cpu_schedule() -> tuple:
    """``(target name, schedule options)`` that CPU tensors use here and now."""
    return _CPU_SCHEDULE.get()


def cuda_options() -> tuple:
    """The CUDA schedule's options (``(name, value)`` pairs) here and now."""
    return _CUDA_OPTIONS.get()
