"""The cache as a trust boundary: permissions, concurrency, stale locks, the cache CLI."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import ce_tvm
from ce_tvm.runtime.cache import ensure_cached
from ce_tvm.store.files import build_lock
from ce_tvm.store.paths import UnsafePermissionsError, check_permissions
from ce_tvm.store.spec import KernelSpec
from ce_tvm.testing import reference
from support import CLI, PROBE, Forked, assert_close, failing_probe, probe, run

# one worker for the cache modules and test_bundle: they share the compiled_cache fixture
# slow: processes: probes, the cache command line
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cache")]


def test_writable_cache_directory_is_refused(tmp_path):
    """A fresh process's first call refuses a cache directory others can write."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    err = failing_probe(7, CE_TVM_CACHE=cache)
    assert "UnsafePermissionsError" in err and str(cache) in err
    assert f"chmod go-w {cache}" in err


@pytest.mark.parametrize("mode", [0o770, 0o707])
def test_group_or_other_writable_cache_directory_is_refused(tmp_path, monkeypatch, mode):
    """Writable by the group or by others alone is refused too (in this process:
    the path from a call to the check is the one above)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    monkeypatch.setenv("CE_TVM_CACHE", str(cache))
    with pytest.raises(UnsafePermissionsError, match=f"chmod go-w {cache}"):
        ensure_cached(KernelSpec("forward", "float32", 7))


def test_writable_precompiled_module_is_refused(precompiled_modules, tmp_path):
    modules = tmp_path / "modules"
    shutil.copytree(precompiled_modules, modules)
    lib = next(modules.glob("*forward*mean-nw-lp-" + "?" * 16 + ".so"))  # what the probe loads
    lib.chmod(0o666)
    err = failing_probe(11, CE_TVM_CACHE=tmp_path / "cache", CE_TVM_MODULE_DIR=modules)
    assert "UnsafePermissionsError" in err and lib.name in err and "others can write" in err


def test_new_cache_directories_are_private(tmp_path):
    cache = tmp_path / "a" / "b" / "cache"
    probe(5, CE_TVM_CACHE=cache)
    assert cache.stat().st_mode & 0o777 == 0o700
    for lib in cache.glob("*.so"):
        assert lib.stat().st_mode & 0o077 == 0
        check_permissions(lib)


def test_four_processes_on_an_empty_cache_build_each_module_once(tmp_path):
    cache = tmp_path / "cache"
    done = [p.result() for p in [Forked(PROBE, 21, CE_TVM_CACHE=cache) for _ in range(4)]]
    for d in done:
        assert d.returncode == 0 and "probe ok" in d.stdout, d.stderr
    built = [line for d in done for line in d.stdout.splitlines() if line.startswith("BUILT")]
    assert len(built) == len(set(built)) == 3  # forward, backward and training, once each


def test_lock_left_by_a_killed_build_does_not_block(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    spec_code = ("from ce_tvm.store.spec import KernelSpec; "
                 "from ce_tvm.store.files import build_lock; "
                 "import pathlib, time, sys; lib = pathlib.Path(sys.argv[1]) / "
                 "KernelSpec('forward', 'float32', 9).file_name(); "
                 "cm = build_lock(lib); cm.__enter__(); print('locked', flush=True); "
                 "time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", spec_code, str(cache)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    t0 = time.monotonic()
    assert "probe ok" in probe(9, CE_TVM_CACHE=cache, CE_TVM_LOCK_TIMEOUT=60)
    assert time.monotonic() - t0 < 60


def test_live_lock_holder_times_out_with_a_clear_error(tmp_path):
    lib = tmp_path / KernelSpec("forward", "float32", 9).file_name()
    with build_lock(lib):
        holder_done = threading.Event()
        errors = []

        def contender():
            try:
                with build_lock(lib, timeout_s=0.3):
                    pass
            except TimeoutError as err:
                errors.append(str(err))
            holder_done.set()

        threading.Thread(target=contender).start()
        assert holder_done.wait(10)
    assert errors and "CE_TVM_LOCK_TIMEOUT" in errors[0]


def test_four_threads_calling_concurrently():
    results, errors = {}, []

    def worker(i):
        try:
            gen = torch.Generator().manual_seed(i)
            x = torch.randn(300, 1000 + i, generator=gen)
            y = torch.randint(0, 1000 + i, (300,), generator=gen)
            for _ in range(5):
                out = ce_tvm.cross_entropy_loss(x, y, reduction="none", label_smoothing=0.1)
            results[i] = (x, y, out)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for x, y, out in results.values():
        ref_loss, ref_lp, _, _ = reference.forward(x.double().numpy(), y.numpy(), None, "none",
                                                   -100, 0.1)
        assert_close(out[0], ref_loss, 1e-5, "loss")
        assert_close(out[1], ref_lp, 1e-5, "log_prob")


def test_cache_cli_list_verify_clear(tmp_path):
    cache = tmp_path / "cache"
    probe(6, CE_TVM_CACHE=cache)
    listed = run([CLI, "cache", "list"], CE_TVM_CACHE=cache)
    assert "3 modules in" in listed
    assert "forward-float32-C6" in listed and "train-float32-C6" in listed
    assert "0 bad" in run([CLI, "cache", "verify"], CE_TVM_CACHE=cache)
    lib = next(cache.glob("*backward*.so"))
    lib.write_bytes(lib.read_bytes()[:-1] + b"x")
    done = subprocess.run([CLI, "cache", "verify"], capture_output=True, text=True,
                          env={**os.environ, "CE_TVM_CACHE": str(cache)})
    assert done.returncode == 1 and f"BAD  {lib.name}: SHA-256 mismatch" in done.stdout
    assert "removed" in run([CLI, "cache", "clear"], CE_TVM_CACHE=cache)
    assert list(cache.glob("*")) == []


def test_check_permissions_message(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    d.chmod(0o775)
    with pytest.raises(UnsafePermissionsError, match="group can write it"):
        check_permissions(d)
