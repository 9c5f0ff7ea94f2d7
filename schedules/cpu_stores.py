"""``[N, C]`` outputs stored past the caches (non-temporal stores): float32 ones,
and a lagged 16-bit training kernel's gradient.

A kernel that writes an ``[N, C]`` output (a gradient; the seed API's
``log_prob``) overwrites every cache line of it whole. A plain store first
reads the line from memory (write-allocate), so the output costs a read and a
write of memory, and the training kernel's ``prefetchw`` (``schedules/cpu.py``)
only moves that read earlier. A non-temporal store (``vmovntps``) writes the
line to memory through a write-combining buffer without reading it, and
leaves it out of the caches.

TVM 0.27 cannot say so: TIR has no non-temporal store and its LLVM codegen
sets no ``!nontemporal``. ``stream_output_stores`` (a pass after lowering)
turns each float32 vector store of such an output whose address is a multiple
of 64 bytes (or of the vector's, if smaller) into a call of a small LLVM
function that stores with ``!nontemporal`` (``pragma_import_llvm``, which
TVM's codegen links in and inlines). That store carries a type-based alias tag
of its own under TVM's root, so LLVM still knows it writes no other buffer
(without one, LLVM reloaded the label in every vector step of the gradient
loop).

The stores are aligned when C is a multiple of 16 (the runtime hands the
kernels 64-byte aligned tensors). Where a row is not (C = 50257), on AVX-512
(``stages_unaligned_rows``), a loop that writes consecutive vectors of the
output and nothing else is staged (``_staged``): blocks of 2048 elements go to
a scratch buffer in L1 and are copied out, the whole lines they cover by
non-temporal stores, the elements before the first and after the last by
masked plain stores (``llvm.masked.store``).

Streaming pays only for an output larger than the caches; one that fits is
read back from them by whatever consumes it. So each loop of such stores runs
in two versions, chosen per launch by the output's size
(``STREAM_MIN_BYTES``), and the ``prefetchw`` of the gradient's lines runs
only where the stores are plain (``fits_in_cache``). 16-bit outputs keep plain
stores, but in a training kernel whose gradient is written during the next
row's sweep (``cpu_lagged_rows``): on a 2-core Zen 4 streaming made the bf16
backward slower (docs/performance.md, "float32 [N, C] outputs streamed past
the caches"); so
does the divergence, whose schedule marks it ``keep_outputs_cached`` (it
writes a row's gradient after whole-row passes over two models' logits, bound
by its arithmetic: 2-4% slower streamed).
"""

from __future__ import annotations

import contextlib

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import codegen

from ..kernels.stages import LOG_PROB
from ._common import GRAD_OUTPUTS, binds, collect_nodes, statements, substituted, unbound
from .cpu_lagged_rows import is_lagged

# The [N, C] outputs whose stores may be streamed.
STREAMED_OUTPUTS = GRAD_OUTPUTS + (LOG_PROB,)
# An output of at least this many bytes is streamed past the caches. On a
# 2-core Zen 4 with 32 MiB of L3 streaming was 0.92-1.08x the time of plain
# stores at 8-32 MiB (float32 training and backward kernels, by shape and run)
# and 0.75-0.90x from 128 MiB up.
STREAM_MIN_BYTES = 64 << 20
# A staged loop goes through its scratch buffer in blocks of at most this many
# float32 elements (8 KB: L1, beside what the loop reads).
STAGE_BLOCK_ELEMENTS = 2048
# float32 lanes of a 64-byte line: a staged block's non-temporal stores.
_LINE_LANES = 16
IMPORT_ATTR = "pragma_import_llvm"
# A loop annotation (traced, so a tuning record replays it): the kernel's
# output stores stay plain.
CACHED_ATTR = "ce_tvm_outputs_cached"
_TBAA = ('!{0} = !{{!"tvm-tbaa"}}\n'
         '!{1} = !{{!"ce_tvm.streamed_output", !{0}, i64 0}}\n'
         '!{2} = !{{!{1}, !{1}, i64 0}}\n')
_NONTEMPORAL = "!{0} = !{{i32 1}}\n"


def _bytes(dtype) -> int:
    return tvm.runtime.DataType(str(dtype)).bits // 8


def _store_function(vector: str) -> str:
    return f"ce_tvm_stream_{vector}"


# LLVM's element types of the vectors a streamed store writes.
_LLVM_ELEMENTS = {"float32": "float", "float16": "half", "uint16": "i16", "int16": "i16"}


def _store_ir(vector: str) -> str:
    """An LLVM function ``(ptr, value)`` that stores the TIR vector type ``vector``
    (``float32x16``, ``uint16x32``, ...) non-temporally (``!0``) with the tag ``!3``.
    ``align`` is at most a cache line's: a wider vector is stored line by line.
    16-bit lanes are stored as float32 ones behind an ``llvm.arithmetic.fence``:
    LLVM selects no non-temporal store for a bfloat16 vector, and folds a plain
    bitcast of one back into it (the bf16 rounding instruction's result)."""
    element, lanes = vector.split("x")[0], int(vector.split("x")[1])
    vec, align = f"<{lanes} x {_LLVM_ELEMENTS[element]}>", min(lanes * _bytes(element), 64)
    stored, value, prelude, declared = vec, "%v", "", ""
    if _bytes(element) == 2:
        stored, value = f"<{lanes // 2} x float>", "%f"
        fence = f"llvm.arithmetic.fence.v{lanes // 2}f32"
        prelude = (f"  %w = bitcast {vec} %v to {stored}\n"
                   f"  %f = call {stored} @{fence}({stored} %w)\n")
        declared = f"declare {stored} @{fence}({stored})\n"
    return (f"define void @{_store_function(vector)}(ptr %p, {vec} %v) {{\n{prelude}"
            f"  store {stored} {value}, ptr %p, align {align}, !nontemporal !0, !tbaa !3\n"
            f"  ret void\n}}\n{declared}")


def _output_vector(store) -> bool:
    """Whether ``store`` writes a contiguous vector of 32 bytes or more (a power of
    two) to a streamed output: float32, or 16-bit lanes (streamed only in a
    kernel ``cpu_lagged_rows`` restructured: ``_eligible``)."""
    index = store.indices[-1] if store.indices else None
    if (store.buffer.name not in STREAMED_OUTPUTS or not isinstance(index, tirx.Ramp)
            or not isinstance(index.stride, tirx.IntImm) or index.stride.value != 1
            or str(store.value.ty).split("x")[0] not in _LLVM_ELEMENTS):
        return False
    size = int(index.lanes) * _bytes(store.buffer.dtype)
    return size >= 32 and not size & (size - 1)


def _eligible(store, values: dict, sixteen: bool) -> bool:
    """``_streamable``, and of a float32 output, or of a 16-bit one where ``sixteen``
    (a lagged kernel's gradient, ``cpu_lagged_rows``; elsewhere 16-bit outputs
    keep plain stores: the module docstring)."""
    return _streamable(store, values) and (_bytes(store.buffer.dtype) == 4 or sixteen)


_FIRST_LANES = f"ce_tvm_store_first_float32x{_LINE_LANES}"


def _first_lanes_ir() -> str:
    """An LLVM function ``(ptr, value, count)`` that stores the first ``count``
    of the ``_LINE_LANES`` float32 lanes ``value`` (``llvm.masked.store``: the
    other lanes' memory is not touched), with the tag ``!3``."""
    lanes = _LINE_LANES
    vec, ints = f"<{lanes} x float>", f"<{lanes} x i32>"
    iota = ", ".join(f"i32 {i}" for i in range(lanes))
    return (f"define void @{_FIRST_LANES}(ptr %p, {vec} %v, i32 %n) {{\n"
            f"  %b = insertelement {ints} poison, i32 %n, i64 0\n"
            f"  %s = shufflevector {ints} %b, {ints} poison, {ints} zeroinitializer\n"
            f"  %m = icmp slt {ints} <{iota}>, %s\n"
            f"  call void @llvm.masked.store.v{lanes}f32.p0({vec} %v, ptr %p, i32 4, "
            f"<{lanes} x i1> %m), !tbaa !3\n"
            "  ret void\n}\n"
            f"declare void @llvm.masked.store.v{lanes}f32.p0({vec}, ptr, i32, <{lanes} x i1>)\n")


def _streamable(store, values: dict) -> bool:
    """Whether ``store`` writes an output vector (``_output_vector``) at an
    address that is a multiple of 64 bytes or of the vector's bytes if fewer
    (given a 64-byte aligned buffer; ``values``: ``binds`` of the body)."""
    if not _output_vector(store):
        return False
    index = store.indices[-1]
    element = _bytes(store.buffer.dtype)
    size = int(index.lanes) * element
    offset = tvm.sym.Analyzer().modular_set(unbound(index.base, values) * element)
    return offset.coeff % min(size, 64) == 0 and offset.base % min(size, 64) == 0


def _sole_store(loop):
    """The one store of a serial ``loop`` whose body holds binds, statements
    without stores (prefetches) and that store, last; else ``None``."""
    body = loop.body
    stmts = statements(body)
    if loop.kind != tirx.ForKind.SERIAL or not isinstance(stmts[-1], tirx.BufferStore):
        return None
    for stmt in stmts[:-1]:
        if collect_nodes(stmt, tirx.BufferStore) or collect_nodes(stmt, tirx.For):
            return None
    return stmts[-1]


def stages_unaligned_rows(target) -> bool:
    """Whether kernels for ``target`` stage their unaligned output rows
    (``_staged``): on AVX-512. In one process on a 2-core Zen 4, float32, at
    8192 x 50257, 4096 x 32001 and 1024 x 151655, the plain stores took
    1.08-1.25x the staged time in the training kernel and 1.02-1.27x in the
    backward (docs/performance.md); the AVX2 build of the same kernels, run
    there, 0.91-1.07x (training) and 0.80-1.11x (backward), with twice the
    instructions per element for the block's copy. AVX2 keeps the plain stores
    there."""
    return bool(codegen.target_has_features("avx512f", target))


def _stages(func) -> bool:
    target = func.attrs.get("target") if func.attrs else None
    return target is not None and stages_unaligned_rows(target)


def _stageable(loop, values: dict):
    """The store ``_staged`` can take out of ``loop``: its sole store, a float32
    output vector (``_output_vector``) that is not aligned, at consecutive vectors
    from one iteration to the next, over at least four lines; else ``None``."""
    store = _sole_store(loop)
    if (store is None or str(store.buffer.dtype) != "float32" or not _output_vector(store)
            or _streamable(store, values) or not isinstance(loop.extent, tirx.IntImm)):
        return None
    lanes = int(store.indices[-1].lanes)
    if loop.extent.value * lanes < 4 * _LINE_LANES:
        return None
    base = unbound(store.indices[-1].base, values)
    var = loop.loop_var
    step = tvm.sym.Analyzer().simplify(
        substituted(base, {var: var + tirx.const(1, var.ty)}) - base)
    return store if isinstance(step, tirx.IntImm) and step.value == lanes else None


def keep_outputs_cached(sch, loop) -> None:
    """Mark a kernel (by ``loop``, one of its loops) whose output stores stay plain."""
    sch.annotate(loop, CACHED_ATTR, 1)


def streamed_outputs(func) -> list:
    """The output buffers ``func`` has streamable or stageable stores to
    (``stream_output_stores``); none in a kernel marked ``keep_outputs_cached``."""
    if any(CACHED_ATTR in f.annotations for f in collect_nodes(func.body, tirx.For)):
        return []
    found, values, sixteen = {}, binds(func.body), is_lagged(func)
    stores = [s for s in collect_nodes(func.body, tirx.BufferStore)
              if _eligible(s, values, sixteen)]
    if _stages(func):
        stores += [s for s in (_stageable(loop, values)
                               for loop in collect_nodes(func.body, tirx.For)) if s is not None]
    for store in stores:
        found.setdefault(store.buffer.name, store.buffer)
    return list(found.values())


def streams(buffer):
    """Whether a launch streams its stores to ``buffer``: its size, at run time
    (always, folded, when ``STREAM_MIN_BYTES`` is 0: ``always_streaming``)."""
    if not STREAM_MIN_BYTES:
        return tirx.const(True, "bool")
    count = tirx.const(1, "int64")
    for extent in buffer.shape:
        count = count * tirx.Cast("int64", extent)
    return count * tirx.const(_bytes(buffer.dtype), "int64") >= tirx.const(
        STREAM_MIN_BYTES, "int64")


@contextlib.contextmanager
def always_streaming():
    """Kernels built inside stream every aligned output store, whatever its
    size: the code a large launch runs, alone (to count its instructions)."""
    global STREAM_MIN_BYTES
    saved, STREAM_MIN_BYTES = STREAM_MIN_BYTES, 0
    try:
        yield
    finally:
        STREAM_MIN_BYTES = saved


def fits_in_cache(buffer):
    """The negation of ``streams``: where the gradient's ``prefetchw`` still pays."""
    return tirx.Not(streams(buffer))


def _streamed(store, values: dict, used: set, sixteen: bool):
    if not _eligible(store, values, sixteen):
        return store
    used.add(str(store.value.ty))
    return _nontemporal(store.buffer, store.indices[-1].base, store.value)


def _direct_stores(stmt) -> list:
    """The stores of ``stmt`` not under a loop of its own body."""
    if isinstance(stmt, tirx.BufferStore):
        return [stmt]
    if isinstance(stmt, tirx.For):
        return []
    found = []
    for child in _children(stmt):
        found += _direct_stores(child)
    return found


def _children(stmt) -> list:
    if isinstance(stmt, tirx.SeqStmt):
        return list(stmt.seq)
    if isinstance(stmt, tirx.IfThenElse):
        return [stmt.then_case] + ([stmt.else_case] if stmt.else_case is not None else [])
    body = getattr(stmt, "body", None)
    return [body] if isinstance(body, tirx.Stmt) else []


def _nontemporal(buffer, index, value):
    """A non-temporal store of the vector ``value`` at ``buffer[index]`` (aligned to
    64 bytes or to its size)."""
    address = tirx.address_of(tirx.BufferLoad(buffer, [index]))
    return tirx.Evaluate(tirx.call_extern("void", _store_function(str(value.ty)), address, value))


def _stage_block(loop, store, stage, first, count: int, values: dict):
    """Iterations ``[first, first + count)`` of ``loop`` (its sole output ``store``
    consecutive vectors) into ``stage``, then copied to the output: the whole
    64-byte lines it covers by non-temporal stores (the output is 64-byte
    aligned), the elements before the first and the last 1 to 31 by plain masked
    stores (a plain store to a line just streamed would wait for it to leave the
    write-combining buffer). The block is read whole before any of it is written:
    an output written over its input holds."""
    var, lanes = loop.loop_var, int(store.indices[-1].lanes)
    inner = tirx.Var(f"{var.name}_staged", var.ty)

    def to_stage(st):
        if not st.buffer.same_as(store.buffer):
            return st
        offset = inner * tirx.const(lanes, var.ty)
        return tirx.BufferStore(stage, st.value, [tirx.Ramp(offset, tirx.const(1, var.ty), lanes)])

    body = substituted(loop.body, {var: first + inner})
    staged = tirx.For(inner, tirx.const(0, var.ty), tirx.const(count, var.ty),
                      tirx.ForKind.SERIAL, tvm_ffi.structural_map(
                          body, [(tirx.BufferStore, to_stage)], order="post"))
    start = substituted(unbound(store.indices[-1].base, values), {var: first})
    one, width = tirx.const(1, var.ty), tirx.const(_LINE_LANES, var.ty)
    head = tirx.floormod(tirx.const(0, var.ty) - start, width)

    def first_lanes(at, n):  # output[start + at + i] = stage[at + i], i < n <= 16
        address = tirx.address_of(tirx.BufferLoad(store.buffer, [start + at]))
        value = tirx.BufferLoad(stage, [tirx.Ramp(at, one, _LINE_LANES)])
        return tirx.Evaluate(tirx.call_extern("void", _FIRST_LANES, address, value,
                                              tirx.Cast("int32", n)))

    # A constant count of whole lines (LLVM unrolls it without a remainder loop),
    # one short of those the block may cover; the rest, 1 to 31 elements, masked.
    lines = count * lanes // _LINE_LANES - 1
    line = tirx.Var(f"{var.name}_line", var.ty)
    at = head + line * width
    streamed = tirx.For(line, tirx.const(0, var.ty), tirx.const(lines, var.ty),
                        tirx.ForKind.SERIAL, _nontemporal(
                            store.buffer, start + at,
                            tirx.BufferLoad(stage, [tirx.Ramp(at, one, _LINE_LANES)])))
    rest_at = head + tirx.const(lines * _LINE_LANES, var.ty)
    rest = tirx.const(count * lanes, var.ty) - rest_at
    return [staged, first_lanes(tirx.const(0, var.ty), head), streamed,
            first_lanes(rest_at, tirx.min(rest, width)),
            first_lanes(rest_at + width, tirx.max(rest - width, tirx.const(0, var.ty)))]


def _staged(loop, store, stage, values: dict):
    """``loop`` through ``stage`` in blocks of ``STAGE_BLOCK_ELEMENTS`` (the last
    one up to a line more, so that none is shorter than a line: ``_stage_block``)."""
    lanes, extent = int(store.indices[-1].lanes), loop.extent.value
    per_block = max(1, STAGE_BLOCK_ELEMENTS // lanes)
    blocks, rest = divmod(extent, per_block)
    if blocks and 0 < rest * lanes < _LINE_LANES:
        blocks, rest = blocks - 1, rest + per_block
    var = loop.loop_var
    stmts = []
    if blocks == 1:
        stmts += _stage_block(loop, store, stage, loop.min, per_block, values)
    elif blocks:
        block = tirx.Var(f"{var.name}_block", var.ty)
        first = loop.min + block * tirx.const(per_block, var.ty)
        stmts.append(tirx.For(block, tirx.const(0, var.ty), tirx.const(blocks, var.ty),
                              tirx.ForKind.SERIAL, tirx.SeqStmt(
                                  _stage_block(loop, store, stage, first, per_block, values))))
    if rest:
        first = loop.min + tirx.const(blocks * per_block, var.ty)
        stmts += _stage_block(loop, store, stage, first, rest, values)
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def _two_versions(loop, values: dict, used: set, stage, sixteen: bool):
    """``loop`` (whose own body stores to a streamed output) as ``if streams:
    streamed copy else loop`` when a store of it is streamable (``_eligible``), or,
    given a ``stage``, stageable (``_staged`` through it)."""
    stores = [s for s in _direct_stores(loop.body) if _eligible(s, values, sixteen)]
    if stores:
        streamed = tvm_ffi.structural_map(
            loop, [(tirx.BufferStore, lambda s: _streamed(s, values, used, sixteen))],
            order="post")
        return tirx.IfThenElse(streams(stores[0].buffer), streamed, loop)
    store = _stageable(loop, values) if stage is not None else None
    if store is None:
        return loop
    used.add(f"float32x{_LINE_LANES}")
    return tirx.IfThenElse(streams(store.buffer), _staged(loop, store, stage, values), loop)


def _uses(stmt, buffer) -> bool:
    return any(s.buffer.same_as(buffer) for s in collect_nodes(stmt, tirx.BufferStore))


def _with_stage(body, stage):
    """``body`` with ``stage`` allocated at the top of each parallel loop that
    uses it (a scratch buffer a thread), or of ``body`` if none does."""
    def allocate(stmt):
        return tirx.SeqStmt([tirx.AllocBuffer(stage), stmt])

    def in_parallel(loop):
        if loop.kind != tirx.ForKind.PARALLEL or not _uses(loop.body, stage):
            return loop
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, allocate(loop.body),
                        loop.thread_binding, loop.annotations)

    placed = tvm_ffi.structural_map(body, [(tirx.For, in_parallel)], order="post")
    if placed.same_as(body) and _uses(body, stage):
        return allocate(body)
    return placed


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def stream_output_stores(func, mod, ctx):
    """Non-temporal stores of the ``[N, C]`` outputs where aligned and large
    (module docstring)."""
    if not streamed_outputs(func):
        return func
    used, values, sixteen = set(), binds(func.body), is_lagged(func)
    # A block's last line may read up to two lines past it (masked off).
    stage = tirx.decl_buffer((STAGE_BLOCK_ELEMENTS + 3 * _LINE_LANES,), "float32",
                             "ce_tvm_stage") if _stages(func) else None
    body = tvm_ffi.structural_map(
        func.body, [(tirx.For, lambda loop: _two_versions(loop, values, used, stage, sixteen))],
        order="post")
    if stage is not None:
        body = _with_stage(body, stage)
    if not used:
        return func
    code = "".join(_store_ir(vector) for vector in sorted(used))
    if stage is not None and _uses(body, stage):
        code += _first_lanes_ir()
    code += _NONTEMPORAL.format(0) + _TBAA.format(1, 2, 3)
    func = func.with_body(tirx.AttrStmt(tvm.ir.StringImm(""), IMPORT_ATTR,
                                        tvm.ir.StringImm(code), body))
    # The loop's two versions define the same variables: each gets its own.
    return tvm.tirx.transform.ConvertSSA()(tvm.IRModule({"main": func}))["main"]
