"""Module cache and precompiled directories, across processes."""

import json
import shutil
from pathlib import Path

import pytest

from ce_tvm.compiler.build import ahead_of_time_specs
from ce_tvm.store.paths import sha256_file
from support import failing_probe, probe

# one worker for the cache modules and test_bundle: they share the compiled_cache fixture
# slow: processes: the cache is only visible across them
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cache")]


def libs(directory: Path):
    return sorted(directory.glob("*.so"))


def test_compile_then_second_process_reuses_cache(compiled_cache):
    cache, out = compiled_cache  # `ce-tvm compile` into an empty cache
    # 12 forward, 4 training, 12 backward, 18 for probability targets, the forward
    # and training ones again without label smoothing (build.all_specs),
    # and the tuned variants of the shipped records that apply (a probe may load them)
    kernels = ahead_of_time_specs("llvm", "float32", 11)
    assert f"{len(kernels)} kernels" in out
    built = {p: p.stat().st_mtime_ns for p in libs(cache)}
    assert len(built) == len(kernels)
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    probe(11, CE_TVM_CACHE=cache, FORBID_COMPILE=1)
    assert {p: p.stat().st_mtime_ns for p in libs(cache)} == built


@pytest.fixture(scope="module")
def probed_cache(tmp_path_factory):
    """A cache filled by one probe of C = 13 (each test damages a copy)."""
    cache = tmp_path_factory.mktemp("probed") / "cache"
    probe(13, CE_TVM_CACHE=cache)
    return cache


# (a truncated kernel is one of test_fault_injection's damaged files)
@pytest.mark.parametrize("damage", ["flip_bit", "drop_manifest"])
def test_damaged_cache_entry_is_rebuilt(probed_cache, tmp_path, damage):
    cache = tmp_path / "cache"
    shutil.copytree(probed_cache, cache)
    lib = next(p for p in libs(cache) if "forward" in p.name)
    data = lib.read_bytes()
    if damage == "flip_bit":
        lib.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        lib.with_suffix(".json").unlink()
    out = probe(13, CE_TVM_CACHE=cache)
    assert "rebuilding cached module" in out and "probe ok" in out
    manifest = json.loads(lib.with_suffix(".json").read_text())
    assert manifest["sha256"] == sha256_file(lib)


def test_precompiled_directory_is_used_and_checked(precompiled_modules, tmp_path):
    modules, cache = tmp_path / "modules", tmp_path / "cache"
    shutil.copytree(precompiled_modules, modules)
    probe(11, CE_TVM_CACHE=cache, CE_TVM_MODULE_DIR=modules, FORBID_COMPILE=1)
    assert libs(cache) == []  # nothing was built or copied into the cache

    lib = next(p for p in libs(modules) if "backward" in p.name and "-mean-nw-log_prob" in p.name)
    data = lib.read_bytes()  # same size, one bit flipped: only the SHA-256 tells
    lib.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    err = failing_probe(11, CE_TVM_CACHE=cache, CE_TVM_MODULE_DIR=modules)
    assert "ModuleIntegrityError" in err and lib.name in err
    assert "SHA-256 mismatch" in err
