"""Where compiled modules live, and whether a path may be trusted, without TVM.

The module cache (``$CE_TVM_CACHE``, else ``$XDG_CACHE_HOME/ce_tvm``, else
``~/.cache/ce_tvm``) and the precompiled directories of
``$CE_TVM_MODULE_DIR`` (``os.pathsep``-separated; ``use_bundle`` adds one).
Loading a shared library runs its code, so, like OpenSSH's StrictModes, a
file or directory that anyone but its owner can write is refused.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

BUNDLE_MANIFEST = "bundle.json"
LAUNCHERS = "launchers"  # the cache's subdirectory for ce_tvm.runtime.omp_pool's launcher


class UnsafePermissionsError(PermissionError):
    """A module, manifest or directory that someone else could have written."""


def check_permissions(path: Path) -> None:
    """Refuse ``path`` unless only its owner (this user, or root) can write it.

    Loading a shared library runs its code, so, like OpenSSH's StrictModes,
    a directory or file that group or others can write is not trusted.
    """
    st = path.stat()
    why = None
    if st.st_uid not in (os.getuid(), 0):
        why = f"it is owned by uid {st.st_uid}, not by you (uid {os.getuid()}) or root"
    elif st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002))
                           if st.st_mode & bit)
        why = f"{who} can write it (mode {oct(st.st_mode & 0o777)})"
    if why:
        fix = f"chmod go-w {path}" if "write" in why else f"chown {os.getuid()} {path}"
        raise UnsafePermissionsError(
            f"ce_tvm refuses to load compiled modules from {path}: {why}. Fix it with: {fix}")


def cache_dir() -> Path:
    """``$CE_TVM_CACHE``, else ``$XDG_CACHE_HOME/ce_tvm``, else ``~/.cache/ce_tvm``."""
    env = os.environ.get("CE_TVM_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ce_tvm"


def module_dirs() -> list[Path]:
    """Precompiled directories to look in first: ``$CE_TVM_MODULE_DIR``
    (``os.pathsep``-separated)."""
    env = os.environ.get("CE_TVM_MODULE_DIR", "")
    return [Path(p) for p in env.split(os.pathsep) if p]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def use_bundle(directory) -> None:
    """Load kernels (and, without apache-tvm, the TVM runtime) from the bundle
    ``directory`` (made by ``ce-tvm bundle``) before any other module directory.

    Call it before the first ce_tvm kernel runs in the process.
    """
    path = Path(directory)
    if not (path / BUNDLE_MANIFEST).is_file():
        raise FileNotFoundError(f"{path} is not a ce_tvm bundle (no {BUNDLE_MANIFEST}); "
                                "make one with: ce-tvm bundle --out DIR ...")
    check_permissions(path)
    os.environ["CE_TVM_MODULE_DIR"] = os.pathsep.join(
        [str(path)] + [str(d) for d in module_dirs() if d != path])


def bundle_dirs() -> list[Path]:
    """The module directories that are bundles (hold a ``bundle.json``)."""
    return [d for d in module_dirs() if (d / BUNDLE_MANIFEST).is_file()]
