"""``logit_scale``: every entry point computes on ``z = cap(s x) / T`` (scale, then
softcap, then temperature, as TRL and the model families apply them), checked
against PyTorch in float64 (values and autograd gradients)."""

import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.runtime.options import LossOptions

C, H = 300, 16
CASES = [(2.0, 0.0, 1.0), (0.25, 3.0, 1.0), (1.7, 5.0, 0.7), (1.0, 4.0, 1.3)]


def transformed(x, scale, softcap, temperature):
    z = x * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def close(actual, expected):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("scale, softcap, temperature", CASES)
def test_losses_take_the_scale_before_the_cap_and_the_temperature(scale, softcap, temperature):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(12, C, generator=gen) * 3).requires_grad_()
    y = torch.randint(0, C, (12,), generator=gen)
    y[3] = -100
    opts = dict(softcap=softcap, temperature=temperature, logit_scale=scale)
    ref_x = x.detach().double().requires_grad_()
    z = transformed(ref_x, scale, softcap, temperature)
    kept = y != -100
    expected = (F.cross_entropy(z, y, label_smoothing=0.1)
                + 1e-2 * (torch.logsumexp(z[kept], 1) ** 2).mean())
    expected.backward()
    loss = ce_tvm.cross_entropy(x, y, label_smoothing=0.1, lse_square_scale=1e-2, **opts)
    close(loss, expected)
    loss.backward()
    close(x.grad, ref_x.grad)
    module = ce_tvm.CrossEntropyLoss(label_smoothing=0.1, lse_square_scale=1e-2, **opts)
    close(module(x.detach(), y), expected)
    assert f"logit_scale={float(scale)}" in repr(module)
    # the fused head: the same on x = h @ W^T
    h = torch.randn(12, H, generator=gen, requires_grad=True)
    W = torch.randn(C, H, generator=gen, requires_grad=True)
    ref_h, ref_W = (t.detach().double().requires_grad_() for t in (h, W))
    z = transformed(ref_h @ ref_W.T, scale, softcap, temperature)
    expected = F.cross_entropy(z, y, label_smoothing=0.1)
    expected.backward()
    loss = ce_tvm.linear_cross_entropy(h, W, y, label_smoothing=0.1, **opts)
    close(loss, expected)
    loss.backward()
    close(h.grad, ref_h.grad)
    close(W.grad, ref_W.grad)


@pytest.mark.parametrize("scale, softcap, temperature", CASES)
def test_log_probs_take_the_scale(scale, softcap, temperature):
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 5, H, generator=gen, requires_grad=True)
    W = torch.randn(C, H, generator=gen, requires_grad=True)
    index = torch.randint(0, C, (2, 5), generator=gen)
    a, b = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    opts = dict(softcap=softcap, temperature=temperature, logit_scale=scale)
    ref_h, ref_W = (t.detach().double().requires_grad_() for t in (h, W))
    logp_all = torch.log_softmax(transformed(ref_h @ ref_W.T, scale, softcap, temperature), -1)
    ref_logp = logp_all.gather(-1, index[..., None])[..., 0]
    ref_entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((a * ref_logp).sum() + (b * ref_entropy).sum()).backward()
    logp, entropy = ce_tvm.linear_log_probs(h, W, index, return_entropy=True, **opts)
    close(logp, ref_logp)
    close(entropy, ref_entropy)
    ((a * logp).sum() + (b * entropy).sum()).backward()
    close(h.grad, ref_h.grad)
    close(W.grad, ref_W.grad)
    logits = (h @ W.T).detach()
    logp, entropy = ce_tvm.log_probs(logits, index, return_entropy=True, **opts)
    close(logp, ref_logp)
    close(entropy, ref_entropy)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_a_scale_that_is_not_finite_and_positive_is_refused(scale):
    with pytest.raises(ValueError, match="logit_scale"):
        LossOptions(logit_scale=scale)
    with pytest.raises(ValueError, match="logit_scale"):
        ce_tvm.log_probs(torch.randn(2, C), torch.zeros(2, dtype=torch.long), logit_scale=scale)


def test_scale_one_is_todays_kernels():
    """The scale folds into the softcap and the temperature: 1 changes neither."""
    options = LossOptions(softcap=30.0, temperature=0.7, logit_scale=1.0)
    assert (options.kernel_softcap, options.kernel_temperature) == (30.0, 0.7)
    scaled = LossOptions(softcap=30.0, temperature=0.7, logit_scale=2.0)
    assert (scaled.kernel_softcap, scaled.kernel_temperature) == (15.0, 0.35)
