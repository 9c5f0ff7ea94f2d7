"""Accuracy of the vectorised exp every schedule uses (ce_tvm.kernels.fastmath), for
its polynomial (exponent-bits) form and both polynomial lengths."""

import numpy as np
import pytest
import torch
import tvm
from tvm import te

from ce_tvm.kernels import fastmath
from ce_tvm.store.targets import tvm_target

# Relative error bound by the precision the result is stored in.
BOUND = {"float32": 4e-7, "bfloat16": 4e-6}
# The polynomial scaling (the CPU's; "exp2" defers to the target's 2**y, below).
VARIANTS = [(s, st) for s in fastmath.SCALINGS if s != "exp2" for st in BOUND]


def _compile(scaling, storage):
    target = tvm_target("llvm")
    n = te.var("n", "int64")
    x = te.placeholder((n,), "float32", name="x")
    with fastmath.scaling(scaling):
        y = te.compute((n,), lambda i: fastmath.exp(x[i].asobject(), storage=storage), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    _, inner = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 16])
    sch.vectorize(inner)
    fn = tvm.compile(sch.mod, target=target)["main"]

    def run(values):
        xs = torch.tensor(values, dtype=torch.float32)
        ys = torch.empty_like(xs)
        fn(xs, ys)
        return xs.double().numpy(), ys.double().numpy()

    return run


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: "-".join(v))
def fast_exp(request):
    return _compile(*request.param), BOUND[request.param[1]]


def test_relative_error_over_the_normal_range(fast_exp):
    run, bound = fast_exp
    x, y = run(np.linspace(-87.0, 88.0, 2_000_003))
    rel = np.abs(y - np.exp(x)) / np.exp(x)
    assert rel.max() < bound, rel.max()


def test_float32_relative_error_where_probabilities_lie():
    """``exp(x - max)`` for ``x - max`` in ``[-10, 0]`` (probabilities above 5e-5):
    half the whole range's bound for float32 results (the rounding of ``ln 2``,
    which grows with ``|x|``, is small there; the 16-bit polynomial's own error
    is its bound everywhere)."""
    run = _compile("bits", "float32")
    x, y = run(np.linspace(-10.0, 0.0, 1_000_001))
    rel = np.abs(y - np.exp(x)) / np.exp(x)
    assert rel.max() < BOUND["float32"] / 2, rel.max()


def test_small_arguments_and_underflow(fast_exp):
    run, bound = fast_exp
    x, y = run(np.concatenate([np.linspace(-1e-3, 1e-3, 10001), [-88.5, -100.0, -1e30]]))
    ref = np.exp(x)
    normal = ref > 1.2e-38
    assert (np.abs(y[normal] - ref[normal]) / ref[normal]).max() < bound
    assert (np.abs(y[~normal] - ref[~normal]) < 1.2e-38).all()


def test_special_values(fast_exp):
    run, _ = fast_exp
    _, y = run([float("-inf"), float("nan"), 0.0, float("inf"), 1000.0])
    assert y[0] == 0.0  # exp(-inf): masked classes contribute exactly nothing
    assert np.isnan(y[1])  # NaN propagates (topi's fast_exp clamps it away)
    assert y[2] == 1.0
    assert np.isinf(y[3]) and np.isinf(y[4])


def test_unknown_scaling_is_refused():
    with pytest.raises(ValueError, match="exp scaling"):
        with fastmath.scaling("vexp"):
            pass


def test_explicit_nan_test_keeps_nan_and_accuracy():
    """``nan_test`` (CUDA, whose ``fmaxf`` drops NaN) returns NaN for NaN, from the
    input's bits, and changes no other value."""
    n = te.var("n", "int64")
    x = te.placeholder((n,), "float32", name="x")
    with fastmath.scaling("bits", nan_test=True):
        y = te.compute((n,), lambda i: fastmath.exp(x[i].asobject()), name="y")
    func = te.create_prim_func([x, y])
    assert "2139095040" in func.script()  # 0x7F800000: the test is in the code, not folded
    fn = tvm.compile(func, target=tvm_target("llvm"))["main"]
    xs = torch.tensor([float("nan"), float("-inf"), -100.0, -1.0, 0.0, 3.5])
    ys = torch.empty_like(xs)
    fn(xs, ys)
    assert torch.isnan(ys[0]) and ys[1] == 0.0 and ys[4] == 1.0
    ref = np.exp(xs[2:].double().numpy())
    assert (np.abs(ys[2:].double().numpy() - ref) <= 4e-7 * ref + 1.2e-38).all()


@pytest.mark.parametrize("scaling", fastmath.SCALINGS)
def test_tanh_accuracy_and_special_values(scaling):
    """``fastmath.tanh`` (softcap): relative error below 1e-6 over the range
    that matters (vectorised), exact odd symmetry, +-1 beyond it, NaN kept."""
    target = tvm_target("llvm")
    n = te.var("n", "int64")
    x = te.placeholder((n,), "float32", name="x")
    with fastmath.scaling(scaling):
        y = te.compute((n,), lambda i: fastmath.tanh(x[i].asobject()), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    _, inner = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 16])
    sch.vectorize(inner)
    fn = tvm.compile(sch.mod, target=target)["main"]
    grid = np.concatenate([np.linspace(-12.0, 12.0, 1_200_001), np.geomspace(1e-30, 1.0, 10001),
                           [0.24999, 0.25, 0.25001]])
    xs = torch.tensor(np.concatenate([grid, -grid]), dtype=torch.float32)
    ys = torch.empty_like(xs)
    fn(xs, ys)
    x64, y64 = xs.double().numpy(), ys.double().numpy()
    rel = np.abs(y64 - np.tanh(x64)) / np.maximum(np.abs(np.tanh(x64)), 1e-37)
    assert rel.max() < 1e-6, (rel.max(), x64[rel.argmax()])
    half = len(grid)
    assert np.array_equal(y64[:half], -y64[half:])  # odd: tanh(-x) = -tanh(x) exactly
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 50.0, -1e30, 0.0])
    out = torch.empty_like(special)
    fn(special, out)
    assert out[0] == 1.0 and out[1] == -1.0 and torch.isnan(out[2])
    assert out[3] == 1.0 and out[4] == -1.0 and out[5] == 0.0


def test_exp2_scaling_is_the_targets_exp2_within_its_rounding():
    """``"exp2"`` (the CUDA schedule's) is ``2**(x log2 e)``: the rounding of the
    product and of ``log2 e`` add up to ``|x| 2**-23`` relative error to the target's ``exp2``
    (here LLVM's; CUDA's ``exp2f`` is within 2 ulp), and NaN and ``-inf``
    need no clamp or test."""
    run = _compile("exp2", "float32")
    x, y = run(np.linspace(-87.0, 10.0, 200_003))
    rel = np.abs(y - np.exp(x)) / np.exp(x)
    assert (rel <= 2.4e-7 + np.abs(x) * 2.0**-23).all(), rel.max()
    _, y = run([float("-inf"), float("nan"), 0.0, -1e30])
    assert y[0] == 0.0 and np.isnan(y[1]) and y[2] == 1.0 and y[3] == 0.0
