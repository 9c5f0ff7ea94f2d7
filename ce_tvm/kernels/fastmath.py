"""Vectorisable ``exp`` (and ``tanh``, for softcap) for the compute declarations.

``tvm.te.exp`` on float32 lowers to scalar ``expf`` calls on LLVM, which
cannot be vectorised and dominate the loss. This is a branchless
polynomial ``exp`` written as plain TIR arithmetic, so it vectorises on
every target and can sit inside a reduction:

    k = round(x log2(e)),  r = x - k ln(2)  (|r| <= ln(2) / 2, one FMA),
    e**r by a minimax polynomial (Horner), times 2**k.

Relative error is below 2e-7 for float32 results of ``exp(x)``,
``-10 <= x <= 0`` (where a loss's probabilities lie), and below 4e-7, about 3
ulp, over the whole float32 range (the rounding of ``ln(2)`` grows with
``k``); 4e-6 for results stored in 16 bits (``tests/kernels/test_fastmath.py``).
Unlike ``topi.fast_exp`` NaN propagates (on x86 the clamp ``maxps(low, x)``
keeps it and every later step is arithmetic on it; where ``max`` drops NaN,
as CUDA's ``fmaxf`` does, the schedule asks for an explicit NaN
test on the bits, ``scaling(..., nan_test=True)``), and ``exp(-inf)`` is
exactly 0.

How ``2**k`` is applied is the one target-dependent choice, made by the
schedule around the declaration (``scaling``): ``"bits"`` rounds
``x log2(e)`` by adding ``1.5 * 2**23 + 127``, which leaves ``k + 127`` in the
sum's low mantissa bits, shifts them into the exponent field and multiplies
(portable, and TVM vectorises it: no call; results below ~1.2e-38 flush to 0,
arguments above 88.3 overflow to inf, a little early: no caller passes any;
on AVX-512 it beat ``vscalefps`` with its two conversions, 0.146 -> 0.13 ns
per element per core for the forward in cache); ``"exp2"`` is the whole
``exp`` as the target's ``2**y`` of ``x log2(e)`` (CUDA's ``exp2f``: the
special-function unit's ``ex2`` plus a denormal fix-up, about 2 ulp; the
rounding of ``x log2(e)`` and of ``log2(e)`` add up to ``|x| 2**-23``
relative, under 1e-5 for ``|x| < 80``: the terms that large an argument
leaves are below 1e-34), which propagates NaN by itself.

float64 keeps the exact ``exp`` (``gradcheck`` needs it).
"""

from __future__ import annotations

import contextlib
import contextvars

from tvm import te, tirx

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# Horner coefficients of e**r on [-ln2/2, ln2/2], highest power first:
# minimax for relative error with the constant term fixed at 1, so exp(0) is
# exactly 1 (Lawson-weighted least squares; float32 Horner error 1.5e-7 for
# degree 5, 2.9e-6 for degree 4). The degree follows the precision the result
# is stored in: a float32 result gets a 1-2 ulp polynomial (degree 6 would
# halve that at one more FMA per element, the unit an ``exp``-bound kernel
# waits on); a float16/bfloat16 one (rounded to 2**-11 or 2**-8) gets an
# ``exp`` that is still more than 100 times finer than that rounding, one
# FMA cheaper again.
_POLY = {
    "float32": (8.2902722061e-03, 4.1898161173e-02, 1.6667638719e-01, 4.9999147654e-01,
                9.9999970198e-01, 1.0),
    "half": (4.1513489222e-02, 1.6787414118e-01, 5.0003014061e-01, 9.9996687006e-01, 1.0),
}
# Clamps keep k where 2**k is representable: k = -127 gives the all-zero
# exponent, i.e. exactly 0.
_LOW = -127 * _LN2
_HIGH = 128 * _LN2

# 1.5 * 2**23 + 127: adding it rounds a float32 in (-2**22, 2**22) to an
# integer k, leaving k + 127 in the low mantissa bits.
_ROUNDER = 12583039.0

SCALINGS = ("bits", "exp2")
_SCALING = contextvars.ContextVar("ce_tvm_exp_scaling", default=("bits", False))


@contextlib.contextmanager
def scaling(name: str, nan_test: bool = False):
    """Declare computes inside the block with ``2**k`` applied by ``name``.

    ``nan_test``: return NaN for NaN by an explicit test on the bits, for targets
    whose ``max`` drops NaN (CUDA's ``fmaxf`` returns the other operand, so the
    lower clamp would turn NaN into ``exp(low)``, about 0). x86's ``maxps(low, x)``
    returns ``x`` when it is NaN, so the CPU needs no test.
    """
    if name not in SCALINGS:
        raise ValueError(f"exp scaling must be one of {SCALINGS}, got {name!r}")
    token = _SCALING.set((name, nan_test))
    try:
        yield
    finally:
        _SCALING.reset(token)


def exp(x, nonpositive: bool = False, storage: str = "float32"):
    """``e**x`` for a float32 or float64 TIR expression.

    ``nonpositive``: the caller knows ``x <= 0`` (or NaN), as for ``x - max``,
    or tests the rows where it may not be (``x - shift`` of a row against its
    shift, ``common.ROW_SHIFT_RANGE``); the upper clamp is then left out, and
    above ``128 ln 2`` the result is meaningless rather than ``inf``.
    ``storage``: the dtype the result ends up rounded to (``float16``/``bfloat16``
    take the shorter polynomial).
    """
    if str(x.ty) != "float32":
        return te.exp(x)

    def f32(v):
        return tirx.const(v, "float32")

    how, nan_test = _SCALING.get()
    if how == "exp2":  # the target's own 2**y (CUDA: exp2f, MUFU.EX2); keeps NaN, exp2(-inf) = 0
        return tirx.exp2(x * f32(_LOG2E))
    # Plain subexpressions, no ``Let``: TVM 0.27's BF16ComputeLegalize rewrites
    # a Let-bound cast of a bfloat16 load into its raw bits. CSE (TIR's and
    # LLVM's) folds the repeats. ``max(low, x)`` is one ``maxps(low, x)``,
    # which returns ``x`` when it is NaN, so NaN passes through every step.
    t = tirx.max(f32(_LOW), x)
    if not nonpositive:
        t = tirx.Select(t > f32(_HIGH), f32(_HIGH), t)
    y = t * f32(_LOG2E) + f32(_ROUNDER)  # k + 127 in its low mantissa bits
    # k = y - rounder, through y's bits: TVM's simplifier would fold (a + c) - c to a
    k = tirx.reinterpret("float32", tirx.reinterpret("int32", y)) - f32(_ROUNDER)
    r = k * f32(-_LN2) + t
    coefs = _POLY["float32" if storage in ("float32", "float64") else "half"]
    poly = f32(coefs[0])
    for coef in coefs[1:]:
        poly = poly * r + f32(coef)
    two_k = tirx.reinterpret("float32", tirx.shift_left(  # k + 127 into the exponent field
        tirx.reinterpret("int32", y), tirx.const(23, "int32")))
    result = poly * two_k
    return _keep_nan(x, result) if nan_test else result


def _keep_nan(x, result):
    """``result``, or a quiet NaN where ``x`` is NaN: branch-free integer
    arithmetic on the bits. TVM folds ``x != x`` away, and a ``Select`` (even on
    ``isnan``) turns into a branch that stops CUDA loops from vectorising.
    ``|x|``'s bits exceed ``0x7F800000`` only for NaN, so ``0x7F800000 - bits``
    is negative, and its arithmetic shift by 31 all ones, only then."""
    def i32(v):
        return tirx.const(v, "int32")

    magnitude = tirx.reinterpret("int32", x) & i32(0x7FFFFFFF)
    nan_mask = tirx.shift_right(i32(0x7F800000) - magnitude, i32(31))
    bits = tirx.reinterpret("int32", result) | (nan_mask & i32(0x7FC00000))
    return tirx.reinterpret("float32", bits)



# tanh(x) ~ x P(x^2) / Q(x^2) on |x| < 9 (Eigen's float tanh: the rational
# minimax fit, relative error below 4e-7); beyond 9 tanh rounds to +-1 in float32.
_TANH_P = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05,
           5.12229709037114e-08, -8.60467152213735e-11, 2.00018790482477e-13,
           -2.76076847742355e-16)
_TANH_Q = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04,
           1.19825839466702e-06)
_TANH_SATURATION = 9.0


def tanh(x):
    """``tanh(x)`` for a float32 or float64 TIR expression, branch-free and
    vectorisable on float32 (float64 keeps the exact ``tanh``).

    A rational function (``_TANH_P``/``_TANH_Q``, one division), ``+-1``
    beyond ``|x| = 9``, kept inside ``[-1, 1]``: by ``max(-1, r)`` then
    ``min(1, .)``, which return ``r`` when it is NaN on x86 (``maxps``,
    ``minps``), or, where ``scaling`` asks for the NaN test (CUDA's
    ``fminf`` drops NaN), by Selects, which name ``r`` three times: every
    name of ``x`` is a copy of its expression in the tree TVM lowers
    (21 copies against 59; a capped kernel's compile time follows).
    Exactly odd; relative error below 1e-6 (``tests/kernels/test_fastmath.py``).
    """
    if str(x.ty) != "float32":
        return te.tanh(x)

    def f32(v):
        return tirx.const(v, "float32")

    def horner(coefs, v):
        out = f32(coefs[-1])
        for coef in reversed(coefs[:-1]):
            out = out * v + f32(coef)
        return out

    square = x * x
    ratio = x * horner(_TANH_P, square) / horner(_TANH_Q, square)
    one = f32(1.0)
    sign = tirx.Select(x < f32(0.0), -one, one)
    if _SCALING.get()[1]:
        inside = tirx.Select(ratio > one, one, tirx.Select(ratio < -one, -one, ratio))
    else:
        inside = tirx.min(one, tirx.max(-one, ratio))
    # NaN fails the comparison and stays NaN through ``inside``
    return tirx.Select(tirx.abs(x) >= f32(_TANH_SATURATION), sign, inside)


# Cephes ``logf``'s polynomial for log(1 + f), f in [sqrt(1/2) - 1, sqrt(2) - 1]
# (relative error about 1e-7), highest degree first.
_LOG_POLY = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
             1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
             3.3333331174e-1)
_SQRT_HALF = 0.70710678118654752440


def log(x, bind: bool = False):
    """``log(x)`` of a float32 TIR expression with ``x`` positive and normal
    (Cephes ``logf``: the exponent from the bits, a polynomial of the mantissa;
    branch-free, so it vectorises, where ``te.log`` is a library call per
    element). Zero, subnormals, infinities and NaN are not handled: callers
    guard them (a zero weight's term is selected away). ``bind``: ``x`` is
    bound once by a ``Let`` (it is named about 70 times; see ``exp`` for why
    half-precision loads must not be). Other dtypes, and
    targets with their own fast transcendentals (``scaling("exp2")``: CUDA,
    where the polynomial measured 10x the instructions of ``logf``):
    ``te.log``."""
    if str(x.ty) != "float32" or _SCALING.get()[0] == "exp2":
        return te.log(x)

    def f32(v):
        return tirx.const(v, "float32")

    def i32(v):
        return tirx.const(v, "int32")

    arg = tirx.Var("log_arg", "float32") if bind else x
    bits = tirx.reinterpret("int32", arg)
    # frexp: x = m 2**e with m in [1/2, 1)
    e = (tirx.shift_right(bits, i32(23)) & i32(0xFF)) - i32(126)
    m = tirx.reinterpret("float32", (bits & i32(0x007FFFFF)) | i32(0x3F000000))
    low = m < f32(_SQRT_HALF)
    e = tirx.Select(low, e - i32(1), e).astype("float32")
    f = tirx.Select(low, m + m, m) - f32(1.0)
    z = f * f
    poly = f32(_LOG_POLY[0])
    for coef in _LOG_POLY[1:]:
        poly = poly * f + f32(coef)
    y = poly * f * z + e * f32(-2.12194440e-4) - f32(0.5) * z
    out = f + y + e * f32(0.693359375)
    return tirx.Let(arg, x, out) if bind else out
