"""``temperature`` on the losses (SPEC section 6): every part of the loss on
``cap(x) / T``, against the float64 reference of the scaled logits and PyTorch,
on both training paths, probability targets (distillation) and the linear
sweep; ``T = 1`` is exactly the kernels of before."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.compiler.build import declared_func
from ce_tvm.kernels.kinds import Variant
from ce_tvm.losses import cross_entropy as ce_nn
from ce_tvm.store.spec import KernelSpec
from ce_tvm.testing import reference
from support import TOL, assert_close

C = 37  # the softcap tests' class count: one set of plain kernels
T = 0.7


def _inputs(n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, C, generator=gen) * 4).to(dtype)
    y = torch.randint(0, C, (n,), generator=gen)
    y[::4] = -100
    return x, y, torch.rand(C, generator=gen) + 0.5


@pytest.fixture(params=["one_pass", "recompute"])
def training_path(request, monkeypatch):
    monkeypatch.setattr(ce_nn, "ONE_PASS_TRAINING", request.param == "one_pass")


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("softcap", [0.0, 3.0], ids=["nocap", "cap3"])
def test_against_the_reference_of_the_scaled_logits(training_path, reduction, softcap):
    """Weights, smoothing and z-loss (on ``lse(z)``): loss and gradient."""
    x, y, w = _inputs(9, torch.float32)
    xg = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xg, y, w, reduction=reduction, label_smoothing=0.1,
                                lse_square_scale=1e-2, softcap=softcap, temperature=T)
    upstream = torch.rand(loss.shape) + 0.5
    (loss * upstream).sum().backward()
    z = reference.capped(x.double().numpy(), softcap) / T
    ref_loss, log_prob, _, lse = reference.forward(z, y.numpy(), w.double().numpy(),
                                                   reduction, -100, 0.1, 1e-2)
    dz = reference.backward(upstream.double().numpy().reshape(-1), log_prob, y.numpy(),
                            w.double().numpy(), None, lse, reduction, -100, 0.1, 1e-2)
    ref_grad = reference.through_softcap(dz / T, x.double().numpy(), softcap)
    assert_close(loss.reshape(-1), ref_loss, TOL[torch.float32], "loss")
    assert_close(xg.grad, ref_grad, TOL[torch.float32], "x grad")


def test_bfloat16_and_token_accuracy():
    """bf16 logits; the accuracy is that of the unscaled logits (T > 0 keeps the order)."""
    x, y, _ = _inputs(12, torch.bfloat16, seed=1)
    xg = x.clone().requires_grad_()
    loss, accuracy = ce_tvm.cross_entropy(xg, y, temperature=1.6, return_token_accuracy=True)
    loss.backward()
    ref = x.float().clone().requires_grad_()
    expected = F.cross_entropy(ref / 1.6, y)
    expected.backward()
    torch.testing.assert_close(loss.float(), expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(xg.grad.float(), ref.grad, rtol=2e-2, atol=2e-3)
    kept = y != -100
    assert float(accuracy) == pytest.approx(float(
        (x.float().argmax(1)[kept] == y[kept]).double().mean()))


def test_distillation_with_probability_targets():
    """Probability targets at a temperature: gradients to the student's logits
    and to the targets, as PyTorch gives them on ``x / T``."""
    x, _, w = _inputs(7, torch.float32, seed=2)
    q = torch.randn(7, C).softmax(-1)
    ours = [t.clone().requires_grad_() for t in (x, q)]
    theirs = [t.clone().requires_grad_() for t in (x, q)]
    loss = ce_tvm.cross_entropy(ours[0], ours[1], w, label_smoothing=0.1, temperature=2.0)
    expected = F.cross_entropy(theirs[0] / 2.0, theirs[1], w, label_smoothing=0.1)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_and_modules():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(10, 8, generator=gen, requires_grad=True)
    W = torch.randn(C, 8, generator=gen, requires_grad=True)
    y = torch.randint(0, C, (10,), generator=gen)
    loss = ce_tvm.LinearCrossEntropyLoss(label_smoothing=0.1, temperature=T)(h, W, y)
    loss.backward()
    hr, Wr = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    expected = F.cross_entropy(F.linear(hr, Wr) / T, y, label_smoothing=0.1)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, hr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(W.grad, Wr.grad, rtol=1e-4, atol=1e-5)
    crit = ce_tvm.CrossEntropyLoss(reduction="sum", temperature=T)
    assert f"temperature={T}" in repr(crit)
    x, y, _ = _inputs(5, torch.float32, seed=4)
    torch.testing.assert_close(crit(x, y), F.cross_entropy(x / T, y, reduction="sum"))


def test_float64_gradcheck():
    x, y, w = _inputs(5, torch.float64, seed=5)
    x.requires_grad_()

    def fn(t):
        return ce_tvm.cross_entropy(t, y, w, label_smoothing=0.1, lse_square_scale=1e-2,
                                    softcap=3.0, temperature=1.3)

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)


def test_temperature_one_is_the_kernels_of_before():
    """``T = 1`` declares the kernels of before (no argument, no multiply, the same
    name and key); another ``T`` is one more kernel, with the argument."""
    for op, variant in [("forward", Variant("mean", True, False)),
                        ("train", Variant("sum", False, False)),
                        ("backward", Variant("none", True, grad_source="logits")),
                        ("shard_stats", Variant(weighted=True)),
                        ("prob_forward", Variant("mean", False, False))]:
        plain = KernelSpec(op, "float32", C, variant)
        tempered = KernelSpec(op, "float32", C, Variant(**{**variant.__dict__, "tempered": True}))
        assert "-t-" not in plain.stem() + "-" and "-t" in tempered.stem()
        assert plain.key_hash() != tempered.key_hash()
        assert "inv_temperature" not in [p.name for p in declared_func(plain).params]
        assert "inv_temperature" in [p.name for p in declared_func(tempered).params]
    x, y, _ = _inputs(6, torch.float32, seed=6)
    np.testing.assert_array_equal(ce_tvm.cross_entropy(x, y, temperature=1.0).numpy(),
                                  ce_tvm.cross_entropy(x, y).numpy())
    with pytest.raises(ValueError, match="no temperature"):
        declared_func(KernelSpec("backward", "float32", C, Variant("mean", tempered=True)))


@pytest.mark.parametrize("bad,error", [(0.0, ValueError), (-1.0, ValueError),
                                       (float("nan"), ValueError), (float("inf"), ValueError),
                                       ("2", TypeError)])
def test_bad_temperature_is_a_clear_error(bad, error):
    x, y, _ = _inputs(4, torch.float32)
    calls = [
        lambda: ce_tvm.cross_entropy(x, y, temperature=bad),
        lambda: ce_tvm.CrossEntropyLoss(temperature=bad),
        lambda: ce_tvm.linear_cross_entropy(torch.randn(4, 3), torch.randn(C, 3), y,
                                            temperature=bad),
        lambda: ce_tvm.LinearCrossEntropyLoss(temperature=bad),
        lambda: ce_tvm.distributed.VocabParallelCrossEntropyLoss(temperature=bad),
        lambda: ce_tvm.log_probs(x, y.clamp(min=0), temperature=bad),
    ]
    for call in calls:
        with pytest.raises(error, match="temperature"):
            call()
