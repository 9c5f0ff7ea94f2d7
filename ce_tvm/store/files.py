"""Writing files into the cache, bundles and tuning log directories, and
checking them before anything is mapped, without TVM.

- ``replacing(path)``: every such file is written through it. The data goes
  to a temporary file in ``path``'s own directory (so the same filesystem,
  whatever ``TMPDIR`` is), is fsynced, then renamed onto ``path``: a reader
  sees the old file or the whole new one, a killed writer leaves only a
  ``.*.tmp`` file behind. A failure to write (full disk, read-only or
  unwritable directory) is a ``CacheWriteError`` naming the file.
- Sealed files: a shared library and its manifest ``<stem>.json`` holding
  its size and SHA-256 (``seal``, ``content_problem``); a library is mapped
  only when both match, since mapping a truncated one kills the process
  (SIGBUS).
- ``build_lock``: one builder per file across processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from .paths import check_permissions, sha256_file


class CacheWriteError(OSError):
    """A file could not be written into the cache, a bundle or a tuning log directory."""


class ModuleIntegrityError(RuntimeError):
    """A file in a precompiled directory or bundle does not match its manifest."""


def _write_error(path: Path, err: OSError) -> CacheWriteError:
    return CacheWriteError(
        err.errno, f"ce_tvm could not write {path}: {err.strerror or err}. Free space there, "
        "make it writable, or point CE_TVM_CACHE at a writable directory")


@contextlib.contextmanager
def replacing(path: Path, mode: int = 0o600):
    """Yield a temporary path in ``path``'s directory to write; on a clean exit
    it gets ``mode``, is fsynced and renamed onto ``path``. Nothing is left on
    error; an ``OSError`` becomes ``CacheWriteError``."""
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as err:
        raise _write_error(path, err) from err
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_directory(path.parent)
    except OSError as err:
        raise _write_error(path, err) from err
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be fsynced)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and parents) with mode 0700; refuse an existing unsafe one.
    One that cannot be created is a ``CacheWriteError``."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise _write_error(path, err) from err
    check_permissions(path)


def write_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` through ``replacing``."""
    with replacing(path, mode) as tmp:
        tmp.write_bytes(data)


def copy_file(src: Path, dst: Path, mode: int = 0o600) -> None:
    """Copy ``src`` to ``dst`` through ``replacing``."""
    with replacing(dst, mode) as tmp:
        shutil.copyfile(src, tmp)


def manifest_path(lib: Path) -> Path:
    return lib.with_suffix(".json")


def fingerprint(path: Path) -> dict:
    """``{"sha256", "size"}`` of ``path``, as manifests hold them."""
    return {"sha256": sha256_file(path), "size": path.stat().st_size}


def content_problem(path: Path, expected: dict) -> str | None:
    """``None`` when ``path`` has ``expected``'s size and SHA-256, else what differs."""
    size = path.stat().st_size
    if expected.get("size", size) != size:
        return f"size {size} bytes, manifest says {expected['size']}"
    digest = sha256_file(path)
    if expected.get("sha256") != digest:
        return f"SHA-256 mismatch (manifest {expected.get('sha256')}, file {digest})"
    return None


def seal(lib: Path, **fields) -> None:
    """Write ``lib``'s manifest: ``fields`` and ``lib``'s size and SHA-256."""
    manifest = {**fields, **fingerprint(lib)}
    write_file(manifest_path(lib), json.dumps(manifest, indent=1, sort_keys=True).encode())


def read_manifest(lib: Path) -> dict:
    """``lib``'s manifest; raises ``OSError`` or ``ValueError`` when it is unreadable."""
    manifest = json.loads(manifest_path(lib).read_text())
    if not isinstance(manifest, dict):
        raise ValueError("not a JSON object")
    return manifest


def sealed_problem(lib: Path) -> str | None:
    """``None`` when ``lib`` and its manifest agree, ``"missing"`` when ``lib``
    is absent, else what is wrong."""
    if not lib.exists():
        return "missing"
    try:
        manifest = read_manifest(lib)
    except (OSError, ValueError) as err:
        return f"unreadable manifest {manifest_path(lib)} ({err})"
    return content_problem(lib, manifest)


def remove_leftovers(lib: Path) -> None:
    """Remove what killed writers of ``lib`` and of its siblings (manifest, binary)
    left behind; call it holding ``build_lock(lib)``."""
    for tmp in lib.parent.glob(f".{lib.stem}.*.tmp"):
        tmp.unlink(missing_ok=True)


LOCK_TIMEOUT_S = float(os.environ.get("CE_TVM_LOCK_TIMEOUT", 900))


@contextlib.contextmanager
def build_lock(lib: Path, timeout_s: float = LOCK_TIMEOUT_S):
    """Exclusive lock for building ``lib``, shared by every process using the directory.

    An ``flock`` dies with its holder, so a lock left by a killed build never
    blocks the next one; a live holder is waited for up to ``timeout_s``.
    A lock file that cannot be created raises ``CacheWriteError``.
    """
    lock = lib.with_suffix(".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        raise _write_error(lock, err) from err
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process has held {lock} for more than "
                        f"{timeout_s:.0f} s (set CE_TVM_LOCK_TIMEOUT to wait longer)") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


_scratch: list[Path] = []


def scratch_dir() -> Path:
    """A private directory of this process in the system temp directory,
    removed at exit: where files go when the cache cannot be written."""
    if not _scratch:
        import atexit

        path = Path(tempfile.mkdtemp(prefix="ce_tvm-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _scratch.append(path)
    return _scratch[0]
