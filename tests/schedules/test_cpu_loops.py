"""Which of the CPU kernels' chunk reductions share a loop (``schedules/cpu.py``:
``logits_sum_in_max_loop`` for the forward, ``sum_with_max`` for the training
kernel, ``sums_ride_the_exp`` for the log-probs). What they compute is checked against float64 by
the loss and log-prob tests, which run these schedules."""

import pytest
from tvm import s_tir
from tvm.target import Target

from ce_tvm.compiler.build import declared_func
from ce_tvm.kernels.common import matrix_param
from ce_tvm.kernels.kinds import Variant
from ce_tvm.schedules import cpu
from ce_tvm.store.spec import KernelSpec

MAX_RF, SUM_RF = "ce_chunk_max_rf_update", "ce_chunk_wxsum_rf_update"


def _step_loops(spec: KernelSpec, mcpu: str):
    """The innermost loops around the chunk max's and the logits' sum's vector steps."""
    target = Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    schedule = cpu.schedule_train if spec.op == "train" else cpu.schedule_forward
    func = declared_func(spec)
    sch = schedule(s_tir.Schedule(func), target,
                   cpu.hand_knobs(spec.op, target, str(matrix_param(func).dtype)))
    return [sch.get(sch.get_loops(sch.get_sblock(name))[-2]) for name in (MAX_RF, SUM_RF)]


@pytest.mark.parametrize("mcpu", ["znver3", "znver5"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("op", ["forward", "train"])
def test_logits_sum_rides_the_max_loop(op, mcpu, dtype, weighted):
    """The max's pass streams the chunk in; label smoothing's sum rides it
    (class weights read beside it) instead of a pass of its own."""
    spec = KernelSpec(op, dtype, 4099, Variant("mean", weighted, False))
    max_steps, sum_steps = _step_loops(spec, mcpu)
    assert max_steps.same_as(sum_steps)


def test_log_prob_sum_waits_for_the_kept_exp():
    """The log-prob kernel's sum reads the kept ``exp``, which needs the max
    first: its loop stays after it."""
    spec = KernelSpec("log_probs", "float32", 4099, Variant(columns=2))
    max_steps, sum_steps = _step_loops(spec, "znver3")
    assert not max_steps.same_as(sum_steps)


@pytest.mark.parametrize("mcpu, rides", [("znver3", False), ("znver4", True), ("znver5", True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_log_prob_sums_ride_the_kept_exp_on_avx512(mcpu, rides, dtype):
    """On AVX-512 the plain log-prob kernel's two sums share the kept ``exp``'s
    loop (``cpu.sums_ride_the_exp``); on AVX2 each keeps a loop of its own."""
    spec = KernelSpec("log_probs", dtype, 4099, Variant(columns=2))
    target = Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    sch = cpu.schedule_forward(s_tir.Schedule(declared_func(spec)), target,
                               cpu.hand_knobs("log_probs", target, dtype))
    exp_steps, sum_steps = (sch.get(sch.get_loops(sch.get_sblock(name))[-2])
                            for name in ("ce_chunk_exp", SUM_RF))
    assert exp_steps.same_as(sum_steps) == rides


@pytest.mark.parametrize("op", ["forward", "train"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_capped_sum_waits_for_the_capped_chunk(op, dtype):
    """With a softcap the sum reads the capped chunk, staged after the max
    (which reads the raw logits: the cap is monotone): its loop stays after it."""
    spec = KernelSpec(op, dtype, 4099, Variant("mean", False, False, softcap=True))
    max_steps, sum_steps = _step_loops(spec, "znver3")
    assert not max_steps.same_as(sum_steps)
