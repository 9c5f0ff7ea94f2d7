"""Schedule steps shared by the target schedules, and the groups of compute
stages they place (not a target itself).

Stage names come from ``ce_tvm.compute`` only. A stage a schedule needs is
looked up with ``sch.get_sblock`` (a missing one is an error); the groups
below hold stages that only some declarations or variants of the compute
have, looked up with ``present_blocks``.
"""

from __future__ import annotations

from tvm import tirx
from tvm.s_tir import ScheduleError

from ..compute import (
    CHUNK_EXPSUM,
    CHUNK_MAX,
    CHUNK_WSUM,
    CHUNK_WXSUM,
    GRAD_HOT,
    GRAD_MASK,
    GRAD_PSCALE,
    GRAD_SMOOTH,
    LOG_PROB,
    LOSS,
    LSE,
    ROW_CE,
    ROW_MASK,
    ROW_WEIGHT,
    ROW_Z,
    ROWSTATS,
    SHARD_LOCAL,
    SHARD_TARGET_LOGIT,
    SHARD_TARGET_WEIGHT,
    STAGES,
    TOTAL_CE,
    TOTAL_COUNT,
    TOTAL_WEIGHT,
    TOTAL_Z,
    X_GRAD,
    ZLOSS,
    matrix_param,
)

# Row reductions of the forward and shard statistics, reduced chunk by chunk;
# CHUNK_WSUM exists for a weighted variant only.
ROW_REDUCTIONS = (CHUNK_MAX, CHUNK_EXPSUM, CHUNK_WXSUM)
# Serial sums over rows: for sum and mean (and the mean backward) only.
ROW_TOTALS = (TOTAL_CE, TOTAL_Z, TOTAL_WEIGHT, TOTAL_COUNT)
# Per-row stages of the forward after the row statistics (not in the shard
# statistics; log_prob for the log-prob variant only).
ROW_FORWARD_REST = (LSE, ROW_CE, ROW_Z, LOG_PROB, LOSS, ZLOSS)
# Blocks inlined into their consumers: without a producer under the row loop,
# reverse_compute_at would recompute them for every row of the batch. Each
# belongs to some declarations only (the row weight to the mean only).
INLINED = (ROW_MASK, ROW_WEIGHT, GRAD_MASK, SHARD_LOCAL)
# Per-row gathers of a vocabulary shard's statistics: no producer, own row loop.
SHARD_GATHERS = (SHARD_TARGET_LOGIT, SHARD_TARGET_WEIGHT)
# Per-row blocks of the shard-combine kernel (rows already reduced over classes).
COMBINE_ROWS = (ROW_CE, ROW_Z, LOSS, ZLOSS)
# Per-row coefficients of the backward.
ROW_GRAD_COEFS = (GRAD_HOT, GRAD_SMOOTH, GRAD_PSCALE)


def present_blocks(sch, names) -> list:
    """The blocks of the stages ``names`` that this function has, in order.

    For stages that only some declarations or variants of the compute have.
    Every name must be a stage ``ce_tvm.compute`` declares (``STAGES``), so
    a stage renamed or removed there is an error here, never a block left
    unscheduled without a word.
    """
    unknown = [name for name in names if name not in STAGES]
    if unknown:
        raise ValueError(f"not stages of ce_tvm.compute: {unknown}")
    out = []
    for name in names:
        try:
            out.append(sch.get_sblock(name))
        except ScheduleError:  # get_sblock's "no block of this name": this variant lacks it
            continue
    return out


def has_stage(sch, name) -> bool:
    return bool(present_blocks(sch, [name]))


def chunk_reductions(sch) -> list:
    """Names of the forward's per-chunk row reductions in this function."""
    return list(ROW_REDUCTIONS) + ([CHUNK_WSUM] if has_stage(sch, CHUNK_WSUM) else [])


def place_row_stages(sch, lanes: int):
    """The forward phase every schedule shares (``forward_func`` and ``shard_stats_func``).

    Each chunk reduction is split by ``lanes`` and rfactored
    (``split_reduction``) and moved, with its rfactor block, under the chunk
    loop of ``ce_rowstats``, which merges them: a chunk is read from memory by
    the first reduction and from cache by the others. The per-row stages
    after it move under its row loop. Returns ``(row loop, chunk loop,
    {reduction: its blocks, producer first})``.
    """
    names = chunk_reductions(sch)
    stages = {name: split_reduction(sch, name, lanes) for name in names}
    row, chunk_loop = sch.get_loops(sch.get_sblock(ROWSTATS))
    for name in reversed(names):
        for blk in reversed(stages[name]):
            sch.compute_at(blk, chunk_loop)
    for blk in present_blocks(sch, ROW_FORWARD_REST):
        if is_per_row(sch, blk):
            sch.reverse_compute_at(blk, row)
    return row, chunk_loop, stages


def place_grad_coefficients(sch):
    """The backward phase every schedule shares: the per-row coefficients under
    the row loop of ``x_grad``. Returns ``(x_grad block, row loop)``."""
    grad = sch.get_sblock(X_GRAD)
    row = sch.get_loops(grad)[0]
    for blk in reversed([sch.get_sblock(name) for name in ROW_GRAD_COEFS]):
        sch.compute_at(blk, row)
    return grad, row


def init_row_totals(sch) -> None:
    """Hoist the init of the serial sums over rows out of their loop.

    Lowered as-is, a reduction initialises on its first iteration, which an
    empty batch (N = 0) never runs: the sum would be left uninitialised.
    """
    for block in present_blocks(sch, ROW_TOTALS):
        sch.decompose_reduction(block, sch.get_loops(block)[-1])


def classes_of(func) -> int:
    """C of a compute function: the static extent of its ``[N, C]`` input."""
    return int(matrix_param(func).shape[1])


def row_lanes(classes: int, max_lanes: int) -> int:
    """The largest divisor of ``classes`` that is at most ``max_lanes``."""
    return max(d for d in range(1, min(classes, max_lanes) + 1) if classes % d == 0)


def is_per_row(sch, block) -> bool:
    """True when ``block`` iterates over rows (``ce_loss`` of sum/mean is a single value)."""
    extent = sch.get(sch.get_loops(block)[0]).extent
    return not (isinstance(extent, tirx.IntImm) and extent.value == 1)


def split_reduction(sch, name, lanes):
    """Blocks of row reduction ``name``, producer first: ``[rfactor, final]``, or ``[block]``.

    The rfactor block holds ``lanes`` partial results per row (vector
    accumulators); with ``lanes == 1`` there is nothing to split.
    """
    block = sch.get_sblock(name)
    if lanes == 1:
        return [block]
    _, ci = sch.split(sch.get_loops(block)[-1], [None, lanes])
    return [sch.rfactor(ci, 0), block]


def vector_accumulators(sch, stages: dict, outer: int) -> None:
    """``vector_accumulator`` for every split reduction of ``place_row_stages``."""
    for blocks in stages.values():
        if len(blocks) == 2:
            vector_accumulator(sch, blocks[0], outer)


def vector_accumulator(sch, rf, outer: int):
    """Make the lanes loop of a placed rfactor block innermost and vectorised.

    ``compute_at`` regenerates the loops under the ``outer`` enclosing ones in
    block-iter order (lanes, then the vector-step loop, which is absent when
    the reduction is one vector long).
    """
    loops = sch.get_loops(rf)[outer:]
    if len(loops) == 2:
        sch.reorder(loops[1], loops[0])
    sch.vectorize(sch.get_loops(rf)[-1])
    sch.decompose_reduction(rf, sch.get_loops(rf)[outer])


def vectorize_inner(sch, block, lanes: int) -> None:
    """Vectorise the innermost (spatial) loop of ``block`` by ``lanes``.

    A tail that is not a multiple of ``lanes`` is peeled off with
    ``loop_partition`` and stays scalar (a split would put a predicate inside
    the vector loop, which TVM scalarises whole). Call it last: the partition
    wraps the loop in opaque blocks.
    """
    inner = sch.get_loops(block)[-1]
    extent = sch.get(inner).extent
    if lanes == 1 or not isinstance(extent, tirx.IntImm) or extent.value < lanes:
        return  # nothing to vectorise (C = 1 leaves only the row loop)
    extent = extent.value
    main = extent // lanes * lanes
    if main != extent:
        inner = sch.loop_partition(inner, [main])[0]
    sch.vectorize(sch.split(inner, [None, lanes])[1])


def inline_row_helpers(sch) -> None:
    """Inline the cheap per-row blocks that have no producer (``INLINED``)."""
    for blk in present_blocks(sch, INLINED):
        sch.compute_inline(blk)
