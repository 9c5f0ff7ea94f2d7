"""The CUDA knob grid: every candidate of one shape (bf16, C = 128256) built
and compiled with nvcc (the forward's for sm_90, the backward's for sm_80),
without a GPU. Measuring the
candidates needs a GPU (``ce-tvm tune --target cuda`` only build-checks)."""

import re
import shutil

import pytest

from ce_tvm.compiler.build import cuda_binary
from ce_tvm.kernels.kinds import Variant
from ce_tvm.store.spec import KernelSpec
from ce_tvm.tools import tuning

pytestmark = pytest.mark.slow  # nvcc

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
VARIANTS = {"forward": Variant("mean", False, False),
            "backward": Variant("mean", False, grad_source="logits")}


@needs_nvcc
@pytest.mark.slow
# Each op and each arch once: TVM writes the same source for both archs.
@pytest.mark.parametrize("op,arch", [("forward", "sm_90"), ("backward", "sm_80")])
def test_whole_knob_grid_compiles_with_nvcc(op, arch):
    spec = KernelSpec(op, "bfloat16", 128256, VARIANTS[op], "cuda", (("arch", arch),))
    points, executable = tuning.compile_grid(spec)
    assert len(points) >= 12
    source, cubin = cuda_binary(executable, spec)  # raises on any nvcc error
    assert cubin[:4] == b"\x7fELF"
    bounds = {}  # candidate -> the block sizes of its kernels
    for size, name in re.findall(r"__launch_bounds__\((\d+)\) (\w+)_kernel", source):
        bounds.setdefault(int(name.split("_")[1]), set()).add(int(size))
    assert sorted(bounds) == list(range(len(points)))  # every candidate is in the cubin
    for i, knobs in enumerate(points):
        assert knobs["threads"] in bounds[i]
    if op == "forward":  # the chunk in shared memory is a knob of the compute
        staged = re.findall(r"nv_bfloat16 x_shared_ptr\[(\d+)\]", source)
        assert len(staged) == len(points) and len(set(staged)) >= 3
