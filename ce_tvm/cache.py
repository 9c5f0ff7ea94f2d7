"""On-disk module cache and precompiled module directories.

Layout (the same for the cache and for ``ce-tvm compile --out DIR``)::

    <dir>/<stem>-<keyhash>.so      the kernel
    <dir>/<stem>-<keyhash>.json    manifest: {"key": ..., "sha256": ...}

A module is loaded only when its manifest names the expected key and the
library's SHA-256 matches. In the cache, anything else is rebuilt; in a
precompiled directory it is an error naming the file and what differed.
Builds take an exclusive ``flock`` on ``<stem>-<keyhash>.lock``, so
concurrent processes build a missing module once; the kernel releases the
lock when its holder dies, so a killed build never blocks the next one.
Libraries are written to a temporary name and renamed into place.

Loading a shared library runs its code: directories and files that anyone
but their owner can write are refused (``UnsafePermissionsError``, see
``ce_tvm.paths``), and new directories and files are created private (0700 /
0600). Only a miss imports the compiler (``ce_tvm.build``); without it, a
miss raises ``CompilerNotInstalledError`` saying how to get the kernel.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from .paths import (
    LAUNCHERS,
    cache_dir,
    check_permissions,
    make_private_dir,
    module_dirs,
    sha256_file,
)
from .spec import KernelSpec
from .tvmlib import INSTALL_HINT, CompilerNotInstalledError, compiler_installed

log = logging.getLogger("ce_tvm")


class ModuleIntegrityError(RuntimeError):
    """A precompiled module does not match its manifest or the expected key."""


def manifest_path(lib: Path) -> Path:
    return lib.with_suffix(".json")


def check_module(lib: Path, spec: KernelSpec) -> str | None:
    """``None`` when ``lib`` is loadable for ``spec``, else what is wrong with it.

    Raises ``UnsafePermissionsError`` when the library or its manifest is
    writable by others: that is never repaired silently.
    """
    if not lib.exists():
        return "missing"
    for path in (lib, manifest_path(lib)):
        if path.exists():
            check_permissions(path)
    try:
        manifest = json.loads(manifest_path(lib).read_text())
    except (OSError, ValueError) as err:
        return f"unreadable manifest {manifest_path(lib)} ({err})"
    key = spec.key()
    if manifest.get("key") != key:
        diff = sorted(k for k in key if manifest.get("key", {}).get(k) != key[k])
        return f"manifest was written for another key (differs in: {', '.join(diff)})"
    digest = sha256_file(lib)
    if manifest.get("sha256") != digest:
        return f"SHA-256 mismatch (manifest {manifest.get('sha256')}, file {digest})"
    return None


def write_module(spec: KernelSpec, directory: Path) -> Path:
    """Compile ``spec`` into ``directory`` with its manifest; returns the library path.

    The only place that imports the compiler (``ce_tvm.build``, TVM)."""
    if not compiler_installed():
        raise CompilerNotInstalledError(
            f"ce_tvm needs the kernel {spec.file_name()}, which is in no module directory "
            f"({os.environ.get('CE_TVM_MODULE_DIR') or 'CE_TVM_MODULE_DIR is unset'}) nor in "
            f"the cache {cache_dir()}, and the TVM compiler is not installed to build it; "
            f"{INSTALL_HINT}")
    from .build import compile_spec, cuda_binary, export_atomically

    lib = directory / spec.file_name()
    executable = compile_spec(spec)
    compiled = cuda_binary(executable, spec)  # CUDA source checked (and kept) with nvcc
    export_atomically(executable, lib)
    manifest = {"key": spec.key(), "sha256": sha256_file(lib)}
    if compiled is not None:
        source, binary = compiled
        write_private(lib.with_suffix(".cubin"), binary)
        manifest["cuda_binary"] = {"sha256": hashlib.sha256(binary).hexdigest(),
                                   "source_sha256": hashlib.sha256(source.encode()).hexdigest()}
    write_private(manifest_path(lib), json.dumps(manifest, indent=1, sort_keys=True).encode())
    return lib


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` atomically with mode 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def cuda_binary_of(lib: Path) -> tuple[str, bytes] | None:
    """``(SHA-256 of the CUDA source, cubin)`` stored beside a verified CUDA module
    (``write_module`` on a host without a GPU), checked against its manifest;
    ``None`` when the module has none."""
    entry = json.loads(manifest_path(lib).read_text()).get("cuda_binary")
    if entry is None:
        return None
    path = lib.with_suffix(".cubin")
    check_permissions(path)
    binary = path.read_bytes()
    if hashlib.sha256(binary).hexdigest() != entry["sha256"]:
        raise ModuleIntegrityError(f"refusing to load {path}: SHA-256 mismatch with "
                                   f"{manifest_path(lib)}")
    return entry["source_sha256"], binary


LOCK_TIMEOUT_S = float(os.environ.get("CE_TVM_LOCK_TIMEOUT", 900))


@contextlib.contextmanager
def build_lock(lib: Path, timeout_s: float = LOCK_TIMEOUT_S):
    """Exclusive lock for building ``lib``, shared by every process using the directory.

    An ``flock`` dies with its holder, so a lock left by a killed build never
    blocks the next one; a live holder is waited for up to ``timeout_s``.
    """
    fd = os.open(lib.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process has held {lib.with_suffix('.lock')} for more than "
                        f"{timeout_s:.0f} s (set CE_TVM_LOCK_TIMEOUT to wait longer)") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def find_precompiled(spec: KernelSpec) -> Path | None:
    """The module for ``spec`` in a precompiled directory, verified; ``None`` if absent."""
    for directory in module_dirs():
        check_permissions(directory)
        lib = directory / spec.file_name()
        problem = check_module(lib, spec)
        if problem == "missing":
            continue
        if problem:
            raise ModuleIntegrityError(f"refusing to load {lib}: {problem}")
        return lib
    return None


def ensure_cached(spec: KernelSpec) -> Path:
    """The verified cached module for ``spec``, built (once across processes) if needed."""
    directory = cache_dir()
    make_private_dir(directory)
    lib = directory / spec.file_name()
    if check_module(lib, spec) is None:
        return lib
    with build_lock(lib):
        problem = check_module(lib, spec)
        if problem is None:
            return lib
        if problem != "missing":
            log.warning("ce_tvm: rebuilding cached module %s: %s", lib.name, problem)
        log.info("ce_tvm: compiling %s", lib.name)
        return write_module(spec, directory)


def entries(directory: Path) -> list[Path]:
    """The compiled modules in ``directory``."""
    return sorted(directory.glob("*.so")) if directory.is_dir() else []


def verify_entry(lib: Path) -> str | None:
    """``None`` when ``lib`` matches its manifest and the key in its name, else why not."""
    try:
        check_permissions(lib)
        manifest = json.loads(manifest_path(lib).read_text())
    except (OSError, ValueError) as err:
        return str(err)
    key_hash = hashlib.sha256(json.dumps(manifest.get("key"), sort_keys=True).encode())
    if not lib.stem.endswith(key_hash.hexdigest()[:16]):
        return "manifest key does not match the file name"
    if manifest.get("sha256") != sha256_file(lib):
        return "SHA-256 mismatch"
    try:
        cuda_binary_of(lib)
    except (OSError, ModuleIntegrityError) as err:
        return str(err)
    return None


def clear(directory: Path) -> int:
    """Remove every module, manifest, lock and OpenMP launcher (``ce_tvm.omp_pool``)
    in ``directory``; returns the files removed."""
    removed = 0
    launchers = directory / LAUNCHERS
    for pattern in ("*.so", "*.cubin", "*.json", "*.lock", "*.tmp"):
        for path in [*directory.glob(pattern), *launchers.glob(pattern)]:
            path.unlink()
            removed += 1
    if launchers.is_dir():
        launchers.rmdir()
    return removed


def module_path(spec: KernelSpec) -> Path:
    """Where the module for ``spec`` comes from: a precompiled directory, else the cache."""
    return find_precompiled(spec) or ensure_cached(spec)
