"""Logit softcapping (``softcap``) and token accuracy (``return_token_accuracy``),
SPEC section 5: against PyTorch on the capped logits ``t * tanh(x / t)`` and
the float64 reference, on the one-pass and recompute training paths, the
linear sweep and every schedule; accuracy against ``torch.argmax``."""

import itertools
import math

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

C = 37  # one class count for every kernel here: each variant compiles once
CAP = 4.0  # small beside the logits' spread, so the cap matters


def _inputs(n, dtype, weighted, seed=0, scale=6.0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, C, generator=gen) * scale).to(dtype)
    y = torch.randint(0, C, (n,), generator=gen)
    y[::4] = -100
    w = torch.rand(C, generator=gen) + 0.5 if weighted else None
    return x, y, w


@pytest.fixture(params=["one_pass", "recompute"])
def training_path(request, monkeypatch):
    """Both autograd paths of ``cross_entropy`` (``sum``/``mean``; ``none``
    always recomputes)."""
    monkeypatch.setattr(ce_nn, "ONE_PASS_TRAINING", request.param == "one_pass")
    return request.param


def _against_reference(x, y, w, reduction, eps, zloss, upstream, softcap=CAP, fn=None):
    """Loss and autograd gradient of ``fn`` (``ce_tvm.cross_entropy``) against the
    float64 reference of the capped logits."""
    fn = fn or (lambda xg: ce_tvm.cross_entropy(
        xg, y, w, reduction=reduction, label_smoothing=eps, lse_square_scale=zloss,
        softcap=softcap))
    xg = x.clone().requires_grad_()
    loss = fn(xg)
    (loss * upstream).sum().backward()
    wn = None if w is None else w.double().numpy()
    xn = x.double().numpy()
    ref_loss, log_prob, _, lse = reference.forward(xn, y.numpy(), wn, reduction, -100, eps,
                                                   zloss, softcap)
    g = upstream.double().numpy().reshape(-1)
    ref_grad = reference.through_softcap(reference.backward(
        g, log_prob, y.numpy(), wn, None, lse, reduction, -100, eps, zloss), xn, softcap)
    tol = TOL[x.dtype]
    assert_close(loss.reshape(-1), ref_loss, tol, "loss")
    assert xg.grad.dtype == x.dtype
    assert_close(xg.grad, ref_grad, tol, "x grad")
    return loss, xg.grad


OPTIONS = [(False, 0.0, 0.0), (True, 0.1, 1e-3)]  # (weighted, label_smoothing, z-loss)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted,eps,zloss", OPTIONS)
def test_softcap_float32_against_reference(training_path, reduction, weighted, eps, zloss):
    x, y, w = _inputs(9, torch.float32, weighted)
    upstream = torch.rand(9 if reduction == "none" else 1) + 0.5
    _against_reference(x, y, w, reduction, eps, zloss, upstream)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_softcap_bfloat16_against_reference(training_path, reduction):
    x, y, w = _inputs(9, torch.bfloat16, True, seed=1)
    upstream = torch.ones(9 if reduction == "none" else 1)
    _against_reference(x, y, w, reduction, 0.1, 1e-3, upstream)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted,eps", [(False, 0.0), (True, 0.1)])
def test_softcap_equals_torch_on_capped_logits(training_path, reduction, weighted, eps):
    """``F.cross_entropy(t * tanh(x / t), ...)``: loss and autograd gradient."""
    x, y, w = _inputs(11, torch.float32, weighted, seed=2)
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(ours, y, w, reduction=reduction, label_smoothing=eps,
                                softcap=CAP)
    expected = F.cross_entropy(CAP * torch.tanh(ref / CAP), y, w, reduction=reduction,
                               label_smoothing=eps)
    g = torch.rand(expected.shape) + 0.5
    (loss * g).sum().backward()
    (expected * g).sum().backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-5, atol=1e-7)


def test_softcap_module_and_module_repr():
    x, y, _ = _inputs(6, torch.float32, False, seed=3)
    crit = ce_tvm.CrossEntropyLoss(reduction="sum", softcap=CAP)
    assert f"softcap={CAP}" in repr(crit)
    expected = F.cross_entropy(CAP * torch.tanh(x / CAP), y, reduction="sum")
    torch.testing.assert_close(crit(x, y), expected, rtol=1e-5, atol=1e-5)


def test_softcap_float64_gradcheck():
    x, y, w = _inputs(5, torch.float64, True, seed=4)
    x.requires_grad_()
    fn = lambda t: ce_tvm.cross_entropy(t, y, w, label_smoothing=0.1,  # noqa: E731
                                        lse_square_scale=1e-2, softcap=CAP)
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)


def test_saturated_and_nonfinite_logits():
    """Logits far beyond the cap saturate at +-t with a zero gradient; +-inf
    give +-t; a NaN logit makes its row NaN and leaves the others alone."""
    x = torch.zeros(3, C)
    x[0, :3] = torch.tensor([1e4, -1e4, float("inf")])
    x[1, 5] = float("-inf")
    x[2, 9] = float("nan")
    y = torch.tensor([0, 1, 2])
    xg = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xg, y, reduction="none", softcap=CAP)
    loss.sum().backward()
    capped = CAP * torch.tanh(x / CAP)
    expected = F.cross_entropy(capped, y, reduction="none")
    torch.testing.assert_close(loss[:2], expected[:2], rtol=1e-5, atol=1e-5)
    assert torch.isnan(loss[2]) and torch.isfinite(xg.grad[:2]).all()
    assert xg.grad[0, 0] == 0 and xg.grad[0, 1] == 0 and xg.grad[0, 2] == 0


# --- kernels with and without softcap --------------------------------------

def test_softcap_variants_are_distinct_kernels_and_off_means_no_tanh():
    """softcap = 0 declares exactly the kernels of before (no tanh, no softcap
    argument, the same name); a capped variant is another kernel."""
    for op, variant in [("forward", Variant("mean", True, False)),
                        ("train", Variant("sum", False, False)),
                        ("backward", Variant("none", True, grad_source="logits")),
                        ("shard_stats", Variant(weighted=True))]:
        plain = KernelSpec(op, "float32", C, variant)
        capped = KernelSpec(op, "float32", C, Variant(**{**variant.__dict__, "softcap": True}))
        assert "-sc" not in plain.stem() and "-sc" in capped.stem()
        assert plain.key_hash() != capped.key_hash()
        plain_names = [p.name for p in declared_func(plain).params]
        capped_names = [p.name for p in declared_func(capped).params]
        assert "softcap" not in plain_names and "softcap" in capped_names
        assert "tanh" not in declared_func(plain).script()
    seed_backward = KernelSpec("backward", "float32", C, Variant("mean", softcap=True))
    with pytest.raises(ValueError, match="no softcap"):
        declared_func(seed_backward)


@pytest.mark.parametrize("bad,error", [(-1.0, ValueError), (float("nan"), ValueError),
                                       (float("inf"), ValueError), ("5", TypeError),
                                       (True, TypeError)])
def test_bad_softcap_is_a_clear_error(bad, error):
    x, y, _ = _inputs(4, torch.float32, False)
    W = torch.randn(C, 3)
    calls = [
        lambda: ce_tvm.cross_entropy(x, y, softcap=bad),
        lambda: ce_tvm.CrossEntropyLoss(softcap=bad),
        lambda: ce_tvm.linear_cross_entropy(torch.randn(4, 3), W, y, softcap=bad),
        lambda: ce_tvm.LinearCrossEntropyLoss(softcap=bad),
        lambda: ce_tvm.distributed.VocabParallelCrossEntropyLoss(softcap=bad),
    ]
    for call in calls:
        with pytest.raises(error, match="softcap"):
            call()


def test_seed_pair_has_no_softcap():
    with pytest.raises(TypeError):
        ce_tvm.cross_entropy_loss(torch.randn(2, 3), torch.tensor([0, 1]), softcap=1.0)


def test_softcap_and_options_are_keyword_only():
    x, y, _ = _inputs(4, torch.float32, False)
    with pytest.raises(TypeError):
        ce_tvm.cross_entropy(x, y, None, None, -100, None, "mean", 0.0, CAP)


# --- token accuracy ---------------------------------------------------------

def _argmax_accuracy(logits, y, ignore_index=-100):
    """The reference: torch.argmax (first maximum) over the rows not ignored."""
    kept = y != ignore_index
    hits = (logits.argmax(dim=1) == y) & kept
    return hits.sum().double() / kept.sum().double()


def _tied_inputs(dtype=torch.float32):
    """Rows whose maximum is tied: the target first, second or elsewhere; an
    ignored row whose target would be a hit; plain rows."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, C, generator=gen)
    y = torch.randint(0, C, (12,), generator=gen)
    for row, (a, b, target) in enumerate([(3, 7, 3), (3, 7, 7), (0, C - 1, 0),
                                          (0, C - 1, C - 1), (10, 11, 12)]):
        x[row, a] = x[row, b] = 9.0
        y[row] = target
    y[5] = int(x[5].argmax())  # a hit ...
    y[6] = -100  # ... and an ignored row
    x[7, 20] = 9.0
    y[7] = 20  # a clear hit
    return x.to(dtype), y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_accuracy_first_maximum_like_argmax(training_path, dtype, reduction):
    x, y = _tied_inputs(dtype)
    xg = x.clone().requires_grad_()
    loss, accuracy = ce_tvm.cross_entropy(xg, y, reduction=reduction,
                                          return_token_accuracy=True)
    expected = _argmax_accuracy(x, y)
    assert 0 < expected < 1
    assert accuracy.shape == () and accuracy.dtype == torch.float32
    assert not accuracy.requires_grad
    assert accuracy.item() == pytest.approx(expected.item(), abs=1e-7)
    torch.testing.assert_close(loss, F.cross_entropy(x.float(), y, reduction=reduction).to(dtype),
                               rtol=TOL[dtype], atol=TOL[dtype])
    loss.sum().backward()  # the loss still trains
    assert xg.grad is not None


def test_accuracy_after_softcap_ties_at_saturation(training_path):
    """Two logits both beyond the cap become equal (t): the first one wins,
    as torch.argmax of the capped logits says."""
    x = torch.randn(4, C)
    x[:, 2], x[:, 5] = 1e3, 2e3
    y = torch.tensor([2, 5, 2, -100])
    for grad in (False, True):
        xg = x.clone().requires_grad_(grad)
        loss, zloss, accuracy = ce_tvm.cross_entropy(xg, y, softcap=CAP, return_zloss=True,
                                                     lse_square_scale=1e-3,
                                                     return_token_accuracy=True)
        expected = _argmax_accuracy(CAP * torch.tanh(x / CAP), y)
        assert accuracy.item() == pytest.approx(expected.item())
        assert accuracy.item() == pytest.approx(2 / 3)
        assert zloss.shape == () and not zloss.requires_grad  # order (loss, zloss, accuracy)
        assert ce_tvm.cross_entropy(x, y, return_token_accuracy=True)[1] == pytest.approx(1 / 3)


def test_accuracy_nan_when_every_row_is_ignored():
    x = torch.randn(5, C, requires_grad=True)
    y = torch.full((5,), -100)
    for reduction in ("mean", "none"):
        _, accuracy = ce_tvm.cross_entropy(x, y, reduction=reduction,
                                           return_token_accuracy=True)
        assert math.isnan(accuracy.item())
    _, accuracy = ce_tvm.cross_entropy(x[:0], y[:0], return_token_accuracy=True)
    assert math.isnan(accuracy.item())


def test_accuracy_custom_ignore_index_and_module():
    x, y = _tied_inputs()
    y[y == -100] = 3
    y[8] = 3
    crit = ce_tvm.CrossEntropyLoss(ignore_index=3, return_token_accuracy=True)
    _, accuracy = crit(x, y)
    assert accuracy.item() == pytest.approx(_argmax_accuracy(x, y, 3).item())


def test_accuracy_spatial_input():
    """``(N, C, d)`` inputs: the class dimension is 1."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, C, 5, generator=gen)
    y = torch.randint(0, C, (2, 5), generator=gen)
    y[0, :2] = x[0, :, :2].argmax(0)
    _, accuracy = ce_tvm.cross_entropy(x, y, reduction="none", return_token_accuracy=True)
    flat = x.movedim(1, -1).reshape(-1, C)
    assert accuracy.item() == pytest.approx(_argmax_accuracy(flat, y.reshape(-1)).item())


# --- linear_cross_entropy ---------------------------------------------------

@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_linear_softcap_and_accuracy_through_chunks(reduction):
    """Chunks of 4 rows: the sweep's capped loss, gradients and accuracy equal
    torch on the whole capped logits."""
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(2, 7, 8, generator=gen)
    W = torch.randn(C, 8, generator=gen)
    b = torch.randn(C, generator=gen)
    y = torch.randint(0, C, (2, 7), generator=gen)
    y[0, ::3] = -100
    y[1, :3] = (h[1, :3] @ W.t() + b).argmax(-1)
    w = torch.rand(C, generator=gen) + 0.5
    ours = [t.clone().requires_grad_() for t in (h, W, b)]
    loss, zloss, accuracy = ce_tvm.linear_cross_entropy(
        ours[0], ours[1], y, linear_bias=ours[2], weight=w, reduction=reduction,
        label_smoothing=0.1, softcap=CAP, return_zloss=True, return_token_accuracy=True,
        chunk_rows=4)
    refs = [t.clone().requires_grad_() for t in (h, W, b)]
    logits = refs[0] @ refs[1].t() + refs[2]
    expected = F.cross_entropy((CAP * torch.tanh(logits / CAP)).reshape(-1, C), y.reshape(-1),
                               w, reduction=reduction, label_smoothing=0.1)
    expected = expected.reshape(y.shape) if reduction == "none" else expected
    g = torch.rand(expected.shape, generator=gen) + 0.5
    (loss * g).sum().backward()
    (expected * g).sum().backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-5)
    for a, e in zip(ours, refs):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-4, atol=1e-5)
    assert accuracy.item() == pytest.approx(
        _argmax_accuracy(logits.detach().reshape(-1, C), y.reshape(-1)).item())
    assert not accuracy.requires_grad and torch.all(zloss == 0)


def test_linear_module_accuracy_without_grad():
    gen = torch.Generator().manual_seed(8)
    h, W = torch.randn(6, 8, generator=gen), torch.randn(C, 8, generator=gen)
    y = (h @ W.t()).argmax(-1)
    y[0] = (y[0] + 1) % C
    crit = ce_tvm.LinearCrossEntropyLoss(return_token_accuracy=True, softcap=CAP)
    assert f"softcap={CAP}" in repr(crit)
    with torch.no_grad():
        loss, accuracy = crit(h, W, y)
    assert accuracy.item() == pytest.approx(5 / 6)
    torch.testing.assert_close(
        loss, F.cross_entropy(CAP * torch.tanh(h @ W.t() / CAP), y), rtol=1e-5, atol=1e-5)


# --- torch.compile and other schedules ---------------------------------------

def test_compiled_fullgraph_softcap_and_accuracy(training_path):
    x, y, w = _inputs(8, torch.float32, True, seed=9)
    h, W = torch.randn(8, 5), torch.randn(C, 5)

    def step(x, h, W, y):
        loss, accuracy = ce_tvm.cross_entropy(x, y, w, softcap=CAP, return_token_accuracy=True)
        lin, lin_accuracy = ce_tvm.linear_cross_entropy(h, W, y, softcap=CAP, chunk_rows=3,
                                                        return_token_accuracy=True)
        return loss + lin, accuracy, lin_accuracy

    compiled = torch.compile(step, fullgraph=True)
    ours = [t.clone().requires_grad_() for t in (x, h, W)]
    refs = [t.clone().requires_grad_() for t in (x, h, W)]
    loss, *accuracies = compiled(*ours, y)
    loss.backward()
    ref_loss, *ref_accuracies = step(*refs, y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for a, e in zip(ours, refs):
        torch.testing.assert_close(a.grad, e.grad)
    assert [a.item() for a in accuracies] == [a.item() for a in ref_accuracies]


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_ascend_schedule_softcap_and_accuracy(reduction):
    """The Ascend-style schedule (run through LLVM) on the capped kernels."""
    x, y, w = _inputs(10, torch.float32, True, seed=10)
    y[1] = int(x[1].argmax())
    upstream = torch.rand(10 if reduction == "none" else 1) + 0.5
    with ce_tvm.schedule("ascend", profile="910b"):
        loss, _ = _against_reference(x, y, w, reduction, 0.1, 1e-3, upstream, fn=lambda xg: (
            ce_tvm.cross_entropy(xg, y, w, reduction=reduction, label_smoothing=0.1,
                                 lse_square_scale=1e-3, softcap=CAP)))
        _, accuracy = ce_tvm.cross_entropy(x.clone().requires_grad_(), y, w, softcap=CAP,
                                           reduction=reduction, return_token_accuracy=True)
    capped = torch.from_numpy(reference.capped(x.numpy(), CAP))
    assert accuracy.item() == pytest.approx(_argmax_accuracy(capped, y).item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_accuracy_reference_grid(dtype):
    """Random rows in several batches against argmax, ties included (bfloat16
    rounds many logits to equal values)."""
    for n, scale in itertools.product((1, 7, 33), (0.05, 3.0)):
        gen = torch.Generator().manual_seed(n)
        x = (torch.randn(n, C, generator=gen) * scale).to(dtype)
        y = torch.where(torch.rand(n, generator=gen) < 0.5, x.float().argmax(1),
                        torch.randint(0, C, (n,), generator=gen))
        _, accuracy = ce_tvm.cross_entropy(x, y, return_token_accuracy=True)
        assert accuracy.item() == pytest.approx(_argmax_accuracy(x.float(), y).item())
        assert np.isfinite(accuracy.item())


def test_compiled_dynamic_with_every_option_left_at_its_default():
    """Under dynamic=True a float default (softcap, lse_square_scale, ...) may
    reach LossOptions as a symbolic float: its checks must still trace."""
    x, y, _ = _inputs(8, torch.float32, False, seed=12)
    compiled = torch.compile(ce_tvm.cross_entropy, fullgraph=True, dynamic=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(x, y), F.cross_entropy(x, y), rtol=1e-5, atol=1e-6)
