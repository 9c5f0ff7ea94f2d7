"""The kernels as a CPU with AVX2 and no AVX-512 gets them (LLVM ``haswell``),
run on whatever host runs the tests: they build, their assembly holds no
512-bit register, and they match float64 (``torch.nn.functional.cross_entropy``
on float64 logits and ``ce_tvm.testing.reference``).

A child process gets a fresh cache whose host descriptor names ``haswell``:
the runtime then builds every kernel for that CPU, exactly as on such a
machine (no tuning record applies: the records are keyed by CPU). Any x86
host with AVX2 runs the code, so this runs on the AVX-512 machines too.
"""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent("""
    import numpy as np
    import torch
    import torch.nn.functional as F

    import ce_tvm
    from ce_tvm.compiler.build import lower_and_compile
    from ce_tvm.kernels.kinds import Variant
    from ce_tvm.store import paths, targets
    from ce_tvm.store.spec import KernelSpec
    from ce_tvm.testing import reference

    targets.write_host_descriptor(paths.cache_dir(), "haswell")
    assert targets.host_cpu() == "haswell"
    asm = lower_and_compile(KernelSpec("train", "bfloat16", 50257, Variant("mean", False, False),
                                       "llvm")).mod.inspect_source("asm")
    assert "%ymm" in asm and "%zmm" not in asm, "AVX-512 registers in an AVX2 kernel"

    TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for c in (1000, 50257):
            x = (torch.randn(16, c, generator=gen) * 3).to(dtype)
            y = torch.randint(0, c, (16,), generator=gen)
            y[::5] = -100
            x64 = x.double().requires_grad_()
            for reduction in ("mean", "none"):
                ours = x.clone().requires_grad_()
                loss = ce_tvm.cross_entropy(ours, y, reduction=reduction, label_smoothing=0.1)
                ref = F.cross_entropy(x64, y, reduction=reduction, label_smoothing=0.1)
                up = torch.linspace(0.5, 1.5, ref.numel()).reshape(ref.shape)
                (loss.float() * up).sum().backward()
                (grad64,) = torch.autograd.grad((ref * up.double()).sum(), x64)
                torch.testing.assert_close(loss.double(), ref.detach(), **TOL[dtype])
                torch.testing.assert_close(ours.grad.double(), grad64, **TOL[dtype])
            index = y.clamp(min=0)[:, None]
            live = (y >= 0).numpy()[:, None]
            ours = x.clone().requires_grad_()
            logp, entropy = ce_tvm.log_probs(ours, y, temperature=0.7, return_entropy=True)
            a, b = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
            ((logp * a).sum() + (entropy * b).sum()).backward()
            xs = x.double().numpy()
            ref_logp, ref_entropy = reference.policy_outputs(xs, index.numpy(), live, 0.7)
            ref_grad = reference.policy_grad(xs, index.numpy(), live, a.double().numpy()[:, None],
                                             b.double().numpy(), 0.7)
            for got, want in ((logp, ref_logp[:, 0]), (entropy, ref_entropy),
                              (ours.grad, ref_grad)):
                torch.testing.assert_close(got.double(), torch.from_numpy(want), **TOL[dtype])
    print("avx2 ok")
""")


def _has_avx2() -> bool:
    try:
        return "avx2" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@pytest.mark.slow  # a process building its kernels
@pytest.mark.skipif(not _has_avx2(), reason="this host cannot run AVX2 code")
def test_avx2_kernels_build_and_match_float64(tmp_path, monkeypatch):
    monkeypatch.setenv("CE_TVM_CACHE", str(tmp_path))
    monkeypatch.delenv("CE_TVM_MODULE_DIR", raising=False)
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and "avx2 ok" in done.stdout, done.stdout + done.stderr
    kernels = sorted(tmp_path.glob("llvm-*.so"))
    assert len(kernels) >= 16  # 5 ops (forward, backward, train, log-probs, their gradient)
    if shutil.which("objdump"):
        for kernel in kernels:
            code = subprocess.run(["objdump", "-d", str(kernel)], capture_output=True,
                                  text=True, check=True).stdout
            assert "%ymm" in code and "%zmm" not in code, kernel.name
