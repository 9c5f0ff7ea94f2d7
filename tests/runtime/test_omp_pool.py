"""CPU kernels run their parallel loops on torch's OpenMP threads (``ce_tvm.runtime.omp_pool``)."""

import ctypes
import shutil
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.runtime import omp_pool
from ce_tvm.runtime import registry as runtime
from ce_tvm.runtime.cache import module_path
from support import run

pytestmark = pytest.mark.slow  # processes: the thread pools of fresh interpreters

# One training step and a no-grad forward on the pool CE_TVM_THREAD_POOL names.
STEP = textwrap.dedent("""
    import sys, torch, ce_tvm
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(96, 1000, generator=g) * 4).requires_grad_()
    y = torch.randint(0, 1000, (96,), generator=g); y[::7] = -100
    loss = ce_tvm.cross_entropy(x, y, label_smoothing=0.1)
    loss.backward()
    with torch.no_grad():
        ref = ce_tvm.cross_entropy(x, y, reduction="none", label_smoothing=0.1)
    torch.save((loss.detach(), x.grad, ref), sys.argv[1])
""")

USABLE = (sys.platform == "linux" and shutil.which("cc") is not None
          and "OpenMP" in torch.__config__.parallel_info())


@pytest.mark.skipif(not USABLE, reason="needs Linux, a C compiler and torch built with OpenMP")
def test_loaded_cpu_kernels_launch_on_the_openmp_pool():
    x, y = torch.randn(16, 300, requires_grad=True), torch.randint(0, 300, (16,))
    ce_tvm.cross_entropy(x, y).backward()
    address = omp_pool.launcher_address()
    assert address is not None
    cpu_specs = [s for s in runtime.loaded_specs() if s.target == "llvm"]
    assert cpu_specs
    for spec in cpu_specs:
        pointer = ctypes.c_void_p.in_dll(ctypes.CDLL(str(module_path(spec))),
                                         omp_pool.LAUNCH_POINTER)
        assert pointer.value == address, spec


@pytest.mark.skipif(not USABLE, reason="needs Linux, a C compiler and torch built with OpenMP")
def test_both_pools_give_bit_identical_results(tmp_path):
    results = {}
    for pool in ("torch", "tvm"):
        out = tmp_path / f"{pool}.pt"
        run([sys.executable, "-c", STEP, str(out)], CE_TVM_THREAD_POOL=pool)
        results[pool] = torch.load(out)
    for a, b in zip(results["torch"], results["tvm"]):
        assert torch.equal(a, b)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(96, 1000, generator=g) * 4).requires_grad_()
    y = torch.randint(0, 1000, (96,), generator=g)
    y[::7] = -100
    F.cross_entropy(x, y, label_smoothing=0.1).backward()
    loss, grad, _ = results["torch"]
    torch.testing.assert_close(loss, F.cross_entropy(x.detach(), y, label_smoothing=0.1))
    torch.testing.assert_close(grad, x.grad)


def test_one_torch_thread_still_computes_every_row():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        x, y = torch.randn(37, 513), torch.randint(0, 513, (37,))
        got = ce_tvm.cross_entropy(x, y, reduction="none")
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, F.cross_entropy(x, y, reduction="none"))


@pytest.mark.parametrize("why", ["env", "no compiler"])
def test_without_the_launcher_modules_keep_tvms_pool(monkeypatch, why):
    ce_tvm.cross_entropy(torch.randn(4, 300), torch.randint(0, 300, (4,)))  # a module loaded
    monkeypatch.setattr(omp_pool, "_state", {})
    if why == "env":
        monkeypatch.setenv("CE_TVM_THREAD_POOL", "tvm")
    else:
        monkeypatch.setattr(omp_pool.shutil, "which", lambda _: None)
    assert omp_pool.launcher_address() is None
    assert omp_pool.use_torch_pool(module_path(runtime.loaded_specs()[0])) is False
