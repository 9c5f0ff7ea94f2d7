"""ce_tvm.cross_entropy / CrossEntropyLoss as autograd drop-ins (torch.library ops)."""

import copy
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.losses.cross_entropy import cross_entropy_backward, cross_entropy_forward

LAYOUTS = {
    "C": ((13,), ()),
    "NC": ((9, 13), (9,)),
    "NCd": ((3, 13, 5), (3, 5)),
    "NCdd": ((2, 13, 3, 4), (2, 3, 4)),
}


def _inputs(layout, dtype=torch.float32, seed=0, ignore=True):
    gen = torch.Generator().manual_seed(seed)
    xshape, yshape = LAYOUTS[layout]
    x = (torch.randn(xshape, generator=gen) * 2).to(dtype)
    y = torch.randint(0, xshape[0 if len(xshape) == 1 else 1], yshape, generator=gen)
    if ignore and y.dim():
        y.view(-1)[::4] = -100
    return x, y


GRID = list(itertools.product(LAYOUTS, ("none", "sum", "mean"), (False, True), (0.0, 0.1)))


@pytest.mark.parametrize("layout,reduction,weighted,eps", GRID)
def test_drop_in_matches_torch(layout, reduction, weighted, eps):
    x, y = _inputs(layout)
    w = torch.rand(13) + 0.5 if weighted else None
    opts = dict(weight=w, ignore_index=-100, reduction=reduction, label_smoothing=eps)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, ref = ce_tvm.cross_entropy(xa, y, **opts), F.cross_entropy(xb, y, **opts)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    grad_out = torch.rand(ref.shape) + 0.5
    ours.backward(grad_out)
    ref.backward(grad_out)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(xa.detach(), x)  # the caller's logits are never overwritten


def test_module_matches_torch_module():
    x, y = _inputs("NC")
    w = torch.rand(13) + 0.5
    ours = ce_tvm.CrossEntropyLoss(weight=w, label_smoothing=0.2, reduction="sum")
    ref = torch.nn.CrossEntropyLoss(weight=w, label_smoothing=0.2, reduction="sum")
    torch.testing.assert_close(ours(x, y), ref(x, y))
    assert "label_smoothing=0.2" in repr(ours)


def _zloss_reference(x, y, s, reduction, eps):
    """F.cross_entropy plus s * lse^2 on kept rows, reduced as SPEC section 1 says."""
    ce = F.cross_entropy(x, y, reduction=reduction, label_smoothing=eps)
    m = (y != -100).to(x.dtype)
    z = s * torch.logsumexp(x, dim=1) ** 2 * m
    zred = {"none": z, "sum": z.sum(), "mean": z.sum() / m.sum()}[reduction]
    return ce + zred, zred


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_zloss_against_autograd_reference(reduction):
    x, y = _inputs("NC", seed=3)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss, zloss = ce_tvm.cross_entropy(xa, y, reduction=reduction, label_smoothing=0.1,
                                       lse_square_scale=1e-2, return_zloss=True)
    ref, ref_z = _zloss_reference(xb, y, 1e-2, reduction, 0.1)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(zloss, ref_z.detach(), rtol=1e-5, atol=1e-7)
    assert not zloss.requires_grad
    g = torch.rand(ref.shape) + 0.5
    loss.backward(g)
    ref.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_gradcheck_float64(reduction):
    x, y = _inputs("NC", torch.float64, seed=5)
    w = torch.rand(13, dtype=torch.float64) + 0.5
    x.requires_grad_()
    fn = lambda t: ce_tvm.cross_entropy(t, y, w, reduction=reduction, label_smoothing=0.1,  # noqa
                                        lse_square_scale=1e-2)
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)


def test_opcheck():
    x, y = _inputs("NC")
    w = torch.rand(13) + 0.5
    # (..., softcap, temperature, token_accuracy): a capped, tempered kernel with
    # accuracy, and a plain one
    for args in [(x, y, w, "mean", -100, 0.1, 1e-3, 5.0, 0.8, True),
                 (x, y, None, "none", -100, 0.0, 0.0, 0.0, 1.0, False)]:
        torch.library.opcheck(cross_entropy_forward, (x.clone().requires_grad_(), *args[1:]))
        loss, _, lse, _ = cross_entropy_forward(*args)
        torch.library.opcheck(cross_entropy_backward,
                              (torch.ones_like(loss), x, lse, y, args[2], *args[3:-1]))


def _saved_for_backward(x, y, reduction):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ce_tvm.cross_entropy(x, y, label_smoothing=0.1, reduction=reduction)
    return [t for t in saved if t.numel() >= x.numel()]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_training_keeps_only_the_gradient(reduction):
    """sum/mean: nothing [N, C] is saved for backward (the logits may be freed);
    the graph keeps only the gradient computed in the forward."""
    x, y = _inputs("NC")
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = ce_tvm.cross_entropy(x, y, label_smoothing=0.1, reduction=reduction)
    assert not [t for t in saved if t.numel() >= x.numel()]
    node = loss.grad_fn
    while not hasattr(node, "grads"):  # the op's node keeps its ForwardGradients
        node = node.next_functions[0][0]
    (kept,) = node.grads.held
    assert kept.data_ptr() != x.data_ptr()
    ref = x.detach().clone().requires_grad_()
    F.cross_entropy(ref, y, label_smoothing=0.1, reduction=reduction).backward()
    torch.testing.assert_close(kept, ref.grad, rtol=1e-5, atol=1e-7)


def test_per_row_upstream_gradient_saves_the_logits():
    """reduction='none' needs a gradient per row: the logits (and N-sized
    vectors) are kept and the backward recomputes from them."""
    x, y = _inputs("NC")
    x.requires_grad_()
    big = _saved_for_backward(x, y, "none")
    assert big and all(t.data_ptr() == x.data_ptr() for t in big)


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=50, width=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        logits = self.head(self.embed(tokens[:, :-1]))
        return ce_tvm.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                    tokens[:, 1:].reshape(-1), label_smoothing=0.1,
                                    lse_square_scale=1e-3)


def test_torch_compile_fullgraph_training_step_equals_eager():
    """The model with the loss inside compiles as one graph; loss and gradients match eager."""
    torch.manual_seed(0)
    eager = TinyLM()
    compiled = copy.deepcopy(eager)
    tokens = torch.randint(0, 50, (4, 12))
    eager_loss = eager(tokens)
    eager_loss.backward()
    compiled_loss = torch.compile(compiled, fullgraph=True, dynamic=True)(tokens)
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=1e-6)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kw,error,message", [
    (dict(target=torch.zeros(9)), ValueError, r"probability target must have shape \(9, 13\)"),
    (dict(target=torch.zeros(8, dtype=torch.long)), ValueError,
     r"class-index target must have shape \(9,\)"),
    (dict(target=torch.zeros(9, dtype=torch.int16)), TypeError, "int64 or int32"),
    (dict(lse_square_scale=-1.0), ValueError, "lse_square_scale must be finite and >= 0"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(target=torch.full((9,), 13)), ValueError, r"target\[0\] = 13"),
])
def test_drop_in_rejects(kw, error, message):
    x, y = _inputs("NC")
    args = dict(input=x, target=y)
    args.update(kw)
    with pytest.raises(error, match=message):
        ce_tvm.cross_entropy(**args)


@pytest.mark.slow  # a process: the example script
def test_example_training_curves_agree():
    """examples/train_tiny_lm.py: ce_tvm and F.cross_entropy agree to 1e-5 for 50+ steps."""
    script = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_lm.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "60", "--check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "largest relative difference over 60 steps" in done.stdout
