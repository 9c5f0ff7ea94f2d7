"""The chunk a CPU kernel reduces a row in (``schedules/cpu_knobs.py``): the
forward's at most ``MAX_CHUNK`` float32 classes on every CPU; the training
kernel's, whose kept ``exp`` sits beside its logits, within half the L1d. What
the kernels compute with either chunk is checked against float64 by the loss
tests, which run them."""

import pytest
from tvm import s_tir
from tvm.target import Target

from ce_tvm.compiler.build import declared_func
from ce_tvm.kernels.kinds import Variant
from ce_tvm.kernels.stages import CHUNK_MAX
from ce_tvm.schedules import cpu, cpu_knobs
from ce_tvm.store.spec import KernelSpec

SHAPES = (1000, 4099, 32000, 50257, 128256, 151936)


def _target(mcpu: str) -> Target:
    return Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})


@pytest.mark.parametrize("mcpu,l1d", [("znver4", 32 << 10), ("haswell", 32 << 10),
                                      ("znver5", 48 << 10), ("sapphirerapids", 48 << 10)])
def test_training_chunk_fits_half_the_l1d_with_its_exp(mcpu, l1d):
    target = _target(mcpu)
    assert cpu_knobs.l1_data_bytes(target) == l1d
    for classes in SHAPES:
        for dtype, size in (("float32", 4), ("bfloat16", 2)):
            chunk = cpu_knobs.train_chunk(classes, dtype, target)
            forward = cpu_knobs.forward_chunk(classes, dtype, target)
            assert chunk <= forward and chunk % (2 * cpu_knobs.vector_lanes(target)) == 0
            assert chunk * (size + 4) <= l1d // 2 or chunk == forward == classes


def test_a_smaller_l1d_gives_the_training_kernel_smaller_chunks():
    """Zen 4 (32 KB) against Zen 5 (48 KB), both AVX-512: the forward's chunk is
    the same, the training kernel's smaller where the exp would not fit."""
    zen4, zen5 = _target("znver4"), _target("znver5")
    assert cpu_knobs.forward_chunk(50257, "float32", zen4) == cpu_knobs.forward_chunk(
        50257, "float32", zen5)
    assert (cpu_knobs.train_chunk(50257, "float32", zen4)
            < cpu_knobs.train_chunk(50257, "float32", zen5)
            < cpu_knobs.forward_chunk(50257, "float32", zen5))


@pytest.mark.parametrize("op,chunk_of", [("train", cpu.train_chunk),
                                         ("forward", cpu.forward_chunk)])
def test_the_build_declares_each_kernel_with_its_chunk(op, chunk_of):
    spec = KernelSpec(op, "float32", 50257, Variant("mean", False, False), "llvm")
    sch = s_tir.Schedule(declared_func(spec))
    declared = sch.get(sch.get_loops(sch.get_sblock(CHUNK_MAX))[-1]).extent
    assert int(declared) == chunk_of(50257, "float32", spec.tvm_target())
