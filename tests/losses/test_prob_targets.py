"""Probability targets (SPEC section 5) in ``ce_tvm.cross_entropy`` / ``CrossEntropyLoss``.

PyTorch's own inputs for ``nn.CrossEntropyLoss`` (``module_db``, every one,
class-index ones included), the float64 reference of ``ce_tvm.testing.reference``,
``gradcheck``, ``opcheck`` and ``torch.compile``.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.losses.cross_entropy import cross_entropy_probs, cross_entropy_probs_backward
from ce_tvm.testing import reference
from support import TOL, assert_close

# module_db's inputs (weights up to ~9 in size) at torch.testing's default tolerance
# for the dtype, as PyTorch's own module tests compare them.


def module_db_samples(dtype):
    """PyTorch's ``ModuleInput``s for ``torch.nn.CrossEntropyLoss`` on the CPU."""
    from torch.testing._internal.common_modules import module_db

    info = next(m for m in module_db if m.module_cls is torch.nn.CrossEntropyLoss)
    return info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True,
                                   training=True)


def _leaf_copies(tensors):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _compare_module_input(sample, dtype):
    """ce_tvm.CrossEntropyLoss against torch's on one ModuleInput: loss, and the
    gradient of every forward input that requires one."""
    ctor, fwd = sample.constructor_input, sample.forward_input
    ours_in, ref_in = _leaf_copies(fwd.args), _leaf_copies(fwd.args)
    ours = ce_tvm.CrossEntropyLoss(*ctor.args, **ctor.kwargs)(*ours_in, **fwd.kwargs)
    ref = torch.nn.CrossEntropyLoss(*ctor.args, **ctor.kwargs)(*ref_in, **fwd.kwargs)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    torch.testing.assert_close(ours, ref, equal_nan=True)  # NaN: a mean over ignored rows only
    grad_out = torch.rand(ref.shape, generator=torch.Generator().manual_seed(0),
                          dtype=dtype) + 0.5
    ours.backward(grad_out)
    ref.backward(grad_out)
    for a, b, given in zip(ours_in, ref_in, fwd.args):
        if given.requires_grad:
            torch.testing.assert_close(a.grad, b.grad, equal_nan=True)
        assert torch.equal(a.detach(), given.detach())  # inputs are never written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_every_module_db_input_of_cross_entropy_loss(dtype):
    torch.manual_seed(0)  # module_db draws its inputs from the global generator
    samples = module_db_samples(dtype)
    failures = []
    for sample in samples:
        try:
            _compare_module_input(sample, dtype)
        except Exception as err:  # noqa: BLE001 - collected, all reported below
            failures.append(f"{sample.desc}: {type(err).__name__}: {err}")
    assert not failures, f"{len(failures)} of {len(samples)} failed:\n" + "\n".join(failures)
    probability = sum(s.forward_input.args[1].dtype.is_floating_point for s in samples)
    assert 0 < probability < len(samples)  # both kinds of target were exercised


GRID = list(itertools.product((False, True), (0.0, 0.1), ("none", "sum", "mean"), (0.0, 1e-2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weighted,eps,reduction,zloss", GRID)
def test_against_float64_reference(dtype, weighted, eps, reduction, zloss):
    """Loss, z-loss and both gradients; C = 6145 cuts a CPU row into two chunks,
    the last overlapping the first (``compute.ChunkLayout``)."""
    gen = torch.Generator().manual_seed(3)
    n, c = 7, 6145
    x = (torch.randn(n, c, generator=gen) * 3).to(dtype)
    q = torch.softmax(torch.randn(n, c, generator=gen) * 2, 1).to(dtype)
    w = torch.rand(c, generator=gen) + 0.5 if weighted else None
    wants_target_grad = dtype == torch.float32  # one dtype is enough for that kernel
    xa, qa = x.clone().requires_grad_(), q.clone().requires_grad_(wants_target_grad)
    loss, zloss_part = ce_tvm.cross_entropy(xa, qa, w, reduction=reduction, label_smoothing=eps,
                                            lse_square_scale=zloss, return_zloss=True)
    args = (x.double().numpy(), q.double().numpy(), None if w is None else w.double().numpy())
    ref_loss, ref_z, _ = reference.prob_forward(*args, reduction, eps, zloss)
    tol = TOL[dtype]
    assert loss.dtype == dtype and loss.shape == ((n,) if reduction == "none" else ())
    assert_close(loss.reshape(-1), ref_loss, tol, "loss")
    assert_close(zloss_part.reshape(-1), ref_z, tol, "zloss")
    g = torch.rand(loss.shape, generator=gen, dtype=dtype) + 0.5
    loss.backward(g)
    x_grad, q_grad = reference.prob_backward(g.double().numpy(), *args, reduction, eps, zloss)
    assert_close(xa.grad, x_grad, tol, "x_grad")
    if wants_target_grad:
        assert_close(qa.grad, q_grad, tol, "target_grad")
    assert torch.equal(xa.detach(), x) and torch.equal(qa.detach(), q)


def test_large_common_offset_does_not_cancel():
    """Logits near 1000 (float32 spacing 6e-5): the per-row loss keeps float32's
    relative precision, as PyTorch's log_softmax does (the sums are of x minus
    the row's first logit, ``compute.prob_forward_func``)."""
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(16, 4000, generator=gen) * 3 + 1000
    q = torch.softmax(torch.randn(16, 4000, generator=gen), 1)
    ours = ce_tvm.cross_entropy(x, q, reduction="none", label_smoothing=0.1)
    ref = F.cross_entropy(x.double(), q.double(), reduction="none", label_smoothing=0.1)
    torch.testing.assert_close(ours.double(), ref, rtol=2e-6, atol=0)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_softcap(reduction):
    """The logits capped inside the kernels, ``t * tanh(x / t)``: against the float64
    reference and against F.cross_entropy of the capped logits (SPEC section 5)."""
    gen = torch.Generator().manual_seed(9)
    n, c, t = 5, 6145, 4.0
    x = torch.randn(n, c, generator=gen) * 5
    q = torch.softmax(torch.randn(n, c, generator=gen), 1)
    w = torch.rand(c, generator=gen) + 0.5
    opts = dict(reduction=reduction, label_smoothing=0.1)
    xa, qa = x.clone().requires_grad_(), q.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xa, qa, w, softcap=t, lse_square_scale=1e-2, **opts)
    args = (x.double().numpy(), q.double().numpy(), w.double().numpy(), reduction, 0.1, 1e-2)
    assert_close(loss.reshape(-1), reference.prob_forward(*args, softcap=t)[0], 1e-5, "loss")
    g = torch.rand(loss.shape, generator=gen) + 0.5
    loss.backward(g)
    x_grad, q_grad = reference.prob_backward(g.double().numpy(), *args, softcap=t)
    assert_close(xa.grad, x_grad, 1e-5, "x_grad")
    assert_close(qa.grad, q_grad, 1e-5, "target_grad")
    xb, qb = x.clone().requires_grad_(), q.clone().requires_grad_()
    ref = F.cross_entropy(t * torch.tanh(xb / t), qb, w, **opts)
    ref.backward(g)
    xc, qc = x.clone().requires_grad_(), q.clone().requires_grad_()
    ours = ce_tvm.cross_entropy(xc, qc, w, softcap=t, **opts)
    ours.backward(g)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(xc.grad, xb.grad)
    torch.testing.assert_close(qc.grad, qb.grad)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_gradcheck_float64(reduction):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    q = torch.softmax(torch.randn(5, 7, dtype=torch.float64, generator=gen), 1)
    q.requires_grad_()
    w = torch.rand(7, dtype=torch.float64, generator=gen) + 0.5

    def loss(x, q, softcap):
        return ce_tvm.cross_entropy(x, q, w, reduction=reduction, label_smoothing=0.2,
                                    lse_square_scale=0.05, softcap=softcap)

    assert torch.autograd.gradcheck(lambda x, q: loss(x, q, 0.0), (x, q))
    assert torch.autograd.gradcheck(lambda x, q: loss(x, q, 1.5), (x, q))


def test_opcheck_of_the_ops():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 11, generator=gen, requires_grad=True)
    q = torch.softmax(torch.randn(6, 11, generator=gen), 1)
    w = torch.rand(11, generator=gen) + 0.5
    for reduction in ("none", "mean"):
        scalars = dict(reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-2,
                       softcap=0.0 if reduction == "none" else 3.0,
                       temperature=1.0 if reduction == "none" else 1.5)
        torch.library.opcheck(cross_entropy_probs, (x, q, w), scalars)
        _, _, lse, mass = cross_entropy_probs(x.detach(), q, w, **scalars)
        g = torch.ones(6 if reduction == "none" else 1)
        torch.library.opcheck(cross_entropy_probs_backward, (g, x.detach(), q, lse, mass, w),
                              dict(scalars, grad_input=True, grad_target=True))


def test_torch_compile_fullgraph_equals_eager():
    """Distillation-style: the teacher's softmax as the target, inside one compiled graph."""
    gen = torch.Generator().manual_seed(6)
    student, teacher = torch.randn(8, 40, generator=gen), torch.randn(8, 40, generator=gen)

    def distill(s, t):
        return ce_tvm.cross_entropy(s, torch.softmax(t / 2.0, -1), label_smoothing=0.05)

    eager_x = student.clone().requires_grad_()
    compiled_x = student.clone().requires_grad_()
    eager = distill(eager_x, teacher)
    eager.backward()
    compiled = torch.compile(distill, fullgraph=True)(compiled_x, teacher)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled_x.grad, eager_x.grad, rtol=1e-6, atol=1e-7)


def test_layouts_and_promotion_match_torch():
    """(C,) and (N, C, d1, d2) layouts; a float64 target promotes a float32 input;
    a negative ignore_index is accepted (it can match no probability), as in PyTorch."""
    gen = torch.Generator().manual_seed(7)
    for shape in [(9,), (2, 9, 3, 2)]:
        x = torch.randn(shape, generator=gen)
        q = torch.softmax(torch.randn(shape, generator=gen), 0 if len(shape) == 1 else 1)
        for reduction in ("none", "mean"):
            torch.testing.assert_close(ce_tvm.cross_entropy(x, q, reduction=reduction),
                                       F.cross_entropy(x, q, reduction=reduction))
    x, q = torch.randn(4, 5, generator=gen), torch.rand(4, 5, generator=gen, dtype=torch.float64)
    ours, ref = ce_tvm.cross_entropy(x, q, ignore_index=-1), F.cross_entropy(x, q, ignore_index=-1)
    assert ours.dtype == ref.dtype == torch.float64
    torch.testing.assert_close(ours, ref)


def test_empty_batch():
    x, q = torch.empty(0, 5, requires_grad=True), torch.empty(0, 5)
    assert torch.isnan(ce_tvm.cross_entropy(x, q))  # mean over no rows, as PyTorch
    loss = ce_tvm.cross_entropy(x, q, reduction="sum")
    assert loss.item() == 0.0
    loss.backward()
    assert x.grad.shape == (0, 5)


@pytest.mark.parametrize("kw,error,message", [
    (dict(target=torch.rand(4, 6)), ValueError, r"probability target must have shape \(4, 5\)"),
    (dict(ignore_index=1), ValueError, "ignore_index is not supported for probability targets"),
    (dict(weight=torch.ones(6)), ValueError, r"weight must have shape \[C\] = \[5\]"),
    (dict(label_smoothing=1.5), ValueError, r"\[0, 1\)"),
    (dict(input=torch.ones(4, 5, dtype=torch.int64)), TypeError, "input must be float32"),
    (dict(return_token_accuracy=True), ValueError, "return_token_accuracy needs class-index"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
])
def test_rejects(kw, error, message):
    args = dict(input=torch.randn(4, 5), target=torch.rand(4, 5))
    args.update(kw)
    with pytest.raises(error, match=message):
        ce_tvm.cross_entropy(**args)
