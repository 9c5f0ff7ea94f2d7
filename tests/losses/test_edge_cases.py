"""All rows ignored, NaN/Inf isolation, determinism, 64-bit indexing."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.testing import reference
from support import MEMORY, assert_close


def test_all_rows_ignored():
    x = torch.randn(5, 11)
    y = torch.full((5,), -100)
    assert torch.isnan(ce_tvm.cross_entropy_loss(x, y)[0]).all()
    assert ce_tvm.cross_entropy_loss(x, y, reduction="sum")[0].item() == 0.0
    none = ce_tvm.cross_entropy_loss(x, y, reduction="none", lse_square_scale_for_zloss=0.1,
                                     return_zloss=True)
    assert torch.equal(none[0], torch.zeros(5)) and torch.equal(none[2], torch.zeros(5))
    # Gradient: exactly zero, as torch gives (SPEC's m / D would be 0/0).
    log_prob = none[1]
    for reduction in ("mean", "sum"):
        g = ce_tvm.cross_entropy_loss_grad(torch.ones(1), log_prob, y, reduction=reduction,
                                           label_smoothing=0.1, lse_square_scale_for_zloss=0.1,
                                           lse_for_zloss=none[3])
        assert torch.equal(g, torch.zeros_like(g))
    xr = x.clone().requires_grad_()
    F.cross_entropy(xr, y).backward()
    assert torch.equal(xr.grad, torch.zeros_like(x))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_stay_in_their_row(bad):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, generator=gen)
    y = torch.randint(0, 40, (6,), generator=gen)
    y[4] = -100
    x[2, 7] = bad
    x[4, 1] = bad  # an ignored row with a bad logit
    opts = dict(reduction="none", label_smoothing=0.1, lse_square_scale_for_zloss=1e-3,
                return_zloss=True)
    loss, log_prob, zloss, lse = ce_tvm.cross_entropy_loss(x, y, **opts)
    ref_loss, ref_lp, ref_z, ref_lse = reference.forward(
        x.double().numpy(), y.numpy(), None, "none", -100, 0.1, 1e-3)
    assert_close(loss, ref_loss, 1e-5, "loss")
    assert_close(log_prob, ref_lp, 1e-5, "log_prob")
    assert_close(lse, ref_lse, 1e-5, "lse")
    assert loss[4].item() == 0.0 and zloss[4].item() == 0.0  # ignored row is exactly 0
    clean = [0, 1, 3, 5]
    assert torch.isfinite(loss[clean]).all() and torch.isfinite(log_prob[clean]).all()
    g = ce_tvm.cross_entropy_loss_grad(torch.ones(6), log_prob, y, reduction="none",
                                       label_smoothing=0.1)
    assert torch.isfinite(g[clean]).all()


def test_negative_infinity_logits_are_masked_classes():
    """-inf marks a forbidden class: the row stays finite, its probability is 0."""
    x = torch.randn(4, 9)
    x[:, 3] = float("-inf")
    y = torch.tensor([0, 1, 2, 4])
    loss, log_prob, _, _ = ce_tvm.cross_entropy_loss(x, y)
    torch.testing.assert_close(loss[0], F.cross_entropy(x, y))
    g = ce_tvm.cross_entropy_loss_grad(torch.ones(1), log_prob, y)
    assert torch.equal(g[:, 3], torch.zeros(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_identical_runs(dtype):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3000, 5000, generator=gen).to(dtype)
    y = torch.randint(0, 5000, (3000,), generator=gen)
    w = torch.rand(5000, generator=gen)
    opts = dict(weight=w, label_smoothing=0.1, lse_square_scale_for_zloss=1e-4, return_zloss=True)
    first = ce_tvm.cross_entropy_loss(x, y, **opts)
    second = ce_tvm.cross_entropy_loss(x, y, **opts)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    grads = [ce_tvm.cross_entropy_loss_grad(torch.ones(1, dtype=dtype), first[1], y, weight=w,
                                            label_smoothing=0.1) for _ in range(2)]
    assert torch.equal(grads[0], grads[1])


@pytest.mark.slow
@MEMORY
def test_more_than_2_pow_31_elements():
    """N * C >= 2**31: every index must be 64-bit. bfloat16 keeps it at 4 GB per [N, C].
    Only the checked tail rows are random (the rest are zeros: an index that wraps
    reads or writes other rows, which then differ from the tail's; and filling
    4 GB with normal_ took 33 s)."""
    c = 32768
    n = (1 << 31) // c + 3
    gen = torch.Generator().manual_seed(5)
    x = torch.zeros(n, c, dtype=torch.bfloat16)
    x[n - 4:].normal_(generator=gen)
    y = torch.randint(0, c, (n,), generator=gen)
    y[-1] = c - 1  # the very last element of the tensor is the target
    loss, log_prob, _, lse = ce_tvm.cross_entropy_loss(x, y, reduction="none", return_zloss=True)
    tail = slice(n - 4, n)
    ref_loss, ref_lp, _, ref_lse = reference.forward(x[tail].double().numpy(), y[tail].numpy(),
                                                     reduction="none")
    assert_close(loss[tail], ref_loss, 1.6e-2, "loss tail")
    assert_close(log_prob[tail], ref_lp, 1.6e-2, "log_prob tail")
    assert_close(lse[tail], ref_lse, 1.6e-2, "lse tail")
    del x
    grad = ce_tvm.cross_entropy_loss_grad(torch.ones(n, dtype=torch.bfloat16), log_prob, y,
                                          reduction="none")
    ref_grad = reference.backward(np.ones(4), log_prob[tail].double().numpy(), y[tail].numpy(),
                                  reduction="none", row_totals=(4.0, 4.0))
    assert_close(grad[tail], ref_grad, 1.6e-2, "grad tail")
