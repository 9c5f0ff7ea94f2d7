"""bfloat16 logits widened by one word permutation in the loops that stream them in.

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
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import codegen

from ._common import collect_nodes

_WORDS_PER_REGISTER = 32  # 16-bit lanes of one zmm register


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


def _is_plain_update(store) -> bool:
    """Whether ``store`` updates an accumulator (its value reads the buffer it
    writes) with no float32 multiplication (no ``exp``, no scaling)."""
    reads_itself = any(load.source.same_as(store.buffer)
                       for load in collect_nodes(store.value, tvm.ir.expr.TensorLoad))
    multiplies = any(_lanes_of(str(m.ty), "float32") or str(m.ty) == "float32"
                     for m in collect_nodes(store.value, tirx.Mul))
    return reads_itself and not multiplies


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
