"""Inputs the kernels cannot take as they are: an empty batch (never launched),
data that does not start 64-byte aligned (copied first), caller buffers that
are not aligned (refused). The CPU cases run here; the same cases on CUDA
(where a misaligned 16-byte load traps and a zero grid fails to launch) run
where a GPU is."""

import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.runtime import launch
from ce_tvm.runtime.options import LossOptions
from ce_tvm.runtime.tensors import KERNEL_ALIGNMENT, is_aligned

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])]
C = 1003  # odd: no row after the first starts aligned


def _reference(x, y, w, reduction="mean", zloss_scale=0.0):
    """Loss and logits gradient from torch (float64), z-loss added by its definition."""
    xr = x.detach().double().cpu().requires_grad_()
    wr = None if w is None else w.double().cpu()
    loss = F.cross_entropy(xr, y.cpu(), wr, reduction=reduction)
    if zloss_scale:
        z = zloss_scale * torch.logsumexp(xr, 1) ** 2
        loss = loss + (z.mean() if reduction == "mean" else z.sum())
    if x.shape[0]:
        loss.backward()
    return loss.detach(), xr.grad


def _misaligned(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """A copy of ``t`` living ``elements`` elements into a fresh buffer."""
    buf = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    view = buf[elements:].view(t.shape)
    view.copy_(t)
    assert not is_aligned(view) and view.is_contiguous()
    return view


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch_matches_torch(device, reduction):
    x = torch.empty(0, C, device=device, requires_grad=True)
    y = torch.empty(0, dtype=torch.int64, device=device)
    w = torch.rand(C, device=device)
    loss = ce_tvm.cross_entropy(x, y, w, reduction=reduction, lse_square_scale=1e-3)
    ref, _ = _reference(x, y, w, reduction)
    torch.testing.assert_close(loss.cpu().double(), ref, equal_nan=True)
    if reduction == "none":
        loss.sum().backward()
    else:
        loss.backward()
    assert x.grad.shape == (0, C)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_offset_views_match_torch(device, dtype):
    """Logits, targets and weight each an offset view of a larger buffer."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, C, generator=gen).to(dtype)
    y = torch.randint(0, C, (7,), generator=gen)
    w = torch.rand(C, generator=gen) + 0.5
    xm, ym, wm = (_misaligned(t.to(device)) for t in (x, y, w))
    xm.requires_grad_()
    loss = ce_tvm.cross_entropy(xm, ym, wm, lse_square_scale=1e-3)
    loss.backward()
    ref, ref_grad = _reference(x, y, w, zloss_scale=1e-3)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(loss.cpu().double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(xm.grad.cpu().double(), ref_grad, rtol=tol, atol=tol * 1e-1)


@pytest.mark.parametrize("device", DEVICES)
def test_uneven_vocabulary_shards_weight_slices(device):
    """Shards of 5 and 4 classes: the second shard's weight slice starts 20 bytes in."""
    gen = torch.Generator().manual_seed(4)
    classes, split = 9, 5
    x = torch.randn(6, classes, generator=gen).to(device)
    y = torch.randint(0, classes, (6,), generator=gen).to(device)
    w = (torch.rand(classes, generator=gen) + 0.5).to(device)
    shard = w[split:]
    assert not is_aligned(shard)
    stats = launch.shard_stats(x[:, split:].contiguous(), y - split, shard, 0, LossOptions())
    rowmax, expsum = stats[0], stats[1]
    ref_max = x[:, split:].max(1).values
    torch.testing.assert_close(rowmax, ref_max)
    torch.testing.assert_close(expsum, torch.exp(x[:, split:] - ref_max[:, None]).sum(1))
    target_logit = stats[3]
    here = (y >= split)
    torch.testing.assert_close(target_logit[here], x[here, y[here]])
    loss = ce_tvm.cross_entropy(x[:, split:].contiguous(), (y - split).clamp(min=0), shard)
    ref, _ = _reference(x[:, split:], (y - split).clamp(min=0), shard)
    torch.testing.assert_close(loss.cpu().double(), ref, rtol=1e-5, atol=1e-5)


def test_misaligned_out_buffer_is_refused():
    x = torch.randn(3, C)
    y = torch.randint(0, C, (3,))
    options = LossOptions("none")
    good = launch.forward(x, y, None, options, log_prob=True)
    bad = launch.ForwardOutputs(loss=_misaligned(good.loss), zloss=good.zloss, lse=good.lse,
                                log_prob=good.log_prob)
    with pytest.raises(ValueError, match=f"{KERNEL_ALIGNMENT}-byte aligned"):
        launch.forward(x, y, None, options, log_prob=True, out=bad)
