"""bfloat16 results rounded by the CPU's own instruction where it has one.

TVM 0.27 keeps no bfloat16 arithmetic for LLVM: ``BF16ComputeLegalize``
writes every float32 -> bfloat16 cast as integer arithmetic on the bits,
round to nearest even,

    Cast(uint16, (bits + ((bits >> 16) & 1) + 0x7FFF) >> 16),

six vector instructions and a ``vpmovdw`` per 16 lanes on AVX-512 (0.41 of
the bf16 training kernel's 2.64 instructions per element on ``znver5``;
``ce_tvm.testing.cpu_static``). Without the legalisation TVM's LLVM codegen
crashes on the bfloat16 type, so ``native_bf16_rounding`` (a pass after
lowering) finds that spelled-out rounding of a vector whose lanes are a
multiple of 16 and, on a target with ``avx512bf16`` (Zen 4 and 5, Cooper Lake,
Sapphire Rapids), puts AVX-512 BF16's ``vcvtneps2bf16`` in its place, one
instruction per 16 lanes. It rounds to nearest even as well; it differs only
where bfloat16 itself is subnormal (|x| < 1.2e-38: the instruction flushes
to zero) and in a NaN's payload (a quiet NaN either way). Other targets, and
scalar casts (a row's loss), keep TVM's arithmetic.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.target import codegen

_INSTRUCTION = "llvm.x86.avx512bf16.cvtneps2bf16.512"
_LANES = 16  # float32 lanes of one zmm register


def _u32(value: int, lanes: int):
    return tirx.Broadcast(tirx.const(value, "uint32"), lanes)


def _lanes(expr) -> int:
    return tvm.runtime.DataType(str(expr.ty.dtype)).lanes


def _legalised_rounding(value, lanes: int):
    """TVM's bfloat16 rounding of the float32 vector ``value`` (see above)."""
    bits = tirx.reinterpret(f"uint32x{lanes}", value)
    odd = tirx.bitwise_and(tirx.shift_right(bits, _u32(16, lanes)), _u32(1, lanes))
    rounded = tirx.Add(bits, tirx.Add(odd, _u32(0x7FFF, lanes)))
    return tirx.Cast(f"uint16x{lanes}", tirx.shift_right(rounded, _u32(16, lanes)))


def _rounded_value(cast):
    """The float32 vector that ``cast`` rounds to bfloat16 the legalised way, or None."""
    lanes = _lanes(cast)
    if str(cast.ty) != f"uint16x{lanes}" or lanes % _LANES:
        return None
    # (bits + ...) >> 16: its first operand's first operand is the reinterpret
    bits = getattr(getattr(cast.value, "a", None), "a", None)
    if not (isinstance(bits, tvm.ir.expr.Call) and bits.op.name == "tirx.reinterpret"):
        return None
    value = bits.args[0]
    if str(value.ty) != f"float32x{lanes}":
        return None
    return value if tvm_ffi.structural_equal(cast, _legalised_rounding(value, lanes)) else None


def _by_instruction(cast):
    """``cast`` (a legalised rounding) as ``vcvtneps2bf16`` per 16 lanes, or None.
    The call is typed ``uint16`` as the legalised buffers are (TVM's LLVM codegen
    has no bfloat16 vectors); LLVM stores its ``<16 x bfloat>`` as is."""
    value = _rounded_value(cast)
    if value is None:
        return None
    lanes = _lanes(cast)
    vector = tirx.Var("bf16_source", f"float32x{lanes}")
    pieces = [tirx.call_llvm_pure_intrin(
        f"uint16x{_LANES}", _INSTRUCTION,
        vector if lanes == _LANES else tirx.Shuffle([vector], list(range(i, i + _LANES))))
        for i in range(0, lanes, _LANES)]
    joined = pieces[0] if len(pieces) == 1 else tirx.Shuffle(pieces, list(range(lanes)))
    return tirx.Let(vector, value, joined)


def _store_by_instruction(store):
    value = _by_instruction(store.value) if isinstance(store.value, tirx.Cast) else None
    if value is None:
        return store
    return tirx.BufferStore(store.buffer, value, store.indices)


def has_bf16_rounding(target) -> bool:
    """Whether ``target`` (a CPU target) has AVX-512 BF16's conversions."""
    return bool(codegen.target_has_features("avx512bf16", target))


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def native_bf16_rounding(func, mod, ctx):
    """On a target with ``avx512bf16``: stores of legalised bfloat16 roundings of
    16k-lane float32 vectors as ``vcvtneps2bf16`` (see the module docstring)."""
    target = func.attrs.get("target") if func.attrs else None
    if target is None or not has_bf16_rounding(target):
        return func
    return func.with_body(tvm_ffi.structural_map(
        func.body, [(tirx.BufferStore, _store_by_instruction)], order="post"))
