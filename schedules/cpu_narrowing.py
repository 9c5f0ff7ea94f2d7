"""bfloat16 results rounded once, and by the CPU's own instruction where it has one.

TVM 0.27 keeps no bfloat16 arithmetic for LLVM: ``BF16ComputeLegalize``
writes every float32 -> bfloat16 cast as integer arithmetic on the bits,
round to nearest even,

    Cast(uint16, (bits + ((bits >> 16) & 1) + 0x7FFF) >> 16),  bits = reinterpret(value),

with ``value``, the whole float32 expression, written out twice. Where that
expression holds a branch (the training gradient's one-hot term,
``if_then_else`` on the chunk holding the label, which TVM lowers to basic
blocks), LLVM evaluates it twice and keeps the test in every chunk: on AVX2
the bf16 gradient loop ran 100 instructions per 32 elements (``znver3``,
``ce_tvm.testing.cpu_static``). And on AVX-512 the rounding is six vector
instructions and a ``vpmovdw`` per 16 lanes (0.41 of the bf16 training
kernel's 2.64 instructions per element on ``znver5``).

``bf16_rounding`` (a pass after lowering) finds that spelled-out rounding in a
store and binds ``bits`` once (``Let``): the same arithmetic, bit for bit, on a
value evaluated once. On a target with ``avx512bf16`` (Zen 4 and 5, Cooper
Lake, Sapphire Rapids) a vector whose lanes are a multiple of 16 takes AVX-512
BF16's ``vcvtneps2bf16`` instead, one instruction per 16 lanes, and one whose
lanes are a multiple of 32 ``vcvtne2ps2bf16``, one per 32 (two registers
rounded into one: no ``vinserti64x4`` to join the halves). Both round to
nearest even as well; they differ only where bfloat16 itself is subnormal
(|x| < 1.2e-38: the instruction flushes to zero) and in a NaN's payload (a
quiet NaN either way). TVM's LLVM codegen crashes on the bfloat16 type when
the legalisation is left out, hence a rewrite after it.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import codegen

_INSTRUCTION = "llvm.x86.avx512bf16.cvtneps2bf16.512"
_PAIR_INSTRUCTION = "llvm.x86.avx512bf16.cvtne2ps2bf16.512"
_LANES = 16  # float32 lanes of one zmm register


def _ty(scalar: str, lanes: int) -> str:
    return f"{scalar}x{lanes}" if lanes > 1 else scalar


def _u32(value: int, lanes: int):
    const = tirx.const(value, "uint32")
    return tirx.Broadcast(const, lanes) if lanes > 1 else const


def _lanes(expr) -> int:
    return tvm.runtime.DataType(str(expr.ty.dtype)).lanes


def _legalised_rounding(value, lanes: int):
    """TVM's bfloat16 rounding of the float32 ``value`` (see above)."""
    return _legalised_rounding_of_bits(
        tirx.reinterpret(_ty("uint32", lanes), value), lanes)


def _legalised_rounding_of_bits(bits, lanes: int):
    odd = tirx.bitwise_and(tirx.shift_right(bits, _u32(16, lanes)), _u32(1, lanes))
    rounded = tirx.Add(bits, tirx.Add(odd, _u32(0x7FFF, lanes)))
    return tirx.Cast(_ty("uint16", lanes), tirx.shift_right(rounded, _u32(16, lanes)))


def _rounded_value(cast):
    """The float32 value that ``cast`` rounds to bfloat16 the legalised way, or None."""
    lanes = _lanes(cast)
    if str(cast.ty) != _ty("uint16", lanes):
        return None
    # (bits + ...) >> 16: its first operand's first operand is the reinterpret
    bits = getattr(getattr(cast.value, "a", None), "a", None)
    if not (isinstance(bits, tvm.ir.expr.Call) and bits.op.name == "tirx.reinterpret"):
        return None
    value = bits.args[0]
    if not tvm_ffi.structural_equal(cast, _legalised_rounding(value, lanes)):
        return None
    return value


def _by_instruction(value, lanes: int, pairs: bool = True):
    """``value`` rounded by AVX-512 BF16: 32 lanes a ``vcvtne2ps2bf16`` (two zmm
    registers into one) where ``lanes`` is a multiple of 32 and ``pairs``, else
    16 a ``vcvtneps2bf16``. The calls are typed ``uint16`` as the legalised
    buffers are (TVM's LLVM codegen has no bfloat16 vectors); LLVM stores its
    ``<N x bfloat>`` as it is."""
    vector = tirx.Var("bf16_source", f"float32x{lanes}")

    def part(i):
        return vector if lanes == _LANES else tirx.Shuffle([vector], list(range(i, i + _LANES)))

    if pairs and lanes % (2 * _LANES) == 0:  # the second source goes to the low half
        pieces = [tirx.call_llvm_pure_intrin(f"uint16x{2 * _LANES}", _PAIR_INSTRUCTION,
                                             part(i + _LANES), part(i))
                  for i in range(0, lanes, 2 * _LANES)]
    else:
        pieces = [tirx.call_llvm_pure_intrin(f"uint16x{_LANES}", _INSTRUCTION, part(i))
                  for i in range(0, lanes, _LANES)]
    joined = pieces[0] if len(pieces) == 1 else tirx.Shuffle(pieces, list(range(lanes)))
    return tirx.Let(vector, value, joined)


def _once(value, lanes: int):
    """The legalised rounding of ``value`` with its bits bound once."""
    bits = tirx.Var("bf16_bits", _ty("uint32", lanes))
    return tirx.Let(bits, tirx.reinterpret(_ty("uint32", lanes), value),
                    _legalised_rounding_of_bits(bits, lanes))


def _rewrite(store, instruction: bool):
    value = _rounded_value(store.value) if isinstance(store.value, tirx.Cast) else None
    if value is None:
        return store
    lanes = _lanes(store.value)
    rounded = (_by_instruction(value, lanes) if instruction and lanes % _LANES == 0
               else _once(value, lanes))
    return tirx.BufferStore(store.buffer, rounded, store.indices)


def has_bf16_rounding(target) -> bool:
    """Whether ``target`` (a CPU target) has AVX-512 BF16's conversions."""
    return bool(codegen.target_has_features("avx512bf16", target))


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def bf16_rounding(func, mod, ctx):
    """Stores of legalised bfloat16 roundings: the value evaluated once, by
    AVX-512 BF16's instructions on a target with ``avx512bf16`` (module docstring)."""
    target = func.attrs.get("target") if func.attrs else None
    instruction = target is not None and has_bf16_rounding(target)
    return func.with_body(tvm_ffi.structural_map(
        func.body, [(tirx.BufferStore, lambda store: _rewrite(store, instruction))],
        order="post"))
