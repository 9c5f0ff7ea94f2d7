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
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

from .build import KernelSpec, compile_spec, export_atomically

log = logging.getLogger("ce_tvm")


class ModuleIntegrityError(RuntimeError):
    """A precompiled module does not match its manifest or the expected key."""


def cache_dir() -> Path:
    """``$CE_TVM_CACHE``, else ``$XDG_CACHE_HOME/ce_tvm``, else ``~/.cache/ce_tvm``."""
    env = os.environ.get("CE_TVM_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ce_tvm"


def module_dirs() -> list[Path]:
    """Precompiled directories to look in first: ``$CE_TVM_MODULE_DIR`` (``os.pathsep``-separated)."""
    env = os.environ.get("CE_TVM_MODULE_DIR", "")
    return [Path(p) for p in env.split(os.pathsep) if p]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_path(lib: Path) -> Path:
    return lib.with_suffix(".json")


def check_module(lib: Path, spec: KernelSpec) -> str | None:
    """``None`` when ``lib`` is loadable for ``spec``, else what is wrong with it."""
    if not lib.exists():
        return "missing"
    try:
        manifest = json.loads(manifest_path(lib).read_text())
    except (OSError, ValueError) as err:
        return f"unreadable manifest {manifest_path(lib)} ({err})"
    if manifest.get("key") != spec.key():
        diff = sorted(k for k in spec.key() if manifest.get("key", {}).get(k) != spec.key()[k])
        return f"manifest was written for another key (differs in: {', '.join(diff)})"
    digest = sha256_file(lib)
    if manifest.get("sha256") != digest:
        return f"SHA-256 mismatch (manifest {manifest.get('sha256')}, file {digest})"
    return None


def write_module(spec: KernelSpec, directory: Path) -> Path:
    """Compile ``spec`` into ``directory`` with its manifest; returns the library path."""
    lib = directory / spec.file_name()
    export_atomically(compile_spec(spec), lib)
    manifest = {"key": spec.key(), "sha256": sha256_file(lib)}
    tmp = lib.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, manifest_path(lib))
    return lib


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and parents) with mode 0700 for the new directories."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


@contextlib.contextmanager
def _build_lock(lib: Path):
    with open(lib.with_suffix(".lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def find_precompiled(spec: KernelSpec) -> Path | None:
    """The module for ``spec`` in a precompiled directory, verified; ``None`` if absent."""
    for directory in module_dirs():
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
    with _build_lock(lib):
        problem = check_module(lib, spec)
        if problem is None:
            return lib
        if problem != "missing":
            log.warning("ce_tvm: rebuilding cached module %s: %s", lib.name, problem)
        log.info("ce_tvm: compiling %s", lib.name)
        return write_module(spec, directory)


def module_path(spec: KernelSpec) -> Path:
    """Where the module for ``spec`` comes from: a precompiled directory, else the cache."""
    return find_precompiled(spec) or ensure_cached(spec)
