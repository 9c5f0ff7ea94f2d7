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
Every file is written through ``ce_tvm.store.files.replacing`` (a temporary file
in the same directory, fsynced, renamed into place). When the cache cannot
be written (full, read-only, not ours to write), a kernel is built into a
directory of this process (``files.scratch_dir``) with a warning.

Loading a shared library runs its code: directories and files that anyone
but their owner can write are refused (``UnsafePermissionsError``, see
``ce_tvm.store.paths``), and new directories and files are created private (0700 /
0600). Only a miss imports the compiler (``ce_tvm.compiler.build``); without it, a
miss raises ``CompilerNotInstalledError`` saying how to get the kernel.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from ..store.files import (
    CacheWriteError,
    ModuleIntegrityError,
    build_lock,
    content_problem,
    copy_file,
    make_private_dir,
    manifest_path,
    read_manifest,
    remove_leftovers,
    scratch_dir,
    seal,
    write_file,
)
from ..store.paths import LAUNCHERS, cache_dir, check_permissions, module_dirs
from ..store.spec import KernelSpec
from ..store.tvmlib import INSTALL_HINT, CompilerNotInstalledError, compiler_installed

log = logging.getLogger("ce_tvm")


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
        manifest = read_manifest(lib)
    except (OSError, ValueError) as err:
        return f"unreadable manifest {manifest_path(lib)} ({err})"
    key = spec.key()
    if manifest.get("key") != key:
        found = manifest.get("key") if isinstance(manifest.get("key"), dict) else {}
        diff = sorted(k for k in key if found.get(k) != key[k])
        return f"manifest was written for another key (differs in: {', '.join(diff)})"
    return content_problem(lib, manifest)


def write_module(spec: KernelSpec, directory: Path) -> Path:
    """Compile ``spec`` into ``directory`` with its manifest; returns the library path.

    The only place that imports the compiler (``ce_tvm.compiler.build``, TVM)."""
    if not compiler_installed():
        raise CompilerNotInstalledError(
            f"ce_tvm needs the kernel {spec.file_name()}, which is in no module directory "
            f"({os.environ.get('CE_TVM_MODULE_DIR') or 'CE_TVM_MODULE_DIR is unset'}) nor in "
            f"the cache {cache_dir()}, and the TVM compiler is not installed to build it; "
            f"{INSTALL_HINT}")
    from ..compiler.build import compile_spec, cuda_binary, export

    lib = directory / spec.file_name()
    executable = compile_spec(spec)
    compiled = cuda_binary(executable, spec)  # CUDA source checked (and kept) with nvcc
    export(executable, lib)
    fields = {"key": spec.key()}
    if compiled is not None:
        source, binary = compiled
        write_file(lib.with_suffix(".cubin"), binary)
        fields["cuda_binary"] = {"sha256": hashlib.sha256(binary).hexdigest(),
                                 "source_sha256": hashlib.sha256(source.encode()).hexdigest()}
    seal(lib, **fields)
    return lib


def export_module(spec: KernelSpec, directory: Path) -> tuple[Path, bool]:
    """``spec``'s module in ``directory`` (``ce-tvm compile --out``, bundles): kept
    when it is there and verified, else copied from the cache when it is there
    and verified, else built there. Returns ``(library path, whether it was built)``."""
    lib = directory / spec.file_name()
    if check_module(lib, spec) is None:
        return lib, False
    cached = cache_dir() / spec.file_name()
    if cached.parent != directory and check_module(cached, spec) is None:
        for path in (cached, manifest_path(cached), cached.with_suffix(".cubin")):
            if path.exists():
                copy_file(path, directory / path.name)
        return lib, False
    return write_module(spec, directory), True


def cuda_binary_of(lib: Path) -> tuple[str, bytes] | None:
    """``(SHA-256 of the CUDA source, cubin)`` stored beside a verified CUDA module
    (``write_module`` on a host without a GPU), checked against its manifest;
    ``None`` when the module has none."""
    entry = read_manifest(lib).get("cuda_binary")
    if entry is None:
        return None
    path = lib.with_suffix(".cubin")
    check_permissions(path)
    binary = path.read_bytes()
    if hashlib.sha256(binary).hexdigest() != entry["sha256"]:
        raise ModuleIntegrityError(f"refusing to load {path}: SHA-256 mismatch with "
                                   f"{manifest_path(lib)}")
    return entry["source_sha256"], binary


def find_precompiled(spec: KernelSpec) -> Path | None:
    """The module for ``spec`` in a precompiled directory, verified; ``None`` if absent."""
    for directory in module_dirs():
        check_permissions(directory)
        lib = directory / spec.file_name()
        problem = check_module(lib, spec)
        if problem == "missing":
            continue
        if problem:
            raise ModuleIntegrityError(
                f"refusing to load {lib}: {problem}. The directory is damaged: make it again "
                "with `ce-tvm bundle` (or `ce-tvm compile --out`)")
        return lib
    return None


def ensure_cached(spec: KernelSpec) -> Path:
    """The verified cached module for ``spec``, built (once across processes) if
    needed; built for this process only when the cache cannot be written."""
    directory = cache_dir()
    lib = directory / spec.file_name()
    try:
        make_private_dir(directory)
        if check_module(lib, spec) is None:
            return lib
        with build_lock(lib):
            problem = check_module(lib, spec)
            if problem is None:
                return lib
            if problem != "missing":
                log.warning("ce_tvm: rebuilding cached module %s: %s", lib.name, problem)
            remove_leftovers(lib)
            log.info("ce_tvm: compiling %s", lib.name)
            return write_module(spec, directory)
    except CacheWriteError as err:
        return _build_outside_cache(spec, err)


def _build_outside_cache(spec: KernelSpec, err: CacheWriteError) -> Path:
    """``spec``'s module in this process's scratch directory (built there if needed)."""
    directory = scratch_dir()
    lib = directory / spec.file_name()
    if check_module(lib, spec) is None:
        return lib
    log.warning("ce_tvm: the module cache cannot be written (%s); building %s for this "
                "process only in %s", err, lib.name, directory)
    return write_module(spec, directory)


def entries(directory: Path) -> list[Path]:
    """The compiled modules in ``directory``."""
    return sorted(directory.glob("*.so")) if directory.is_dir() else []


def verify_entry(lib: Path) -> str | None:
    """``None`` when ``lib`` matches its manifest and the key in its name, else why not."""
    try:
        check_permissions(lib)
        manifest = read_manifest(lib)
    except (OSError, ValueError) as err:
        return str(err)
    key_hash = hashlib.sha256(json.dumps(manifest.get("key"), sort_keys=True).encode())
    if not lib.stem.endswith(key_hash.hexdigest()[:16]):
        return "manifest key does not match the file name"
    problem = content_problem(lib, manifest)
    if problem:
        return problem
    try:
        cuda_binary_of(lib)
    except (OSError, ModuleIntegrityError) as err:
        return str(err)
    return None


def clear(directory: Path) -> int:
    """Remove every module, manifest, lock and OpenMP launcher (``ce_tvm.runtime.omp_pool``)
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
