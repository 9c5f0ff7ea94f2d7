"""The CUDA kernels as nvcc compiles them, run in GPGPU-Sim (``ce_tvm.testing.gpgpu_sim``):
the patched simulator's self-check and a few cases of ``ce_tvm.testing.cuda_cases``
against the float64 reference. The full report is
``benchmarks/gpu_schedule_on_gpgpu_sim.py``'s (docs/targets.md).

Opt-in: the simulator takes about 20 minutes to build
(``benchmarks/gpgpu_sim/build.sh``) and is not built in CI; these tests skip,
saying why, unless ``CE_TVM_GPGPU_SIM`` (or ``GSIM``) names a build. The host
program generation is tested everywhere (no simulator needed).
"""

import re
from dataclasses import replace

import pytest

from ce_tvm.testing import cuda_cases, gpgpu_sim, gpgpu_sim_checks

# (family, kernel index, dtype, C, rows, schedule arch)
CASES = [
    ("forward", 0, "bfloat16", 5003, 7, "sm_80"),
    ("train", 0, "float16", 1000, 7, "sm_80"),
    ("backward", 2, "float32", 1000, 1, "sm_90"),  # the gradient written over the logits
    ("forward", 0, "bfloat16", 32000, 7, "sm_90"),  # log_prob: the row in dynamic shared memory
    ("log_probs", 1, "float32", 5003, 7, "sm_80"),
    ("shards", 0, "float32", 1000, 7, "sm_80"),
    ("distillation", 0, "bfloat16", 1000, 7, "sm_90"),
]


def _case(family, index, dtype, classes, rows, arch):
    kernel = cuda_cases.KERNELS[family][index]
    return replace(cuda_cases._case(family, kernel, dtype, classes, rows), arch=arch)


@pytest.fixture(scope="module")
def sim():
    reason = gpgpu_sim.unavailable()
    if reason:
        pytest.skip(reason)
    return gpgpu_sim.Simulator.find()


@pytest.mark.slow
def test_the_patched_simulator_passes_its_self_check(sim):
    checks = gpgpu_sim_checks.run_all(sim)
    assert {c.name for c in checks} == {
        "warp shuffles", "bf16 conversions", "bf16 pairs", "half conversions",
        "64-bit integer conversions", "exp2f and __expf", "dynamic shared memory"}
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
    assert not failed, failed


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_the_reference_in_the_simulator(sim, case):
    result = cuda_cases.run_case(_case(*case), sim)
    assert result.passed, f"{case}: {result.problem} (worst {result.worst:.3g})"
    assert result.instructions > 0 and result.device == sim.name


def test_the_staged_log_prob_row_is_dynamic_shared_memory_on_sm_90():
    """What the dynamic-shared case above runs: the sm_90 schedule of the log_prob
    forward stages a C = 32000 bf16 row (64 KB) in dynamic shared memory, and the host
    program launches it with those bytes, opting in beyond 48 KB."""
    kernels = gpgpu_sim.build(_case(*CASES[3]).spec())
    shared = [int(kernels.evaluate(launch.shared, {"N": 7})) for launch in kernels.launches]
    assert max(shared) == 32000 * 2
    program = gpgpu_sim.host_program(kernels)
    assert "extern __shared__" in program and "cudaFuncSetAttribute" in program
    assert len(re.findall(r"<<<l\.grid, l\.block, l\.shared>>>", program)) == len(
        kernels.launches)


def test_the_plan_gives_every_launch_its_extents_and_scalars():
    case = _case("forward", 0, "float32", 1000, 7, "sm_80")
    kernels = gpgpu_sim.build(case.spec())
    prob = cuda_cases.problem(case)
    sizes = list(range(100, 100 + len(kernels.buffers())))
    alias = {kernels.buffers()[-1].name: "x"}
    plan = gpgpu_sim._plan_text(kernels, {"N": 7, **prob.scalars}, sizes, alias)
    lines = plan.splitlines()
    names = [p.name for p in kernels.buffers()]
    assert lines[:len(sizes)] == [f"-1 {s}" for s in sizes[:-1]] + [
        f"{names.index('x')} {sizes[-1]}"]
    launches = lines[len(sizes):]
    assert len(launches) == len(kernels.launches)
    for line, launch in zip(launches, kernels.launches):
        scalars = sum(arg[0] == "scalar" for arg in launch.args)
        assert len(line.split()) == 7 + scalars
        grid = [int(kernels.evaluate(e, {"N": 7})) for e in launch.grid]
        assert [int(w) for w in line.split()[:3]] == grid


def test_a_missing_build_is_a_reason_not_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv("CE_TVM_GPGPU_SIM", raising=False)
    monkeypatch.delenv("GSIM", raising=False)
    assert "not built" in gpgpu_sim.unavailable()
    assert "not built" in gpgpu_sim.unavailable(tmp_path)
