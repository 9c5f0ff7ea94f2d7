"""CPU kernels run on torch's OpenMP thread pool instead of TVM's own.

TVM's CPU kernels hand their parallel loops to ``TVMBackendParallelLaunch``,
which runs TVM's thread pool. Torch runs its operators on an OpenMP pool
whose idle workers keep spinning for a few milliseconds after each parallel
operator; on a machine with few cores, a TVM kernel started in that window
shares the cores with them (measured on 2 cores: the forward at 4096x32000
took 23 ms after a torch operator, 16.5 ms on torch's pool). Each loaded
module calls the launcher through its ``__TVMBackendParallelLaunch`` pointer
(set by TVM when it loads the module); ``use_torch_pool`` points it at a
small launcher compiled here against the OpenMP runtime torch loaded, so
TVM's parallel tasks run as one OpenMP team on torch's (already warm)
threads: ``torch.set_num_threads`` sizes it.

The launcher is compiled once per OpenMP runtime (in the system temp
directory) and moved into ``launchers/`` of the module cache with a manifest
(size, SHA-256), under the cache's rules: checked before it is mapped,
rebuilt with a warning when damaged, built once across processes, and built
for this process only when the cache cannot be written. Without a C
compiler, with a torch that does not use OpenMP, off Linux, or with
``CE_TVM_THREAD_POOL=tvm``, modules keep TVM's pool (sized by
``ce_tvm.runtime.registry.configure_thread_pool``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..store.files import (
    CacheWriteError,
    build_lock,
    copy_file,
    make_private_dir,
    remove_leftovers,
    scratch_dir,
    seal,
    sealed_problem,
)
from ..store.paths import LAUNCHERS, cache_dir, check_permissions

log = logging.getLogger("ce_tvm")

LAUNCHER_SOURCE = r"""
#include <stdint.h>
/* declared here rather than by <omp.h>, which a compiler may ship without */
int omp_get_max_threads(void);
int omp_get_num_threads(void);
int omp_get_thread_num(void);
typedef struct { void* sync_handle; int32_t num_task; } TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv* penv, void* cdata);

/* TVMBackendParallelLaunch's contract: run flambda(task, env, cdata) for every
   task of one group; env.num_task is the group's size; 0 when all return 0. */
int ce_tvm_omp_parallel_launch(FTVMParallelLambda flambda, void* cdata, int num_task) {
  int failed = 0;
  #pragma omp parallel num_threads(num_task > 0 ? num_task : omp_get_max_threads())
  {
    TVMParallelGroupEnv env = {0, omp_get_num_threads()};
    if (flambda(omp_get_thread_num(), &env, cdata) != 0) {
      #pragma omp atomic write
      failed = -1;
    }
  }
  return failed;
}
"""
SYMBOL = "ce_tvm_omp_parallel_launch"
LAUNCH_POINTER = "__TVMBackendParallelLaunch"
_state: dict = {}


def torch_openmp_library() -> Path | None:
    """The OpenMP runtime (libgomp or libiomp) this process has loaded, or ``None``."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        name = Path(path).name
        if name.startswith(("libgomp", "libiomp5")) and ".so" in name:
            return Path(path)
    return None


def _compile_launcher(openmp: Path) -> Path | None:
    """The verified launcher library for ``openmp`` in the cache (built on first
    use, once across processes), or ``None`` when it cannot be compiled."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    digest = hashlib.sha256(f"{LAUNCHER_SOURCE}\0{openmp}".encode()).hexdigest()[:16]
    directory = cache_dir() / LAUNCHERS  # beside the kernels, not among them
    lib = directory / f"omp-launch-{digest}.so"
    try:
        make_private_dir(directory)
        if sealed_problem(lib) is None:
            check_permissions(lib)
            return lib
        with build_lock(lib):
            return _build_sealed(lib, compiler, openmp)
    except CacheWriteError as err:
        log.warning("ce_tvm: the module cache cannot be written (%s); building the OpenMP "
                    "launcher for this process only", err)
    try:
        return _build_sealed(scratch_dir() / lib.name, compiler, openmp)
    except CacheWriteError as err:
        log.warning("ce_tvm: OpenMP launcher not built (%s); TVM's thread pool runs the "
                    "kernels", err)
        return None


def _build_sealed(lib: Path, compiler: str, openmp: Path) -> Path | None:
    """``lib`` verified against its manifest, (re)built there with one when it is not."""
    problem = sealed_problem(lib)
    if problem is None:
        check_permissions(lib)
        return lib
    if problem != "missing":
        log.warning("ce_tvm: rebuilding the OpenMP launcher %s: %s", lib, problem)
    remove_leftovers(lib)
    with tempfile.TemporaryDirectory(prefix="ce_tvm-launcher-") as tmp:
        built = _compile_in(Path(tmp), compiler, openmp)
        if built is None:
            return None
        copy_file(built, lib)
    seal(lib)
    return lib


def _compile_in(scratch: Path, compiler: str, openmp: Path) -> Path | None:
    """The launcher compiled in ``scratch``, or ``None`` (logged) when it cannot be."""
    source, obj, built = scratch / "launch.c", scratch / "launch.o", scratch / "launch.so"
    try:
        source.write_text(LAUNCHER_SOURCE)
        subprocess.run([compiler, "-O2", "-fPIC", "-fopenmp", "-c", str(source),
                        "-o", str(obj)], check=True, capture_output=True)
        # linked against the runtime torch loaded (by path), not the compiler's own
        subprocess.run([compiler, "-shared", str(obj), str(openmp), "-o", str(built),
                        f"-Wl,-rpath,{openmp.parent}"], check=True, capture_output=True)
    except (subprocess.CalledProcessError, OSError) as err:
        log.info("ce_tvm: OpenMP launcher not built (%s); TVM's thread pool runs "
                 "the kernels", getattr(err, "stderr", err))
        return None
    return built


def launcher_address() -> int | None:
    """Address of the OpenMP launcher, or ``None`` when modules keep TVM's pool."""
    if "address" not in _state:
        _state["address"] = None
        openmp = torch_openmp_library()
        if os.environ.get("CE_TVM_THREAD_POOL", "torch") != "tvm" and openmp is not None:
            lib = _compile_launcher(openmp)
            if lib is not None:
                _state["library"] = ctypes.CDLL(str(lib))
                _state["address"] = ctypes.cast(getattr(_state["library"], SYMBOL),
                                                ctypes.c_void_p).value
    return _state["address"]


def use_torch_pool(module: Path) -> bool:
    """Point the loaded CPU module at ``module`` to the OpenMP launcher; whether it now uses it."""
    address = launcher_address()
    if address is None:
        return False
    try:  # the library is loaded already (tvm_ffi.load_module): this only looks it up
        pointer = ctypes.c_void_p.in_dll(ctypes.CDLL(str(module)), LAUNCH_POINTER)
    except ValueError:  # no parallel loop in this kernel
        return False
    pointer.value = address
    return True
