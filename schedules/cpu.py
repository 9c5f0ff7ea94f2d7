"""LLVM (CPU) schedule for the fused cross-entropy forward and backward.

Expects the blocks that ``ce_tvm.compute`` names (see its module docstring);
the math is never touched here, only where and how each block runs.

Strategy, forward (the compute reduces each row in chunks, see
``forward_chunk``):

1. Every per-chunk reduction (``ce_chunk_max``, ``_expsum``, ``_wxsum``,
   ``_wsum``) is split by the vector width and rfactored, so it runs as
   independent vector accumulators (two native vectors: two dependency
   chains).
2. The mask and row-weight blocks are inlined (a block with no block
   producer would be recomputed for every row by ``reverse_compute_at``).
3. The chunk reductions move under the chunk loop of ``ce_rowstats`` (which
   merges them): a chunk is read from memory by its first reduction and from
   L1 by the others. All per-row blocks move under the row loop, which runs
   in parallel over the cores.
4. ``log_prob`` (seed API) is written in one more vectorised pass over the
   row, which hits L2.
5. The serial row totals (``ce_total_*``) stay at the root: N floats, a fixed
   order, so results are bit-identical run after run; their init is hoisted
   so that N = 0 still initialises them.

Backward: the per-row coefficient blocks move under the ``x_grad`` row loop,
which runs in parallel; the element loop is vectorised. ``log_prob`` (or the
logits) is read once and ``x_grad`` written once.

Vector width: two native vectors (32 float32 lanes on AVX-512). A chunk is a
multiple of it when it can be (C = 32000 -> 4000, 128256 -> 5344; C = 50257
-> 9 chunks of 5600, the last overlapping the one before), so the reductions
carry no tail predicate; a row shorter than ``MAX_CHUNK`` is one chunk, vectorised by the largest
divisor of C up to 32 lanes. The element-wise loops (``log_prob``,
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

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width, target_has_features

from ..compute import CHUNK_CAPPED, CHUNK_EXP, CHUNK_MAX, LOG_PROB
from ._common import (
    COMBINE_ROWS,
    SHARD_GATHERS,
    init_row_totals,
    inline_row_helpers,
    is_per_row,
    place_grad_coefficients,
    place_row_stages,
    present_blocks,
    row_lanes,
    row_sweep,
    sweep_accumulators,
    vector_accumulators,
    vectorize_gradient_by_chunk,
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


ACCUMULATOR_CHOICES = (1, 2, 4)


def sample_knobs(sch) -> CPUKnobs:
    """Knobs drawn with a sampling instruction, so a tuning trace records them."""
    choice = sch.sample_categorical(list(ACCUMULATOR_CHOICES),
                                    [1.0 / len(ACCUMULATOR_CHOICES)] * len(ACCUMULATOR_CHOICES))
    return CPUKnobs(accumulators=int(sch.get(choice)))


def exp_scaling(target: Target) -> str:
    """How ``ce_tvm.fastmath.exp`` applies ``2**k`` on ``target``: AVX-512's
    ``vscalefps`` (``tirx.ldexp``, lowered below) where it exists, else exponent bits."""
    return "ldexp" if target_has_features("avx512f", target) else "bits"


def _ldexp_to_llvm(call):
    """``tirx.ldexp`` as LLVM's ``ldexp`` intrinsic (exact, like the libm call it
    replaces): one ``vscalefps`` per vector on AVX-512 instead of a scalar call."""
    return tirx.call_llvm_pure_intrin(call.ty, "llvm.ldexp", *call.args)


tirx.register_intrin_lowering("tirx.ldexp", target="llvm", f=_ldexp_to_llvm, level=99)


def vector_lanes(target: Target, elem_bytes: int = 4) -> int:
    """float32 lanes of one native vector register of ``target``."""
    return max(1, llvm_get_vector_width(target) // (8 * elem_bytes))


def forward_chunk(classes: int, dtype: str, target: Target, knobs: CPUKnobs = CPUKnobs()) -> int:
    """Chunk of the compute's row reduction, a multiple of the vector width:
    the largest one dividing ``C`` and at most ``MAX_CHUNK``; else (``C`` like
    50257) equal chunks of at most ``MAX_CHUNK``, the last one overlapping the
    one before (``compute._row_stats``); a row
    shorter than ``MAX_CHUNK`` is one chunk. ``dtype`` does not matter here:
    the float32 accumulators size the chunk."""
    lanes = vector_lanes(target) * knobs.accumulators
    if classes <= MAX_CHUNK:
        return classes
    fits = [b for b in range(lanes * MIN_CHUNK_VECTORS, MAX_CHUNK + 1, lanes) if classes % b == 0]
    if fits:
        return max(fits)
    per_chunk = -(-classes // -(-classes // MAX_CHUNK))
    return -(-per_chunk // lanes) * lanes


def forward(func, target: Target, knobs: CPUKnobs = CPUKnobs()):
    """Schedule ``ce_tvm.compute.forward_func`` for ``target``; returns the scheduled PrimFunc."""
    return schedule_forward(s_tir.Schedule(func), target, knobs).mod["main"]


def schedule_forward(sch, target: Target, knobs: CPUKnobs = CPUKnobs()):
    """``forward`` on a given schedule (meta_schedule's search space calls it)."""
    inline_row_helpers(sch)
    chunk = _chunk(sch)
    lanes = row_lanes(chunk, vector_lanes(target) * knobs.accumulators)
    row, _, stages = place_row_stages(sch, lanes)
    sch.parallel(row)
    for blk in present_blocks(sch, SHARD_GATHERS):
        sch.parallel(sch.get_loops(blk)[0])
    vector_accumulators(sch, stages, outer=2)
    init_row_totals(sch)
    for blk in present_blocks(sch, [LOG_PROB, CHUNK_CAPPED]):
        vectorize_inner(sch, blk, vector_lanes(target) * knobs.accumulators)
    return sch


def backward(func, target: Target, knobs: CPUKnobs = CPUKnobs()):
    """Schedule ``ce_tvm.compute.backward_func`` for ``target``; returns the scheduled PrimFunc."""
    return schedule_backward(s_tir.Schedule(func), target, knobs).mod["main"]


def schedule_backward(sch, target: Target, knobs: CPUKnobs = CPUKnobs()):
    """``backward`` on a given schedule (meta_schedule's search space calls it)."""
    inline_row_helpers(sch)
    grad, row = place_grad_coefficients(sch)
    sch.parallel(row)
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


def train(func, target: Target, knobs: CPUKnobs = CPUKnobs()):
    """Schedule ``ce_tvm.compute.train_func`` for ``target``; returns the scheduled
    PrimFunc, marked for ``TIR_PIPELINE`` to prefetch the next chunk."""
    sch = s_tir.Schedule(func)
    chunk = _chunk(sch)
    return schedule_train(sch, target, knobs).mod["main"].with_attr(PREFETCH_ATTR, chunk)


def schedule_train(sch, target: Target, knobs: CPUKnobs = CPUKnobs()):
    """One sweep per row (``row_sweep``): the forward's chunk loop, where
    ``ce_chunk_exp`` keeps ``exp(x - chunk_max)`` in a per-row float32 scratch
    (L1 while the chunk is reduced, L2 after), then ``x_grad`` under the same
    row loop, reading the scratch back chunk by chunk. The logits are read
    from memory once and the gradient written once."""
    inline_row_helpers(sch)
    chunk = _chunk(sch)
    lanes = vector_lanes(target) * knobs.accumulators
    sweep = row_sweep(sch, row_lanes(chunk, lanes))
    sch.parallel(sweep.row)
    sweep_accumulators(sch, sweep)
    init_row_totals(sch)
    for blk in present_blocks(sch, [CHUNK_CAPPED, CHUNK_EXP]):
        vectorize_inner(sch, blk, lanes)
    vectorize_gradient_by_chunk(sch, chunk, lanes)
    return sch


# --- Prefetching the next chunk -------------------------------------------
# The training kernel alternates between streaming a chunk in from memory
# (its max) and computing on it from L1 (exp, sums): the hardware prefetcher
# does not run far enough ahead, so memory idles while exp computes. A
# software prefetch of the next chunk (the next row's first, after the last:
# rows are contiguous) in the exp loop overlaps the two. No schedule
# primitive emits prefetches, so a pass after TVM's lowering adds them to
# the loops that store ``ce_chunk_exp``, in functions that carry the attribute.

PREFETCH_ATTR = "ce_tvm_prefetch_distance"
TIR_PIPELINE = "ce_tvm_llvm"
_LINE_BYTES = 64


def _chunk(sch) -> int:
    """The chunk the compute reduces a row in (before the chunk loops are merged)."""
    return int(sch.get(sch.get_loops(sch.get_sblock(CHUNK_MAX))[-1]).extent)


def _collect(node, kind) -> list:
    found = []
    tvm_ffi.structural_map(node, [(kind, lambda n: found.append(n) or n)], order="post")
    return found


def _unbound(expr, body):
    """``expr`` with the ``Bind`` variables of ``body`` substituted (CSE binds indices)."""
    values = {b.var: b.value for b in _collect(body, tirx.Bind)}
    for _ in range(len(values) + 1):
        new = tvm_ffi.structural_map(expr, [(tirx.Var, lambda v: values.get(v, v))])
        if new.same_as(expr):
            return expr
        expr = new
    return expr


def _depends_on(expr, var) -> bool:
    return any(v.same_as(var) for v in _collect(expr, tirx.Var))


def _with_prefetch(loop, distance: int):
    """``loop`` with prefetches of ``distance`` elements ahead of its logits
    loads, one per cache line an iteration reads, when it is the vector loop
    of ``ce_chunk_exp`` (its body is the lane loop, or a vector store)."""
    body = loop.body
    lanes_loop = body if isinstance(body, tirx.For) else None
    stores = [st for st in _collect(body, tirx.BufferStore) if st.buffer.name == CHUNK_EXP]
    vector = [st for st in stores if isinstance(st.indices[-1], tirx.Ramp)]
    if not stores or (lanes_loop is None and not vector):
        return loop
    loads = [ld for ld in _collect(body, tvm.ir.expr.TensorLoad)
             if ld.source.name != CHUNK_EXP
             and _depends_on(_unbound(ld.indices[-1], body), loop.loop_var)]
    if not loads:
        return loop
    logits = loads[0]
    first = _unbound(logits.indices[-1], body)
    if isinstance(first, tirx.Ramp):
        first, span = first.base, first.lanes
    elif lanes_loop is None:  # a vector store of scalar loads (float64's exact tanh)
        return loop
    else:
        span = int(lanes_loop.extent)
        first = tvm_ffi.structural_map(first, [(tirx.Var, lambda v: (
            tirx.const(0, v.ty) if v.same_as(lanes_loop.loop_var) else v))])
    elem_bytes = max(1, tvm.runtime.DataType(str(logits.ty)).bits // 8)
    per_line = max(1, _LINE_BYTES // elem_bytes)
    ahead = [first + tirx.const(distance + o, first.ty) for o in range(0, span, per_line)]
    fetches = [tirx.Evaluate(tirx.call_intrin(
        "void", "tirx.prefetch", tirx.address_of(tirx.BufferLoad(logits.source, [i])), 0, 3, 1))
        for i in ahead]
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                    tirx.SeqStmt(fetches + [body]), loop.thread_binding, loop.annotations)


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def prefetch_next_chunk(func, mod, ctx):
    """Add ``_with_prefetch`` to functions marked with ``PREFETCH_ATTR``."""
    distance = func.attrs.get(PREFETCH_ATTR) if func.attrs is not None else None
    if distance is None:
        return func
    return func.with_body(tvm_ffi.structural_map(
        func.body, [(tirx.For, lambda loop: _with_prefetch(loop, int(distance)))], order="post"))


def _pipeline():
    lower, finalize_host, finalize_device = tvm.tirx.compilation_pipeline.PIPELINE_MAP["s_tir"]()
    return tvm.transform.Sequential([lower, prefetch_next_chunk]), finalize_host, finalize_device


tvm.tirx.register_tir_pipeline(TIR_PIPELINE, _pipeline)
