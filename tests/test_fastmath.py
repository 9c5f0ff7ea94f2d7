"""Accuracy of the vectorised exp every schedule uses (ce_tvm.fastmath)."""

import numpy as np
import pytest
import torch
import tvm
from tvm import te

from ce_tvm import fastmath
from ce_tvm.targets import tvm_target


@pytest.fixture(scope="module")
def fast_exp():
    n = te.var("n", "int64")
    x = te.placeholder((n,), "float32", name="x")
    y = te.compute((n,), lambda i: fastmath.exp(x[i].asobject()), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    _, inner = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 16])
    sch.vectorize(inner)
    fn = tvm.compile(sch.mod, target=tvm_target("llvm"))["main"]

    def run(values):
        xs = torch.tensor(values, dtype=torch.float32)
        ys = torch.empty_like(xs)
        fn(xs, ys)
        return xs.double().numpy(), ys.double().numpy()

    return run


def test_relative_error_over_the_normal_range(fast_exp):
    x, y = fast_exp(np.linspace(-87.0, 88.0, 2_000_003))
    rel = np.abs(y - np.exp(x)) / np.exp(x)
    assert rel.max() < 4e-7, rel.max()


def test_small_arguments_and_underflow(fast_exp):
    x, y = fast_exp(np.concatenate([np.linspace(-1e-3, 1e-3, 10001), [-88.5, -100.0, -1e30]]))
    ref = np.exp(x)
    normal = ref > 1.2e-38
    assert (np.abs(y[normal] - ref[normal]) / ref[normal]).max() < 4e-7
    assert (np.abs(y[~normal] - ref[~normal]) < 1.2e-38).all()


def test_special_values(fast_exp):
    _, y = fast_exp([float("-inf"), float("nan"), 0.0, float("inf"), 1000.0])
    assert y[0] == 0.0  # exp(-inf): masked classes contribute exactly nothing
    assert np.isnan(y[1])  # NaN propagates (topi's fast_exp clamps it away)
    assert y[2] == 1.0
    assert np.isinf(y[3]) and np.isinf(y[4])
