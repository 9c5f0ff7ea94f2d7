"""Bundles (``ce-tvm bundle``) run with the TVM compiler unavailable.

A fresh process blocks ``import tvm`` (a meta-path finder whose module
specs for ``tvm`` and ``tvm.*`` raise ImportError when loaded; they have no
files, as if the package were not installed, so that ``find_spec`` callers
such as torch's dynamo keep working), runs the training path and the seed
pair from a bundle and checks them against torch and the float64 reference,
and checks that the compiler library was never mapped.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from ce_tvm.store.files import fingerprint
from ce_tvm.store.paths import sha256_file
from support import CLI, DISTILL_PROBE, run

# its bundles are built once (session fixtures), the CPU one from compiled_cache: every
# test of the module on the cache modules' worker
# slow: processes: the command line builds bundles, fresh interpreters run them
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cache")]

C = 11  # the bundle takes its kernels from conftest's compiled_cache (nothing is built twice)
BLOCK_TVM = textwrap.dedent("""
    import importlib.machinery, sys
    class BlockTVM:
        def find_spec(self, name, path=None, target=None):
            if name == "tvm" or name.startswith("tvm."):
                return importlib.machinery.ModuleSpec(name, self)
            return None
        def create_module(self, spec):
            raise ImportError(f"{spec.name} is blocked in this test")
        def exec_module(self, module):
            raise ImportError(f"{module.__name__} is blocked in this test")
    sys.meta_path.insert(0, BlockTVM())
""")
PROBE = BLOCK_TVM + textwrap.dedent("""
    import numpy as np, torch, torch.nn.functional as F
    import ce_tvm
    from ce_tvm.testing import reference
    c = int(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(16, c) * 2; y = torch.randint(0, c, (16,)); y[3] = -100
    w = torch.rand(c) + 0.5
    for weight in (None, w):
        for reduction in ("mean", "sum", "none"):  # one-pass kernel; none: forward + backward
            xt = x.clone().requires_grad_(); xr = x.clone().requires_grad_()
            loss = ce_tvm.cross_entropy(xt, y, weight, reduction=reduction, label_smoothing=0.1)
            loss.sum().backward()
            ref = F.cross_entropy(xr, y, weight, reduction=reduction, label_smoothing=0.1)
            ref.sum().backward()
            torch.testing.assert_close(loss, ref); torch.testing.assert_close(xt.grad, xr.grad)
    loss, log_prob, _, _ = ce_tvm.cross_entropy_loss(x, y, w, label_smoothing=0.1)
    grad = ce_tvm.cross_entropy_loss_grad(torch.ones(1), log_prob, y, w, label_smoothing=0.1)
    ref_loss, ref_lp, _, _ = reference.forward(x.double().numpy(), y.numpy(), w.double().numpy(),
                                               label_smoothing=0.1)
    ref_grad = reference.backward(np.ones(1), ref_lp, y.numpy(), w.double().numpy(),
                                  label_smoothing=0.1)
    np.testing.assert_allclose(loss.double().numpy(), np.reshape(ref_loss, -1), rtol=1e-5)
    np.testing.assert_allclose(grad.double().numpy(), ref_grad, rtol=1e-4, atol=1e-7)
    maps = open("/proc/self/maps").read()
    assert "libtvm_compiler" not in maps, "the compiler library was mapped"
    runtime = sorted({l.split()[-1] for l in maps.splitlines() if "libtvm_runtime" in l})
    assert not [m for m in sys.modules if m == "tvm" or m.startswith("tvm.")]
    # torch imports torch._dynamo (1.3 s) on a custom op's first call unless deferred
    assert "torch._dynamo" not in sys.modules, "a custom op imported torch._dynamo"
    print("RUNTIME", runtime)
    print("probe ok")
""")


@pytest.fixture(scope="session")
def bundle(compiled_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "b"
    text = run([CLI, "bundle", "--target", "llvm", "--dtype", "float32", "--classes", str(C),
                "--out", out], CE_TVM_CACHE=compiled_cache[0])
    assert f"CE_TVM_MODULE_DIR={out}" in text
    return out


def probe(c, program=PROBE, **env):
    full = {**os.environ, **{k: str(v) for k, v in env.items()}}
    return subprocess.run([sys.executable, "-c", program, str(c)], env=full,
                          capture_output=True, text=True, timeout=600)


def test_bundle_contents(bundle):
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["runtime_libs"] == {"libtvm_runtime.so":
                                        fingerprint(bundle / "lib" / "libtvm_runtime.so")}
    kernels = sorted(p.name for p in bundle.glob("*.so"))
    # 12 fwd, 4 train, 12 bwd; probability targets: 6 fwd, 6 bwd, 6 target-grad; the
    # 16 fwd and train again without label smoothing, and the 7 kernels that compute
    # a call again where a row is not finite (build.exact_path_specs)
    assert sorted(manifest["kernels"]) == kernels and len(kernels) == 69
    assert (bundle / "licenses" / "apache-tvm-LICENSE").is_file()
    assert (bundle / "licenses" / "apache-tvm-NOTICE").is_file()
    assert len(list(bundle.glob("host-*.json"))) == 1
    for path in [bundle, *bundle.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), path
    out = run([CLI, "cache", "verify", "--dir", bundle])
    assert "69 modules" in out and ", 0 bad" in out


def test_runs_from_bundle_without_the_compiler(bundle, tmp_path):
    # An empty private cache: every kernel and the TVM runtime come from the bundle.
    done = probe(C, CE_TVM_MODULE_DIR=bundle, CE_TVM_CACHE=tmp_path / "cache")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "probe ok" in done.stdout
    assert f"RUNTIME ['{bundle / 'lib' / 'libtvm_runtime.so'}']" in done.stdout


def test_missing_kernel_without_the_compiler_says_how_to_get_it(bundle, tmp_path):
    done = probe(C + 1, CE_TVM_MODULE_DIR=bundle, CE_TVM_CACHE=tmp_path / "cache")
    assert done.returncode != 0
    assert "CompilerNotInstalledError" in done.stderr
    assert "ce-tvm bundle" in done.stderr and "pip install apache-tvm" in done.stderr
    assert f"C{C + 1}" in done.stderr  # names the kernel it looked for


def test_no_bundle_and_no_compiler_says_how_to_get_it(tmp_path):
    done = probe(C, CE_TVM_CACHE=tmp_path / "cache", CE_TVM_MODULE_DIR="")
    assert done.returncode != 0
    assert "ce-tvm bundle" in done.stderr and "pip install apache-tvm" in done.stderr


@pytest.mark.parametrize("which", ["runtime library", "kernels", "kernel manifests",
                                   "host descriptor"])
def test_damaged_bundle_file_is_a_clear_error(bundle, tmp_path, which):
    # A bundle is read-only by design: nothing is rebuilt, the error names the
    # file and how to make the bundle again; the process never dies of a signal.
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    damaged = {"runtime library": [copy / "lib" / "libtvm_runtime.so"],
               "kernels": list(copy.glob("*.so")),
               "kernel manifests": [p.with_suffix(".json") for p in copy.glob("*.so")],
               "host descriptor": list(copy.glob("host-*.json"))}[which]
    for path in damaged:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    done = probe(C, CE_TVM_MODULE_DIR=copy, CE_TVM_CACHE=tmp_path / "cache")
    assert done.returncode == 1, done.stderr
    assert "ModuleIntegrityError" in done.stderr and "ce-tvm bundle" in done.stderr
    assert any(str(p.with_suffix("")) in done.stderr for p in damaged), done.stderr


def test_distill_bundle_runs_the_distillation_losses_without_the_compiler(compiled_cache,
                                                                         tmp_path):
    """``--distill`` adds the 6 divergence kernels (3 directions x with and without
    the gradient); both distillation losses then run from the bundle alone."""
    out = tmp_path / "b"
    run([CLI, "bundle", "--classes", str(C), "--distill", "--out", out],
        CE_TVM_CACHE=compiled_cache[0])
    kernels = json.loads((out / "bundle.json").read_text())["kernels"]
    assert len(kernels) == 69 + 6 and sum("-divergence-" in k for k in kernels) == 6
    done = probe(C, BLOCK_TVM + DISTILL_PROBE, CE_TVM_MODULE_DIR=out,
                 CE_TVM_CACHE=tmp_path / "cache")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "distill probe ok" in done.stdout


def make_cuda_bundle(out, classes):
    args = [CLI, "bundle", "--target", "cuda", "--arch", "sm_90", "--dtype", "bfloat16"]
    run(args + [a for c in classes for a in ("--classes", str(c))] + ["--out", out])
    return out


# An LM vocabulary (its rows end in an overlapping chunk); test_cuda builds the
# CUDA kernels of larger ones (256000) with nvcc.
LM_CLASSES = (32000,)
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.fixture(scope="session")
def cuda_bundle(tmp_path_factory):
    return make_cuda_bundle(tmp_path_factory.mktemp("cuda_bundle") / "b", LM_CLASSES)


@pytest.mark.slow
@needs_nvcc
def test_cuda_bundle_of_lm_vocabularies(cuda_bundle):
    """sm_90, bfloat16, C=32000: every kernel with its cubin, under 20 MB per C."""
    check_cuda_bundle(cuda_bundle, LM_CLASSES)


def check_cuda_bundle(cuda_bundle, classes):
    manifest = json.loads((cuda_bundle / "bundle.json").read_text())
    assert (manifest["target"], manifest["arch"], manifest["dtype"]) == ("cuda", "sm_90",
                                                                        "bfloat16")
    libs = {"libtvm_runtime.so", "libtvm_runtime_cuda.so"}
    assert manifest["runtime_libs"] == {n: fingerprint(cuda_bundle / "lib" / n) for n in libs}
    kernels = sorted(p.name for p in cuda_bundle.glob("*.so"))
    assert sorted(manifest["kernels"]) == kernels
    # per C: 12 forward, 4 training (gpu_check times them), 12 backward variants,
    # 18 for probability targets, the 16 forward and training ones again without
    # label smoothing
    assert len(kernels) == 62 * len(classes)
    for name in kernels:
        lib = cuda_bundle / name
        entry = json.loads(lib.with_suffix(".json").read_text())
        assert entry["sha256"] == sha256_file(lib)
        assert entry["key"]["target"] == {"kind": "cuda", "arch": "sm_90"}
        assert entry["key"]["dtype"] == "bfloat16"
        assert entry["key"]["classes"] in classes
        cubin = lib.with_suffix(".cubin").read_bytes()  # what runs where TVM cannot compile
        assert cubin[:4] == b"\x7fELF" and entry["cuda_binary"]["sha256"] == sha256_file(
            lib.with_suffix(".cubin"))
    total = sum(p.stat().st_size for p in cuda_bundle.rglob("*") if p.is_file())
    assert total < 20e6 * len(classes), f"{total / 1e6:.1f} MB"
    out = run([CLI, "cache", "verify", "--dir", cuda_bundle])
    assert f"{len(kernels)} modules" in out and ", 0 bad" in out


CALLBACK_PROBE = BLOCK_TVM + textwrap.dedent("""
    import tvm_ffi
    from pathlib import Path
    from ce_tvm.runtime.cache import cuda_binary_of
    from ce_tvm.store.tvmlib import provide_cuda_binary
    lib = Path(sys.argv[1])
    provide_cuda_binary(*cuda_binary_of(lib))
    compile_cuda = tvm_ffi.get_global_func("tvm_callback_cuda_compile")
    binary = bytes(compile_cuda(Path(sys.argv[2]).read_text()))
    assert binary == lib.with_suffix(".cubin").read_bytes()
    try:
        compile_cuda("__global__ void other() {}")
    except Exception as err:
        assert "ce-tvm bundle" in str(err), err
    else:
        raise AssertionError("an unknown source got a binary")
    print("callback ok")
""")


@pytest.mark.slow
@needs_nvcc
def test_cuda_runtime_gets_the_bundled_binary_without_the_compiler(cuda_bundle, tmp_path):
    """TVM's CUDA runtime compiles a module's source through the global function
    tvm_callback_cuda_compile; without TVM the bundle's binary of exactly that source
    answers (no GPU here: the callback is called directly)."""
    from ce_tvm.compiler.build import compile_spec, cuda_binary
    from ce_tvm.kernels.kinds import Variant
    from ce_tvm.store.spec import KernelSpec

    spec = KernelSpec("forward", "bfloat16", LM_CLASSES[0], Variant("mean", False, False),
                      "cuda", (("arch", "sm_90"),))
    source, _ = cuda_binary(compile_spec(spec), spec)
    (tmp_path / "kernel.cu").write_text(source)
    lib = cuda_bundle / spec.file_name()
    done = subprocess.run([sys.executable, "-c", CALLBACK_PROBE, str(lib),
                           str(tmp_path / "kernel.cu")], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "callback ok" in done.stdout



OLD_TORCH_PROBE = BLOCK_TVM + textwrap.dedent("""
    import os, torch, torch.nn.functional as F
    del torch.Tensor.__dlpack_c_exchange_api__  # as in torch 2.11, the GPU host's
    import ce_tvm
    c = int(sys.argv[1])
    x = torch.randn(6, c, requires_grad=True)
    y = torch.tensor([0, 3, c - 1, -100, 5, 2])
    loss = ce_tvm.cross_entropy(x, y, label_smoothing=0.1)
    loss.backward()
    xr = x.detach().clone().requires_grad_()
    ref = F.cross_entropy(xr, y, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(x.grad, xr.grad)
    cache = os.environ["TVM_FFI_CACHE_DIR"]
    print(os.environ["TVM_FFI_DISABLE_TORCH_C_DLPACK"],
          sorted(os.listdir(cache)) if os.path.isdir(cache) else [])
""")


def test_bundle_host_with_an_older_torch_builds_no_tvm_ffi_addon(bundle, tmp_path):
    """Where torch lacks ``Tensor.__dlpack_c_exchange_api__``, tvm-ffi's first
    import would compile a torch extension for minutes (it did on the GPU host,
    torch 2.11, running from a bundle): ``import ce_tvm`` asks it not to, and
    tensors take the DLPack protocol instead, with the same results."""
    env = {k: v for k, v in os.environ.items() if k != "TVM_FFI_DISABLE_TORCH_C_DLPACK"}
    env.update(CE_TVM_MODULE_DIR=str(bundle), CE_TVM_CACHE=str(tmp_path / "cache"),
               TVM_FFI_CACHE_DIR=str(tmp_path / "tvm-ffi"))
    done = subprocess.run([sys.executable, "-c", OLD_TORCH_PROBE, str(C)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "[]"]
