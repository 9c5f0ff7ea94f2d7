import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_module_cache(tmp_path_factory):
    """Compile into a cache private to this test run unless CE_TVM_CACHE is set.

    Every test of the run shares it, the workers of ``pytest -n`` too (the
    cache's build locks make each kernel compile once across processes).
    """
    if "CE_TVM_CACHE" not in os.environ:
        base = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):  # base is the run's folder / the worker's
            base = base.parent
        os.environ["CE_TVM_CACHE"] = str(base / "ce_tvm_cache")
    yield


@pytest.fixture(scope="session")
def compiled_cache(tmp_path_factory):
    """``(cache, output)``: a private cache that ``ce-tvm compile`` filled with every
    kernel for float32 C=11. Tests read it, never change it."""
    from support import CLI, run

    cache = tmp_path_factory.mktemp("compiled") / "cache"
    return cache, run([CLI, "compile", "--dtype", "float32", "--classes", "11"],
                      CE_TVM_CACHE=cache)


@pytest.fixture(scope="session")
def precompiled_modules(compiled_cache, tmp_path_factory):
    """Every kernel for float32 C=11 in a directory made by ``ce-tvm compile --out``,
    which copies them from ``compiled_cache`` (nothing is built twice); tests
    that change it work on a copy."""
    from support import CLI, run

    cache, _ = compiled_cache
    out = tmp_path_factory.mktemp("precompiled") / "modules"
    text = run([CLI, "compile", "--dtype", "float32", "--classes", "11", "--out", out],
               CE_TVM_CACHE=cache)
    assert f"CE_TVM_MODULE_DIR={out}" in text
    assert "\n0 built, " in text, text  # copied from the cache
    return out


@pytest.fixture
def one_rank():
    """A gloo world of one in this process (a one-rank mesh), torn down after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    """Slow tests last, so ``-x`` stops on a cheap failure first.

    ``slow`` (the fast lane is ``-m "not slow"``) marks, in its module or on the
    test, every test that starts a process (``subprocess``, ``support.Forked``,
    the command line through ``support.run``, ranks, torchrun), calls nvcc or
    takes over 10 s with a warm kernel cache: the fast lane is the in-process
    checks of the kernels against the references."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)
