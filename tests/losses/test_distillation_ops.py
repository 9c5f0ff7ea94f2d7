"""The distillation losses as ``torch.library`` ops (``ce_tvm::linear_distillation``,
``ce_tvm::distillation`` and their backwards; docs/distillation.md):
``torch.library.opcheck`` of each, and ``torch.compile(fullgraph=True)`` of both
losses giving eager's values and gradients. The values themselves are
``test_distillation.py``'s."""

from dataclasses import astuple

import pytest
import torch

import ce_tvm
from ce_tvm.losses.distillation import (
    distillation_backward,
    distillation_forward,
    linear_distillation_backward,
    linear_distillation_forward,
)
from ce_tvm.runtime.options import DivergenceOptions

V, H, HT, N = 1000, 8, 12, 6  # test_distillation.py's vocabulary: its kernels
OPTIONS = dict(beta=0.5, temperature=2.0, student_logit_scale=1.0, teacher_logit_scale=1.0,
               student_softcap=0.0, teacher_softcap=0.0)


def _scalars(**changes):
    """The ops' scalar arguments (``DivergenceOptions``' fields) of ``OPTIONS`` with ``changes``."""
    opts = DivergenceOptions.checked(**{**OPTIONS, **changes})
    assert opts.op_scalars() == astuple(opts)  # every field, in order
    return opts.op_scalars()


def _heads(bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs, Ws = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    xt, Wt = torch.randn(N, HT, generator=g), torch.randn(V, HT, generator=g) * 0.4
    bs, bt = (torch.randn(V, generator=g), torch.randn(V, generator=g)) if bias else (None, None)
    kept = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    return xs, Ws, bs, xt, Wt, bt, kept


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_opcheck_linear_ops(bias, reduction):
    xs, Ws, bs, xt, Wt, bt, kept = _heads(bias)
    student = [t if t is None else t.clone().requires_grad_() for t in (xs, Ws, bs)]
    flags = (True, True, bias)
    torch.library.opcheck(linear_distillation_forward,
                          (*student, xt, Wt, bt, kept, reduction, *_scalars(), 4, *flags,
                           False))
    grad_rows = torch.rand(N) * kept
    torch.library.opcheck(linear_distillation_backward,
                          (grad_rows, xs, Ws, bs, xt, Wt, bt, *_scalars(), 4, *flags))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_opcheck_logits_ops(reduction):
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(N, V, generator=g) * 3, torch.randn(N, V, generator=g) * 3
    kept = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    scalars = _scalars(beta=0.0 if reduction == "sum" else 0.5)
    torch.library.opcheck(distillation_forward,
                          (s.clone().requires_grad_(), t, kept, reduction, *scalars, True,
                           False))
    torch.library.opcheck(distillation_backward, (torch.rand(N) * kept, s, t, *scalars))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph_equals_eager(reduction):
    """Both losses (and the entropy) in one compiled graph: eager's loss and
    the student's gradients."""
    xs, Ws, bs, xt, Wt, bt, kept = _heads(bias=True, seed=2)
    y = torch.where(kept.bool(), 3, -100)
    teacher_logits = (xt @ Wt.t() + bt).reshape(2, 3, V)

    def objective(xs, Ws, bs, logits):
        fused, entropy = ce_tvm.linear_distillation_loss(
            xs, Ws, xt, Wt, y, student_bias=bs, teacher_bias=bt, beta=0.5, temperature=2.0,
            reduction=reduction, return_entropy=True, chunk_rows=4)
        whole = ce_tvm.distillation_loss(logits, teacher_logits, y.reshape(2, 3), beta=1.0,
                                         reduction=reduction)
        upstream = torch.linspace(0.5, 1.5, N)
        return ((fused * upstream).sum() + 0.5 * (whole.reshape(-1) * upstream).sum()
                + 0.1 * entropy.sum())

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (xs, Ws, bs)]
        logits = (xs @ Ws.t() + bs).reshape(2, 3, V).requires_grad_()
        loss = fn(*leaves, logits)
        loss.backward()
        return loss, [t.grad for t in (*leaves, logits)]

    eager, eager_grads = run(objective)
    compiled, compiled_grads = run(torch.compile(objective, fullgraph=True))
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    for got, expected in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduction,sweeps", [("mean", 1), ("sum", 1), ("none", 2)])
def test_backward_sweeps_again_for_none_only(reduction, sweeps, monkeypatch):
    """``mean``/``sum``: the student's gradients come from the forward's sweep
    (the backward scales them); ``none`` sweeps again with the per-row upstream
    gradient. The caller's tensors are never written."""
    from ce_tvm.runtime import linear_sweep

    calls = []
    original = linear_sweep.divergence_sweep
    monkeypatch.setattr(linear_sweep, "divergence_sweep",
                        lambda *a: calls.append(a[6] is not None) or original(*a))
    xs, Ws, bs, xt, Wt, bt, kept = _heads(bias=True, seed=3)
    leaves = [t.clone().requires_grad_() for t in (xs, Ws, bs)]
    loss = ce_tvm.linear_distillation_loss(leaves[0], leaves[1], xt, Wt, student_bias=leaves[2],
                                           teacher_bias=bt, reduction=reduction)
    (2 * loss.sum()).backward()
    assert calls == [reduction != "none"] + [True] * (sweeps - 1)
    for leaf, before in zip(leaves, (xs, Ws, bs)):
        assert torch.equal(leaf.detach(), before) and leaf.grad is not None
