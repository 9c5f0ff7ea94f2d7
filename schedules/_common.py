"""Schedule steps shared by the target schedules, and the groups of compute
stages they place (not a target itself).

Stage names come from ``ce_tvm.kernels`` only. A stage a schedule needs is
looked up with ``sch.get_sblock`` (a missing one is an error); the groups
below hold stages that only some declarations or variants of the compute
have, looked up with ``present_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import tirx

from ..kernels.common import matrix_param
from ..kernels.stages import (
    CHUNK_BEATS,
    CHUNK_EXP,
    CHUNK_EXPSUM,
    CHUNK_FIRST,
    CHUNK_LOGITS,
    CHUNK_MAX,
    CHUNK_SQSUM,
    CHUNK_WSUM,
    CHUNK_WXSUM,
    CHUNK_ZSUM,
    GRAD_HOT,
    GRAD_MASK,
    GRAD_PSCALE,
    GRAD_SMOOTH,
    KL_S_MAX,
    KL_T_MAX,
    LOG_PROB,
    LOSS,
    LSE,
    ROW_CE,
    ROW_ENTROPY,
    ROW_HIT,
    ROW_LOG_EXPSUM,
    ROW_LOG_SUM_SQ,
    ROW_MASK,
    ROW_MASS,
    ROW_MAX,
    ROW_MEAN_LOGITS,
    ROW_REF,
    ROW_SHIFT,
    ROW_TARGET_LOGIT,
    ROW_WEIGHT,
    ROW_Z,
    ROWSTATS,
    SHARD_LOCAL,
    SHARD_TARGET_LOGIT,
    SHARD_TARGET_WEIGHT,
    STAGES,
    TARGET_GRAD,
    TOKEN_LOGP,
    TOKEN_TOP1,
    TOTAL_CE,
    TOTAL_COUNT,
    TOTAL_WEIGHT,
    TOTAL_Z,
    WSUM,
    X_GRAD,
    ZLOSS,
)

# Row reductions of the forward and shard statistics, reduced chunk by chunk;
# the optional ones exist for some variants only (CHUNK_WXSUM all but the loss
# kernels without label smoothing, CHUNK_WSUM probability targets, CHUNK_BEATS
# token accuracy, the last three the log-probs' stats variant, in an order where
# ptxas spills nothing on CUDA: first, sqsum, zsum; other orders spilled 16
# bytes of row-invariant values at fp32 C = 50257).
ROW_REDUCTIONS = (CHUNK_MAX, CHUNK_EXPSUM)
OPTIONAL_ROW_REDUCTIONS = (CHUNK_WXSUM, CHUNK_WSUM, CHUNK_BEATS, CHUNK_FIRST, CHUNK_SQSUM,
                           CHUNK_ZSUM)
# Serial sums over rows: for sum and mean (and the mean backward) only.
ROW_TOTALS = (TOTAL_CE, TOTAL_Z, TOTAL_WEIGHT, TOTAL_COUNT)
# Per-row stages of the forward after the row statistics (not in the shard
# statistics; log_prob for the log-prob variant only, the hits for the accuracy
# variant only, the target mass for probability targets only, the entropy and
# the token log-probs for the log-prob kernels only; their statistics for the
# stats variant only).
ROW_FORWARD_REST = (LSE, ROW_MASS, ROW_CE, ROW_Z, LOG_PROB, LOSS, ZLOSS, ROW_HIT, ROW_MAX,
                    ROW_LOG_EXPSUM, ROW_ENTROPY, TOKEN_LOGP, ROW_LOG_SUM_SQ, ROW_MEAN_LOGITS,
                    TOKEN_TOP1)
# Per-row values the chunk reductions read (probability targets' reference, a
# row's shift: ``kernels.choices.row_shift``): computed once per row, under the
# row loop, before its chunks.
ROW_PRODUCERS = (ROW_REF, ROW_SHIFT)
# Blocks inlined into their consumers: without a producer under the row loop,
# reverse_compute_at would recompute them for every row of the batch. Each
# belongs to some declarations only (the row weight to the mean only).
INLINED = (ROW_MASK, ROW_WEIGHT, GRAD_MASK, SHARD_LOCAL)
# Per-row gathers of a vocabulary shard's statistics: no producer, own row loop.
SHARD_GATHERS = (SHARD_TARGET_LOGIT, SHARD_TARGET_WEIGHT)
# Per-row blocks of the shard-combine kernel (rows already reduced over classes).
COMBINE_ROWS = (ROW_CE, ROW_Z, LOSS, ZLOSS)
# The [N, C] output of a backward: the logits' gradient, or the probability targets'.
GRAD_OUTPUTS = (X_GRAD, TARGET_GRAD)
# Per-row coefficients of the backward (probability targets have no one-hot term).
ROW_GRAD_COEFS = (GRAD_HOT, GRAD_SMOOTH, GRAD_PSCALE)
# Stages over the classes only, that per-row stages read (weighted only): reduced
# once per launch at the root, outside the rows.
ROW_INDEPENDENT = (WSUM,)
# The training kernel's mean normalisers D and M: from the targets alone, before
# its rows (``kernels.training``).
TOTALS_BEFORE_ROWS = (TOTAL_WEIGHT, TOTAL_COUNT)


def collect_nodes(node, kind) -> list:
    """Every node of type ``kind`` in the IR ``node``, in post-order."""
    found = []
    tvm_ffi.structural_map(node, [(kind, lambda n: found.append(n) or n)], order="post")
    return found


def statements(body) -> list:
    """The statements of a loop body in order: a ``SeqStmt``'s, or the body alone."""
    return list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]


def depends_on(expr, var) -> bool:
    """Whether the variable ``var`` occurs in ``expr``."""
    return any(v.same_as(var) for v in collect_nodes(expr, tirx.Var))


def loads_of(node, name: str) -> list:
    """The loads of ``node`` from buffers named ``name``."""
    return [ld for ld in collect_nodes(node, tvm.ir.expr.TensorLoad) if ld.source.name == name]


def substituted(node, values: dict):
    """``node`` with each variable of ``values`` replaced by its value, in one pass
    (a value may hold the variable it replaces)."""
    return tvm_ffi.structural_map(node, [(tirx.Var, lambda v: values.get(v, v))])


def binds(body) -> dict:
    """The values of the ``Bind`` variables of ``body`` (CSE binds indices)."""
    return {b.var: b.value for b in collect_nodes(body, tirx.Bind)}


def unbound(expr, values: dict):
    """``expr`` with the variables of ``values`` (``binds``) substituted."""
    for _ in range(len(values) + 1):
        new = tvm_ffi.structural_map(expr, [(tirx.Var, lambda v: values.get(v, v))])
        if new.same_as(expr):
            return expr
        expr = new
    return expr


def sample_knobs(sch, space: dict, decisions: dict | None = None) -> dict:
    """Draw every knob of ``space`` (``{name: choices}``) with ``sample_categorical``,
    uniformly, so that the schedule's trace records each value; ``decisions``
    (``{name: value}``) fixes the values instead (a grid point of the search).
    Returns ``{name: value}``."""
    drawn = {}
    for name, choices in space.items():
        decision = None if decisions is None else list(choices).index(decisions[name])
        value = sch.sample_categorical([int(c) for c in choices],
                                       [1.0 / len(choices)] * len(choices), decision=decision)
        drawn[name] = int(sch.get(value))
    return drawn


def present_blocks(sch, names) -> list:
    """The blocks of the stages ``names`` that this function has, in order.

    For stages that only some declarations or variants of the compute have.
    Every name must be a stage ``ce_tvm.kernels`` declares (``STAGES``), so
    a stage renamed or removed there is an error here, never a block left
    unscheduled without a word.
    """
    unknown = [name for name in names if name not in STAGES]
    if unknown:
        raise ValueError(f"not stages of ce_tvm.kernels: {unknown}")
    present = {sch.get(block).name_hint for block in all_blocks(sch)}
    return [sch.get_sblock(name) for name in names if name in present]


def all_blocks(sch) -> list:
    """Every block of the function, walked from the root. (Asking ``get_sblock`` for a
    missing name costs its error, which prints the whole function: 0.1 s a time for
    a capped kernel, 5 of its 6 s of scheduling.)"""
    found, todo = [], [sch.get_sblock("root")]
    while todo:
        children = sch.get_child_blocks(todo.pop())
        found += children
        todo += children
    return found


def has_stage(sch, name) -> bool:
    return bool(present_blocks(sch, [name]))


def chunk_reductions(sch) -> list:
    """Names of the forward's per-chunk row reductions in this function."""
    return list(ROW_REDUCTIONS) + [name for name in OPTIONAL_ROW_REDUCTIONS
                                   if has_stage(sch, name)]


def place_row_stages(sch, lanes: int):
    """The forward phase every schedule shares (``forward_func`` and ``shard_stats_func``):
    ``place_chunk_stages`` under the chunk loop of ``ce_rowstats``, which merges
    them, then ``place_row_rest`` under its row loop. Returns ``(row loop, chunk
    loop, {reduction: its blocks, producer first})``.
    """
    row, chunk_loop = sch.get_loops(sch.get_sblock(ROWSTATS))
    stages = place_chunk_stages(sch, chunk_loop, lanes)
    row = place_row_rest(sch, row)
    return row, sch.get_loops(sch.get_sblock(ROWSTATS))[1], stages


def place_chunk_stages(sch, chunk_loop, lanes: int) -> dict:
    """Each chunk reduction split by ``lanes`` and rfactored (``split_reduction``)
    and moved, with its rfactor block, under ``chunk_loop`` (the loop of the merge
    over chunks): a chunk is read from memory by the first reduction and from
    cache by the others; a kept ``ce_chunk_exp`` (the log-prob kernels) is
    computed once per chunk before the sums that read it, and a staged
    ``ce_chunk_logits`` once per chunk. Returns ``{reduction: its blocks,
    producer first}``."""
    names = chunk_reductions(sch)
    stages = {name: split_reduction(sch, name, lanes) for name in names}
    for name in reversed(names):  # consumers first
        if name == CHUNK_MAX:  # a kept exp (the log-prob kernels) reads the max
            for blk in present_blocks(sch, [CHUNK_EXP]):
                sch.compute_at(blk, chunk_loop)
        for blk in reversed(stages[name]):
            sch.compute_at(blk, chunk_loop)
    for blk in present_blocks(sch, [CHUNK_LOGITS]):  # the staged chunk, once per chunk
        sch.compute_at(blk, chunk_loop)
    return stages


def place_row_rest(sch, row, then: tuple = ()):
    """The per-row stages around a row's statistics under its row loop ``row``: the
    target's logit (read by every chunk), the stages after the statistics
    (``ROW_FORWARD_REST``; with ``then``, the training kernel's gradient, both
    joined in program order), the per-row values the chunks read
    (``ROW_PRODUCERS``). Returns the row loop."""
    for blk in present_blocks(sch, [ROW_TARGET_LOGIT]):  # read by every chunk of the row
        sch.compute_at(blk, row)
    after = present_blocks(sch, ROW_FORWARD_REST)
    if then:  # in program order: a stage of the rest may come after the gradient
        order = [sch.get(b).name_hint for b in all_blocks(sch)]
        after = sorted(after + present_blocks(sch, then),
                       key=lambda b: order.index(sch.get(b).name_hint))
    for blk in after:
        if is_per_row(sch, blk):
            row = join_row(sch, blk, row)
    for blk in present_blocks(sch, ROW_PRODUCERS):  # its consumers are under the row now
        sch.compute_at(blk, row)
    return row


def join_row(sch, block, row):
    """Move the per-row ``block`` (its own row loop at the root) under the row
    loop ``row``, after what is there; returns the row loop.

    ``reverse_compute_at``, unless ``block`` reads a stage computed at the root,
    once, before the rows (``ROW_INDEPENDENT``; the training kernel's mean
    normalisers, ``TOTALS_BEFORE_ROWS``), which that primitive refuses (it
    wants every producer under the loop), or shares its row loop with its
    producers (a gradient with its coefficients, ``place_grad_coefficients``):
    then the two row loops are merged, and the merged loop takes the place of
    ``block``'s, after the stage.
    """
    reads = {region.source.name for region in sch.get(block).reads}
    own_row = sch.get_loops(block)[0]
    along = {sch.get(b).name_hint for b in sch.get_child_blocks(own_row)}
    if len(along) == 1 and not reads & set(ROW_INDEPENDENT + TOTALS_BEFORE_ROWS):
        sch.reverse_compute_at(block, row)
        return row
    children = sch.get_child_blocks(sch.get_sblock("root"))
    names = [sch.get(b).name_hint for b in children]
    rows = [i for i, b in enumerate(children)
            if any(sch.get(loop).same_as(sch.get(row)) for loop in sch.get_loops(b))]
    between = [name for name in names[max(rows) + 1:names.index(sch.get(block).name_hint)]
               if name not in along]
    if not set(between) <= set(ROW_INDEPENDENT):  # they would run before the merged rows
        raise ValueError(f"cannot merge the rows of {names[rows[0]]} and "
                         f"{sch.get(block).name_hint}: {between} lie between them")
    return sch.merge(row, own_row)


def place_grad_coefficients(sch):
    """The backward phase every schedule shares: the per-row coefficients under
    the row loop of the gradient (``x_grad``, or ``target_grad``). Returns
    ``(gradient block, row loop)``."""
    grad = present_blocks(sch, GRAD_OUTPUTS)[0]
    row = sch.get_loops(grad)[0]
    for blk in reversed(present_blocks(sch, ROW_GRAD_COEFS)):
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


def vector_accumulators(sch, stages: dict, outer: int, unroll: int = 1) -> None:
    """``vector_accumulator`` for every split reduction of ``place_row_stages``."""
    for blocks in stages.values():
        if len(blocks) == 2:
            vector_accumulator(sch, blocks[0], outer, unroll)


def vector_accumulator(sch, rf, outer: int, unroll: int = 1):
    """Make the lanes loop of a placed rfactor block innermost and vectorised,
    ``unroll`` vector steps per iteration of the loop around it.

    ``compute_at`` regenerates the loops under the ``outer`` enclosing ones in
    block-iter order (lanes, then the vector-step loop, which is absent when
    the reduction is one vector long). An ``unroll`` that does not divide the
    vector steps leaves a guarded last iteration (the guard does not depend
    on the lanes, so the vector body stays whole).
    """
    loops = sch.get_loops(rf)[outer:]
    if len(loops) == 2:
        sch.reorder(loops[1], loops[0])
        steps = sch.get(loops[1]).extent
        if unroll > 1 and isinstance(steps, tirx.IntImm) and steps.value > unroll:
            sch.unroll(sch.split(loops[1], [None, unroll])[1])
    sch.vectorize(sch.get_loops(rf)[-1])
    sch.decompose_reduction(rf, sch.get_loops(rf)[outer])


def parallel_rows(sch, row, grain: int = 1) -> int:
    """Run the row loop in parallel, ``grain`` consecutive rows per task (before
    any ``decompose_reduction`` under it); returns how many loops the rows
    now take (1, or 2 when split)."""
    if grain == 1:
        sch.parallel(row)
        return 1
    sch.parallel(sch.split(row, [None, grain])[0])
    return 2


def vector_row_independent(sch, lanes: int) -> None:
    """The row-independent reductions (``ROW_INDEPENDENT``, at the root, once
    per launch) as vector accumulators of up to ``lanes`` lanes (the largest
    divisor of ``C``: no tail predicate), summed across lanes at the end."""
    for blk in present_blocks(sch, ROW_INDEPENDENT):
        classes = int(sch.get(sch.get_loops(blk)[-1]).extent)
        blocks = split_reduction(sch, sch.get(blk).name_hint, row_lanes(classes, lanes))
        if len(blocks) == 2:
            loops = sch.get_loops(blocks[0])
            sch.vectorize(loops[-1])
            sch.decompose_reduction(blocks[0], loops[1])


def vectorize_inner(sch, block, lanes: int) -> None:
    """Vectorise the innermost (spatial) loop of ``block`` by ``lanes`` (``vectorize_loop``)."""
    vectorize_loop(sch, sch.get_loops(block)[-1], lanes)


def vectorize_loop(sch, loop, lanes: int) -> None:
    """Vectorise the spatial ``loop`` by ``lanes``.

    A tail that is not a multiple of ``lanes`` is peeled off with
    ``loop_partition`` and stays scalar (a split would put a predicate inside
    the vector loop, which TVM scalarises whole). Call it last: the partition
    wraps the loop in opaque blocks.
    """
    extent = sch.get(loop).extent
    if lanes == 1 or not isinstance(extent, tirx.IntImm) or extent.value < lanes:
        return  # nothing to vectorise (C = 1 leaves only the row loop)
    extent = extent.value
    main = extent // lanes * lanes
    if main != extent:
        loop = sch.loop_partition(loop, [main])[0]
    sch.vectorize(sch.split(loop, [None, lanes])[1])


def inline_capped_chunk(sch) -> None:
    """Inline ``ce_chunk_logits`` (the staged chunk: capped with softcap) into
    the chunk sums that read it: for schedules that do not keep the chunk on
    chip (``tanh`` per read)."""
    for blk in present_blocks(sch, [CHUNK_LOGITS]):
        sch.compute_inline(blk)


def inline_row_helpers(sch) -> None:
    """Inline the cheap per-row blocks that have no producer (``INLINED``)."""
    for blk in present_blocks(sch, INLINED):
        sch.compute_inline(blk)


@dataclass
class Sweep:
    """Loops of ``row_sweep``: ``row`` (every per-row stage of the sweep under
    it), ``chunk`` (the chunk stages and their merge under it), and the
    chunk reductions' blocks by name (``[rfactor, final]`` or ``[block]``)."""

    row: object
    chunk: object
    stages: dict


def row_sweep(sch, lanes: int) -> Sweep:
    """The training phase every schedule shares (``train_func``): its per-row
    stages under one row loop, and its chunk stages (the chunk reductions,
    ``ce_chunk_exp`` when not inlined, and ``ce_rowstats``) under one chunk
    loop inside it.

    ``compute_at`` cannot build this nest: the chunk max and the kept
    exponentials have consumers after the chunk loop (the per-chunk scale and
    the gradient). Instead the row loops of every stage up to ``x_grad`` are
    merged, then the chunk loops; blocks run in program order, which is a
    valid order, so merging keeps every dependence. The chunk reductions are
    first split into ``lanes`` vector accumulators (rfactor; see
    ``sweep_accumulators``).
    """
    names = chunk_reductions(sch)
    stages = {name: split_reduction(sch, name, lanes) for name in names}
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    upto = [sch.get(b).name_hint for b in blocks].index(X_GRAD) + 1
    n_rows = matrix_param(sch.mod["main"]).shape[0]  # a variable, or bound while tuning
    rows = [b for b in blocks[:upto]
            if tvm_ffi.structural_equal(sch.get(sch.get_loops(b)[0]).extent, n_rows)
            and sch.get(b).name_hint not in ROW_TOTALS]
    row = sch.merge(*[sch.get_loops(b)[0] for b in rows])
    chunk_blocks = [blk for name in names for blk in stages[name]]
    if has_stage(sch, CHUNK_EXP):  # inlined where the gradient recomputes exp
        chunk_blocks.insert(len(stages[names[0]]), sch.get_sblock(CHUNK_EXP))
    if has_stage(sch, CHUNK_LOGITS):  # softcap: before the kept exp, which reads it
        chunk_blocks.insert(len(stages[names[0]]), sch.get_sblock(CHUNK_LOGITS))
    chunk_blocks.append(sch.get_sblock(ROWSTATS))
    chunk = sch.merge(*[sch.get_loops(b)[1] for b in chunk_blocks])
    return Sweep(row, chunk, stages)


def sweep_accumulators(sch, sweep: Sweep) -> None:
    """Vectorise the accumulators of ``row_sweep``'s rfactored reductions
    (merged loops keep the split's order: the lanes are already innermost).
    Call it after the row loop is parallelised."""
    for blocks in sweep.stages.values():
        if len(blocks) == 2:
            loops = sch.get_loops(blocks[0])
            sch.vectorize(loops[-1])
            sch.decompose_reduction(blocks[0], loops[len(loops) - 2])


def vectorize_gradient_by_chunk(sch, chunk: int, lanes: int) -> None:
    """Vectorise ``x_grad``'s columns chunk by chunk, so that no vector
    straddles two chunks (each has its own scale); the last chunk (shorter
    when ``chunk`` does not divide C) gets a loop of its own."""
    grad = sch.get_sblock(X_GRAD)
    classes = int(sch.get(sch.get_loops(grad)[-1]).extent)
    n_chunks = -(-classes // chunk)
    if n_chunks == 1:
        vectorize_inner(sch, grad, lanes)
        return
    full, last = sch.loop_partition(sch.split(sch.get_loops(grad)[-1], [n_chunks, chunk])[0],
                                    [n_chunks - 1])
    vectorize_loop(sch, _innermost(sch, full), lanes)
    width = classes - (n_chunks - 1) * chunk
    inner = _innermost(sch, last)
    if width != chunk:
        inner = sch.loop_partition(inner, [width])[0]
    vectorize_loop(sch, inner, lanes)


def _innermost(sch, loop):
    """The innermost loop of the (one) block nest under ``loop``."""
    blocks = sch.get_child_blocks(loop)
    while sch.get_child_blocks(blocks[0]):  # through loop_partition's opaque wrappers
        blocks = sch.get_child_blocks(blocks[0])
    return sch.get_loops(blocks[0])[-1]


def divergence_row(sch, order: list):
    """Put every block of ``divergence_func`` (``order``: its blocks in program
    order, a split reduction's rfactor block before its final one) under one
    row loop; returns ``(row loop, the two row maxima's first blocks)``.

    The two maxima read only the inputs, so neither's row loop bounds the
    other's: the blocks between the first one and the second (the first side's
    stages) go under the first's row loop, which is then merged with the
    second's (``merge`` puts the merged loop at the second's place and checks
    no order: nothing between them is left behind), and every later block
    follows under it (``reverse_compute_at``, in order: each after what it reads).
    """
    names = [sch.get(b).name_hint for b in order]
    roots = [next(order[i] for i, n in enumerate(names) if n.startswith(m))
             for m in (KL_S_MAX, KL_T_MAX)]
    at = sorted(next(i for i, b in enumerate(order) if sch.get(b).same_as(sch.get(r)))
                for r in roots)
    row = sch.get_loops(order[at[0]])[0]
    for blk in order[at[0] + 1:at[1]]:
        sch.reverse_compute_at(blk, row)
    row = sch.merge(row, sch.get_loops(order[at[1]])[0])
    for blk in order[at[1] + 1:]:
        sch.reverse_compute_at(blk, row)
    return row, roots
