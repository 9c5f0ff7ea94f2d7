"""Stage names: declared once by the compute, used by the schedules, never re-typed."""

import ast
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from tvm import s_tir, tirx
from tvm.target import Target

from ce_tvm.kernels import (
    backward,
    choices,
    divergence,
    forward,
    kinds,
    log_probs,
    prob_targets,
    shards,
    stages,
    training,
)
from ce_tvm.kernels.kinds import Variant
from ce_tvm.schedules import _common, cpu_stores
from support import lowered_after

SCHEDULES = Path(__file__).resolve().parents[2] / "schedules"


def declared_funcs():
    """Every declaration of the compute in every variant, with a chunked row."""
    for reduction, weighted, log_prob in itertools.product(
            kinds.REDUCTIONS, (False, True), (False, True)):
        yield forward.forward_func(10, "float32", Variant(reduction, weighted, log_prob), 4)
    for reduction, weighted, source in itertools.product(
            kinds.REDUCTIONS, (False, True), ("log_prob", "logits", "shard")):
        yield backward.backward_func(10, "float32", Variant(reduction, weighted,
                                                           grad_source=source))
    for reduction, weighted in itertools.product(("sum", "mean"), (False, True)):
        yield training.train_func(10, "float32", Variant(reduction, weighted, False), 4)
    for weighted in (False, True):
        yield shards.shard_stats_func(10, "float32", Variant(weighted=weighted), 4)
    for reduction in kinds.REDUCTIONS:
        yield shards.shard_combine_func(10, "float32", Variant(reduction))
    # softcap and token accuracy (their stages: the target logit, the count of
    # columns ahead of it, the per-row hit)
    capped = dict(softcap=True, accuracy=True)
    yield forward.forward_func(10, "float32", Variant("mean", True, False, **capped), 4)
    # the row merged in lanes (the CUDA forward's regrouping of long rows)
    yield forward.forward_func(10, "float32", Variant("mean", True, False, **capped), 2, lanes=2)
    yield log_probs.log_probs_func(10, "float32", Variant(columns=2, softcap=True, stats=True),
                                   2, lanes=2)
    yield training.train_func(10, "float32", Variant("sum", False, False, **capped), 4)
    yield backward.backward_func(10, "float32", Variant("none", True, grad_source="logits",
                                                       softcap=True))
    yield shards.shard_stats_func(10, "float32", Variant(weighted=True, softcap=True), 4)
    for reduction, weighted in itertools.product(kinds.REDUCTIONS, (False, True)):
        yield prob_targets.prob_forward_func(10, "float32", Variant(reduction, weighted, False), 4)
        yield prob_targets.prob_backward_func(10, "float32", Variant(reduction, weighted, False))
        yield prob_targets.prob_target_grad_func(10, "float32", Variant(reduction, weighted, False))
    # the temperature (a shard's scaled row max), the log-prob kernels
    yield shards.shard_stats_func(10, "float32", Variant(weighted=True, tempered=True), 4)
    for softcap in (False, True):
        yield log_probs.log_probs_func(10, "float32", Variant(columns=2, softcap=softcap), 4)
        yield log_probs.log_probs_func(10, "float32", Variant(columns=2, softcap=softcap,
                                                              stats=True), 4)
        yield log_probs.log_probs_grad_func(10, "float32", Variant(columns=2, softcap=softcap))
    # the student-teacher divergence, each direction, with and without its gradient
    for kind, reduction in itertools.product(kinds.DIVERGENCES, ("none", "sum")):
        yield divergence.divergence_func(10, "float32", Variant(reduction, divergence=kind))
    # a row taken against its shift (the CPU's forward without label smoothing)
    with choices.row_shift(True):
        yield forward.forward_func(10, "float32", Variant("mean", False, False, smoothing=False),
                                   4)


def block_names(func) -> set:
    sch = s_tir.Schedule(func)
    return {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}


def test_exported_stages_are_exactly_the_blocks_of_the_compute():
    emitted = set().union(*(block_names(f) for f in declared_funcs()))
    assert sorted(emitted) == sorted(stages.STAGES)
    assert len(set(stages.STAGES)) == len(stages.STAGES)


def _stage_constants_used(path: Path) -> set:
    """Values of the compute's stage constants a schedule module names."""
    source = ast.parse(path.read_text())
    names = {node.id for node in ast.walk(source) if isinstance(node, ast.Name)}
    names |= {alias.asname or alias.name for node in ast.walk(source)
              if isinstance(node, ast.ImportFrom) for alias in node.names}
    used = set()
    for name in names:
        value = getattr(stages, name, getattr(_common, name, None))
        if isinstance(value, str) and value in stages.STAGES:
            used.add(value)
        elif isinstance(value, tuple) and set(value) & set(stages.STAGES):  # a stage group
            used.update(value)
    return used


@pytest.mark.parametrize("module", ["_common", "cpu", "cuda", "ascend"])
def test_every_stage_a_schedule_uses_exists_in_some_variant(module):
    used = _stage_constants_used(SCHEDULES / f"{module}.py")
    assert used, f"{module} names no stage"
    emitted = set().union(*(block_names(f) for f in declared_funcs()))
    assert used <= emitted, sorted(used - emitted)


@pytest.mark.parametrize("module", ["_common", "cpu", "cuda", "ascend"])
def test_schedules_never_retype_a_stage_name(module):
    tree = ast.parse((SCHEDULES / f"{module}.py").read_text())
    literals = {node.value for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not literals & set(stages.STAGES), sorted(literals & set(stages.STAGES))


def test_a_name_that_is_not_a_stage_is_an_error():
    sch = s_tir.Schedule(forward.forward_func(10, "float32", Variant("mean", True, True)))
    assert [sch.get(b).name_hint for b in _common.present_blocks(sch, _common.ROW_TOTALS)] == [
        "ce_total_ce", "ce_total_z", "ce_total_weight", "ce_total_count"]
    with pytest.raises(ValueError, match="ce_rowmax"):
        _common.present_blocks(sch, ["ce_rowmax"])


def test_a_stage_the_variant_lacks_is_skipped_and_a_required_one_is_not():
    sch = s_tir.Schedule(forward.forward_func(10, "float32", Variant("none", False, False)))
    assert _common.present_blocks(sch, _common.ROW_TOTALS + (stages.LOG_PROB,)) == []
    assert _common.chunk_reductions(sch) == [*_common.ROW_REDUCTIONS, stages.CHUNK_WXSUM]
    plain = s_tir.Schedule(forward.forward_func(10, "float32", Variant(smoothing=False)))
    assert _common.chunk_reductions(plain) == list(_common.ROW_REDUCTIONS)
    shard = s_tir.Schedule(shards.shard_combine_func(10, "float32", Variant("sum")))
    with pytest.raises(s_tir.ScheduleError):  # a forward phase on a kernel without row stats
        _common.place_row_stages(shard, lanes=1)


@pytest.mark.parametrize("declare", [
    lambda v: forward.forward_func(10, "float32", v, 4),
    lambda v: training.train_func(10, "float32", v, 4),
    lambda v: backward.backward_func(10, "float32", v)], ids=["forward", "train", "backward"])
def test_class_weight_sum_is_one_stage_over_the_classes(declare):
    """``sum_c w[c]`` does not depend on the row: one ``ce_wsum`` over the
    classes, no per-row chunk sum (``ce_chunk_wsum``)."""
    names = block_names(declare(Variant("mean", True, False)))
    assert stages.WSUM in names and stages.CHUNK_WSUM not in names
    assert stages.WSUM not in block_names(declare(Variant("mean", False, False)))


def test_probability_target_mass_keeps_its_per_row_sum():
    variant = Variant("mean", True, False)
    names = block_names(prob_targets.prob_forward_func(10, "float32", variant, 4))
    assert stages.CHUNK_WSUM in names and stages.WSUM not in names


@pytest.mark.parametrize("op", ["forward", "train", "backward"])
def test_cpu_reduces_the_class_weight_sum_once_before_the_parallel_rows(op):
    """The CPU schedule leaves ``ce_wsum`` at the root, ahead of the row loop
    that runs in parallel, and vectorised (its lanes summed at the end)."""
    from ce_tvm.compiler.build import KernelSpec, scheduled_func

    variant = Variant("mean", True, grad_source="logits") if op == "backward" else Variant(
        "mean", True, False)
    func = scheduled_func(KernelSpec(op, "float32", 1024, variant, "llvm"))
    script = func.script()
    first_parallel = script.index("T.parallel(")
    assert script.index('T.sblock("ce_wsum_rf_update")') < first_parallel
    assert script.index('T.sblock("ce_wsum")') < first_parallel
    sch = s_tir.Schedule(func)
    loops = sch.get_loops(sch.get_sblock("ce_wsum_rf_update"))
    assert sch.get(loops[-1]).kind == tirx.ForKind.VECTORIZED


@pytest.mark.parametrize("dtype,classes,staged", [
    ("float32", 1024, False),  # float32 rows are reduced in place
    ("float32", 1001, False),  # aligned or not
    ("bfloat16", 1024, False),  # and 16-bit rows too: two passes, each widens
    ("float16", 1024, False),
])
def test_cpu_forward_reduces_the_chunk_in_place(dtype, classes, staged):
    """The CPU asks for ``ce_chunk_logits`` (``stages_chunk``) where it pays, not
    for the loss forward; unstaged, every chunk reduction reads ``x``."""
    from ce_tvm.compiler.build import KernelSpec, scheduled_func

    func = scheduled_func(KernelSpec("forward", dtype, classes, Variant("mean", False, False),
                                     "llvm"))
    sch = s_tir.Schedule(func)
    for name in ("ce_chunk_max_rf_update", "ce_chunk_expsum_rf_update",
                 "ce_chunk_wxsum_rf_update"):
        reads = {r.source.name for r in sch.get(sch.get_sblock(name)).reads}
        assert (stages.CHUNK_LOGITS in reads) == staged and ("x" in reads) != staged, reads


@pytest.mark.parametrize("op,variant,dtype,avx2,avx512", [
    ("shard_stats", Variant("mean", False, False), "bfloat16", True, False),
    ("log_probs", Variant(columns=1), "bfloat16", True, False),
    ("log_probs", Variant(columns=1, stats=True), "bfloat16", True, True),
    ("shard_stats", Variant("mean", False, False), "float16", False, False),
    ("log_probs", Variant(columns=1), "float16", False, False),
    ("prob_forward", Variant("mean", False, False), "bfloat16", False, False),
])
def test_cpu_stages_bf16_chunks_where_widening_costs(op, variant, dtype, avx2, avx512):
    """On AVX2 a vocabulary shard's statistics and the log-probs (which pass over
    a chunk more often) copy a bfloat16 chunk to float32 once (its widening is
    two instructions, float16's one); with AVX-512 BW's one-permutation widening
    only the log-probs' statistics variant does. Probability targets, which
    stream the targets beside the logits, never do (it costs them). The
    scheduled kernel for this host reads the copy exactly where asked."""
    from ce_tvm.compiler.build import KernelSpec, scheduled_func
    from ce_tvm.schedules import cpu
    from ce_tvm.store import targets

    for mcpu, staged in (("znver3", avx2), ("haswell", avx2), ("znver4", avx512),
                         ("znver5", avx512)):
        target = Target({"kind": "llvm", "mcpu": mcpu})
        assert cpu.stages_chunk(op, 1024, dtype, target, variant) == staged, mcpu
    host = cpu.stages_chunk(op, 1024, dtype, targets.tvm_target("llvm"), variant)
    sch = s_tir.Schedule(scheduled_func(KernelSpec(op, dtype, 1024, variant, "llvm")))
    reads = {r.source.name for r in sch.get(sch.get_sblock("ce_chunk_max_rf_update")).reads}
    assert (stages.CHUNK_LOGITS in reads) == host, reads


def _prefetched_buffers(func, write: bool = False) -> list[str]:
    """Names of the buffers ``func`` prefetches, for reading or (``write``) writing."""
    import tvm

    from ce_tvm.schedules import cpu

    return [call.args[0].args[0].source.name
            for call in cpu.collect_nodes(func.body, tvm.ir.expr.Call)
            if call.op.name == "tirx.prefetch" and int(call.args[1]) == int(write)]


@pytest.mark.parametrize("op,dtype", [("forward", "float32"), ("forward", "bfloat16"),
                                      ("train", "float32")])
def test_cpu_exp_loop_prefetches_the_next_chunk_of_the_logits(op, dtype):
    """The loop that computes ``exp`` on a chunk prefetches the logits of the
    next one (``prefetch_ahead``), also when it reads a staged copy (bf16)."""
    from ce_tvm.compiler.build import KernelSpec

    spec = KernelSpec(op, dtype, 12800, Variant("mean", False, False), "llvm")
    fetched = _prefetched_buffers(lowered_after(spec, "prefetch_marked_loops"))
    assert fetched and set(fetched) == {stages.LOGITS}, fetched


@pytest.mark.parametrize("op,dtype,variant", [
    ("forward", "float32", Variant("mean", False, False)),
    ("forward", "float32", Variant("mean", False, False, smoothing=False)),
    ("train", "bfloat16", Variant("mean", False, False)),
    ("log_probs", "bfloat16", Variant(columns=1))])  # its bf16 chunk staged
def test_cpu_rows_split_into_tasks_still_prefetch(op, dtype, variant):
    """With several rows per parallel task (``row_grain``) each row tests
    ``row < N``, and lowering hoists the test above the chunk's loops: the
    marked ``exp`` loop is then guarded by an ``if``. It prefetches the same
    lines as with one row per task (tuning records with 8 rows per task ran
    without prefetches: the fp32 forward at 4096 x 32000 1.23x slower)."""
    from ce_tvm.compiler.build import KernelSpec, declared_func
    from ce_tvm.schedules import cpu

    spec = KernelSpec(op, dtype, 12800, variant, "llvm")
    fetched = {}
    for grain in (1, 8):
        knobs = {"row_grain": grain, "unroll": 1}
        scheduled = cpu.schedule_with_knobs(declared_func(spec), op, spec.tvm_target(), knobs)
        func = lowered_after(spec, "prefetch_marked_loops", scheduled)
        fetched[grain] = (_prefetched_buffers(func), _prefetched_buffers(func, write=True))
    assert fetched[1][0] and fetched[8] == fetched[1], fetched


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_training_exp_loop_fetches_the_gradient_lines_for_writing(dtype):
    """The training kernel's ``exp`` loop also prefetches, for writing, the lines
    of the gradient it stores after the row's sweep: as many lines as it fetches
    of the logits (the gradient has their dtype), and nothing else for writing;
    the forward fetches nothing for writing."""
    from ce_tvm.compiler.build import KernelSpec

    for op in ("train", "forward"):
        spec = KernelSpec(op, dtype, 12800, Variant("mean", False, False), "llvm")
        func = lowered_after(spec, "prefetch_marked_loops")
        written = _prefetched_buffers(func, write=True)
        if op == "forward":
            assert written == []
        else:
            assert written and set(written) == {stages.X_GRAD}
            read = _prefetched_buffers(func)
            assert len(written) == len(read), (written, read)


@pytest.mark.parametrize("mcpu,dtype,smoothing,fetches", [
    ("znver4", "float32", False, True),
    ("znver4", "float32", True, True),  # with label smoothing's terms too
    ("znver4", "bfloat16", False, False),  # written a row late: the next row is read
    ("znver3", "bfloat16", False, False),  # AVX2: not streamed
    ("haswell", "float32", False, False)])  # AVX2: no row shift
def test_cpu_streamed_gradient_loops_prefetch_the_next_row(mcpu, dtype, smoothing, fetches):
    """A training kernel that takes each row against its first chunk's max and
    streams its float32 gradient: every loop that stores the gradient
    prefetches, into L2, the logits exactly one row (C elements) below the
    elements it writes, on a launch that streams only (``prefetch_next_row``)."""
    import tvm

    from ce_tvm.schedules import cpu
    from ce_tvm.testing.cpu_static import cross_spec

    classes = 12800
    spec = replace(cross_spec("train", dtype, classes, f"llvm -mcpu={mcpu}"),
                   variant=Variant("mean", False, False, smoothing=smoothing))
    func = lowered_after(spec, "prefetch_next_rows")
    loops = [f for f in cpu.collect_nodes(func.body, tirx.For)
             if any(st.buffer.name == stages.X_GRAD
                    for st in cpu.collect_nodes(f.body, tirx.BufferStore))
             and not cpu.collect_nodes(f.body, tirx.For)]
    assert loops
    analyzer = tvm.sym.Analyzer()
    for loop in loops:
        guards = [g for g in cpu.collect_nodes(loop.body, tirx.IfThenElse)
                  if cpu.collect_nodes(g.then_case, tvm.ir.expr.Call)]
        to_l2 = [c for c in cpu.collect_nodes(loop.body, tvm.ir.expr.Call)
                 if c.op.name == "tirx.prefetch" and int(c.args[2]) == 2]
        assert bool(to_l2) == fetches
        if not fetches:
            continue
        assert guards and all(str(cpu_stores.STREAM_MIN_BYTES) in str(g.condition)
                              for g in guards)
        store = next(st for st in cpu.collect_nodes(loop.body, tirx.BufferStore)
                     if st.buffer.name == stages.X_GRAD)
        written = cpu.unbound(store.indices[-1], cpu.binds(loop.body)).base
        lines = sorted(int(analyzer.simplify(
            cpu.unbound(c.args[0].args[0].indices[-1], cpu.binds(loop.body)) - written))
            for c in to_l2)
        assert {c.args[0].args[0].source.name for c in to_l2} == {stages.LOGITS}
        assert lines == [classes + i * 16 for i in range(len(lines))] and len(lines) == 2


def test_cpu_overlap_test_runs_on_the_last_chunk_only():
    """C = 12289 is cut into 3 chunks, the last overlapping the one before:
    TVM's LoopPartition peels it (``PASS_CONFIG``), so no ``likely`` overlap test
    is left in the loops (the first chunks run without it)."""
    from ce_tvm.compiler.build import KernelSpec, scheduled_func

    spec = KernelSpec("forward", "float32", 12289, Variant("mean", False, False), "llvm")
    assert "likely" in scheduled_func(spec).script()
    assert "likely" not in lowered_after(spec, "s_tir.LoopPartition").script()


@pytest.mark.parametrize("op", ["train", "backward"])
def test_cpu_one_hot_compares_a_broadcast_plus_a_constant_ramp(op):
    """The gradient's one-hot test compares column indices with the target: the
    CPU pipeline writes the int32 ramp of columns as a broadcast base plus a
    constant ramp (two instructions, not LLVM's shuffles), and only there."""
    import tvm

    from ce_tvm.compiler.build import KernelSpec
    from ce_tvm.schedules import cpu

    variant = Variant("mean", False, False) if op == "train" else Variant(
        "mean", False, grad_source="logits")
    spec = KernelSpec(op, "bfloat16", 12800, variant, "llvm")
    before = lowered_after(spec, "prefetch_marked_loops")
    after = lowered_after(spec, "compared_ramps_as_offsets")

    def compared_ramps(func):
        return [side for kind in cpu._COMPARISONS for cmp in cpu.collect_nodes(func.body, kind)
                for side in (cmp.a, cmp.b) if isinstance(side, tirx.Ramp)
                and not (isinstance(side.base, tirx.IntImm) and side.base.value == 0)]

    assert compared_ramps(before) and not compared_ramps(after)
    indexed = [ld for ld in cpu.collect_nodes(after.body, tvm.ir.expr.TensorLoad)
               if isinstance(ld.indices[-1], tirx.Ramp)]
    assert indexed  # vector loads keep their ramp index
