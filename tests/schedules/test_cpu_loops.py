"""Which of the CPU kernels' chunk reductions share a loop (``schedules/cpu.py``:
``logits_sum_in_max_loop`` for the forward, with the exp-sum where the row is
taken against its shift, ``sum_with_max`` for the training kernel,
``sums_ride_the_exp`` for the log-probs). What they compute is checked against
float64 by the loss and log-prob tests, which run these schedules."""

import pytest
from tvm import s_tir
from tvm.target import Target

from ce_tvm.compiler.build import declared_func
from ce_tvm.kernels.common import matrix_param
from ce_tvm.kernels.kinds import Variant
from ce_tvm.schedules import cpu
from ce_tvm.store.spec import KernelSpec
from ce_tvm.testing.cpu_static import cross_spec

MAX_RF, SUM_RF = "ce_chunk_max_rf_update", "ce_chunk_wxsum_rf_update"
EXPSUM_RF, SHIFT_RF = "ce_chunk_expsum_rf_update", "ce_row_shift_rf_update"


def _scheduled(spec: KernelSpec, mcpu: str):
    """``spec``'s compute as the build declares it, hand-scheduled for ``mcpu``."""
    target = Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    schedule = cpu.schedule_train if spec.op == "train" else cpu.schedule_forward
    func = declared_func(spec)
    return schedule(s_tir.Schedule(func), target,
                    cpu.hand_knobs(spec.op, target, str(matrix_param(func).dtype)))


def _step_loops(spec: KernelSpec, mcpu: str, names=(MAX_RF, SUM_RF)):
    """The innermost loops around the vector steps of the blocks ``names``."""
    sch = _scheduled(spec, mcpu)
    return [sch.get(sch.get_loops(sch.get_sblock(name))[-2]) for name in names]


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


@pytest.mark.parametrize("mcpu, shifts", [("znver3", False), ("znver4", True), ("znver5", True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_row_against_its_shift_sweeps_each_chunk_once(mcpu, shifts, dtype, weighted):
    """The AVX-512 forward, with label smoothing's sum or without, takes a row
    against its first chunk's max (``ce_row_shift``, under the row loop before
    the chunks): a chunk's max and exp-sum (and the logits' sum) share one loop
    (``cpu.shifts_rows``). On AVX2 the exp-sum still waits for the chunk's max;
    with ``log_prob`` written, on every CPU."""
    for op, one_sweep in (("forward-ns", shifts), ("forward", shifts), ("forward-lp", False)):
        spec = cross_spec(op, dtype, 4099, f"llvm -mcpu={mcpu}", weighted)  # declared for mcpu
        max_steps, exp_steps = _step_loops(spec, mcpu, (MAX_RF, EXPSUM_RF))
        assert max_steps.same_as(exp_steps) == one_sweep
        if one_sweep:
            sch = _scheduled(spec, mcpu)
            shift_row, max_row = (sch.get(sch.get_loops(sch.get_sblock(name))[0])
                                  for name in (SHIFT_RF, MAX_RF))
            assert shift_row.same_as(max_row)


@pytest.mark.parametrize("mcpu, shifts", [("znver3", False), ("znver4", True), ("znver5", True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_log_probs_without_the_entropy_sweep_each_chunk_once(mcpu, shifts, dtype):
    """The AVX-512 log-prob kernel without the entropy takes a row against its
    first chunk's max: the chunk's max, its kept ``exp`` and their sum share the
    loop that streams the chunk in. With the entropy, or on AVX2, the max comes
    first. A bf16 chunk is read in place on AVX-512 and copied to float32 first
    on AVX2 (``cpu.stages_chunk``)."""
    for op, one_sweep in (("log_probs-nh", shifts), ("log_probs", False)):
        spec = cross_spec(op, dtype, 4099, f"llvm -mcpu={mcpu}")
        names = ("ce_chunk_max_rf_update", "ce_chunk_exp", EXPSUM_RF)
        max_steps, exp_steps, sum_steps = _step_loops(spec, mcpu, names)
        assert max_steps.same_as(exp_steps) == one_sweep
        assert exp_steps.same_as(sum_steps) == (mcpu != "znver3")  # cpu.sums_ride_the_exp
        staged = "ce_chunk_logits" in declared_func(spec).script()
        assert staged == (dtype == "bfloat16" and mcpu == "znver3")


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
