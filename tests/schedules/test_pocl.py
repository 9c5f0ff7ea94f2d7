"""The CUDA schedule's kernels executed on PoCL (``ce_tvm.testing.pocl``, the cases of
``ce_tvm.testing.cuda_cases``): a representative part of the full matrix
(``benchmarks/gpu_schedule_on_pocl.py``).

Every op family with float32 at C = 5003 (prime: two chunks, the last
overlapping, no row 16-byte aligned), every one again in float16 with a single
row at C = 1000, the bfloat16 training and forward kernels at C = 32000 (a
row staged whole; eight chunks; with and without label smoothing's terms),
the bfloat16 forward and log-probs at C = 8191 (in lanes of two vectors,
loaded one element at a time: no row aligned; the last chunk overlapping),
1000 rows once, rows of one class (C = 1), and the stress pass (fewest and
most threads per block, 4 rows per block, three launches compared bit for
bit). The full matrix is the benchmark's (docs/targets.md). The PoCL runs are
in the slow lane; they skip, saying why, where PoCL cannot be loaded.
"""

import numpy as np
import pytest

from ce_tvm.kernels.kinds import Variant
from ce_tvm.store.spec import KernelSpec
from ce_tvm.testing import cuda_cases, pocl


def _every_kernel(dtype, classes, rows):
    return [cuda_cases._case(family, kernel, dtype, classes, rows)
            for family in cuda_cases.FAMILIES for kernel in cuda_cases.KERNELS[family]]


def _first(family, dtype, classes, rows):
    return cuda_cases._case(family, cuda_cases.KERNELS[family][0], dtype, classes, rows)


STRESS = [c for c in cuda_cases.stress(dtypes=("float32",), classes=(5003,), rows=7)
          if c.family in ("forward", "backward", "train", "log_probs")]
# C = 1: a row of one class, which the forward, training and distillation schedules once
# failed to build
ONE_CLASS = [_first(f, "bfloat16", 1, 7) for f in ("forward", "train", "prob_targets", "shards",
                                                    "log_probs", "distillation")]
# what a bfloat16 call with eps = 0 runs (and a log-prob call without the entropy), at
# a vocabulary in eight chunks
NO_SMOOTHING = [cuda_cases._case(f, kernel, "bfloat16", 32000, 64)
                for f in ("forward", "train", "shards", "log_probs")
                for kernel in cuda_cases.KERNELS[f]
                if not (kernel[1].smoothing and kernel[1].entropy)]
CASES = (_every_kernel("float32", 5003, 7) + _every_kernel("float16", 1000, 1)
         + [_first(f, "bfloat16", 32000, 64) for f in ("forward", "train")] + NO_SMOOTHING
         + [_first(f, "bfloat16", 8191, 7) for f in ("forward", "log_probs")]
         + [_first("forward", "float32", 1000, 1000)] + ONE_CLASS + STRESS)


def _id(case) -> str:
    return f"{case.family}-{case.op}-{case.label}-{case.dtype}-C{case.classes}-N{case.rows}"


@pytest.fixture(scope="module")
def device():
    reason = pocl.pocl_unavailable()
    if reason:
        pytest.skip(reason)
    return pocl.PoCL.get()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kernel_matches_the_reference_on_pocl(device, case):
    result = cuda_cases.run_case(case, device)
    assert result.passed, f"{_id(case)}: {result.problem} (worst {result.worst:.3g})"
    assert result.kernels >= 1 and result.device == device.name


def test_suite_covers_every_family_and_the_stress_pass():
    assert {c.family for c in CASES} == set(cuda_cases.FAMILIES)
    assert {c.dtype for c in CASES} == {"float32", "float16", "bfloat16"}
    threads = {dict(c.knobs)["threads"] for c in STRESS}
    assert len(threads) == 2 and any(dict(c.knobs).get("rows_per_block") == "4" for c in STRESS)
    assert all(c.repeats == 3 for c in STRESS)


def test_full_matrix_covers_every_family_dtype_and_vocabulary():
    cases = cuda_cases.matrix()
    assert {c.family for c in cases} == set(cuda_cases.FAMILIES)
    assert {(c.dtype, c.classes) for c in cases} == {
        (d, c) for d in cuda_cases.DTYPES for c in cuda_cases.CLASSES}
    for classes in cuda_cases.CLASSES:
        rows = {n for n in cuda_cases.ROWS if n <= cuda_cases.MAX_ROWS.get(classes, n)}
        assert {c.rows for c in cases if c.classes == classes} == rows


def test_launch_plan_is_read_from_the_lowered_host_function():
    """Three kernels for a weighted mean forward: the weight sum (one block of
    1024), the rows (a block of 256 threads per row), the sums over rows (one
    block); arguments by parameter name, N bound at run time."""
    spec = KernelSpec("forward", "float32", 1000, Variant("mean", True, True), "cuda",
                      (("arch", "sm_90"),))
    kernels = pocl.build(spec)
    shapes = [(tuple(kernels.evaluate(e, {"N": 7}) for e in launch.grid),
               tuple(kernels.evaluate(e, {"N": 7}) for e in launch.block))
              for launch in kernels.launches]
    assert shapes == [((1, 1, 1), (1024, 1, 1)), ((7, 1, 1), (256, 1, 1)),
                      ((1, 1, 1), (256, 1, 1))]
    row_kernel = kernels.launches[1]
    assert ("buffer", "x") in row_kernel.args and ("buffer", "log_prob") in row_kernel.args
    assert "__kernel void" in kernels.source and "barrier(CLK_LOCAL_MEM_FENCE)" in kernels.source


def test_local_arrays_are_hoisted_to_kernel_scope():
    source = "\n".join([
        "__kernel void k(__global float* restrict a) {",
        "  float r[1];",
        "  for (int i = 0; i < 2; ++i) {",
        "    __local float red_buf0_ptr[256];",
        "    a[i] = 0;",
        "  }",
        "}",
    ])
    lines = pocl.hoist_local(source).splitlines()
    assert lines[1] == "  __local float red_buf0_ptr[256];"
    assert sum("__local" in line for line in lines) == 1


def test_bfloat16_bits_round_to_nearest_even():
    values = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf], np.float32)
    bits = pocl.bf16_bits(values)
    assert list(pocl.bf16_values(bits)) == [1.0, 1.0, 1.015625, -2.5, np.inf]
    assert np.isnan(pocl.bf16_values(pocl.bf16_bits(np.array([np.nan], np.float32))))[0]
