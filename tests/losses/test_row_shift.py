"""A forward at ``eps = 0`` on the CPU takes each row against the max of its
first chunk (``Variant.shifts_rows``, ``kernels.choices.row_shift``). A row
whose max lies more than ``ROW_SHIFT_RANGE`` above that shift, or one that is
not finite, has the call computed again by kernels that take each chunk
against its own max (``launch._exact_forward``). Both paths against the
float64 reference and torch."""

import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.kernels.common import ROW_SHIFT_RANGE
from ce_tvm.runtime import launch
from ce_tvm.testing import reference
from support import TOL, assert_close

C = 5003  # two chunks on every CPU: the first ends near the middle of the row


@pytest.fixture
def again(monkeypatch):
    """The calls computed again exactly (a list, one entry per call)."""
    calls = []
    exact = launch._exact_forward

    def counted(*args):
        calls.append(args[0].shape)
        exact(*args)

    monkeypatch.setattr(launch, "_exact_forward", counted)
    return calls


def _logits(dtype, spike: float, weighted: bool = False):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(9, C, generator=gen) * 3
    y = torch.randint(0, C, (9,), generator=gen)
    y[4] = -100
    x[2, C - 3] = spike  # in the last chunk, far above the first chunk's max
    x[6, 5] = spike  # in the first chunk: the shift itself
    y[7] = C - 3
    w = torch.rand(C, generator=gen) + 0.5 if weighted else None
    return x.to(dtype), y, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_row_far_above_its_shift_is_computed_again_exactly(again, dtype, reduction, weighted):
    x, y, w = _logits(dtype, 90.0, weighted)
    loss = ce_tvm.cross_entropy(x, y, w, reduction=reduction, lse_square_scale=1e-3)
    assert len(again) == 1
    ref, _, _, _ = reference.forward(x.double().numpy(), y.numpy(),
                                     None if w is None else w.double().numpy(),
                                     reduction, -100, 0.0, 1e-3)
    assert_close(loss.reshape(-1), ref.reshape(-1), TOL[dtype], "loss")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_within_the_range_take_one_sweep(again, dtype):
    """A max up to ``ROW_SHIFT_RANGE`` above the shift: terms up to e**64 summed,
    no second computation, the same loss and gradient as float64."""
    x, y, _ = _logits(dtype, 0.0)
    x[2, C - 3] = float(x[2, :2000].float().max()) + ROW_SHIFT_RANGE - 2
    xs = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xs, y, reduction="none")
    loss.backward(torch.ones_like(loss))
    assert not again
    ref, log_prob, _, lse = reference.forward(x.double().numpy(), y.numpy(), None, "none")
    assert_close(loss, ref, TOL[dtype], "loss")
    grad = reference.backward(torch.ones(9, dtype=torch.float64).numpy(), log_prob, y.numpy(),
                              reduction="none", lse=lse)
    assert_close(xs.grad, grad, TOL[dtype], "grad")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_gradient_after_a_second_computation(again, reduction, weighted):
    """``none``: the backward reads the ``lse`` the exact kernels wrote;
    ``mean``/``sum``: the one-pass training kernel's call is computed again,
    the gradient by the backward from the logits."""
    x, y, w = _logits(torch.float32, 90.0, weighted)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xs, y, w, reduction=reduction)
    ref = F.cross_entropy(xr, y, w, reduction=reduction)
    loss.sum().backward()
    ref.sum().backward()
    assert len(again) == 1
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_training_kernel_within_the_range(again, dtype):
    """The one-pass kernel's kept ``exp`` against the shift: loss and gradient as
    float64, no second computation."""
    x, y, _ = _logits(dtype, 0.0)
    x[2, C - 3] = float(x[2, :2000].float().max()) + ROW_SHIFT_RANGE - 2
    xs = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xs, y)
    loss.backward()
    assert not again
    ref, log_prob, _, lse = reference.forward(x.double().numpy(), y.numpy(), None, "mean")
    assert_close(loss.reshape(1), ref, TOL[dtype], "loss")
    grad = reference.backward(torch.ones(1, dtype=torch.float64).numpy(), log_prob, y.numpy(),
                              reduction="mean", lse=lse)
    assert_close(xs.grad, grad, TOL[dtype], "grad")


def test_a_temperature_scales_the_range(again):
    """The range is of the scaled logits: a gap of 40 at T = 0.5 is 80."""
    x, y, _ = _logits(torch.float32, 0.0)
    x[2, C - 3] = float(x[2, :2000].max()) + 40
    loss = ce_tvm.cross_entropy(x, y, reduction="none", temperature=0.5)
    assert len(again) == 1
    torch.testing.assert_close(loss, F.cross_entropy(x / 0.5, y, reduction="none"),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rows_as_the_exact_kernels_give_them(again, bad):
    x, y, _ = _logits(torch.float32, 0.0)
    x[3, C - 10] = bad
    x[5, :] = float("-inf")
    loss = ce_tvm.cross_entropy(x, y, reduction="none")
    ref, _, _, _ = reference.forward(x.double().numpy(), y.numpy(), None, "none")
    assert_close(loss, ref, 1e-5, "loss")
    assert len(again) == 1
