"""The one autograd protocol (``ce_tvm.losses.autograd``): gradients computed in the
forward and scaled by the backward, the same rules for every family, and backward
returns laid out by each op's schema."""

import numpy as np
import pytest
import torch

import ce_tvm
from ce_tvm.losses import cross_entropy, distillation, linear, log_probs
from ce_tvm.losses.autograd import op_gradients

OPS = [cross_entropy.cross_entropy_forward, cross_entropy.cross_entropy_train,
       cross_entropy.cross_entropy_probs, linear.linear_cross_entropy_forward,
       log_probs.log_probs_forward, log_probs.log_probs_stats_forward,
       log_probs.linear_log_probs_forward, log_probs.linear_log_probs_stats_forward,
       distillation.linear_distillation_forward, distillation.distillation_forward]


@pytest.mark.parametrize("op", OPS, ids=lambda op: op._name)
def test_backward_slots_come_from_the_schema(op):
    names = [a.name for a in op._opoverload._schema.arguments]
    slots = op_gradients(op, **{names[0]: "g"})
    assert len(slots) == len(names) and slots[0] == "g" and set(slots[1:]) == {None}
    with pytest.raises(TypeError, match="no arguments"):
        op_gradients(op, no_such_argument=None)


def _student(seed=0, n=6, v=40, h=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.5,
            torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.5)


def _linear_distillation(allow):
    xs, Ws, xt, Wt = _student()
    Ws.requires_grad_()
    return Ws, ce_tvm.linear_distillation_loss(xs, Ws, xt, Wt, allow_retain_graph=allow)


def _distillation(allow):
    xs, Ws, xt, Wt = _student()
    s = (xs @ Ws.T).requires_grad_()
    return s, ce_tvm.distillation_loss(s, xt @ Wt.T, allow_retain_graph=allow)


def _linear_cross_entropy(allow):
    xs, Ws, _, _ = _student()
    Ws.requires_grad_()
    y = torch.arange(xs.shape[0])
    return Ws, ce_tvm.linear_cross_entropy(xs, Ws, y, allow_retain_graph=allow)


FAMILIES = {"linear_cross_entropy": _linear_cross_entropy,
            "linear_distillation_loss": _linear_distillation,
            "distillation_loss": _distillation}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_backward_needs_allow_retain_graph(family):
    """Every family with forward gradients: the first backward consumes them; a
    second one through the same graph is a clear error, unless allow_retain_graph
    (then each backward gets a scaled copy, and the sums add up)."""
    leaf, loss = FAMILIES[family](False)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=f"{family}.*allow_retain_graph"):
        loss.backward()
    leaf, loss = FAMILIES[family](True)
    (0.5 * loss).backward(retain_graph=True)
    first = leaf.grad.clone()
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(leaf.grad, 5 * first)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_upstream_gradient_scales_the_kept_gradients(family):
    leaf, loss = FAMILIES[family](False)
    loss.backward()
    unit = leaf.grad.clone()
    leaf, loss = FAMILIES[family](False)
    (-3.0 * loss).backward()
    torch.testing.assert_close(leaf.grad, -3.0 * unit)


def test_cross_entropy_keeps_its_gradient_while_the_graph_is_kept():
    """The drop-in, as PyTorch's loss: retain_graph needs no flag."""
    x = torch.randn(5, 30, requires_grad=True)
    y = torch.randint(0, 30, (5,))
    loss = ce_tvm.cross_entropy(x, y)
    for _ in range(3):
        loss.backward(retain_graph=True)
    reference = x.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy(reference, y).backward()
    torch.testing.assert_close(x.grad, 3 * reference.grad)


@pytest.mark.parametrize("make", [np.float32, np.float64])
def test_numpy_scalars_are_real_numbers_everywhere(make):
    """One numeric check for every option: NumPy scalars work for the divergence's
    options as they do for the cross-entropy's."""
    xs, Ws, xt, Wt = _student()
    s, t = xs @ Ws.T, xt @ Wt.T
    y = torch.arange(6)
    torch.testing.assert_close(
        ce_tvm.distillation_loss(s, t, beta=make(0.5), temperature=make(2.0)),
        ce_tvm.distillation_loss(s, t, beta=0.5, temperature=2.0))
    torch.testing.assert_close(ce_tvm.cross_entropy(s, y, label_smoothing=make(0.25)),
                               ce_tvm.cross_entropy(s, y, label_smoothing=0.25))
    for bad in (True, "0.5"):
        with pytest.raises(TypeError, match="beta must be a real number"):
            ce_tvm.distillation_loss(s, t, beta=bad)
