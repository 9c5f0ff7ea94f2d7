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


# --- Eager calls: the implementation and autograd directly, else the dispatcher ---------


def _step(x, y):
    loss = ce_tvm.cross_entropy(x, y, label_smoothing=0.1)
    loss.backward()
    return loss


def _inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(12, 50, generator=g, requires_grad=True), torch.randint(0, 50, (12,),
                                                                                generator=g)


@pytest.mark.parametrize("op", OPS, ids=lambda op: op._name)
def test_every_op_is_an_eager_custom_op(op):
    from ce_tvm.losses.autograd import EagerCustomOp

    assert isinstance(op, EagerCustomOp) and isinstance(op, torch.library.CustomOpDef)


class _Counted:
    """An op's ``_opoverload`` (the dispatcher's entry point), its calls counted."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def test_an_eager_call_on_plain_tensors_skips_the_dispatcher(monkeypatch):
    """The training step gives torch's loss and gradient without entering the
    dispatcher for any op of the step."""
    counted = []
    for op in (cross_entropy.cross_entropy_train, cross_entropy.cross_entropy_forward):
        counted.append(_Counted(op._opoverload))
        monkeypatch.setattr(op, "_opoverload", counted[-1])
    x, y = _inputs()
    loss = _step(x, y)
    ref_x = x.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_x, y, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(x.grad, ref_x.grad)
    assert [c.calls for c in counted] == [0, 0]


def test_modes_and_subclasses_go_through_the_dispatcher(monkeypatch):
    """Under a dispatch mode the step is the registered op (the mode sees
    ``ce_tvm::cross_entropy_train``, not its inner kernels), and under the
    profiler (its trace names the op); a tensor subclass goes through the
    dispatcher too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        names: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Seen.names.append(str(func))
            return func(*args, **(kwargs or {}))

    x, y = _inputs()
    with Seen():
        ce_tvm.cross_entropy(x, y, label_smoothing=0.1)
    assert any("ce_tvm.cross_entropy_train" in n for n in Seen.names), Seen.names
    with torch.profiler.profile() as trace:  # a profiler's trace names the op
        _step(x, y)
    assert "ce_tvm::cross_entropy_train" in {e.key for e in trace.key_averages()}

    class Marked(torch.Tensor):
        pass

    counted = _Counted(cross_entropy.cross_entropy_train._opoverload)
    monkeypatch.setattr(cross_entropy.cross_entropy_train, "_opoverload", counted)
    _step(x.detach().as_subclass(Marked).requires_grad_(), y)
    _step(x, y)
    assert counted.calls == 1  # the subclass only
