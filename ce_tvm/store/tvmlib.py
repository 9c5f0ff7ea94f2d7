"""The TVM runtime library, found and loaded without importing the ``tvm`` package.

Compiled kernels need ``libtvm_runtime.so`` (and ``libtvm_runtime_cuda.so``
for CUDA) loaded with global symbols before ``tvm_ffi.load_module`` opens
them; the compiler (``libtvm_compiler.so``, the ``tvm`` package) is never
needed to run a kernel that is already built. The libraries come from the
installed ``apache-tvm`` when it can be imported (the same files ``import
tvm`` loads, so a later cache miss that compiles shares them), else from a
bundle (``ce-tvm bundle``) among the module directories, checked against the
SHA-256 sums of its ``bundle.json``.

Importing this module (``import ce_tvm`` does) sets
``TVM_FFI_DISABLE_TORCH_C_DLPACK=1`` unless the user set it: tvm-ffi, on its
first import with a torch that lacks ``Tensor.__dlpack_c_exchange_api__``
(torch 2.11, say; 2.13 has it), would otherwise compile a torch C++ extension,
with nvcc where CUDA is available, once per torch build and with no output
(most likely what kept a GPU check on an H200 silent for eight minutes).
Without it tensors take the DLPack protocol's Python path, at no measurable
cost per call. With torch 2.13 nothing changes: the flag also skips tvm-ffi's
patch that gives older torch streams ``__cuda_stream__``, which 2.13's have
and ce_tvm does not use (``tvm_ffi.use_torch_stream`` reads ``cuda_stream``).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

from .files import ModuleIntegrityError, content_problem
from .paths import BUNDLE_MANIFEST, bundle_dirs, check_permissions

os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")

RUNTIME_LIBS = {"llvm": ("libtvm_runtime.so",),
                "cuda": ("libtvm_runtime.so", "libtvm_runtime_cuda.so")}
INSTALL_HINT = ("build the kernels where apache-tvm is installed with `ce-tvm bundle --target "
                "TARGET --dtype DTYPE --classes C --out DIR` and point CE_TVM_MODULE_DIR (or "
                "ce_tvm.use_bundle) at DIR, or install the compiler: pip install apache-tvm")


class CompilerNotInstalledError(RuntimeError):
    """A kernel (or the TVM runtime) is needed that only the TVM compiler could provide."""


def tvm_package_dir() -> Path | None:
    """The directory of the installed ``tvm`` package (the compiler), or ``None``;
    nothing is imported (an import hook may hide the package)."""
    try:
        spec = importlib.util.find_spec("tvm")
    except (ImportError, ValueError):
        return None
    locations = spec.submodule_search_locations if spec is not None else None
    return Path(locations[0]) if locations else None


def compiler_installed() -> bool:
    """Whether the ``tvm`` package (the compiler) is installed; nothing is imported."""
    return tvm_package_dir() is not None


def runtime_source() -> tuple[Path, str, dict]:
    """``(directory, TVM version, {library: {"sha256", "size"}})`` of the TVM runtime
    to use: the installed apache-tvm's (no sums: pip installed it), else the first
    bundle's."""
    package = tvm_package_dir()
    if package is not None:
        return package / "lib", importlib.metadata.version("apache-tvm"), {}
    for bundle in bundle_dirs():
        manifest = json.loads((bundle / BUNDLE_MANIFEST).read_text())
        return bundle / "lib", manifest["tvm"], manifest["runtime_libs"]
    raise CompilerNotInstalledError(
        "ce_tvm found neither the TVM runtime of apache-tvm nor a bundle in "
        f"CE_TVM_MODULE_DIR; {INSTALL_HINT}")


def tvm_version() -> str:
    """Version of the TVM whose runtime runs the kernels (part of every cache key)."""
    return runtime_source()[1]


_loaded: dict = {}
_cuda_binaries: dict = {}


def load_runtime(target: str) -> None:
    """Load the TVM runtime libraries kernels for ``target`` need (once per process)."""
    import tvm_ffi  # noqa: F401  (loads libtvm_ffi.so, which the runtime links against)

    directory, _, sums = runtime_source()
    for name in RUNTIME_LIBS["cuda" if target == "cuda" else "llvm"]:
        if name in _loaded:
            continue
        path = directory / name
        if sums:  # a bundle: the same rules as its kernels
            if name not in sums:
                raise CompilerNotInstalledError(
                    f"the bundle {directory.parent} has no {name} (a {target} kernel needs it); "
                    f"{INSTALL_HINT}")
            check_permissions(directory)
            check_permissions(path)
            problem = content_problem(path, sums[name])
            if problem:
                raise ModuleIntegrityError(
                    f"refusing to load {path}: {problem} against "
                    f"{directory.parent / BUNDLE_MANIFEST}. The bundle is damaged: make it again "
                    "with `ce-tvm bundle`")
        _loaded[name] = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def provide_cuda_binary(source_sha256: str, binary: bytes) -> None:
    """Make the compiled code of a CUDA kernel (``ce_tvm.runtime.cache.cuda_binary_of``)
    what TVM's CUDA runtime gets when it loads a module that kept its source.

    The CUDA runtime asks the global function ``tvm_callback_cuda_compile`` to
    compile such a module's source. With the compiler installed, TVM's own
    (``tvm.support.nvcc``: NVRTC, or nvcc with ``TVM_CUDA_COMPILE_MODE=nvcc``)
    answers; without it, this module answers with the binary built with the
    bundle, found by the source's SHA-256.
    """
    import tvm_ffi

    _cuda_binaries[source_sha256] = binary
    if tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True) is not None:
        return
    if compiler_installed():
        import tvm.support.nvcc  # noqa: F401  (registers TVM's callback)
    else:
        tvm_ffi.register_global_func("tvm_callback_cuda_compile", _precompiled_cuda)


def _precompiled_cuda(code: str, *_):
    found = _cuda_binaries.get(hashlib.sha256(code.encode()).hexdigest())
    if found is None:
        raise CompilerNotInstalledError(
            "a CUDA kernel's source has no binary built with it (its bundle was built without "
            f"nvcc on PATH, or for another version); {INSTALL_HINT}")
    return bytearray(found)
