"""Vectorisable ``exp`` for the compute declarations.

``tvm.te.exp`` on float32 lowers to scalar ``expf`` calls on LLVM, which
cannot be vectorised and dominate the loss. This is the Cephes-style
polynomial that ``topi.fast_exp`` uses (range reduction by ``ln 2``, degree-6
polynomial, exponent built by bit shift), written as plain TIR arithmetic so
it vectorises on every target and can sit inside a reduction. Relative error
is below 4e-7, about 3 ulp (``tests/test_fastmath.py``). It differs from ``topi``'s in
two ways that the loss needs: NaN propagates (``topi`` clamps it away), and
results below ~1e-38 flush to exactly 0, so ``exp(-inf) == 0``.

float64 keeps the exact ``exp`` (``gradcheck`` needs it).
"""

from __future__ import annotations

from tvm import te, tirx

_LOG2E = 1.44269504088896341
_LN2 = 0.6931471805599453
_HI = 88.3762626647950
_LO = -88.3762626647949
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
         1.6666665459e-1, 5.0000001201e-1)


def exp(x):
    """``e**x`` for a float32 or float64 TIR expression."""
    if str(x.ty) != "float32":
        return te.exp(x)

    def f32(v):
        return tirx.const(v, "float32")

    # Plain subexpressions, no ``Let``: TVM 0.27's BF16ComputeLegalize rewrites
    # a Let-bound cast of a bfloat16 load into its raw bits. CSE (TIR's and
    # LLVM's) folds the repeats.
    clamped = tirx.Select(x < f32(_LO), f32(_LO), tirx.Select(x > f32(_HI), f32(_HI), x))
    k = te.floor(clamped * f32(_LOG2E) + f32(0.5))
    r = clamped - k * f32(_LN2)
    poly = f32(_POLY[0])
    for coef in _POLY[1:]:
        poly = poly * r + f32(coef)
    two_k = tirx.reinterpret(
        "float32", tirx.shift_left(k.astype("int32") + tirx.const(127, "int32"),
                                   tirx.const(23, "int32"))
    )
    return tirx.Select(x != x, x, two_k * (poly * r * r + r + f32(1.0)))
