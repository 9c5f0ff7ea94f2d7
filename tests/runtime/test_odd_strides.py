"""Tensors torch calls contiguous whose strides are not the row-major ones.

An empty batch built from NumPy (``torch.tensor(np.zeros((0, C)))``) has
strides ``(0, 0)``, and a size-1 dimension may carry any stride; the
kernels check strides exactly, so the runtime passes such tensors on as
views with the canonical strides (``ce_tvm.runtime.registry.canonical_strides``).
Every entry point is checked here for inputs, targets, weights and upstream
gradients; the vocab-parallel one in ``test_distributed.py``.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.runtime.registry import canonical_strides
from support import TOL

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
needs_gpu = [pytest.mark.gpu,
             pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]
C = 65


def numpy_empty(classes, dtype, device):
    """The issue's empty batch: ``[0, C]`` logits and ``[0]`` targets, all strides 0."""
    x = torch.tensor(np.zeros((0, classes)), dtype=dtype, device=device)
    y = torch.tensor(np.zeros(0), dtype=torch.int64, device=device)
    assert x.stride() == (0, 0) and y.stride() == (0,)  # what makes the case
    return x, y


def restrided(t, stride):
    """A copy of ``t`` laid out with ``stride`` (any stride on a size-1 dimension)."""
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def empty_vector(device, dtype):
    """An upstream gradient ``[0]`` with stride 0."""
    return torch.empty_strided((0,), (0,), device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_seed_pair_empty_batch(dtype, device):
    x, y = numpy_empty(C, dtype, device)
    loss, log_prob, zloss, lse = ce_tvm.cross_entropy_loss(
        x, y, reduction="none", lse_square_scale_for_zloss=1e-3, return_zloss=True)
    for out in (loss, zloss, lse):
        assert out.shape == (0,) and out.dtype == dtype
    assert log_prob.shape == (0, C) and log_prob.dtype == dtype
    grad = ce_tvm.cross_entropy_loss_grad(
        empty_vector(device, dtype), restrided(log_prob, (0, 0)), y,
        grad_zloss=empty_vector(device, dtype),
        lse_for_zloss=restrided(lse, (0,)), reduction="none", lse_square_scale_for_zloss=1e-3)
    assert grad.shape == (0, C) and grad.dtype == dtype and grad.device == x.device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_drop_in_and_module_empty_batch(dtype, device):
    """``mean`` of nothing is NaN and ``sum`` is 0, as in PyTorch; the gradient is empty."""
    x, y = numpy_empty(C, dtype, device)
    ref = F.cross_entropy(x.float(), y, label_smoothing=0.1)
    for loss_fn in (lambda a, b: ce_tvm.cross_entropy(a, b, label_smoothing=0.1),
                    ce_tvm.CrossEntropyLoss(label_smoothing=0.1)):
        xr = x.detach().requires_grad_()
        loss = loss_fn(xr, y)
        assert loss.shape == () and loss.dtype == dtype
        assert torch.isnan(loss) and torch.isnan(ref)
        loss.backward()
        assert xr.grad.shape == (0, C) and xr.grad.dtype == dtype


@pytest.mark.parametrize("device", DEVICES)
def test_drop_in_empty_batch_every_reduction(device):
    x, y = numpy_empty(C, torch.float32, device)
    for reduction in ("none", "sum"):
        xr = x.detach().requires_grad_()
        loss = ce_tvm.cross_entropy(xr, y, reduction=reduction)
        ref = F.cross_entropy(x, y, reduction=reduction)
        assert loss.shape == ref.shape
        torch.testing.assert_close(loss, ref)
        loss.backward(empty_vector(device, torch.float32) if reduction == "none" else None)
        assert xr.grad.shape == (0, C)


def _size1_inputs(classes, n, device, seed=6):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, classes, generator=gen) * 3).to(device)
    y = torch.randint(0, classes, (n,), generator=gen).to(device)
    w = (torch.rand(classes, generator=gen) + 0.5).to(device)
    return x, y, w


@pytest.mark.parametrize("device", DEVICES)
def test_size_one_dimensions_with_odd_strides(device):
    """One row with a row stride of 1000, a one-element target and upstream
    gradient with strides 7 and 3; one class with a column stride of 9 and a
    one-element weight with stride 4: results equal those of the canonical tensors."""
    cases = [  # (x, y, weight, x stride, y stride, weight stride)
        (*_size1_inputs(C, 1, device)[:2], None, (1000, 1), (7,), None),
        (*_size1_inputs(1, 5, device), (1, 9), (1,), (4,)),
    ]
    opts = dict(label_smoothing=0.1, lse_square_scale_for_zloss=1e-3)
    for x, y, w, xs, ys, ws in cases:
        xo, yo = restrided(x, xs), restrided(y, ys)
        wo = None if w is None else restrided(w, ws)
        assert xo.is_contiguous() and xo.stride() == xs
        # Seed pair: loss, log_prob and the gradient for a [1] upstream gradient of stride 3.
        expected = ce_tvm.cross_entropy_loss(x, y, w, return_zloss=True, **opts)
        got = ce_tvm.cross_entropy_loss(xo, yo, wo, return_zloss=True, **opts)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        g = restrided(torch.full((1,), 0.7, device=device), (3,))
        grad = ce_tvm.cross_entropy_loss_grad(g, restrided(got[1], xs), yo, wo,
                                              lse_for_zloss=got[3], **opts)
        grad_ref = ce_tvm.cross_entropy_loss_grad(g.clone(), expected[1], y, w,
                                                  lse_for_zloss=expected[3], **opts)
        assert torch.equal(grad, grad_ref)
        # Drop-in and module: against PyTorch.
        module = ce_tvm.CrossEntropyLoss(weight=wo, label_smoothing=0.1)
        for loss_fn in (lambda a, b: ce_tvm.cross_entropy(a, b, wo, label_smoothing=0.1),
                        module):
            xr, xt = xo.detach().requires_grad_(), x.detach().requires_grad_()
            loss = loss_fn(xr, yo)
            ref = F.cross_entropy(xt, y, w, label_smoothing=0.1)
            torch.testing.assert_close(loss, ref, rtol=TOL[torch.float32], atol=1e-6)
            loss.backward()
            ref.backward()
            torch.testing.assert_close(xr.grad, xt.grad, rtol=TOL[torch.float32], atol=1e-7)


def test_canonical_strides_is_a_view_never_a_copy():
    big = torch.randn(1, 70000)
    odd = big.as_strided((1, 70000), (123457, 1))
    view = canonical_strides(odd)
    assert view.stride() == (70000, 1)
    assert view.data_ptr() == odd.data_ptr() and view.untyped_storage()._cdata == \
        odd.untyped_storage()._cdata
    assert torch.equal(view, big)
    empty = torch.empty_strided((0, 65), (0, 0))
    assert canonical_strides(empty).stride() == (65, 1)
    assert canonical_strides(big) is big  # already canonical: untouched
    strided = torch.randn(4, 6)[:, ::2]
    assert canonical_strides(strided) is strided  # not contiguous: left to the kernels to refuse
    assert canonical_strides(3.5) == 3.5
