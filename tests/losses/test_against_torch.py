"""The seed pair against torch.nn.functional.cross_entropy (loss and autograd gradient)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import ce_tvm

GRID = list(itertools.product(("none", "sum", "mean"), (False, True), (False, True), (0.0, 0.1)))


@pytest.mark.parametrize("reduction,weighted,ignore,eps", GRID)
def test_matches_torch(reduction, weighted, ignore, eps):
    gen = torch.Generator().manual_seed(1)
    n, c = 64, 1000
    x = torch.randn(n, c, generator=gen) * 2
    y = torch.randint(0, c, (n,), generator=gen)
    if ignore:
        y[::4] = -100
    w = torch.rand(c, generator=gen) + 0.5 if weighted else None
    opts = dict(weight=w, reduction=reduction, ignore_index=-100, label_smoothing=eps)

    loss, log_prob, zloss, lse = ce_tvm.cross_entropy_loss(x, y, **opts)
    xr = x.clone().requires_grad_()
    ref = F.cross_entropy(xr, y, **opts)
    torch.testing.assert_close(loss.reshape(ref.shape), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(log_prob, torch.log_softmax(x, 1), rtol=1e-5, atol=1e-5)
    assert zloss.numel() == 0 and lse.numel() == 0

    grad_out = torch.rand(ref.shape, generator=gen) + 0.5
    ref.backward(grad_out)
    x_grad = ce_tvm.cross_entropy_loss_grad(grad_out.reshape(-1), log_prob, y, **opts)
    torch.testing.assert_close(x_grad, xr.grad, rtol=1e-5, atol=1e-7)


def test_int32_targets_and_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(40, 30, generator=gen)
    x = base.t()  # [30, 40], not contiguous
    y = torch.randint(0, 40, (60,), generator=gen, dtype=torch.int32)[::2]  # strided int32
    w = (torch.rand(80, generator=gen) + 0.5)[::2]
    assert not x.is_contiguous() and not y.is_contiguous() and not w.is_contiguous()
    loss, log_prob, _, _ = ce_tvm.cross_entropy_loss(x, y, w, label_smoothing=0.05)
    ref = F.cross_entropy(x, y.long(), w, label_smoothing=0.05)
    torch.testing.assert_close(loss[0], ref, rtol=1e-5, atol=1e-6)
    grad = ce_tvm.cross_entropy_loss_grad(torch.ones(1), log_prob.t().contiguous().t(), y, w,
                                          label_smoothing=0.05)
    xr = x.clone().requires_grad_()
    F.cross_entropy(xr, y.long(), w, label_smoothing=0.05).backward()
    torch.testing.assert_close(grad, xr.grad, rtol=1e-5, atol=1e-7)
