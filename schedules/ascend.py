"""Ascend-style tiled schedule, built from the tiling plan of ``ascend_plan``
(hardware profiles, plan, cost model), validated by compiling through LLVM.

No Ascend compiler is available here, so the schedule is expressed in TVM's
generic language the way an AI Core kernel must be laid out, and its numerics
are checked on the CPU:

1. Rows are split into ``block_dim`` parallel blocks (one per vector core).
2. A row is cut into ``chunk``-element tiles sized so that every live buffer
   of the plan fits the Unified Buffer (UB); each tile of the logits is staged
   into a local scratch buffer (``cache_read`` into ``local`` at the tile loop),
   double-buffered (``double_buffer_scope``) when the plan has room for two.
3. The compute on a tile is vectorised (``lanes`` float32 per instruction).
4. When a whole row fits the UB it is staged once and everything (max,
   exp-sum, ``log_prob``) is computed from UB: one read of the logits. Longer
   rows keep an online max/sum over tiles (the compute's ``_softmax_merge``)
   and read the row a second time only to write ``log_prob``: two reads, where
   the vendor kernel makes three plus the write. The log-probs and entropy read
   the row once whatever its tiles (``log_probs``: no output tile in UB).

Tile sizes are multiples of 32 bytes of the storage dtype and of one float32
vector repeat (64 elements), unless the tile is the whole row.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.target import Target

from ..kernels.common import matrix_param
from ..kernels.stages import CHUNK_EXP, CHUNK_WSUM, LOG_PROB, X_GRAD
from ._common import (
    COMBINE_ROWS,
    SHARD_GATHERS,
    classes_of,
    divergence_row,
    init_row_totals,
    inline_capped_chunk,
    inline_row_helpers,
    is_per_row,
    place_grad_coefficients,
    place_row_stages,
    present_blocks,
    row_lanes,
    row_sweep,
    split_reduction,
    sweep_accumulators,
    vector_accumulators,
    vector_row_independent,
    vectorize_inner,
)
from .ascend_plan import DIVERGENCE, get_profile, plan


def forward_chunk(classes: int, dtype: str, target: Target, profile: str = "910b") -> int:
    """The compute's row chunk: the plan's UB tile."""
    return plan(get_profile(profile), 1, classes, dtype, "forward").chunk


def train_chunk(classes: int, dtype: str, target: Target, profile: str = "910b") -> int:
    """The training compute's row chunk: the training plan's UB tile."""
    return plan(get_profile(profile), 1, classes, dtype, "train").chunk


def log_probs_chunk(classes: int, dtype: str, target: Target, profile: str = "910b") -> int:
    """The log-prob compute's row chunk: the log-prob plan's UB tile (no output tile)."""
    return plan(get_profile(profile), 1, classes, dtype, "log_probs").chunk


def _stage(sch, consumers, loop, buffers: int, buffer: str = "x"):
    """Stage the tile of ``buffer`` read by ``consumers`` into a local buffer at ``loop``."""
    reads = [r.source.name for r in sch.get(consumers[0]).reads]
    staged = sch.cache_read(consumers[0], reads.index(buffer), "local",
                            consumer_blocks=consumers)
    sch.compute_at(staged, loop)
    if buffers == 2:
        sch.annotate(staged, "double_buffer_scope", 0)
    return staged


def _parallel_rows(sch, row, cores: int) -> None:
    """Split the row loop into one block of rows per vector core, in parallel."""
    blocks, _ = sch.split(row, [cores, None])
    sch.parallel(blocks)


def forward(func, target: Target, profile: str = "910b"):
    """Schedule ``ce_tvm.kernels.forward_func`` (built with ``forward_chunk``) from the plan."""
    return _row_sweep(func, get_profile(profile), "forward")


def log_probs(func, target: Target, profile: str = "910b"):
    """Schedule ``ce_tvm.kernels.log_probs_func`` (built with ``log_probs_chunk``) as the
    forward, from the log-prob plan."""
    return _row_sweep(func, get_profile(profile), "log_probs")


def _row_sweep(func, prof, op: str):
    """Rows in one block per vector core; each plan tile staged into UB (double-
    buffered when two fit), then reduced; a forward's log_prob written tile by tile."""
    sch = s_tir.Schedule(func)
    inline_row_helpers(sch)
    inline_capped_chunk(sch)  # softcap: tanh per read of the staged tile
    dtype = str(matrix_param(func).dtype)
    p = plan(prof, 1, classes_of(func), dtype, op)
    lanes = row_lanes(p.chunk, prof.repeat_bytes // 4)
    row, tile_loop, stages = place_row_stages(sch, lanes)
    readers = [blocks[0] for name, blocks in stages.items() if name != CHUNK_WSUM]
    log_prob = present_blocks(sch, [LOG_PROB])
    if p.tiles == 1:
        staged = [_stage(sch, readers + log_prob, row, p.buffers)]
    else:
        staged = [_stage(sch, readers, tile_loop, p.buffers)]
        if log_prob:
            tile, _ = sch.split(sch.get_loops(log_prob[0])[-1], [None, p.chunk])
            staged.append(_stage(sch, log_prob, tile, p.buffers))
    _parallel_rows(sch, row, prof.vector_cores)
    for blk in present_blocks(sch, SHARD_GATHERS):
        _parallel_rows(sch, sch.get_loops(blk)[0], prof.vector_cores)
    vector_accumulators(sch, stages, outer=3)
    vector_row_independent(sch, prof.repeat_bytes // 4)
    init_row_totals(sch)
    for blk in staged + log_prob:
        vectorize_inner(sch, blk, lanes)
    return sch.mod["main"]


def train(func, target: Target, profile: str = "910b"):
    """Schedule ``ce_tvm.kernels.train_func`` from the plan: rows in one block
    per core, each row one sweep (``row_sweep``) over UB tiles.

    When the row fits the UB, the logits are staged once and ``ce_chunk_exp``
    stays in UB (``local``) for the gradient: one read, one write. Otherwise
    ``ce_chunk_exp`` is inlined, so the gradient pass stages the logits again
    tile by tile and recomputes ``exp``: two reads, one write.
    """
    prof = get_profile(profile)
    sch = s_tir.Schedule(func)
    inline_row_helpers(sch)
    inline_capped_chunk(sch)  # softcap: tanh per read of the staged tile
    dtype = str(matrix_param(func).dtype)
    p = plan(prof, 1, classes_of(func), dtype, "train")
    lanes = row_lanes(p.chunk, prof.repeat_bytes // 4)
    fits = p.tiles == 1
    if not fits:
        sch.compute_inline(sch.get_sblock(CHUNK_EXP))
    sweep = row_sweep(sch, lanes)
    readers = [blocks[0] for name, blocks in sweep.stages.items() if name != CHUNK_WSUM]
    grad = sch.get_sblock(X_GRAD)
    if fits:
        kept = sch.get_sblock(CHUNK_EXP)
        # with softcap the gradient reads the logits too (the tanh's slope): from UB
        grad_reads_x = "x" in [r.source.name for r in sch.get(grad).reads]
        staged = [_stage(sch, readers + [kept] + ([grad] if grad_reads_x else []), sweep.row,
                         p.buffers)]
        sch.set_scope(kept, 0, "local")
    else:
        staged = [_stage(sch, readers, sweep.chunk, p.buffers)]
        tile, _ = sch.split(sch.get_loops(grad)[-1], [None, p.chunk])
        staged.append(_stage(sch, [grad], tile, p.buffers))
    _parallel_rows(sch, sweep.row, prof.vector_cores)
    sweep_accumulators(sch, sweep)
    vector_row_independent(sch, prof.repeat_bytes // 4)
    init_row_totals(sch)
    for blk in staged + ([kept] if fits else []) + [grad]:
        vectorize_inner(sch, blk, lanes)
    return sch.mod["main"]


def backward(func, target: Target, profile: str = "910b"):
    """Schedule ``ce_tvm.kernels.backward_func``: per-row coefficients, then the
    gradient tile by tile from a staged copy of ``log_prob`` (or the logits)."""
    prof = get_profile(profile)
    sch = s_tir.Schedule(func)
    inline_row_helpers(sch)
    dtype = str(matrix_param(func).dtype)
    p = plan(prof, 1, classes_of(func), dtype, "backward")
    grad, row = place_grad_coefficients(sch)
    tile, _ = sch.split(sch.get_loops(grad)[-1], [None, p.chunk])
    # log_prob or the logits (a probability target is read from memory, unstaged)
    staged = _stage(sch, [grad], tile, p.buffers, matrix_param(func).name)
    _parallel_rows(sch, row, prof.vector_cores)
    vector_row_independent(sch, prof.repeat_bytes // 4)
    init_row_totals(sch)
    for blk in (staged, grad):
        vectorize_inner(sch, blk, prof.repeat_bytes // 4)
    return sch.mod["main"]


def per_row(func, target: Target, profile: str = "910b"):
    """Schedule a kernel over rows only (``shard_combine_func``): one block of
    rows per vector core."""
    prof = get_profile(profile)
    sch = s_tir.Schedule(func)
    inline_row_helpers(sch)
    for blk in [sch.get_sblock(name) for name in COMBINE_ROWS]:
        if is_per_row(sch, blk):
            _parallel_rows(sch, sch.get_loops(blk)[0], prof.vector_cores)
    init_row_totals(sch)
    return sch.mod["main"]


def divergence(func, target: Target, profile: str = "910b"):
    """Schedule ``ce_tvm.kernels.divergence_func`` from the divergence plan: rows
    in one block per vector core, every stage under the row (``divergence_row``).

    When both rows fit the UB they are staged once, at the row, and every row
    reduction and the gradient read them from UB: one read of each side. Else
    each pass over the row (the maxima, exp-sums, the entropy's and the KL sums,
    the gradient) stages its tiles of the sides it reads, double-buffered when
    two fit: ``tiled_passes`` reads (ascend_plan). Each reduction is split into
    vector accumulators of up to one fp32 repeat (a divisor of the tile, so no
    accumulator straddles a tile), and the gradient is vectorised per tile.
    """
    prof = get_profile(profile)
    sch = s_tir.Schedule(func)
    classes = classes_of(func)
    p = plan(prof, 1, classes, str(matrix_param(func).dtype), DIVERGENCE)
    lanes = row_lanes(math.gcd(classes, p.chunk), prof.repeat_bytes // 4)
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    stages = {name: split_reduction(sch, name, lanes) if _reduces(sch, name) else
              [sch.get_sblock(name)] for name in names}
    row, roots = divergence_row(sch, [blk for name in names for blk in stages[name]])
    passes = [stages[name][0] for name in names if len(sch.get_loops(stages[name][0])) > 1]
    tiles = {}
    for blk in passes:  # [steps, lanes] under the row, the steps cut at tile boundaries
        loops = sch.get_loops(blk)[1:]
        if len(loops) == 2:
            if not any(sch.get(blk).same_as(sch.get(r)) for r in roots):
                sch.reorder(loops[1], loops[0])  # regenerated under the row: lanes, steps
            tiles[blk] = sch.split(sch.get_loops(blk)[1], [None, p.chunk // lanes])[0]
        elif p.tiles > 1:
            tiles[blk] = sch.split(loops[0], [None, p.chunk])[0]
    staged = []
    for side in ("student", "teacher"):
        readers = [blk for blk in passes if side in _reads(sch, blk)]
        if p.tiles == 1:
            staged.append(_stage(sch, readers, row, p.buffers, side))
        else:
            staged += [_stage(sch, [blk], tiles[blk], p.buffers, side) for blk in readers]
    _parallel_rows(sch, row, prof.vector_cores)
    for name in names:
        if len(stages[name]) == 2:
            rf = stages[name][0]
            sch.vectorize(sch.get_loops(rf)[-1])
            sch.decompose_reduction(rf, tiles.get(rf, sch.get_loops(rf)[2]))
    for blk in staged + present_blocks(sch, [X_GRAD]):
        vectorize_inner(sch, blk, lanes)
    return sch.mod["main"]


def _reduces(sch, name: str) -> bool:
    """Whether the block ``name`` reduces over the classes."""
    return any(v.iter_type == tirx.IterVar.CommReduce
               for v in sch.get(sch.get_sblock(name)).iter_vars)


def _reads(sch, block) -> set:
    return {r.source.name for r in sch.get(block).reads}

