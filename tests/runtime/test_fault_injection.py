"""Faults a user's machine can put in the cache's way, each in a fresh process.

Every case: the loss is right (checked against torch in the process), or the
error is clear; the process never dies of a signal. The cases: the system
temp directory and the cache on different filesystems, a full cache
filesystem, every kind of cached file truncated, zeroed or replaced by
garbage, a build killed with SIGKILL, a read-only cache (pre-built, or
empty), four processes starting on an empty cache.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from support import Forked

# its module fixture and mounts: every test of the module on one worker
# slow: processes: each fault in a fresh one
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("faults")]

C = 13


# The case's process: the forward on C classes, checked against torch. Its
# environment's PATCH (optional) is code run before the call, to make the
# process fail where a test wants it to.
PROBE = textwrap.dedent(f"""
    import os, signal, torch
    import ce_tvm
    import ce_tvm.runtime.cache as cache
    import ce_tvm.store.files as files
    write_module = cache.write_module
    def reporting_write(spec, directory):
        print("BUILT", directory / spec.file_name(), flush=True)
        return write_module(spec, directory)
    cache.write_module = reporting_write
    exec(os.environ.get("PATCH", ""))
    x = torch.randn(8, {C}, dtype=torch.float64).float()
    y = torch.randint(0, {C}, (8,))
    torch.testing.assert_close(ce_tvm.cross_entropy(x, y), torch.nn.functional.cross_entropy(x, y))
    print("probe ok", flush=True)
""")


# Kills the process halfway through writing the file whose name holds WHAT, or
# (WHAT=manifest) when a kernel's manifest is to be written.
KILL_WHILE_WRITING = textwrap.dedent("""
    copy = files.shutil.copyfile
    def dying_copy(src, dst):
        copy(src, dst)
        if os.environ["WHAT"] in str(dst):
            os.truncate(dst, os.path.getsize(dst) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
    files.shutil.copyfile = dying_copy
    seal = files.seal
    def dying_seal(lib, **fields):
        if os.environ["WHAT"] == "manifest":
            os.kill(os.getpid(), signal.SIGKILL)
        seal(lib, **fields)
    cache.seal = dying_seal
""")


def start(cache: Path, **env) -> Forked:
    """The probe forked (``support.Forked``: no state of ce_tvm's crosses cases,
    and a case costs its own work, not 5-7 s of imports), on ``cache``."""
    return Forked(PROBE, CE_TVM_CACHE=cache, **env)


def finish(started: Forked) -> tuple[int, str]:
    """``(exit code, output)``; the exit code is ``-signal`` for a signal."""
    done = started.result()
    return done.returncode, done.stdout + done.stderr


def served(cache: Path, **env) -> str:
    """The probe's output; it must have passed."""
    rc, out = finish(start(cache, **env))
    assert rc == 0 and "probe ok" in out, out
    return out


def kernel(cache: Path) -> Path:
    return next(cache.glob(f"llvm-forward-float32-C{C}-*.so"))


def launcher(cache: Path) -> Path:
    return next((cache / "launchers").glob("omp-launch-*.so"))


def assert_sound(cache: Path) -> None:
    """Every library in ``cache`` matches its manifest, and no temporary file is left."""
    from ce_tvm.store.files import sealed_problem

    for lib in [*cache.glob("*.so"), *(cache / "launchers").glob("*.so")]:
        assert sealed_problem(lib) is None, lib
    assert not list(cache.rglob("*.tmp"))


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A cache holding the probe's kernel, the launcher and the host descriptor."""
    cache = tmp_path_factory.mktemp("faults") / "cache"
    served(cache)
    return cache


@pytest.fixture
def cache_copy(built_cache, tmp_path) -> Path:
    copy = tmp_path / "cache"
    shutil.copytree(built_cache, copy)
    return copy


@contextlib.contextmanager
def mounted(where: Path, *options: str):
    """A tmpfs (``options`` passed to ``mount``) on ``where``; skips unless we may mount."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options),
                                            "tmpfs", str(where)]).returncode != 0:
        pytest.skip("mounting a filesystem needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


@contextlib.contextmanager
def read_only(directory: Path):
    """``directory`` made read-only for this user: a read-only bind mount as root
    (root writes through any mode), mode 0500 otherwise."""
    if os.geteuid() == 0:
        subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
            yield
        finally:
            subprocess.run(["umount", "-l", str(directory)], check=True)
    else:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)


def test_temp_directory_on_another_filesystem_than_the_cache(tmp_path):
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    cache = tmp_path / "cache"
    served(cache, TMPDIR="/dev/shm")
    assert_sound(cache)
    launcher(cache)  # the launcher crossed filesystems too


def test_cache_on_another_filesystem_than_the_temp_directory(tmp_path):
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    (tmp_path / "tmp").mkdir()
    cache = Path("/dev/shm") / f"ce_tvm_cache_{os.getpid()}_{tmp_path.name}"
    try:
        served(cache, TMPDIR=tmp_path / "tmp")
        assert_sound(cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def test_full_cache_filesystem_builds_for_the_process(tmp_path):
    with mounted(tmp_path / "small", "size=16k", "mode=0700") as small:
        out = served(small / "cache")
        assert "the module cache cannot be written" in out and "No space left" in out
        assert f"BUILT {small}" in out  # tried the cache first, then built elsewhere
        assert not list(small.rglob("*.tmp"))


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "garbage"])
@pytest.mark.parametrize("which", ["kernel", "kernel manifest", "launcher", "launcher manifest",
                                   "host descriptor"])
def test_damaged_cache_file_is_rebuilt(cache_copy, which, damage):
    path = {"kernel": kernel(cache_copy), "launcher": launcher(cache_copy),
            "kernel manifest": kernel(cache_copy).with_suffix(".json"),
            "launcher manifest": launcher(cache_copy).with_suffix(".json"),
            "host descriptor": next(cache_copy.glob("host-*.json"))}[which]
    size = path.stat().st_size
    path.write_bytes({"truncated": path.read_bytes()[: size // 2], "zeroed": bytes(size),
                      "garbage": os.urandom(size)}[damage])
    out = served(cache_copy)
    assert "rebuilding" in out or "rewriting" in out, out
    assert_sound(cache_copy)
    assert "rebuilding" not in served(cache_copy)  # repaired for the next process


@pytest.mark.parametrize("what", ["forward", "omp-launch", "manifest"])
def test_build_killed_midway_then_another_process(tmp_path, what):
    cache = tmp_path / "cache"
    rc, out = finish(start(cache, PATCH=KILL_WHILE_WRITING, WHAT=what))
    assert rc == -signal.SIGKILL, out
    out = served(cache)
    if what == "manifest":  # the library was in place, its manifest was not
        assert "rebuilding cached module" in out
    assert_sound(cache)


def test_read_only_prebuilt_cache_serves(cache_copy):
    with read_only(cache_copy):
        out = served(cache_copy)
    assert "BUILT" not in out and "cannot be written" not in out, out


def test_read_only_empty_cache_builds_for_the_process(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    with read_only(cache):
        out = served(cache)
    assert "the module cache cannot be written" in out, out
    assert list(cache.iterdir()) == []


def test_four_processes_start_on_an_empty_cache(tmp_path):
    cache = tmp_path / "cache"
    results = [finish(p) for p in [start(cache, TMPDIR="/dev/shm") for _ in range(4)]]
    for rc, out in results:
        assert rc == 0 and "probe ok" in out, out
        assert "ce_tvm:" not in out, out  # no warning (a rebuild, a fallback)
    assert sum(out.count("BUILT") for _, out in results) == 1
    assert_sound(cache)


def test_files_are_moved_into_place_only_by_the_helper():
    # ce_tvm.store.files.replacing is the one place that renames or copies a file into
    # a directory: anything else would bring back the cross-device rename.
    root = Path(__file__).resolve().parents[2]
    calls = ("os.replace(", "os.rename(", "shutil.copy", "shutil.move(", "mkstemp(")
    found = [f"{path.relative_to(root)}:{n}" for folder in ("ce_tvm", "schedules")
             for path in (root / folder).rglob("*.py") if path.name != "files.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if any(call in line for call in calls)]
    assert found == []
