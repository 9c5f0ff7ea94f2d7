"""Stage names and schedule steps shared by the target schedules (not a target itself)."""

from __future__ import annotations

from tvm import tirx

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
ROW_TOTALS = ("ce_total_ce", "ce_total_z", "ce_total_weight", "ce_total_count")
CHUNK_REDUCTIONS = ("ce_chunk_max", "ce_chunk_expsum", "ce_chunk_wxsum", "ce_chunk_wsum")
ROW_FORWARD_REST = ("lse", "ce_row_ce", "ce_row_z", "log_prob", "ce_loss", "ce_zloss")
# Blocks inlined into their consumers: without a producer under the row loop,
# reverse_compute_at would recompute them for every row of the batch.
INLINED = ("ce_row_mask", "ce_row_weight", "ce_grad_mask", "ce_shard_local")
# Per-row gathers of a vocabulary shard's statistics: no producer, own row loop.
SHARD_GATHERS = ("ce_shard_target_logit", "ce_shard_target_weight")
# Per-row blocks of the shard-combine kernel (rows already reduced over classes).
COMBINE_ROWS = ("ce_row_ce", "ce_row_z", "ce_loss", "ce_zloss")
ROW_GRAD_COEFS = ("ce_grad_hot", "ce_grad_smooth", "ce_grad_pscale")


def existing_blocks(sch, names):
    """The blocks among ``names`` that this variant of the compute has."""
    out = []
    for name in names:
        try:
            out.append(sch.get_sblock(name))
        except Exception:  # noqa: BLE001 - TVM raises a bare error for a missing block
            continue
    return out


def init_row_totals(sch) -> None:
    """Hoist the init of the serial sums over rows out of their loop.

    Lowered as-is, a reduction initialises on its first iteration, which an
    empty batch (N = 0) never runs: the sum would be left uninitialised.
    """
    for block in existing_blocks(sch, ROW_TOTALS):
        sch.decompose_reduction(block, sch.get_loops(block)[-1])


def row_lanes(classes: int, max_lanes: int) -> int:
    """The largest divisor of ``classes`` that is at most ``max_lanes``."""
    return max(d for d in range(1, min(classes, max_lanes) + 1) if classes % d == 0)


def classes_of(func) -> int:
    """C of a compute function: the static extent of its 2-D ``[N, C]`` input."""
    return next(int(p.shape[1]) for p in func.params if len(getattr(p, "shape", ())) == 2)


def has_block(sch, name) -> bool:
    return bool(existing_blocks(sch, [name]))


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


def vector_accumulators(sch, rf, outer: int):
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
    for blk in existing_blocks(sch, INLINED):
        sch.compute_inline(blk)
