"""bfloat16 logits widened by 32-bit pairs in the loops that only accumulate them,
else by one word permutation in the loops that stream them in.

TVM 0.27 legalises a bfloat16 -> float32 cast into integer arithmetic on the
bits, ``reinterpret(float32, Cast(uint32, bits) << 16)``, which LLVM emits as
a ``vpmovzxwd`` and a ``vpslld`` per 16 lanes. The same float32 lanes are the
16-bit words interleaved with zero words, a shuffle that an AVX-512 BW target
does in one ``vpermt2w`` per 16 lanes (its third source a zero register).

``bf16_widening`` (a pass after lowering) writes the cast as that shuffle
where it pays: in an accumulator's update (a store whose value reads the
buffer it writes: the chunk's max and the logits' sum, in the loop that
streams the chunk in from memory) with no float32 multiplication in it.
Where the widened value feeds an ``exp`` (an FMA chain) the two-instruction
form measured faster: on a 2-core Zen 4 the permutation there made the bf16
forward 4% and its backward 7% slower, and a chunk's staging copy 2.5% slower
(docs/performance.md). Words that another store widens too (an ``exp`` in the
same loop: a row taken against its shift, ``kernels.choices.row_shift``) keep
the two-instruction form, which LLVM then computes once for both. Bit for bit
the same values: both put the word in the high half of a zero float32.

``bf16_pairs_widening`` (a pass before it, on every CPU) widens the words of
a loop that only accumulates them, lane by lane, into ``rfactor``'s partial
results, by pairs: the ``L`` words read as ``L / 2`` 32-bit pairs, the even
words shifted into the high halves (``vpslld``) and the odd ones kept there
by a mask (``vpandd``), one instruction per vector of floats and no shuffle,
where the zero-extension takes two. The floats then sit in the lanes
``0, 2, 4, ..., 1, 3, 5, ...`` of the row, not in order: every accumulator of
the loop takes the same order every step, the loop's other lane-varying
values (a column compared with a bound) are reordered alike, and
``rfactor``'s partial results (``<stage>.rf``) are read only by the
reduction across their lanes, which is commutative, so each row's max is the
same and each sum the same terms, grouped otherwise. A buffer the function
allocates that the loop writes once a step at fixed lanes and reads after,
and nothing else reads (the log-probs' ``exp`` kept a vector at a time for
its two sums), is a temporary in the same order. On a 2-core Zen 4 the bf16
forward is 1.08-1.21x faster, the log-probs 1.06-1.08x (docs/performance.md).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import codegen

from ._common import binds, collect_nodes, depends_on, statements, unbound

_WORDS_PER_REGISTER = 32  # 16-bit lanes of one zmm register
# TVM's ``rfactor`` names its buffer of partial results ``<stage>.rf``
# (printed ``<stage>_rf``).
_RFACTOR_SUFFIX = ".rf"


def _lanes_of(ty: str, scalar: str) -> int:
    """The lanes of the vector type ``ty`` of ``scalar``s, 0 for any other type."""
    head, _, lanes = ty.partition("x")
    return int(lanes) if head == scalar and lanes.isdigit() else 0


def _legalised_words(call):
    """The ``uint16`` vector that ``call`` widens the legalised way
    (``reinterpret(float32xL, Cast(uint32xL, words) << 16)``), else ``None``."""
    if not (isinstance(call, tvm.ir.expr.Call) and call.op.name == "tirx.reinterpret"):
        return None
    lanes = _lanes_of(str(call.ty), "float32")
    shift = call.args[0]
    if not lanes or not isinstance(shift, tirx.LShift) or not isinstance(shift.a, tirx.Cast):
        return None
    amount = shift.b.value if isinstance(shift.b, tirx.Broadcast) else shift.b
    words = shift.a.value
    if (_lanes_of(str(words.ty), "uint16") != lanes or not isinstance(amount, tirx.IntImm)
            or amount.value != 16):
        return None
    return words


def _by_permutation(call, shared: list):
    """``call`` (a legalised widening of a multiple of 16 lanes, of words not in
    ``shared``) as the words interleaved with zero words (``vpermt2w``), else
    ``call`` itself."""
    words = _legalised_words(call)
    if words is None or any(tvm_ffi.structural_equal(words, other) for other in shared):
        return call
    lanes = _lanes_of(str(words.ty), "uint16")
    if lanes % (_WORDS_PER_REGISTER // 2):
        return call
    zeros = tirx.Broadcast(tirx.const(0, "uint16"), lanes)
    high_halves = [index for lane in range(lanes) for index in (lanes, lane)]
    return tirx.reinterpret(f"float32x{lanes}", tirx.Shuffle([words, zeros], high_halves))


def _is_plain_update(store, multiplied: bool = False) -> bool:
    """Whether ``store`` updates an accumulator (its value reads the buffer it
    writes) with no float32 multiplication (no ``exp``, no scaling) unless
    ``multiplied``."""
    reads_itself = any(load.source.same_as(store.buffer)
                       for load in collect_nodes(store.value, tvm.ir.expr.TensorLoad))
    multiplies = any(_lanes_of(str(m.ty), "float32") or str(m.ty) == "float32"
                     for m in collect_nodes(store.value, tirx.Mul))
    return reads_itself and (multiplied or not multiplies)


def _rewrite(store, shared: list):
    if not _is_plain_update(store):
        return store
    value = tvm_ffi.structural_map(
        store.value, [(tvm.ir.expr.Call, lambda call: _by_permutation(call, shared))],
        order="post")
    return store if value.same_as(store.value) else tirx.BufferStore(
        store.buffer, value, store.indices)


def _widened_by_others(body) -> list:
    """The words that stores other than plain updates widen (``_legalised_words``)."""
    return [words for store in collect_nodes(body, tirx.BufferStore)
            if not _is_plain_update(store)
            for call in collect_nodes(store.value, tvm.ir.expr.Call)
            if (words := _legalised_words(call)) is not None]


def has_word_permutes(target) -> bool:
    """Whether ``target`` (a CPU target) permutes 16-bit words across a register
    (AVX-512 BW's ``vpermt2w``)."""
    return bool(codegen.target_has_features("avx512bw", target))


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def bf16_widening(func, mod, ctx):
    """Legalised bfloat16 widenings in plain accumulator updates written as a
    word permutation, on a target with AVX-512 BW (module docstring)."""
    target = func.attrs.get("target") if func.attrs else None
    if target is None or not has_word_permutes(target):
        return func
    shared = _widened_by_others(func.body)
    return func.with_body(tvm_ffi.structural_map(
        func.body, [(tirx.BufferStore, lambda store: _rewrite(store, shared))], order="post"))


def _in_pair_order(lanes: int, even, odd):
    """The ``lanes``-lane vector of ``even``'s lanes, then ``odd``'s."""
    return tirx.Shuffle([even, odd], [tirx.const(i, "int32") for i in range(lanes)])


def _by_pairs(words):
    """The float32 lanes of the ``uint16xL`` words ``words`` in pair order (even
    words, then odd words): ``L / 2`` 32-bit pairs, shifted and masked."""
    half = _lanes_of(str(words.ty), "uint16") // 2
    pairs = tirx.reinterpret(f"uint32x{half}", words)
    def bits(value):
        return tirx.Broadcast(tirx.const(value, "uint32"), half)

    even = tirx.reinterpret(f"float32x{half}", pairs << bits(16))
    odd = tirx.reinterpret(f"float32x{half}", pairs & bits(0xFFFF0000))
    return _in_pair_order(2 * half, even, odd)


def _ramp_in_pair_order(ramp):
    """``ramp``'s lanes in pair order (a column compared with a bound, say)."""
    lanes = int(ramp.lanes)
    half = lanes // 2
    return _in_pair_order(lanes, tirx.Ramp(ramp.base, ramp.stride * 2, half),
                          tirx.Ramp(ramp.base + ramp.stride, ramp.stride * 2, half))


def _outside_loads(value, rewrite):
    """``value`` with ``rewrite`` applied to it as if its loads were opaque
    (indices included): each load stands in as a variable meanwhile."""
    loads = {}

    def hide(load):
        var = tirx.Var("load", load.ty)
        loads[var] = load
        return var

    hidden = tvm_ffi.structural_map(value, [(tvm.ir.expr.TensorLoad, hide)], order="post")
    return tvm_ffi.structural_map(rewrite(hidden), [(tirx.Var, lambda v: loads.get(v, v))])


def _same_indices(a, b) -> bool:
    """Whether the indices ``a`` and ``b`` are the same (constants of any
    integer type by value: lowering mixes int32 and int64)."""
    def constant(i):
        if isinstance(i, tirx.IntImm):
            return i.value
        if isinstance(i, tirx.Ramp) and all(isinstance(v, tirx.IntImm)
                                            for v in (i.base, i.stride)):
            return ("ramp", i.base.value, i.stride.value, int(i.lanes))
        return None

    return len(a) == len(b) and all(
        constant(x) is not None and constant(x) == constant(y)
        or tvm_ffi.structural_equal(x, y) for x, y in zip(a, b))


def _lanewise_words(store, step, temporaries):
    """Whether ``store`` works lane by lane at the same lanes every ``step`` of
    its loop, and the ``uint16xL`` words it widens (``None`` for none), as
    ``(ok, words)``. It writes an ``rfactor`` buffer whose value it reads at
    the stored lanes (an accumulator), or one of ``temporaries`` (a buffer
    only this loop reads, at the lanes it writes them); its value reads
    besides only the words inside legalised widenings, ``temporaries`` at
    their lanes, and scalars; no shuffle, and every ramp outside a load ``L``
    lanes (``_ramp_in_pair_order`` reorders it)."""
    index = store.indices[-1] if len(store.indices) == 1 else None
    temporary = any(store.buffer.same_as(t) for t, _ in temporaries)
    if not (index is not None and not depends_on(index, step) and (temporary or (
            store.buffer.name.endswith(_RFACTOR_SUFFIX)
            and _is_plain_update(store, multiplied=True)))):
        return False, None
    widened = [w for call in collect_nodes(store.value, tvm.ir.expr.Call)
               if (w := _legalised_words(call)) is not None]
    if any(not tvm_ffi.structural_equal(w, widened[0]) for w in widened):
        return False, None
    words = widened[0] if widened else None
    lanes = _lanes_of(str(store.value.ty), str(store.value.ty).partition("x")[0])
    outside = []
    _outside_loads(store.value, lambda hidden: outside.extend(
        collect_nodes(hidden, tirx.Shuffle) + collect_nodes(hidden, tirx.Ramp)) or hidden)
    if not lanes or lanes % 2 or any(
            not isinstance(n, tirx.Ramp) or int(n.lanes) != lanes for n in outside):
        return False, None
    loads = collect_nodes(store.value, tvm.ir.expr.TensorLoad)
    for load in loads:
        # the lanes it reads: its own (an accumulator's), or where a temporary is written
        lanes_read = [i for t, i in temporaries if load.source.same_as(t)] or (
            [store.indices] if load.source.same_as(store.buffer) and not temporary else [])
        if lanes_read:
            if not _same_indices(load.indices, lanes_read[0]):
                return False, None
        elif "x" in str(load.ty) and not (
                words is not None and tvm_ffi.structural_equal(load, words)):
            return False, None
    if words is not None and sum(
            tvm_ffi.structural_equal(load, words) for load in loads) != len(widened):
        return False, None  # the words are also read outside a widening
    return True, words


def _temporaries(body: list, step, loads_in_func: dict, local: set) -> list:
    """``(buffer, indices)`` of the buffers that ``body`` (a loop's statements in
    order, its binds substituted) write once, at ``indices`` fixed over
    ``step``, and then read, and that nothing else in the function reads
    (``loads_in_func``: loads per buffer) and that the function allocates
    (``local``: its allocations' data, by name: a vector view of one holds
    an expression of its own for the same storage)."""
    found = []
    for i, stmt in enumerate(body):
        if not isinstance(stmt, tirx.BufferStore) or stmt.buffer.name.endswith(_RFACTOR_SUFFIX) \
                or str(stmt.buffer.data) not in local:
            continue
        buffer = stmt.buffer
        reads = [ld for st in body for ld in collect_nodes(st, tvm.ir.expr.TensorLoad)
                 if ld.source.same_as(buffer)]
        earlier = [ld for st in body[:i + 1] for ld in collect_nodes(
            st, tvm.ir.expr.TensorLoad) if ld.source.same_as(buffer)]
        writes = [st for st in body
                  if isinstance(st, tirx.BufferStore) and st.buffer.same_as(buffer)]
        if len(writes) == 1 and not earlier and reads \
                and len(reads) == loads_in_func.get(buffer, 0) \
                and not any(depends_on(i, step) for i in stmt.indices):
            found.append((buffer, stmt.indices))
    return found


def _through_binds(stmt, values: dict):
    """``stmt``, a store's value and indices with the ``binds`` ``values``
    substituted; any other statement as it is."""
    if not isinstance(stmt, tirx.BufferStore):
        return stmt
    return tirx.BufferStore(stmt.buffer, unbound(stmt.value, values),
                            [unbound(i, values) for i in stmt.indices])


def _pairs_in_loop(loop, register_lanes: int, loads_in_func: dict, local: set):
    """``loop`` in pair order, when every store in its body works lane by lane
    (``_lanewise_words``) and they widen the same words, at least two
    registers of ``register_lanes`` floats (fewer would leave the pairs in
    half registers, joined by a shuffle), and it binds no vector: the words
    widened by pairs, the ramps outside loads reordered alike."""
    stores = collect_nodes(loop.body, tirx.BufferStore)
    if not stores or collect_nodes(loop.body, tirx.For) or any(
            "x" in str(bind.var.ty) for bind in collect_nodes(loop.body, tirx.Bind)):
        return loop
    values = binds(loop.body)  # checked through the binds, which may hide the loop's variable
    stores = [_through_binds(store, values) for store in stores]
    in_order = [_through_binds(stmt, values) for stmt in statements(loop.body)]
    temporaries = _temporaries(in_order, loop.loop_var, loads_in_func, local)
    checked = [_lanewise_words(store, loop.loop_var, temporaries) for store in stores]
    words = [w for _, w in checked if w is not None]
    if not all(ok for ok, _ in checked) or not words or any(
            not tvm_ffi.structural_equal(w, words[0]) for w in words) or \
            _lanes_of(str(words[0].ty), "uint16") < 2 * register_lanes:
        return loop

    def pairs(call):
        found = _legalised_words(call)
        return call if found is None else _by_pairs(found)

    def reordered(store):
        value = _outside_loads(store.value, lambda hidden: tvm_ffi.structural_map(
            hidden, [(tirx.Ramp, _ramp_in_pair_order)]))
        value = tvm_ffi.structural_map(value, [(tvm.ir.expr.Call, pairs)], order="post")
        return tirx.BufferStore(store.buffer, value, store.indices)

    body = tvm_ffi.structural_map(loop.body, [(tirx.BufferStore, reordered)])
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body,
                    loop.thread_binding, loop.annotations)


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def bf16_pairs_widening(func, mod, ctx):
    """bfloat16 words that a loop only accumulates into ``rfactor`` lanes,
    widened by 32-bit pairs (module docstring), on a CPU target."""
    target = func.attrs.get("target") if func.attrs else None
    if target is None:
        return func
    register_lanes = 16 if codegen.target_has_features("avx512f", target) else 8
    loads_in_func: dict = {}
    for load in collect_nodes(func.body, tvm.ir.expr.TensorLoad):
        loads_in_func[load.source] = loads_in_func.get(load.source, 0) + 1
    local = {str(alloc.buffer.data) for alloc in collect_nodes(func.body, tirx.AllocBuffer)}
    return func.with_body(tvm_ffi.structural_map(
        func.body, [(tirx.For, lambda loop: _pairs_in_loop(
            loop, register_lanes, loads_in_func, local))], order="post"))
