"""float32 ``[N, C]`` outputs stored past the caches (non-temporal stores).

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
kernels 64-byte aligned tensors): a 50257-class row keeps its plain stores.
Streaming pays only for an output larger than the caches; one that fits is
read back from them by whatever consumes it. So each loop of such stores runs
in two versions, chosen per launch by the output's size
(``STREAM_MIN_BYTES``), and the ``prefetchw`` of the gradient's lines runs
only where the stores are plain (``fits_in_cache``). 16-bit outputs keep plain
stores: on a 2-core Zen 4 streaming made the bf16 backward slower
(docs/performance.md, "float32 [N, C] outputs streamed past the caches"); so
does the divergence, whose schedule marks it ``keep_outputs_cached`` (it
writes a row's gradient after whole-row passes over two models' logits, bound
by its arithmetic: 2-4% slower streamed).
"""

from __future__ import annotations

import contextlib

import tvm
import tvm_ffi
from tvm import tirx

from ..kernels.stages import LOG_PROB
from ._common import GRAD_OUTPUTS, binds, collect_nodes, unbound

# The [N, C] outputs whose stores may be streamed.
STREAMED_OUTPUTS = GRAD_OUTPUTS + (LOG_PROB,)
# An output of at least this many bytes is streamed past the caches. On a
# 2-core Zen 4 with 32 MiB of L3 streaming was 0.92-1.08x the time of plain
# stores at 8-32 MiB (float32 training and backward kernels, by shape and run)
# and 0.75-0.90x from 128 MiB up.
STREAM_MIN_BYTES = 64 << 20
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


def _store_function(lanes: int) -> str:
    return f"ce_tvm_stream_float32x{lanes}"


def _store_ir(lanes: int) -> str:
    """An LLVM function ``(ptr, value)`` that stores ``lanes`` float32 lanes
    non-temporally (``!0``) with the tag ``!3``. ``align`` is at most a cache
    line's: a wider vector is stored line by line."""
    vec, align = f"<{lanes} x float>", min(lanes * 4, 64)
    return (f"define void @{_store_function(lanes)}(ptr %p, {vec} %v) {{\n"
            f"  store {vec} %v, ptr %p, align {align}, !nontemporal !0, !tbaa !3\n"
            "  ret void\n}\n")


def _streamable(store, values: dict) -> bool:
    """Whether ``store`` writes a contiguous float32 vector of a streamed output,
    of 32 bytes or more, at an address that is a multiple of 64 bytes or of the
    vector's bytes if fewer (given a 64-byte aligned buffer; ``values``:
    ``binds`` of the body)."""
    index = store.indices[-1] if store.indices else None
    if (store.buffer.name not in STREAMED_OUTPUTS or not isinstance(index, tirx.Ramp)
            or not isinstance(index.stride, tirx.IntImm) or index.stride.value != 1
            or not str(store.value.ty).startswith("float32")):
        return False
    element = _bytes(store.buffer.dtype)
    size = int(index.lanes) * element
    if size < 32 or size & (size - 1):
        return False
    offset = tvm.sym.Analyzer().modular_set(unbound(index.base, values) * element)
    return offset.coeff % min(size, 64) == 0 and offset.base % min(size, 64) == 0


def keep_outputs_cached(sch, loop) -> None:
    """Mark a kernel (by ``loop``, one of its loops) whose output stores stay plain."""
    sch.annotate(loop, CACHED_ATTR, 1)


def streamed_outputs(func) -> list:
    """The output buffers ``func`` has streamable stores to (``stream_output_stores``);
    none in a kernel marked ``keep_outputs_cached``."""
    if any(CACHED_ATTR in f.annotations for f in collect_nodes(func.body, tirx.For)):
        return []
    found, values = {}, binds(func.body)
    for store in collect_nodes(func.body, tirx.BufferStore):
        if _streamable(store, values):
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


def _streamed(store, values: dict, used: set):
    if not _streamable(store, values):
        return store
    index = store.indices[-1]
    used.add(int(index.lanes))
    address = tirx.address_of(tirx.BufferLoad(store.buffer, [index.base]))
    return tirx.Evaluate(tirx.call_extern("void", _store_function(int(index.lanes)),
                                          address, store.value))


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


def _two_versions(loop, values: dict, used: set):
    """``loop`` (whose own body stores to a streamed output) as ``if streams:
    streamed copy else loop`` when a store of it is streamable."""
    stores = [s for s in _direct_stores(loop.body) if _streamable(s, values)]
    if not stores:
        return loop
    streamed = tvm_ffi.structural_map(
        loop, [(tirx.BufferStore, lambda s: _streamed(s, values, used))], order="post")
    return tirx.IfThenElse(streams(stores[0].buffer), streamed, loop)


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def stream_output_stores(func, mod, ctx):
    """Non-temporal stores of the ``[N, C]`` outputs where aligned and large
    (module docstring)."""
    if not streamed_outputs(func):
        return func
    used, values = set(), binds(func.body)
    body = tvm_ffi.structural_map(
        func.body, [(tirx.For, lambda loop: _two_versions(loop, values, used))],
        order="post")
    if not used:
        return func
    code = "".join(_store_ir(lanes) for lanes in sorted(used))
    code += _NONTEMPORAL.format(0) + _TBAA.format(1, 2, 3)
    func = func.with_body(tirx.AttrStmt(tvm.ir.StringImm(""), IMPORT_ATTR,
                                        tvm.ir.StringImm(code), body))
    # The loop's two versions define the same variables: each gets its own.
    return tvm.tirx.transform.ConvertSSA()(tvm.IRModule({"main": func}))["main"]
