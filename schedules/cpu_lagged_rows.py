"""A row's gradient written while the next row's ``exp`` is computed (16-bit
training kernels on AVX-512).

The one-pass training kernel sweeps a row chunk by chunk, its ``exp`` kept in a
float32 row buffer (``ce_chunk_exp``), then writes the row's gradient from that
buffer. The sweep is bound by its arithmetic and leaves memory idle; the
gradient's loops are bound by memory. ``lagged_gradient_rows`` (a pass after
lowering) runs the rows as a pipeline instead, in tasks of consecutive rows
(``TASK_ROWS``): in the iteration of row ``n``, before each chunk of its sweep,
the gradient loops of row ``n - 1`` write the columns that chunk is about to
overwrite in the buffer; one more iteration writes the task's last gradient.
What else row ``n - 1``'s gradient reads from the row's scratch (the chunks'
scales, the one-hot and smoothing terms) is copied to buffers of its own at
the end of its iteration (``<name>_lag``). Nothing is computed otherwise or in
another order; in the moved loops LLVM may contract a multiply and a
subtraction otherwise, which moves a rare gradient element by one 16-bit
rounding.

Where the gradient's rows are whole 64-byte lines and the output is large, its
stores are also made non-temporal (``cpu_stores``: the pass marks the task
loop, ``LAGGED_ATTR``, and ``cpu_stores`` then streams 16-bit stores too): the
lines go to memory from the write-combining buffers while the sweep computes,
instead of being read for ownership first. On a 2-core Zen 4, bf16, the two
together took the training kernel 1.14-1.22x faster at 4096 x 32000 and
2048 x 128256; lagged with plain stores (C = 50257, unaligned) 1.09x; at
256 x 32000 (in cache) no change (docs/performance.md, "A row's gradient
written during the next row's sweep").

The pass applies to a parallel row loop whose body is, in order: allocations,
the row's statements, one loop over the chunks that stores the kept ``exp``,
more statements, then loops that store only the gradient (the schedule of
``cpu.schedule_train`` with one row per task). It leaves any other kernel as
it is.
"""

from __future__ import annotations

import contextlib

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import codegen

from ..kernels.stages import CHUNK_EXP, X_GRAD
from ._common import binds, collect_nodes, loads_of, statements, substituted, unbound

# The task loop of a lagged kernel carries this annotation (``cpu_stores``
# streams its 16-bit gradient).
LAGGED_ATTR = "ce_tvm_gradient_lags_a_row"
# Rows per task: at most TASK_ROWS, and no more than a 64th of the rows (a short
# batch keeps enough tasks for the cores). A task's last gradient runs alone.
TASK_ROWS = 32
_ROWS_PER_TASK_DIVISOR = 64


_LAGGING = [True]


def lags_rows(target) -> bool:
    """Whether training kernels for ``target`` lag their gradient a row: on AVX-512,
    where it was measured (not inside ``unlagged``). The AVX2 build, run on a Zen 4,
    was 0.92-0.95x as fast lagged at 4096 x 32000 and 1.08x at 2048 x 128256."""
    return _LAGGING[0] and bool(codegen.target_has_features("avx512f", target))


@contextlib.contextmanager
def unlagged():
    """Kernels built inside keep each row's gradient in its own iteration: the
    loops a static count attributes to a row (``ce_tvm.testing.cpu_static``; the
    lag moves the gradient's loops into the next row's chunk loop, their
    instructions unchanged)."""
    _LAGGING[0] = False
    try:
        yield
    finally:
        _LAGGING[0] = True


def is_lagged(func) -> bool:
    """Whether ``lagged_gradient_rows`` restructured ``func``."""
    return any(LAGGED_ATTR in f.annotations for f in collect_nodes(func.body, tirx.For))


def _stores(stmt) -> set:
    return {st.buffer.name for st in collect_nodes(stmt, tirx.BufferStore)}


def _kept_exp_starts(stmt, var, stores: bool = False):
    """``(first, step)`` of ``stmt``'s accesses to the kept ``exp`` (its loads, or
    with ``stores`` its stores), in float32 elements: the lowest flat index they
    touch with every loop variable at 0, and how far the first access moves as
    ``var`` (the loop around ``stmt``) grows by one; ``(None, None)`` where either
    is not a constant."""
    accesses = ([st for st in collect_nodes(stmt, tirx.BufferStore) if st.buffer.name == CHUNK_EXP]
                if stores else loads_of(stmt, CHUNK_EXP))
    zero = {v: tirx.const(0, v.ty) for v in [f.loop_var for f in collect_nodes(stmt, tirx.For)]}
    zero[var] = tirx.const(0, var.ty)
    analyzer, values, firsts, steps = tvm.sym.Analyzer(), binds(stmt), [], []
    for access in accesses:
        index = unbound(access.indices[-1], values)
        if isinstance(index, tirx.Ramp):
            index = index.base
        buffer = access.buffer if stores else access.source
        lanes = tvm.runtime.DataType(str(buffer.dtype)).lanes  # a buffer of vectors
        index = index * tirx.const(lanes, index.ty) if lanes > 1 else index
        firsts.append(analyzer.simplify(substituted(index, zero)))
        steps.append(analyzer.simplify(
            substituted(index, {**zero, var: tirx.const(1, var.ty)}) - firsts[-1]))
    if not firsts or not all(isinstance(x, tirx.IntImm) for x in firsts + steps):
        return None, None
    return min(x.value for x in firsts), steps[0].value


def _placed(grad_loops, sweep):
    """``(in the sweep, after it)``: each gradient loop, or each iteration of it,
    placed before the iteration of ``sweep`` (whose iterations overwrite the kept
    ``exp`` in consecutive ranges) that would first overwrite a column it reads,
    or after the sweep where it reads only columns the sweep does not write
    (those of a peeled last chunk, written after it); ``None`` where an access
    is not of those forms. Only where a read starts matters: the sweep's
    iterations before it wrote below that start."""
    begin, chunk = _kept_exp_starts(sweep.body, sweep.loop_var, stores=True)
    if begin is None or chunk <= 0:
        return None
    chunks, k = int(sweep.extent), sweep.loop_var
    end = begin + chunks * chunk

    def slot(column: int) -> int:
        return (max(column, begin) - begin) // chunk

    inside, after = [], []
    for loop in grad_loops:
        var, extent = loop.loop_var, int(loop.extent)
        first, step = _kept_exp_starts(loop.body, var)
        if first is None:
            return None
        at = tirx.Cast(var.ty, k) - tirx.const(slot(first), var.ty)
        if step == chunk and first >= begin:  # a chunk an iteration: each before its own
            swept = min(extent, max(0, chunks - slot(first)))
            if swept:
                inside.append(tirx.IfThenElse(
                    tirx.And(at >= tirx.const(0, var.ty), at < tirx.const(swept, var.ty)),
                    substituted(loop.body, {var: at}), None))
            if swept < extent:
                after.append(tirx.For(var, tirx.const(swept, var.ty),
                                      tirx.const(extent - swept, var.ty), loop.kind, loop.body))
        elif first < end:  # the whole loop before the iteration that writes its first column
            inside.append(tirx.IfThenElse(at == tirx.const(0, var.ty), loop, None))
        else:
            after.append(loop)
    return inside, after


def _block(stmts: list):
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def _lagged(loop, rows):
    """The parallel row ``loop`` (``rows`` of them) as tasks of lagged rows, or
    ``loop`` itself where its body is not of the form the module docstring names."""
    body = statements(loop.body)
    split = len(body)
    while split and isinstance(body[split - 1], tirx.For) and _stores(body[split - 1]) == {X_GRAD}:
        split -= 1
    grad_loops, rest = body[split:], body[:split]
    heads = 0
    while heads < len(rest) and isinstance(rest[heads], (tirx.AllocBuffer, tirx.DeclBuffer)):
        heads += 1
    head, rest = rest[:heads], rest[heads:]
    sweeps = [i for i, s in enumerate(rest) if isinstance(s, tirx.For) and CHUNK_EXP in _stores(s)]
    if not grad_loops or not sweeps:
        return loop
    pre, sweep, post = rest[:sweeps[0]], rest[sweeps[0]], rest[sweeps[0] + 1:]
    pre_binds = [s for s in pre if isinstance(s, tirx.Bind)]
    if any(collect_nodes(b.value, tvm.ir.expr.TensorLoad) for b in pre_binds):
        return loop  # a bind that reads the row's scratch must keep its place
    if any(CHUNK_EXP in _stores(stmt) for stmt in pre):
        return loop  # the row's exp written before its sweep: not the form taken

    # the row's scratch the gradient reads, but the kept exp: copied after its row
    scratch = {str(s.buffer.data) for s in head if isinstance(s, tirx.AllocBuffer)}
    lags, copies = {}, []
    for ld in [ld for g in grad_loops for ld in collect_nodes(g, tvm.ir.expr.TensorLoad)]:
        buffer = ld.source
        if (str(buffer.data) in scratch and buffer.name != CHUNK_EXP
                and not any(buffer.same_as(b) for b in lags)):
            lag = tirx.decl_buffer(buffer.shape, buffer.dtype, f"{buffer.name}_lag")
            lags[buffer] = lag
            i = tirx.Var("i", buffer.shape[0].ty)
            copies.append(tirx.For(i, tirx.const(0, i.ty), buffer.shape[0], tirx.ForKind.SERIAL,
                                   tirx.BufferStore(lag, tirx.BufferLoad(buffer, [i]), [i])))
    if any(len(b.shape) != 1 for b in lags):
        return loop

    row = loop.loop_var
    one = tirx.const(1, row.ty)
    row_values = {b.var: b.value for b in pre + post if isinstance(b, tirx.Bind)}

    def of_row_before(stmt):
        stmt = unbound(stmt, row_values)
        stmt = substituted(stmt, {row: row - one})

        def lagged_load(ld):
            lag = next((lg for b, lg in lags.items() if ld.source.same_as(b)), None)
            return ld if lag is None else tirx.BufferLoad(lag, ld.indices)
        return tvm_ffi.structural_map(stmt, [(tvm.ir.expr.TensorLoad, lagged_load)], order="post")

    placed = _placed([of_row_before(g) for g in grad_loops], sweep)
    if placed is None:
        return loop
    inside, after = placed

    task, step = tirx.Var(f"{row.name}_task", row.ty), tirx.Var(f"{row.name}_step", row.ty)
    per_task = tirx.max(one, tirx.min(tirx.const(TASK_ROWS, row.ty), tirx.floordiv(
        rows, tirx.const(_ROWS_PER_TASK_DIVISOR, row.ty))))
    this_row = tirx.And(step < per_task, row < rows)
    row_before = tirx.And(step > tirx.const(0, row.ty), row - one < rows)
    chunk_step = _block(([tirx.IfThenElse(row_before, _block(inside), None)] if inside else [])
                        + [tirx.IfThenElse(this_row, sweep.body, None)])
    sweep = tirx.For(sweep.loop_var, sweep.min, sweep.extent, sweep.kind, chunk_step,
                     sweep.thread_binding, sweep.annotations)
    iteration = ([tirx.Bind(row, task * per_task + step)] + pre_binds
                 + [tirx.IfThenElse(this_row, _block(
                     [s for s in pre if not isinstance(s, tirx.Bind)] or [tirx.Evaluate(0)]),
                     None), sweep]
                 + ([tirx.IfThenElse(row_before, _block(after), None)] if after else [])
                 + [tirx.IfThenElse(this_row, _block(post + copies), None)])
    steps = tirx.For(step, tirx.const(0, row.ty), per_task + one, tirx.ForKind.SERIAL,
                     tirx.SeqStmt(iteration))
    tasks = tirx.floordiv(rows + per_task - one, per_task)
    annotations = {**dict(loop.annotations.items()), LAGGED_ATTR: 1}
    return tirx.For(task, tirx.const(0, row.ty), tasks, loop.kind,
                    _block(head + [tirx.AllocBuffer(b) for b in lags.values()] + [steps]),
                    loop.thread_binding, annotations)


def _lags(func) -> bool:
    target = func.attrs.get("target") if func.attrs else None
    grads = [st.buffer for st in collect_nodes(func.body, tirx.BufferStore)
             if st.buffer.name == X_GRAD]
    return (target is not None and lags_rows(target) and bool(grads)
            and tvm.runtime.DataType(str(grads[0].dtype)).bits == 16)


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def lagged_gradient_rows(func, mod, ctx):
    """A 16-bit training kernel's rows as a pipeline, each row's gradient written
    during the next row's sweep, on AVX-512 (module docstring)."""
    if not _lags(func):
        return func
    loops = [f for f in collect_nodes(func.body, tirx.For) if f.kind == tirx.ForKind.PARALLEL
             and {X_GRAD, CHUNK_EXP} <= _stores(f)]
    if len(loops) != 1:
        return func
    target = loops[0]
    body = tvm_ffi.structural_map(func.body, [(tirx.For, lambda f: (
        _lagged(f, target.extent) if f.same_as(target) else f))])
    if body.same_as(func.body):
        return func
    return tvm.tirx.transform.ConvertSSA()(tvm.IRModule({"main": func.with_body(body)}))["main"]
