"""The one-pass training path: ``ce_tvm.cross_entropy`` with ``sum``/``mean``
under autograd computes the gradient in the forward sweep
(``ce_tvm::cross_entropy_train``); checked against the float64 reference."""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.losses.cross_entropy import cross_entropy_train
from ce_tvm.testing import reference
from support import TOL, assert_close, check_training_step, training_inputs

OPTIONS = list(itertools.product(
    ("sum", "mean"), (False, True), (False, True), (0.0, 0.1), (0.0, 1e-3), (1.0, 0.7)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction,weighted,ignore,eps,zloss,upstream", OPTIONS)
def test_every_option(dtype, reduction, weighted, ignore, eps, zloss, upstream):
    check_training_step(7, 17, dtype, reduction, weighted, ignore, eps, zloss, upstream)


# Chunk boundaries of the CPU schedule (6144-class chunks, 32 float32 lanes):
# one chunk, one chunk + 1 (an overlapping last chunk), exact chunks, and
# rows whose last chunk overlaps (50257).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("c", [1, 2, 33, 6144, 6145, 32000, 50257])
def test_chunk_boundaries(c, dtype):
    check_training_step(9, c, dtype, "mean", True, True, 0.1, 1e-3, 1.0, seed=c)


def test_float64():
    check_training_step(5, 23, torch.float64, "mean", True, True, 0.1, 1e-2, 0.7)


def test_every_row_ignored_gives_nan_loss_and_zero_gradient():
    x = torch.randn(6, 40, requires_grad=True)
    y = torch.full((6,), -100)
    loss = ce_tvm.cross_entropy(x, y, label_smoothing=0.1, lse_square_scale=1e-3)
    loss.backward()
    assert torch.isnan(loss)
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_retained_graph_backward_twice_accumulates():
    """Logits from a layer (not a leaf): the kept gradient flows on, never modified."""
    x, y, _ = training_inputs(8, 50, torch.float32, False, True)
    ref = x.clone().requires_grad_()
    F.cross_entropy(ref * 2, y, label_smoothing=0.1).backward()
    xg = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xg * 2, y, label_smoothing=0.1)
    loss.backward(retain_graph=True)
    (loss * 0.5).backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(xg.grad, 2.5 * ref.grad, rtol=1e-5, atol=1e-7)


def test_retained_graph_on_a_leaf(monkeypatch):
    """A leaf's gradient through a retained graph: each backward adds the
    kept gradient (which autograd copies, since the graph still holds it)."""
    x, y, _ = training_inputs(8, 50, torch.float32, False, True)
    ref = x.clone().requires_grad_()
    F.cross_entropy(ref, y).backward()
    xg = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xg, y)
    for _ in range(3):
        loss.backward(retain_graph=True)
    torch.testing.assert_close(xg.grad, 3 * ref.grad, rtol=1e-5, atol=1e-7)
    (grad,) = torch.autograd.grad(loss, xg)
    torch.testing.assert_close(grad, ref.grad, rtol=1e-5, atol=1e-7)


def test_gradient_modified_between_backwards_does_not_leak():
    """While the graph is kept, a pass hands out a copy of the kept gradient:
    what the caller does to it cannot reach a later pass."""
    x, y, _ = training_inputs(8, 50, torch.float32, False, True)
    ref = x.clone().requires_grad_()
    F.cross_entropy(ref, y).backward()
    xg = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xg, y)
    (grad,) = torch.autograd.grad(loss, xg, retain_graph=True)
    grad.mul_(2)
    (again,) = torch.autograd.grad(loss, xg)
    torch.testing.assert_close(again, ref.grad, rtol=1e-5, atol=1e-7)


def test_reruns_are_bit_identical():
    x, y, w = training_inputs(64, 6145, torch.float32, True, True)
    runs = []
    for _ in range(2):
        xg = x.clone().requires_grad_()
        loss = ce_tvm.cross_entropy(xg, y, w, label_smoothing=0.1, lse_square_scale=1e-3)
        loss.backward()
        runs.append((loss.detach().clone(), xg.grad.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_nan_stays_in_its_row():
    x, y, _ = training_inputs(6, 100, torch.float32, False, False)
    x[2, 7] = float("nan")
    xg = x.clone().requires_grad_()
    ce_tvm.cross_entropy(xg, y, reduction="sum").backward()
    assert torch.isnan(xg.grad[2]).all()
    others = torch.cat([xg.grad[:2], xg.grad[3:]])
    assert torch.isfinite(others).all()


def test_no_grad_and_none_take_the_forward_only_path(monkeypatch):
    calls = []
    monkeypatch.setattr(ce_tvm.losses.cross_entropy.launch, "train",
                        lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(AssertionError))
    x, y, _ = training_inputs(4, 10, torch.float32, False, False)
    with torch.no_grad():
        ce_tvm.cross_entropy(x.clone().requires_grad_(), y)
    ce_tvm.cross_entropy(x, y)  # logits without requires_grad
    ce_tvm.cross_entropy(x.clone().requires_grad_(), y, reduction="none")
    assert not calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("c", [4099, 32000])
def test_softcapped_smoothing_against_float64(c, weighted, dtype):
    """Label smoothing's sum of the capped logits: the capped chunk is staged
    after the max, so the sum cannot ride the max's loop (it read the chunk
    before it was written: NaN in 16 bits, a wrong loss in float32)."""
    x, y, w = training_inputs(12, c, dtype, weighted, True, seed=3)
    xg = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xg, y, w, label_smoothing=0.1, softcap=5.0,
                                loss_dtype=torch.float32)
    loss.backward()
    ref_x = x.double().requires_grad_()
    ref = F.cross_entropy(5.0 * torch.tanh(ref_x / 5.0), y, None if w is None else w.double(),
                          label_smoothing=0.1)
    ref.backward()
    tol = TOL[dtype]
    assert_close(loss, ref.detach().numpy(), max(tol, 1e-5), "loss")
    assert_close(xg.grad, ref_x.grad.numpy(), tol, "gradient")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_gradients_as_accurate_as_pytorchs(dtype):
    """The 16-bit gradient is rounded once: no worse than PyTorch's own."""
    x, y, w = training_inputs(64, 3001, dtype, True, True, seed=5)
    ref = reference.backward(
        np.array([1.0]), reference.forward(x.double().numpy(), y.numpy(), w.double().numpy(),
                                           "mean", -100, 0.1)[1],
        y.numpy(), w.double().numpy(), reduction="mean", label_smoothing=0.1)
    errors = []
    for fn in (ce_tvm.cross_entropy, F.cross_entropy):
        xg = x.clone().requires_grad_()
        fn(xg, y, w.to(dtype) if fn is F.cross_entropy else w, label_smoothing=0.1).backward()
        errors.append(np.abs(xg.grad.double().numpy() - ref).max())
    assert errors[0] <= 1.01 * errors[1] + 1e-9, errors


def test_opcheck():
    x, y, w = training_inputs(5, 19, torch.float32, True, True)
    # (..., softcap, temperature, token_accuracy)
    for args in [(w, "mean", -100, 0.1, 1e-3, 5.0, 0.8, True),
                 (None, "sum", -100, 0.0, 0.0, 0.0, 1.0, False)]:
        torch.library.opcheck(cross_entropy_train, (x.clone().requires_grad_(), y, *args))


def test_leaf_grad_is_the_gradient_buffer_and_backward_allocates_nothing(monkeypatch):
    """The leaf's .grad is the buffer the forward wrote (no copy, no zero-filled
    gradients for the op's other outputs)."""
    written = []  # the buffer's address only: a reference would make autograd copy it
    train = ce_tvm.losses.cross_entropy.launch.train

    def spy(*args, **kwargs):
        out = train(*args, **kwargs)
        written.append(out[1].data_ptr())
        return out

    monkeypatch.setattr(ce_tvm.losses.cross_entropy.launch, "train", spy)
    x, y, _ = training_inputs(64, 3000, torch.float32, False, True)
    xg = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xg, y, label_smoothing=0.1)
    with torch.profiler.profile(profile_memory=True) as prof:
        loss.backward()
    allocated = sum(max(e.cpu_memory_usage, 0) for e in prof.events() if e.name != "[memory]")
    assert allocated < x.numel() * x.element_size() // 4, allocated
    assert xg.grad.data_ptr() == written[0]
