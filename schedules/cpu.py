"""LLVM (CPU) schedules of the kernels: the forward (also of a vocabulary
shard's statistics, of probability targets and of the log-probs), the
backward (also of their gradients), the one-pass training kernel
(``train``), the shard combine (``per_row``) and the divergence; the
tuning search's ``schedule_knobs``; and the lowering pipeline
(``TIR_PIPELINE``: TVM's, then vector accumulators merged by halves,
``cpu_reductions``, the prefetches ``prefetch_ahead`` and ``prefetch_next_row``
mark, a 16-bit training kernel's gradient written a row late, during the next
row's sweep, ``cpu_lagged_rows``, compared ramps rewritten, below, bfloat16
widened by 32-bit pairs where
a loop only accumulates it, else by a word permutation where it pays and the
CPU has one, ``cpu_widening``, rounded once, by AVX-512
BF16 where the CPU has it, ``cpu_narrowing``, and a large float32 ``[N, C]``
output's stores made non-temporal, ``cpu_stores``). The numbers they run with
(vector width, chunk, knobs and their choices) are ``cpu_knobs``'s.

Expects the blocks that ``ce_tvm.kernels`` names (see its module docstring);
the math is never touched here, only where and how each block runs.

Strategy, forward (the compute reduces each row in chunks, see
``cpu_knobs.forward_chunk``):

1. Every per-chunk reduction (``ce_chunk_max``, ``_expsum``, ``_wxsum``; the
   probability targets' ``_wsum``) is split by the vector width and
   rfactored, so it runs as independent vector accumulators (two native
   vectors: two dependency chains). A class weight's sum (``ce_wsum``) runs
   once, vectorised, before the rows.
2. The mask and row-weight blocks are inlined (a block with no block
   producer would be recomputed for every row by ``reverse_compute_at``).
3. The chunk reductions move under the chunk loop of ``ce_rowstats`` (which
   merges them): a chunk is read from memory by its first reduction and from
   L1 by the others, while the ``exp`` loop prefetches the next chunk
   (``prefetch_ahead``). For bfloat16 rows of the log-probs and of a shard's
   statistics (``cpu_knobs.stages_chunk``) the compute copies the chunk to
   float32 first (``ce_chunk_logits``): converted once.
   All per-row blocks move under the row loop, which runs in parallel over
   the cores.
4. ``log_prob`` (seed API) is written in one more vectorised pass over the
   row, which hits L2. The log-probs' stats variant adds no pass over a chunk:
   its three reductions ride in the exp-sum's loop (``ride_along``); on
   AVX-512 the plain log-probs' two sums ride it too (``sums_ride_the_exp``).
5. The serial row totals (``ce_total_*``) stay at the root: N floats, a fixed
   order, so results are bit-identical run after run; their init is hoisted
   so that N = 0 still initialises them.

Backward: the per-row coefficient blocks move under the ``x_grad`` row loop,
which runs in parallel; the element loop is vectorised. ``log_prob`` (or the
logits) is read once and ``x_grad`` written once.

Vector width: two native vectors (32 float32 lanes on AVX-512). A chunk is a
multiple of it when it can be (C = 32000 -> 4000, 128256 -> 5344; C = 50257
-> 9 chunks of 5600, the last overlapping the one before), so the reductions
carry no tail predicate. A row no longer than ``cpu_knobs.MAX_CHUNK`` is one
chunk when C is a multiple of that step or shorter than 16 steps (vectorised
by the largest divisor of C up to 32 lanes), else two overlapping chunks
(``cpu_knobs.forward_chunk``). The element-wise loops (``log_prob``,
``x_grad``) peel a tail that is not a multiple of the width off with
``loop_partition`` and keep it scalar.

Why not a predicated tail in the reductions: ``compute_at`` of an rfactored
block drops the split predicate (TVM 0.27; the tail then reads the next
row), and ``LoopPartition`` only peels ``likely`` conditions, which
``split`` does not emit.

Rejected: ``dlight.cpu.Reduction`` (scalar ``expf``, no vector accumulators);
a merged (max, sum) reducer (``rfactor`` rejects unregistered reducers).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.target import Target
from tvm.target.codegen import target_has_features

from ..kernels.common import matrix_param
from ..kernels.stages import (
    CHUNK_EXP,
    CHUNK_EXPSUM,
    CHUNK_FIRST,
    CHUNK_LOGITS,
    CHUNK_MAX,
    CHUNK_SQSUM,
    CHUNK_WXSUM,
    CHUNK_ZSUM,
    LOG_PROB,
    LOGITS,
    ROW_SHIFT,
    ROWSTATS,
    X_GRAD,
)
from ._common import (
    COMBINE_ROWS,
    SHARD_GATHERS,
    binds,
    classes_of,
    collect_nodes,
    depends_on,
    divergence_row,
    has_stage,
    init_row_totals,
    inline_row_helpers,
    is_per_row,
    loads_of,
    parallel_rows,
    place_grad_coefficients,
    place_row_stages,
    present_blocks,
    row_lanes,
    row_sweep,
    sample_knobs,
    split_reduction,
    sweep_accumulators,
    unbound,
    vector_accumulator,
    vector_accumulators,
    vector_row_independent,
    vectorize_gradient_by_chunk,
    vectorize_inner,
)
from .cpu_knobs import SCHEDULE_OF, CPUKnobs, hand_knobs, vector_lanes

# Entry points (``schedules/__init__.py``) that ``cpu_knobs`` declares.
from .cpu_knobs import forward_chunk as forward_chunk
from .cpu_knobs import knob_chunk as knob_chunk
from .cpu_knobs import knob_space as knob_space
from .cpu_knobs import shifts_rows as shifts_rows
from .cpu_knobs import stages_chunk as stages_chunk
from .cpu_knobs import train_chunk as train_chunk
from .cpu_lagged_rows import is_lagged, lagged_gradient_rows
from .cpu_narrowing import bf16_rounding
from .cpu_reductions import tree_lane_reductions
from .cpu_stores import (
    fits_in_cache,
    keep_outputs_cached,
    stream_output_stores,
    streamed_outputs,
    streams,
)
from .cpu_widening import bf16_pairs_widening, bf16_widening

# TVM's LoopPartition also splits constant-extent loops on ``likely``
# conditions: the chunk loop of a row whose last chunk overlaps the one before
# (C = 50257) runs its other chunks without the overlap test, the last one
# peeled after them (``kernels.choices.last_chunk_peeled``; in cache, fp32 4096x50257:
# 0.25 -> 0.16 ns per element per core).
PASS_CONFIG = {"s_tir.LoopPartition": {"partition_const_loop": True}}
PEELS_LAST_CHUNK = True
# The training gradient's columns are vectorised chunk by chunk
# (``vectorize_gradient_by_chunk``), and LLVM takes the test on the chunk out
# of a float32 chunk's loop, which is then a load, an FMA and a store per vector
# (``kernels.choices.one_hot_by_chunk``; in-process A/B, fp32 4096x32000: 87.8 ->
# 82.9 ms, 2048x50257 73.2 -> 71.5 ms; bf16 keeps the test in its loop).
ONE_HOT_BY_CHUNK = True


def schedule_knobs(sch, op: str, target: Target, space: dict, decisions: dict | None = None):
    """Schedule ``op`` with knobs drawn from ``space`` by sampling instructions (the
    tuning search's space; ``decisions`` fixes them). The ``chunk`` drawn must be
    the one the compute was declared with."""
    knobs = sample_knobs(sch, space, decisions)
    chunk = knobs.pop("chunk", None)
    if chunk is not None and chunk != _chunk(sch):
        raise ValueError(f"chunk {chunk} drawn for a compute declared with chunk {_chunk(sch)}")
    return _schedule_of(op)(sch, target, CPUKnobs(**knobs))


def schedule_with_knobs(func, op: str, target: Target, knobs: dict):
    """Schedule ``op``'s ``func`` with ``knobs``, a tuning record's (``chunk``, a
    knob of the compute, is the one ``func`` was declared with): how a record
    tuned on a sibling kernel's compute (``KernelSpec.record_name``) applies,
    its trace naming blocks this compute may not have."""
    fields = {name: value for name, value in knobs.items() if name != "chunk"}
    return _schedule_of(op)(s_tir.Schedule(func), target, CPUKnobs(**fields)).mod["main"]


def _schedule_of(op: str):
    """The function scheduling ``op`` on a ``Schedule`` (``SCHEDULE_OF``)."""
    return {"forward": schedule_forward, "backward": schedule_backward,
            "train": schedule_train}[SCHEDULE_OF[op]]


def forward(func, target: Target, knobs: CPUKnobs | None = None):
    """Schedule ``ce_tvm.kernels.forward_func`` for ``target``; returns the scheduled PrimFunc."""
    return schedule_forward(s_tir.Schedule(func), target,
                           knobs or hand_knobs("forward", target, _dtype(func))).mod["main"]


def schedule_forward(sch, target: Target, knobs: CPUKnobs):
    """``forward`` on a given schedule (the tuning search's ``schedule_knobs`` calls it)."""
    inline_row_helpers(sch)
    chunk = _chunk(sch)
    lanes = row_lanes(chunk, vector_lanes(target) * knobs.accumulators)
    shift = split_reduction(sch, ROW_SHIFT, lanes) if has_stage(sch, ROW_SHIFT) else []
    row, _, stages = place_row_stages(sch, lanes)
    if len(shift) == 2:  # the first chunk's max, under the row before its chunks
        sch.compute_at(shift[0], row)
    for blk in present_blocks(sch, SHARD_GATHERS):
        sch.parallel(sch.get_loops(blk)[0])
    row_loops = parallel_rows(sch, row, knobs.row_grain)
    if len(shift) == 2:  # in vector accumulators
        vector_accumulator(sch, shift[0], row_loops, knobs.unroll)
    alone, swept = ride_along(sch, stages, row_loops + 1, lanes, knobs.unroll,
                              plain=sums_ride_the_exp(target))
    alone = logits_sum_in_max_loop(sch, alone, row_loops + 1)
    vector_accumulators(sch, alone, outer=row_loops + 1, unroll=knobs.unroll)
    steps = sch.get_loops(stages[CHUNK_EXPSUM][0])[row_loops + 1:-1]
    if steps and not has_stage(sch, CHUNK_EXP):  # absent when the chunk is one vector
        prefetch_ahead(sch, steps[0], chunk * knobs.prefetch)
    vector_row_independent(sch, vector_lanes(target) * knobs.accumulators)
    init_row_totals(sch)
    width = vector_lanes(target) * knobs.accumulators
    for blk in present_blocks(sch, [LOG_PROB, CHUNK_LOGITS] + ([] if swept else [CHUNK_EXP])):
        vectorize_inner(sch, blk, width)
    kept = present_blocks(sch, [CHUNK_EXP])  # the log-prob kernels: exp reads the chunk
    if kept and chunk % width == 0 and chunk > width:
        prefetch_ahead(sch, swept or sch.get_loops(kept[0])[-2], chunk * knobs.prefetch)
    return sch


# The log-probs' stats variant (``Variant.stats``) sweeps a chunk in one loop
# after its max: the kept exp, the plain kernel's two sums of it (``SWEPT``) and
# the three statistics (``RIDERS``), which read nothing that loop does not have
# by then (the chunk's max, the kept exp, the chunk staged, capped, after the
# max); the kept exp then never leaves registers (LLVM drops its stores). On a
# 2-core EPYC (AVX-512) under load, 2048 x 32000 fp32, one thread, kernel calls
# interleaved, best of 15, three runs: plain 12.7-13.5 ms, stats 13.7-15.1 ms.
# The statistics as passes of their own over the chunk (in L1) cost +50%; riding
# the exp-sum's loop only, +22-27%; with the column ramp of the first argmax
# built cheaply (``_selected_offsets``), what is left is their arithmetic.
RIDERS = (CHUNK_ZSUM, CHUNK_SQSUM, CHUNK_FIRST)
SWEPT = (CHUNK_WXSUM, CHUNK_EXPSUM)


def sums_ride_the_exp(target: Target) -> bool:
    """Whether the plain log-prob kernels' two sums (``SWEPT``) ride the kept
    exp's loop as the stats variant's do: on AVX-512 (32 vector registers).
    In-process A/B on a 2-core Zen 4 EPYC, the same outputs bit for bit, at
    4096 x 32000, 8192 x 50257 and 2048 x 128256, two runs: float32 0.66-0.76x
    the time of the separate loops, bfloat16 0.61-0.80x. The AVX2
    build of the same kernels, run there, was 0.92-0.93x in float32 but
    2.0-2.3x in bfloat16 (16 registers for the merged loop and the staged
    chunk's widening): AVX2 keeps the loops."""
    return bool(target_has_features("avx512f", target))


def ride_along(sch, stages: dict, outer: int, lanes: int, unroll: int = 1,
               plain: bool = False):
    """Merge the chunk loops after the max into one, for the stats variant (and,
    with ``plain``, for the plain log-prob kernels): the kept exp's (split by
    ``lanes``), then the vector-step loops of the rfactor blocks of the
    ``RIDERS`` and the ``SWEPT`` sums, and their lane reductions after it;
    vectorise those as ``vector_accumulator`` and ``vectorize_inner`` would.
    Returns ``(stages left to vector_accumulators, merged loop or None)``:
    without riders or ``plain`` nothing is touched.

    ``merge`` puts the merged loop where its last argument's loop was and keeps
    the arguments' order in its body, without checking dependences: the
    exp-sum goes last, so the merged loops sit where its loops were, after
    everything the body reads; the exp comes first in the body, before the
    sums that read what it keeps. A reduction one vector long (no step loop)
    leaves everything as it is.

    A row taken against its shift (``ce_row_shift``) has its chunk's max in the
    merged loop too, which then streams the chunk in and sweeps it once."""
    names = [name for name in RIDERS if name in stages]
    kept = present_blocks(sch, [CHUNK_EXP])
    if not (names or plain) or not kept:
        return stages, None
    names += [name for name in SWEPT if name in stages]
    if has_stage(sch, ROW_SHIFT):  # no chunk max before the exp: it rides too
        names.insert(0, CHUNK_MAX)
    group = [stages[name] for name in names]
    if any(len(blocks) != 2 or len(sch.get_loops(blocks[0])) != outer + 2 for blocks in group):
        return stages, None
    exp_steps, exp_lanes = sch.split(sch.get_loops(kept[0])[outer], [None, lanes])
    steps = [exp_steps]
    for rf, _ in group:
        lane, step = sch.get_loops(rf)[outer:]
        sch.reorder(step, lane)
        steps.append(step)
    merged = sch.merge(*steps)
    if len(group) > 1:
        sch.merge(*[sch.get_loops(final)[outer] for _, final in group])
    extent = sch.get(merged).extent
    if unroll > 1 and isinstance(extent, tirx.IntImm) and extent.value > unroll:
        merged, inner = sch.split(merged, [None, unroll])
        sch.unroll(inner)
    sch.vectorize(exp_lanes)
    for rf, _ in group:
        sch.vectorize(sch.get_loops(rf)[-1])
    for rf, _ in group:
        sch.decompose_reduction(rf, sch.get_loops(rf)[outer])
    return {name: blocks for name, blocks in stages.items() if name not in names}, merged


def logits_sum_in_max_loop(sch, stages: dict, outer: int) -> dict:
    """The forward's chunk max and logits' sum (label smoothing's ``sum_c w_c
    x_c``) in one loop: the max's pass streams the chunk in from memory and has
    room for one more vector add, so the sum's own pass over the chunk (from
    L1) goes, where the sum reads only the chunk and the class weights (not in
    the log-prob kernels, whose sum reads the kept ``exp``). The merged loop
    sits where the first of the two was, before either's lane reduction. Each
    lane loop is vectorised and each accumulator initialised before the loop,
    as ``vector_accumulator`` does; returns the stages left to it. Nothing
    changes where the sum already rides the exp's loop (``ride_along``) or a
    reduction is one vector long.

    Interleaved on a 2-core Zen 3 EPYC (znver3), the same outputs bit for bit,
    4096 x 32000 / 8192 x 50257 / 2048 x 128256: fp32 0.95x / 0.84x / 0.94x the
    time of the two loops, bf16 0.94x / 0.97x / 0.94x.

    A row taken against its shift (``ce_row_shift``, read before the chunks)
    also has its chunk's exp-sum in that loop, which then sweeps the chunk once
    (with or without the logits' sum)."""
    names = [CHUNK_MAX, CHUNK_WXSUM] if CHUNK_WXSUM in stages else [CHUNK_MAX]
    if has_stage(sch, ROW_SHIFT):
        names.append(CHUNK_EXPSUM)
    pairs = [stages.get(name, []) for name in names]
    if len(pairs) < 2 or any(len(pair) != 2 or len(sch.get_loops(pair[0])) != outer + 2
                             for pair in pairs):
        return stages
    extents = [sch.get(sch.get_loops(rf)[-1]).extent for rf, _ in pairs]  # the vector steps
    if not all(tvm_ffi.structural_equal(extents[0], e) for e in extents[1:]) or not all(
            _reads_only_inputs_of(sch, pairs[0], pair) for pair in pairs[1:]):
        return stages
    chunk_loop = sch.get_loops(pairs[0][0])[outer - 1]
    order = [sch.get(b).name_hint for b in sch.get_child_blocks(chunk_loop)]
    pairs.sort(key=lambda pair: -order.index(sch.get(pair[0]).name_hint))  # the first one last
    steps = []
    for rf, _ in pairs:
        lane, step = sch.get_loops(rf)[outer:]
        sch.reorder(step, lane)
        steps.append(step)
    sch.merge(*steps)  # where its last argument's loop was
    for rf, _ in pairs:
        sch.vectorize(sch.get_loops(rf)[-1])
        sch.decompose_reduction(rf, sch.get_loops(rf)[outer])
    return {name: blocks for name, blocks in stages.items() if name not in names}


def _reads_only_inputs_of(sch, max_pair, sum_pair) -> bool:
    """Whether the sum's split block reads nothing but the kernel's inputs, the
    row's shift (``ce_row_shift``, computed before the chunks), what the max
    reads (the staged chunk) and its own accumulator: the log-prob kernels' sum
    of ``p x`` reads the kept ``exp``, and a softcapped kernel's sum the capped
    chunk, which both come after the max."""
    def buffers(region_list):
        return {region.source.name for region in region_list}

    max_rf, sum_rf = sch.get(max_pair[0]), sch.get(sum_pair[0])
    inputs = {p.name for p in sch.mod["main"].params if hasattr(p, "shape")} | {ROW_SHIFT}
    return buffers(sum_rf.reads) <= inputs | buffers(max_rf.reads) | buffers(sum_rf.writes)


def sum_with_max(sch, stages: dict) -> None:
    """Sweep a chunk's logit sum (``ce_chunk_wxsum``, label smoothing's) in the
    loop of its max, the training kernel's counterpart of
    ``logits_sum_in_max_loop``: one pass over the chunk fewer, and for a 16-bit
    chunk one load and widening for both vector accumulators (bf16, C = 32000:
    2.30 -> 2.15 instructions per element on ``znver5``, 5.34 -> 4.95 on
    ``znver3``). A float32 chunk counts one instruction more per vector merged
    (each loop folded its load into the ``vmaxps`` or ``vaddps``: 2.02 ->
    2.06), yet runs faster: interleaved on ``znver3``, 4096 x 32000 / 8192 x
    50257 / 2048 x 128256, 0.97-0.99x / 0.94-0.95x / 0.91-0.94x the time of the
    two loops, the same outputs bit for bit. ``merge`` puts the loop where its
    last argument's was, the max's, before the ``exp`` that reads the max; the
    sum reads only the logits (and class weights): not with a softcap, whose
    sum reads the capped chunk, staged after the max. Reductions one vector
    long (no loop of vector steps) are left as they are."""
    max_pair, sum_pair = stages.get(CHUNK_MAX, []), stages.get(CHUNK_WXSUM, [])
    blocks = [sum_pair, max_pair]  # merged in this order: the loop goes where the max's was
    if any(len(pair) != 2 for pair in blocks) or not _reads_only_inputs_of(sch, max_pair,
                                                                          sum_pair):
        return
    depth = len(sch.get_loops(sch.get_sblock(ROWSTATS))) + 2  # rows, chunk, steps, lanes
    loops = [sch.get_loops(pair[0]) for pair in blocks]
    if any(len(nest) != depth for nest in loops) or not tvm_ffi.structural_equal(
            sch.get(loops[0][-2]).extent, sch.get(loops[1][-2]).extent):
        return
    sch.merge(loops[0][-2], loops[1][-2])


def exp_with_max(sch, stages: dict, lanes: int) -> bool:
    """With a row shift (``ce_row_shift``), the training sweep's kept ``exp`` and
    its sum in the loop of the chunk's max, which streams the chunk in: none of
    them reads another, so a chunk is swept once before its gradient (from the
    kept ``exp``, after the row). The merged loop sits where the max's was, the
    ``exp``'s lanes vectorised. Returns whether it merged: not without a
    shift, nor where a reduction is one vector long."""
    max_pair, sum_pair = stages.get(CHUNK_MAX, []), stages.get(CHUNK_EXPSUM, [])
    if not has_stage(sch, ROW_SHIFT) or len(max_pair) != 2 or len(sum_pair) != 2:
        return False
    depth = len(sch.get_loops(sch.get_sblock(ROWSTATS))) + 2  # rows, chunk, steps, lanes
    loops = [sch.get_loops(pair[0]) for pair in (max_pair, sum_pair)]
    extents = [sch.get(nest[-2]).extent for nest in loops]
    if any(len(nest) != depth for nest in loops) or not tvm_ffi.structural_equal(*extents):
        return False
    exp_steps, exp_lanes = sch.split(sch.get_loops(sch.get_sblock(CHUNK_EXP))[-1],
                                     [extents[0], lanes])
    sch.merge(exp_steps, loops[1][-2], loops[0][-2])  # where the last one is: the max's
    sch.vectorize(exp_lanes)
    return True


def backward(func, target: Target, knobs: CPUKnobs | None = None):
    """Schedule ``ce_tvm.kernels.backward_func`` for ``target``; returns the scheduled PrimFunc."""
    return schedule_backward(s_tir.Schedule(func), target,
                           knobs or hand_knobs("backward", target, _dtype(func))).mod["main"]


def schedule_backward(sch, target: Target, knobs: CPUKnobs):
    """``backward`` on a given schedule (the tuning search's ``schedule_knobs`` calls it)."""
    inline_row_helpers(sch)
    grad, row = place_grad_coefficients(sch)
    parallel_rows(sch, row, knobs.row_grain)
    vector_row_independent(sch, vector_lanes(target) * knobs.accumulators)
    init_row_totals(sch)
    vectorize_inner(sch, grad, vector_lanes(target) * knobs.accumulators)
    return sch


def per_row(func, target: Target, knobs: CPUKnobs = CPUKnobs()):
    """Schedule a kernel over rows only (``shard_combine_func``): rows in parallel."""
    sch = s_tir.Schedule(func)
    inline_row_helpers(sch)
    for blk in [sch.get_sblock(name) for name in COMBINE_ROWS]:
        if is_per_row(sch, blk):
            sch.parallel(sch.get_loops(blk)[0])
    init_row_totals(sch)
    return sch.mod["main"]


def train(func, target: Target, knobs: CPUKnobs | None = None):
    """Schedule ``ce_tvm.kernels.train_func`` for ``target``; returns the scheduled
    PrimFunc."""
    return schedule_train(s_tir.Schedule(func), target,
                           knobs or hand_knobs("train", target, _dtype(func))).mod["main"]


def schedule_train(sch, target: Target, knobs: CPUKnobs):
    """One sweep per row (``row_sweep``): the forward's chunk loop, where
    ``ce_chunk_exp`` keeps ``exp(x - chunk_max)`` in a per-row float32 scratch
    (L1 while the chunk is reduced, L2 after), then ``x_grad`` under the same
    row loop, reading the scratch back chunk by chunk. The logits are read
    from memory once and the gradient written once. The ``exp`` loop
    prefetches the chunk ``knobs.prefetch`` ahead (``prefetch_ahead``) and,
    for writing, the gradient's lines of the chunk it computes."""
    inline_row_helpers(sch)
    chunk = _chunk(sch)
    lanes = vector_lanes(target) * knobs.accumulators
    shift = (split_reduction(sch, ROW_SHIFT, row_lanes(chunk, lanes))
             if has_stage(sch, ROW_SHIFT) else [])
    sweep = row_sweep(sch, row_lanes(chunk, lanes))
    parallel_rows(sch, sweep.row, knobs.row_grain)
    sum_with_max(sch, sweep.stages)
    merged = exp_with_max(sch, sweep.stages, row_lanes(chunk, lanes))
    sweep_accumulators(sch, sweep)
    if len(shift) == 2:  # the first chunk's max, in vector accumulators
        loops = sch.get_loops(shift[0])
        sch.vectorize(loops[-1])
        sch.decompose_reduction(shift[0], loops[-2])
    vector_row_independent(sch, lanes)
    init_row_totals(sch)
    for blk in present_blocks(sch, [CHUNK_LOGITS] + ([] if merged else [CHUNK_EXP])):
        vectorize_inner(sch, blk, lanes)
    if shift:
        prefetch_next_row(sch, sch.get_loops(sch.get_sblock(ROWSTATS))[0])
    vectorize_gradient_by_chunk(sch, chunk, lanes)
    if chunk % lanes == 0 and chunk > lanes:  # a loop of vector steps to prefetch in
        prefetch_ahead(sch, sch.get_loops(sch.get_sblock(CHUNK_EXP))[-2], chunk * knobs.prefetch)
    return sch


# --- Prefetching the next chunk -------------------------------------------
# A row's chunk is streamed in from memory by its first pass (a copy when the
# chunk is staged, else its max) and then computed on from L1 (exp, sums):
# the hardware prefetcher does not run far enough ahead, so memory idles
# while ``exp`` computes. A software prefetch of the next chunk (the next
# row's first, after the last: rows are contiguous) in the ``exp`` loop
# overlaps the two (4096x32000 fp32 forward, 2 cores: 16.5 -> 12.5 ms). No
# schedule primitive emits prefetches: the schedule annotates the loop
# (``PREFETCH_ATTR``, a traced instruction, so a tuning record replays it) and
# a pass after TVM's lowering adds the prefetches to it.
#
# The training kernel writes a row's gradient after its sweep. Each line it
# stores to is first read from memory (write-allocate) when the stores reach
# it, and that loop has little compute to hide the wait behind. The same ``exp``
# loop therefore also prefetches, for writing (``prefetchw``), the gradient's
# lines at the elements it reads; the row's gradient then waits in L2
# (in-process A/B, 2-core AVX2 EPYC: fp32 1024x32000 31.4 -> 27.4 ms,
# 4096x32000, 1024x50257 and 512x128256 3% faster; bf16 within noise).
# Where ``cpu_stores`` streams the gradient's stores past the caches instead,
# those prefetches run only on the plain path.

PREFETCH_ATTR = "ce_tvm_prefetch_distance"
TIR_PIPELINE = "ce_tvm_llvm"
_LINE_BYTES = 64


def prefetch_ahead(sch, loop, distance: int) -> None:
    """Mark ``loop`` (a chunk's vector-step loop that reads the chunk, from the
    logits or their staged copy) to prefetch the logits ``distance`` elements
    ahead of what each iteration reads (0: no prefetch)."""
    if distance:
        sch.annotate(loop, PREFETCH_ATTR, distance)


def _dtype(func) -> str:
    """The dtype of ``func``'s ``[N, C]`` rows (the logits, or the log-probs)."""
    return str(matrix_param(func).dtype)


def _chunk(sch) -> int:
    """The chunk the compute reduces a row in (before the chunk loops are merged)."""
    return int(sch.get(sch.get_loops(sch.get_sblock(CHUNK_MAX))[-1]).extent)


def _first_index(access, buffer, body, inner=()):
    """The flat index, in scalars, of the first element a load or store of
    ``buffer`` reads or writes: ``Bind``s of ``body`` substituted, a ``Ramp``'s
    base, the loop variables ``inner`` at 0 (a buffer of vectors, as
    ``StorageRewrite`` may leave a staged chunk, counts its lanes)."""
    index = unbound(access.indices[-1], binds(body))
    if isinstance(index, tirx.Ramp):
        index = index.base
    zeros = {v: tirx.const(0, v.ty) for v in inner}
    index = tvm_ffi.structural_map(index, [(tirx.Var, lambda v: zeros.get(v, v))])
    lanes = tvm.runtime.DataType(str(buffer.dtype)).lanes
    return index * tirx.const(lanes, index.ty) if lanes > 1 else index


def _staged_chunk(stmt):
    """``(logits buffer, where the chunk starts in it)`` when ``stmt`` copies a
    chunk of the logits into ``ce_chunk_logits``, else ``None``."""
    for store in collect_nodes(stmt, tirx.BufferStore):
        sources = loads_of(store.value, LOGITS)
        if store.buffer.name == CHUNK_LOGITS and sources:
            logits = sources[0].source
            start = tvm.sym.Analyzer().simplify(_first_index(sources[0], logits, stmt)
                                                - _first_index(store, store.buffer, stmt))
            copy_loops = [f.loop_var for f in collect_nodes(stmt, tirx.For)]
            return None if any(depends_on(start, v) for v in copy_loops) else (logits, start)
    return None


def _with_prefetch(loop, staged, grad=None, streamed=()):
    """``loop`` (marked by ``prefetch_ahead``) with prefetches, at the top of
    each iteration, of every cache line of the logits ``PREFETCH_ATTR``
    elements ahead of those it reads. ``staged``: ``_staged_chunk`` of the
    copy before it, used when the loop reads the staged chunk. ``grad``: the
    gradient buffer of a training kernel (same shape as the logits), whose
    lines at the elements the loop reads are fetched for writing, only where
    its stores are plain if it is among ``streamed`` (``cpu_stores``)."""
    distance = int(loop.annotations[PREFETCH_ATTR])
    body, var = loop.body, loop.loop_var
    inner = [f.loop_var for f in collect_nodes(body, tirx.For)]
    direct = [(ld.source, first) for ld in loads_of(body, LOGITS)
              if depends_on(first := _first_index(ld, ld.source, body, inner), var)]
    reads = loads_of(body, CHUNK_LOGITS)
    if direct:
        logits, first = direct[0]
    elif staged is not None and reads:
        logits, start = staged
        first = start + _first_index(reads[0], reads[0].source, body, inner)
    else:
        return loop
    step = _per_iteration(first, var)
    if not isinstance(step, tirx.IntImm):
        return loop
    fetches = _line_prefetches(logits, first + tirx.const(distance, first.ty), step, write=False)
    if grad is not None:
        writes = _line_prefetches(grad, first, step, write=True)
        writes = writes[0] if len(writes) == 1 else tirx.SeqStmt(writes)
        fetches.append(tirx.IfThenElse(fits_in_cache(grad), writes, None)
                       if any(grad.same_as(b) for b in streamed) else writes)
    return tirx.For(var, loop.min, loop.extent, loop.kind, tirx.SeqStmt(fetches + [body]),
                    loop.thread_binding, loop.annotations)


def _per_iteration(first, var):
    """How far the flat index ``first`` moves in one iteration of the loop over ``var``."""
    return tvm.sym.Analyzer().simplify(tvm_ffi.structural_map(first, [(tirx.Var, lambda v: (
        v + tirx.const(1, v.ty) if v.same_as(var) else v))]) - first)


def _line_prefetches(buffer, start, count, write: bool, locality: int = 3) -> list:
    """Prefetches, for reading or writing, of every cache line of ``buffer``'s
    ``count`` elements from flat index ``start`` (``locality`` 3: into L1, 2: L2)."""
    per_line = max(1, _LINE_BYTES * 8 // tvm.runtime.DataType(str(buffer.dtype)).bits)
    return [tirx.Evaluate(tirx.call_intrin(
        "void", "tirx.prefetch", tirx.address_of(tirx.BufferLoad(
            buffer, [start + tirx.const(o, start.ty)])), int(write), locality, 1))
        for o in range(0, int(count.value), per_line)]


def _marked_loop(stmt):
    """The loop ``prefetch_ahead`` marked that ``stmt`` is or guards, else ``None``.
    Rows split into tasks (``row_grain`` > 1) test ``row < N``, and lowering
    hoists that test above the chunk's loops: the marked loop is then the
    ``then`` of an ``if`` in the sequence."""
    if isinstance(stmt, tirx.IfThenElse) and stmt.else_case is None:
        stmt = stmt.then_case
    return stmt if isinstance(stmt, tirx.For) and PREFETCH_ATTR in stmt.annotations else None


def _prefetch_in(seq, grad=None, streamed=()):
    """``_with_prefetch`` on the marked loops of a statement sequence (``grad``,
    ``streamed``: as there)."""
    if not any(_marked_loop(stmt) is not None for stmt in seq.seq):
        return seq
    staged, out = None, []
    for stmt in seq.seq:
        staged = _staged_chunk(stmt) or staged
        loop = _marked_loop(stmt)
        if loop is not None:
            fetched = _with_prefetch(loop, staged, grad, streamed)
            stmt = fetched if loop.same_as(stmt) else tirx.IfThenElse(stmt.condition, fetched, None)
        out.append(stmt)
    return tirx.SeqStmt(out)


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def prefetch_marked_loops(func, mod, ctx):
    """Add prefetches to the loops ``prefetch_ahead`` marked (after lowering); in
    a training kernel also of the gradient's lines (``_with_prefetch``) where
    they are not streamed (``cpu_stores``)."""
    if not any(PREFETCH_ATTR in f.annotations for f in collect_nodes(func.body, tirx.For)):
        return func
    grads = [st.buffer for st in collect_nodes(func.body, tirx.BufferStore)
             if st.buffer.name == X_GRAD]
    grad, streamed = (grads[0] if grads else None), streamed_outputs(func)
    return func.with_body(tvm_ffi.structural_map(
        func.body, [(tirx.SeqStmt, lambda seq: _prefetch_in(seq, grad, streamed))],
        order="post"))


# --- Prefetching the next row ----------------------------------------------
# A training kernel reads a row while it sweeps it and writes the row's
# gradient after: each core's memory traffic alternates between reads (the
# sweep) and writes (the gradient), where a copy keeps both in flight. Where a
# float32 gradient is streamed past the caches (``cpu_stores``), the loops
# that write it also prefetch the next row's logits into L2, at the columns
# they write, so the next sweep reads from L2. Measured on a 2-core Zen 4 in
# one process (docs/performance.md, "The next row prefetched while the
# gradient streams out"): the kernels that take each row against its first
# chunk's max (AVX-512) 1.14-1.27x faster at five shapes without label
# smoothing's terms, 1.16-1.25x with them; those with each chunk against its
# own max 0.92-1.09x, and every kernel with plain stores 0.89-1.02x, so the
# schedule marks only the former (``prefetch_next_row``) and the pass adds
# nothing where the stores are plain.

NEXT_ROW_ATTR = "ce_tvm_prefetch_next_row"


def prefetch_next_row(sch, loop) -> None:
    """Mark a training kernel (by ``loop``, one of its loops) whose streamed
    gradient's loops prefetch the next row's logits."""
    sch.annotate(loop, NEXT_ROW_ATTR, 1)


def _next_row_in(loop, logits, classes: int, streamed):
    """``loop`` with prefetches, to L2, of the logits one row below the elements
    each iteration writes, when it writes a streamed gradient (and only on a
    launch that streams it) and reads no logits."""
    body = loop.body
    stores = [st for st in collect_nodes(body, tirx.BufferStore) if st.buffer.name == X_GRAD]
    if not stores or loads_of(body, LOGITS) or collect_nodes(body, tirx.For):
        return loop
    grad = stores[0].buffer
    if not any(grad.same_as(b) for b in streamed):
        return loop
    first = _first_index(stores[0], grad, body)
    step = _per_iteration(first, loop.loop_var)
    if not isinstance(step, tirx.IntImm):
        return loop
    fetches = _line_prefetches(logits, first + tirx.const(classes, first.ty), step,
                               write=False, locality=2)
    fetch = tirx.IfThenElse(streams(grad), fetches[0] if len(fetches) == 1
                            else tirx.SeqStmt(fetches), None)
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                    tirx.SeqStmt([fetch, body]), loop.thread_binding, loop.annotations)


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def prefetch_next_rows(func, mod, ctx):
    """In a kernel ``prefetch_next_row`` marked, ``_next_row_in`` on every loop; not
    in one whose gradient is written a row late (``cpu_lagged_rows``), while the
    next row is swept: read already."""
    if (not any(NEXT_ROW_ATTR in f.annotations for f in collect_nodes(func.body, tirx.For))
            or is_lagged(func)):
        return func
    loads = loads_of(func.body, LOGITS)
    rows = [d.buffer for d in collect_nodes(func.body, tirx.DeclBuffer)
            if d.buffer.name == LOGITS and len(d.buffer.shape) == 2]
    streamed = streamed_outputs(func)
    if not loads or not rows or not streamed:
        return func
    logits, classes = loads[0].source, int(rows[0].shape[1])
    return func.with_body(tvm_ffi.structural_map(
        func.body, [(tirx.For, lambda loop: _next_row_in(loop, logits, classes, streamed))],
        order="post"))


# TVM's LLVM codegen builds a ``Ramp`` lane by lane, and LLVM turns a 32-lane
# int32 one into about ten shuffles; ``Broadcast(base) + Ramp(0, stride)`` (a
# constant) is two instructions. The one-hot test of the gradient compares
# such a ramp of column indices with the target in every vector (bf16 training
# kernel in cache: 0.25 -> 0.225 ns per element per core). Only comparisons
# are rewritten: a ramp that indexes a buffer must stay one (a contiguous access).
_COMPARISONS = (tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE)


def _as_offsets(value):
    if (isinstance(value, tirx.Ramp) and str(value.ty).startswith("int32")
            and not (isinstance(value.base, tirx.IntImm) and value.base.value == 0)):
        lanes = int(value.lanes)
        return tirx.Broadcast(value.base, lanes) + tirx.Ramp(
            tirx.const(0, "int32"), value.stride, lanes)
    return value


def _compare_offsets(cmp):
    a, b = _as_offsets(cmp.a), _as_offsets(cmp.b)
    return cmp if a.same_as(cmp.a) and b.same_as(cmp.b) else type(cmp)(a, b)


def _selected_offsets(sel):
    """A ramp of column indices selected as a value (the stats variant's first
    argmax: ``Select(x == max, column, none)``), built the same way: in the
    loop of its sum, 9 shuffles and ORs per two vectors became 2 instructions."""
    t, f = _as_offsets(sel.true_value), _as_offsets(sel.false_value)
    if t.same_as(sel.true_value) and f.same_as(sel.false_value):
        return sel
    return tirx.Select(sel.condition, t, f)


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def compared_ramps_as_offsets(func, mod, ctx):
    """Compare (and select) int32 ramps as a broadcast base plus a constant ramp
    (see above)."""
    return func.with_body(tvm_ffi.structural_map(
        func.body, [(kind, _compare_offsets) for kind in _COMPARISONS]
        + [(tirx.Select, _selected_offsets)], order="post"))


def _pipeline():
    lower, finalize_host, finalize_device = tvm.tirx.compilation_pipeline.PIPELINE_MAP["s_tir"]()
    return (tvm.transform.Sequential([lower, tree_lane_reductions, lagged_gradient_rows,
                                      prefetch_marked_loops,
                                      prefetch_next_rows, compared_ramps_as_offsets,
                                      bf16_pairs_widening, bf16_widening, bf16_rounding,
                                      stream_output_stores]),
            finalize_host, finalize_device)


tvm.tirx.register_tir_pipeline(TIR_PIPELINE, _pipeline)


def divergence(func, target: Target, knobs: CPUKnobs | None = None):
    """Schedule ``ce_tvm.kernels.divergence_func``: rows in parallel; under each
    row, the row reductions in their order (the two maxima, the two exp-sums,
    the divergence's sums), each rfactored into ``lanes`` vector accumulators
    (``accumulators`` native vectors: two dependency chains), then the per-row
    outputs and the gradient's vectorised pass, which writes each element
    after reading it (in place). A row of both models' logits (1 MB at
    C = 128256 fp32) is read once from memory and again from L2 by each later
    reduction: whole-row passes rather than the forward's L1 chunks, the
    simpler nest, since two GEMMs per row chunk outweigh these passes
    (``benchmarks/distillation_bench.py``)."""
    knobs = knobs or CPUKnobs()
    sch = s_tir.Schedule(func)
    lanes = row_lanes(classes_of(func), vector_lanes(target) * knobs.accumulators)
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    rfs = {name: split_reduction(sch, name, lanes) for name in names
           if any(v.iter_type == tirx.IterVar.CommReduce
                  for v in sch.get(sch.get_sblock(name)).iter_vars)}
    order = [blk for name in names for blk in rfs.get(name, [sch.get_sblock(name)])]
    row, roots = divergence_row(sch, order)
    sch.parallel(row)
    keep_outputs_cached(sch, row)
    for blocks in rfs.values():
        if len(blocks) == 1:
            continue
        if any(sch.get(blocks[0]).same_as(sch.get(r)) for r in roots):  # rows, steps, lanes
            sch.vectorize(sch.get_loops(blocks[0])[-1])
            sch.decompose_reduction(blocks[0], sch.get_loops(blocks[0])[1])
        else:  # regenerated under the rows: lanes, steps
            vector_accumulator(sch, blocks[0], 1)
    if X_GRAD in names:
        vectorize_inner(sch, sch.get_sblock(X_GRAD), lanes)
    return sch.mod["main"]
