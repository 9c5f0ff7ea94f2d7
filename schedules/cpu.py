"""LLVM (CPU) schedule for the fused cross-entropy forward and backward.

Expects the blocks that ``ce_tvm.compute`` names (see its module docstring);
the math is never touched here, only where and how each block runs.

Strategy, forward:

1. Every reduction over a row (``ce_rowmax``, ``ce_expsum``, ``ce_wlogpsum``) is
   split by ``lanes`` and rfactored, so it runs as ``lanes`` independent
   vector accumulators (two native vectors: two dependency chains).
2. The mask and row-weight blocks are inlined (a block with no block
   producer would be recomputed for every row by ``reverse_compute_at``). All per-row blocks move under the ``lse`` row loop (``compute_at`` for
   producers, ``reverse_compute_at`` for consumers), and that loop runs in
   parallel over the cores. A row is read from memory once by the first pass;
   the other passes over it hit the cache (a 32000-wide fp32 row is 128 KB).
3. The ``log_prob`` row write is vectorised.
4. The serial row totals (``ce_total_*``) stay at the root: N floats, a fixed
   order, so results are bit-identical run after run; their init is hoisted
   so that N = 0 still initialises them.

Backward: the per-row coefficient blocks move under the ``x_grad`` row loop,
which runs in parallel; the element loop is vectorised. ``log_prob`` (or the
logits) is read once and ``x_grad`` written once.

Vector width per row: the largest divisor of ``C`` that is at most
``lanes`` (two native vectors), so no loop carries a tail predicate. Real
vocabularies divide well (32000 -> 64... capped at ``lanes``; 50257 -> 29,
which LLVM lowers as 16+8+4+1 lanes). A prime ``C`` above ``lanes`` runs
scalar: correct, slower.

Why not a predicated tail: ``compute_at`` of an rfactored block drops the
split predicate (TVM 0.27; the tail then reads the next row), and
``LoopPartition`` only peels ``likely`` conditions, which ``split`` does not
emit.

Rejected: ``dlight.cpu.Reduction`` (scalar ``expf``, no vector accumulators);
a merged (max, sum) reducer (``rfactor`` rejects unregistered reducers).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width

from ._common import (
    CHUNK_REDUCTIONS,
    INLINED,
    ROW_FORWARD_REST,
    ROW_GRAD_COEFS,
    classes_of,
    existing_blocks,
    has_block,
    init_row_totals,
    is_per_row,
    row_lanes,
    split_reduction,
    vector_accumulators,
    vectorize_inner,
)

# Chunk of a row kept in L1 between its max and its exp-sum: at most 24 KB of
# float32 (half the 48 KB L1d of Zen 4/5), at least 8 vectors of accumulators.
MAX_CHUNK = 6144
MIN_CHUNK_VECTORS = 8


@dataclass(frozen=True)
class CPUKnobs:
    """Tunable constants of the CPU schedule.

    ``accumulators``: vector accumulators per row reduction; 2 hides the
    4-cycle FP add latency behind a second chain (measured on znver4/5).
    """

    accumulators: int = 2


def vector_lanes(target: Target, elem_bytes: int = 4) -> int:
    """float32 lanes of one native vector register of ``target``."""
    return max(1, llvm_get_vector_width(target) // (8 * elem_bytes))


def forward_chunk(classes: int, dtype: str, target: Target, knobs: CPUKnobs = CPUKnobs()) -> int:
    """Chunk of the compute's row reduction: the largest multiple of the row's
    vector width dividing ``C`` and at most ``MAX_CHUNK``; the whole row when
    ``C`` has no such divisor (the row then makes two passes through L2).
    ``dtype`` does not matter here: the float32 accumulators size the chunk."""
    lanes = row_lanes(classes, vector_lanes(target) * knobs.accumulators)
    fits = [b for b in range(lanes * MIN_CHUNK_VECTORS, min(classes, MAX_CHUNK) + 1, lanes)
            if classes % b == 0]
    return max(fits) if fits else classes


def forward(func, target: Target, knobs: CPUKnobs = CPUKnobs()):
    """Schedule ``ce_tvm.compute.forward_func`` for ``target``; returns the scheduled PrimFunc."""
    sch = s_tir.Schedule(func)
    for blk in existing_blocks(sch, INLINED):
        sch.compute_inline(blk)
    chunk = int(sch.get(sch.get_loops(sch.get_sblock("ce_chunk_max"))[-1]).extent)
    lanes = row_lanes(chunk, vector_lanes(target) * knobs.accumulators)
    names = [b for b in CHUNK_REDUCTIONS if has_block(sch, b)]
    stages = {name: split_reduction(sch, name, lanes) for name in names}
    row, chunk_loop = sch.get_loops(sch.get_sblock("ce_rowstats"))
    for name in reversed(names):
        for blk in reversed(stages[name]):
            sch.compute_at(blk, chunk_loop)
    for blk in existing_blocks(sch, ROW_FORWARD_REST):
        if is_per_row(sch, blk):
            sch.reverse_compute_at(blk, row)
    sch.parallel(row)
    for blocks in stages.values():
        if len(blocks) == 2:
            vector_accumulators(sch, blocks[0], outer=2)
    if has_block(sch, "log_prob"):
        vectorize_inner(sch, sch.get_sblock("log_prob"), row_lanes(
            classes_of(func), vector_lanes(target) * knobs.accumulators))
    init_row_totals(sch)
    return sch.mod["main"]


def backward(func, target: Target, knobs: CPUKnobs = CPUKnobs()):
    """Schedule ``ce_tvm.compute.backward_func`` for ``target``; returns the scheduled PrimFunc."""
    sch = s_tir.Schedule(func)
    for blk in existing_blocks(sch, INLINED):
        sch.compute_inline(blk)
    lanes = row_lanes(classes_of(func), vector_lanes(target) * knobs.accumulators)
    grad = sch.get_sblock("x_grad")
    row = sch.get_loops(grad)[0]
    for blk in reversed(existing_blocks(sch, ROW_GRAD_COEFS)):
        sch.compute_at(blk, row)
    vectorize_inner(sch, grad, lanes)
    sch.parallel(row)
    init_row_totals(sch)
    return sch.mod["main"]
