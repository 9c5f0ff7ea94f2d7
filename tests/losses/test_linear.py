"""ce_tvm.linear_cross_entropy against the float64 reference of cross_entropy(linear(...)).

The reference forms the whole logits in float64 NumPy (``ce_tvm.testing.reference``) and
takes the gradients of ``input``, ``linear_weight`` and ``linear_bias`` by
the chain rule from ``reference.backward``'s logits gradient.
"""

from __future__ import annotations

import copy
import itertools
import shutil
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.losses.linear import linear_cross_entropy_backward, linear_cross_entropy_forward
from ce_tvm.runtime import linear_sweep
from ce_tvm.runtime.launch import ForwardOutputs
from ce_tvm.runtime.options import LossOptions
from ce_tvm.testing import reference
from support import TOL, assert_close


@dataclass
class LinearCase:
    lead: tuple = (13,)          # leading dimensions of input (N = their product)
    hidden: int = 8
    classes: int = 1001
    dtype: torch.dtype = torch.float32
    reduction: str = "mean"
    weighted: bool = False
    label_smoothing: float = 0.0
    zloss_scale: float = 0.0
    bias: bool = False
    ignore: str = "some"         # "none", "some" (every 3rd row), "all"
    chunk_rows: int | None = 4
    seed: int = 0
    device: str = "cpu"

    def inputs(self):
        gen = torch.Generator().manual_seed(self.seed)
        x = torch.randn(*self.lead, self.hidden, generator=gen).to(self.dtype)
        W = torch.randn(self.classes, self.hidden, generator=gen).to(self.dtype)
        b = torch.randn(self.classes, generator=gen).to(self.dtype) if self.bias else None
        y = torch.randint(0, self.classes, self.lead, generator=gen)
        if self.ignore == "some":
            y.view(-1)[::3] = -100
        elif self.ignore == "all":
            y.fill_(-100)
        w = torch.rand(self.classes, generator=gen) + 0.5 if self.weighted else None
        return x, W, b, y, w

    def upstream(self, shape):
        """A gradient of the loss that is not 1 (one value per row for ``none``)."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        return (torch.rand(shape, generator=gen) + 0.5).to(self.dtype)


def reference_loss_and_grads(case: LinearCase, x, W, b, y, w, g):
    """float64 ``(loss, zloss, grad_x, grad_W, grad_b)`` of SPEC section 1 on
    ``x @ W^T + b``, for the upstream gradient ``g`` of ``loss``."""
    x2 = x.double().reshape(-1, case.hidden).numpy()
    Wn = W.double().numpy()
    logits = x2 @ Wn.T + (b.double().numpy() if b is not None else 0.0)
    yn = y.reshape(-1).numpy()
    wn = None if w is None else w.double().numpy()
    terms = reference.row_terms(logits, yn, wn, -100, case.label_smoothing, case.zloss_scale)
    loss, zloss = reference.reduce(terms, case.reduction)
    G = reference.backward(g.double().reshape(-1).numpy(), terms.log_prob, yn, wn, None,
                           terms.lse, case.reduction, -100, case.label_smoothing,
                           case.zloss_scale)
    shape = tuple(case.lead) if case.reduction == "none" else ()
    return (loss.reshape(shape), zloss.reshape(shape), (G @ Wn).reshape(x.shape), G.T @ x2,
            G.sum(axis=0))


def check_case(case: LinearCase) -> None:
    x, W, b, y, w = case.inputs()

    def leaf(t):
        return None if t is None else t.to(case.device, copy=True).requires_grad_()

    xg, Wg, bg = leaf(x), leaf(W), leaf(b)
    on_device = [None if t is None else t.to(case.device) for t in (y, w)]
    loss, zloss = ce_tvm.linear_cross_entropy(
        xg, Wg, on_device[0], linear_bias=bg, weight=on_device[1], reduction=case.reduction,
        label_smoothing=case.label_smoothing, lse_square_scale=case.zloss_scale,
        return_zloss=True, chunk_rows=case.chunk_rows)
    assert loss.dtype == zloss.dtype == case.dtype
    g = case.upstream(loss.shape)
    loss.backward(g.to(case.device))
    ref = reference_loss_and_grads(case, x, W, b, y, w, g)
    tol = TOL[case.dtype]
    assert_close(loss.cpu(), ref[0], tol, "loss")
    assert_close(zloss.cpu(), ref[1], tol, "zloss")
    assert_close(xg.grad.cpu(), ref[2], tol, "grad input")
    assert_close(Wg.grad.cpu(), ref[3], tol, "grad linear_weight")
    if b is not None:
        assert_close(bg.grad.cpu(), ref[4], tol, "grad linear_bias")
    for mine, theirs in ((xg, x), (Wg, W), (bg, b)):  # the caller's tensors are never written
        if theirs is not None:
            assert torch.equal(mine.detach().cpu(), theirs)


GRID = list(itertools.product(("none", "sum", "mean"), (False, True), (0.0, 0.1), (0.0, 1e-2),
                              (False, True)))


@pytest.mark.parametrize("reduction,weighted,eps,zloss,bias", GRID)
def test_matches_float64_reference(reduction, weighted, eps, zloss, bias):
    check_case(LinearCase(reduction=reduction, weighted=weighted, label_smoothing=eps,
                          zloss_scale=zloss, bias=bias))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_three_d_input(reduction):
    check_case(LinearCase(lead=(3, 5), reduction=reduction, weighted=True,
                          label_smoothing=0.1, zloss_scale=1e-2, bias=True))


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_awkward_vocabulary(reduction):
    check_case(LinearCase(lead=(6,), classes=32003, reduction=reduction, label_smoothing=0.1,
                          zloss_scale=1e-3, bias=True, chunk_rows=4))


@pytest.mark.parametrize("chunk_rows", [5, None])  # several chunks (float32 sums), one
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, chunk_rows, monkeypatch):
    monkeypatch.setattr(linear_sweep, "SCRATCH_BYTES", 300 * 8 * 2)  # grad_W in 4 blocks
    monkeypatch.setattr(linear_sweep, "CONVERT_BYTES", 70 * 8 * 4)  # each added in 5 parts
    check_case(LinearCase(lead=(16,), dtype=dtype, reduction="mean", weighted=True,
                          label_smoothing=0.1, zloss_scale=1e-3, bias=True,
                          chunk_rows=chunk_rows))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_with_a_float32_output_gemm(dtype, monkeypatch):
    """Where torch has ``addmm(..., out_dtype=float32)`` for 16-bit matrices (CUDA),
    each chunk's ``grad_W`` is added by that one GEMM, the first chunk with
    beta 0 (the accumulator is not initialised): here a CPU stand-in of it."""
    real_addmm, calls = torch.addmm, []

    def addmm(input, mat1, mat2, *, beta=1.0, out_dtype=None, out=None, **kw):
        if out_dtype is None:
            return real_addmm(input, mat1, mat2, beta=beta, out=out, **kw)
        calls.append(beta)
        product = mat1.to(out_dtype) @ mat2.to(out_dtype)
        return out.copy_(product if beta == 0 else beta * input + product)

    monkeypatch.setattr(linear_sweep, "_wide_gemm", lambda device: True)
    monkeypatch.setattr(torch, "addmm", addmm)
    check_case(LinearCase(lead=(16,), dtype=dtype, reduction="mean", weighted=True,
                          label_smoothing=0.1, zloss_scale=1e-3, bias=True, chunk_rows=5))
    assert calls[:4] == [0.0, 1.0, 1.0, 1.0]  # 16 rows in chunks of 5


def test_the_float32_output_gemm_is_for_cuda():
    assert not linear_sweep._wide_gemm(torch.device("cpu"))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_all_rows_ignored(reduction):
    """mean: NaN loss (as PyTorch); every reduction: zero gradients."""
    case = LinearCase(reduction=reduction, ignore="all", label_smoothing=0.1, zloss_scale=1e-2,
                      bias=True)
    check_case(case)
    x, W, b, y, _ = case.inputs()
    W.requires_grad_()
    loss = ce_tvm.linear_cross_entropy(x, W, y, linear_bias=b, reduction=reduction,
                                       label_smoothing=0.1, lse_square_scale=1e-2)
    assert bool(loss.isnan().all()) if reduction == "mean" else not bool(loss.any())
    loss.sum().backward()
    assert not bool(W.grad.any())


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_empty_batch(reduction):
    """N = 0: mean NaN, sum 0, none empty; gradients empty or zero."""
    check_case(LinearCase(lead=(0,), reduction=reduction, weighted=True, bias=True,
                          label_smoothing=0.1, zloss_scale=1e-2))


@pytest.mark.parametrize("chunk_rows", [1, 5, 13, 100, None])
def test_chunk_size_does_not_change_results(chunk_rows):
    check_case(LinearCase(reduction="mean", weighted=True, label_smoothing=0.1,
                          zloss_scale=1e-2, bias=True, chunk_rows=chunk_rows))


@pytest.mark.parametrize("per_row", [False, True])
def test_chunk_step_may_write_the_gradient_over_the_logits(per_row):
    """The sweep keeps one chunk buffer: ``chunk_loss_and_dlogits`` must give the
    same bits with ``dlogits`` being ``logits`` as with a separate buffer (so must
    a one-pass kernel that replaces it)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 1001, generator=gen) * 3
    y = torch.randint(0, 1001, (7,), generator=gen)
    y[2] = -100
    w = torch.rand(1001, generator=gen) + 0.5
    opts = LossOptions(reduction="sum", label_smoothing=0.1, zloss_scale=1e-2)
    g = torch.rand(7 if per_row else 1, generator=gen) + 0.5
    results = []
    for in_place in (False, True):
        buf = logits.clone()
        dlogits = buf if in_place else torch.empty_like(buf)
        out = ForwardOutputs(torch.empty(7), torch.empty(7), torch.empty(7), None)
        linear_sweep.chunk_loss_and_dlogits(buf, y, w, opts, g, 2 * g, out, dlogits,
                                            per_row=per_row)
        results.append((dlogits, out.loss, out.zloss, out.lse))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_chunk_rows_default_and_environment(monkeypatch):
    """An eighth of the rows, at least MIN_CHUNK_ROWS, at most MAX_CHUNK_BYTES of
    logits (the minimum wins), at most the batch; the environment, then the
    argument, override it."""
    monkeypatch.delenv(linear_sweep.CHUNK_ROWS_ENV, raising=False)
    least, chunks = linear_sweep.MIN_CHUNK_ROWS, linear_sweep.CHUNKS
    rows = linear_sweep.chunk_rows
    assert rows(4096, 128256, torch.float32) == 4096 // chunks > least
    assert rows(4099, 128256, torch.float32) == 4096 // chunks + 1
    assert rows(2048, 32000, torch.float32) == least == rows(1000, 32000, torch.float32)
    assert rows(10, 32000, torch.float32) == 10
    most = linear_sweep.MAX_CHUNK_BYTES // (128256 * 4)
    assert least < most < 10**6 // chunks
    assert rows(10**6, 128256, torch.float32) == most
    assert rows(10**6, 128256, torch.bfloat16) == 2 * most
    assert rows(10**6, 10**7, torch.float32) == least
    monkeypatch.setenv(linear_sweep.CHUNK_ROWS_ENV, "7")
    assert rows(100000, 32000, torch.float32) == 7
    assert rows(100000, 32000, torch.float32, requested=3) == 3


def test_equals_cross_entropy_of_linear():
    """Same kernels, same options: close to ce_tvm.cross_entropy on the whole logits,
    and to PyTorch's own (unfused and chunked) linear cross entropy."""
    x, W, b, y, w = LinearCase(lead=(20,), hidden=16, weighted=True, bias=True).inputs()
    opts = dict(weight=w, label_smoothing=0.1)
    ours = ce_tvm.linear_cross_entropy(x, W, y, linear_bias=b, chunk_rows=6, **opts)
    whole = ce_tvm.cross_entropy(F.linear(x, W, b), y, **opts)
    torch.testing.assert_close(ours, whole, rtol=1e-6, atol=1e-6)
    if not hasattr(F, "linear_cross_entropy"):
        pytest.skip(f"torch {torch.__version__} has no F.linear_cross_entropy to compare with")
    torch_ref = F.linear_cross_entropy(x, W, y, linear_bias=b, **opts)
    torch.testing.assert_close(ours, torch_ref, rtol=1e-5, atol=1e-5)
    chunked = F.linear_cross_entropy(x, W, y, linear_bias=b, weight=w,
                                     options=torch.nn.LinearCrossEntropyOptions())
    torch.testing.assert_close(
        ce_tvm.linear_cross_entropy(x, W, y, linear_bias=b, weight=w), chunked,
        rtol=1e-5, atol=1e-5)


def test_bit_identical_reruns():
    case = LinearCase(reduction="mean", label_smoothing=0.1, zloss_scale=1e-2, bias=True)
    x, W, b, y, w = case.inputs()
    runs = []
    for _ in range(2):
        Wg = W.clone().requires_grad_()
        loss = ce_tvm.linear_cross_entropy(x, Wg, y, linear_bias=b, label_smoothing=0.1,
                                           lse_square_scale=1e-2, chunk_rows=4)
        loss.backward()
        runs.append((loss.detach(), Wg.grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _op_args(x, W, b, y, w, reduction="mean", grads=(True, True, True), retain=False,
             softcap=0.0, accuracy=False, temperature=1.0):
    return (x, W, b, y, w, reduction, -100, 0.1, 1e-2, softcap, temperature, accuracy, 4, *grads,
            retain)


def test_only_requested_gradients_are_computed():
    x, W, b, y, w = LinearCase(bias=True).inputs()
    _, _, _, gx, gW, gb = linear_cross_entropy_forward(*_op_args(x, W, b, y, w,
                                                              grads=(False, True, False)))
    assert gx.numel() == 0 and gW.shape == W.shape and gb.numel() == 0
    # what autograd asks for: only linear_weight requires grad here
    Wg = W.clone().requires_grad_()
    ce_tvm.linear_cross_entropy(x, Wg, y, linear_bias=b).backward()
    assert Wg.grad is not None
    with torch.no_grad():
        loss = ce_tvm.linear_cross_entropy(x, Wg, y, linear_bias=b)
    assert not loss.requires_grad
    for reduction, grads in (("mean", (False,) * 3), ("none", (True,) * 3)):
        # none: the gradients come from the backward op, never from the forward
        out = linear_cross_entropy_forward(*_op_args(x, W, b, y, w, reduction, grads))
        assert all(t.numel() == 0 for t in out[3:])


def test_second_backward_needs_allow_retain_graph():
    x, W, b, y, w = LinearCase().inputs()
    W.requires_grad_()
    loss = ce_tvm.linear_cross_entropy(x, W, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="allow_retain_graph"):
        loss.backward()
    W.grad = None
    loss = ce_tvm.linear_cross_entropy(x, W, y, allow_retain_graph=True)
    loss.backward(retain_graph=True)
    first = W.grad.clone()
    loss.backward()
    torch.testing.assert_close(W.grad, 2 * first)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_gradcheck_float64(reduction):
    case = LinearCase(lead=(5,), hidden=3, classes=7, dtype=torch.float64, weighted=True,
                      bias=True, ignore="some")
    x, W, b, y, w = case.inputs()
    inputs = tuple(t.requires_grad_() for t in (x, W, b))

    def fn(x, W, b):
        return ce_tvm.linear_cross_entropy(x, W, y, linear_bias=b, weight=w, reduction=reduction,
                                           label_smoothing=0.1, lse_square_scale=1e-2,
                                           chunk_rows=2, allow_retain_graph=True)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8)


def test_opcheck():
    x, W, b, y, w = LinearCase(bias=True, weighted=True).inputs()
    for reduction in ("mean", "sum", "none"):
        args = _op_args(x.clone().requires_grad_(), W.clone().requires_grad_(),
                        b.clone().requires_grad_(), y, w, reduction, retain=True,
                        softcap=5.0 if reduction == "mean" else 0.0,
                        accuracy=reduction != "sum",
                        temperature=0.8 if reduction == "none" else 1.0)
        torch.library.opcheck(linear_cross_entropy_forward, args)
    g = torch.rand(x.shape[0])
    for softcap in (0.0, 5.0):
        torch.library.opcheck(linear_cross_entropy_backward,
                              (g, x, W, b, y, w, -100, 0.1, 1e-2, softcap, 1.0 if softcap else 1.4,
                               4, True, True, True))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=50, width=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)
        self.loss = ce_tvm.LinearCrossEntropyLoss(label_smoothing=0.1, lse_square_scale=1e-3,
                                                  chunk_rows=8)

    def forward(self, tokens):
        hidden = self.embed(tokens[:, :-1])
        return self.loss(hidden, self.head.weight, tokens[:, 1:], self.head.bias)


def test_torch_compile_fullgraph_training_step_equals_eager():
    """A model with the fused head compiles as one graph; loss and gradients match eager."""
    torch.manual_seed(0)
    eager = TinyLM()
    compiled = copy.deepcopy(eager)
    tokens = torch.randint(0, 50, (4, 12))
    eager_loss = eager(tokens)
    (2 * eager_loss).backward()
    compiled_loss = torch.compile(compiled, fullgraph=True)(tokens)
    (2 * compiled_loss).backward()
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=1e-6)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_module_matches_functional():
    x, W, b, y, w = LinearCase(bias=True, weighted=True).inputs()
    criterion = ce_tvm.LinearCrossEntropyLoss(weight=w, reduction="sum", label_smoothing=0.2)
    assert torch.equal(criterion(x, W, y, b),
                       ce_tvm.linear_cross_entropy(x, W, y, linear_bias=b, weight=w,
                                                   reduction="sum", label_smoothing=0.2))
    assert "label_smoothing=0.2" in repr(criterion)


@pytest.mark.parametrize("change,error,message", [
    (dict(linear_weight=torch.zeros(5, 9)), ValueError, r"\[V, H\] with H = 8"),
    (dict(linear_weight=torch.zeros(5)), ValueError, "2-D"),
    (dict(linear_bias=torch.zeros(4)), ValueError, r"linear_bias must have shape \[V\]"),
    (dict(linear_weight=torch.zeros(5, 8, dtype=torch.int64)), TypeError, "floating-point"),
    (dict(linear_bias=torch.zeros(5, dtype=torch.int32)), TypeError, "floating-point"),
    (dict(target=torch.zeros(12, dtype=torch.long)), ValueError, "target must have shape"),
    (dict(target=torch.zeros(13)), TypeError, "class-index targets"),
    (dict(target=torch.full((13,), 5)), ValueError, r"target\[0\] = 5"),
    (dict(weight=torch.ones(4)), ValueError, r"weight must have shape \[C\] = \[5\]"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(label_smoothing=1.0), ValueError, "label_smoothing"),
    (dict(chunk_rows=0), ValueError, "chunk_rows"),
    (dict(input=torch.zeros(13, 8, dtype=torch.int64)), TypeError, "input must be float"),
])
def test_rejects_bad_arguments(change, error, message):
    args = dict(input=torch.randn(13, 8), linear_weight=torch.randn(5, 8),
                target=torch.randint(0, 5, (13,)))
    args.update(change)
    with pytest.raises(error, match=message):
        ce_tvm.linear_cross_entropy(**args)


def test_reference_of_this_file_is_cross_entropy_of_linear():
    """The chain-rule reference agrees with PyTorch autograd on F.cross_entropy(F.linear)."""
    case = LinearCase(lead=(9,), classes=11, dtype=torch.float64, reduction="sum",
                      weighted=True, label_smoothing=0.1, bias=True)
    x, W, b, y, w = case.inputs()
    leaves = [t.clone().requires_grad_() for t in (x, W, b)]
    loss = F.cross_entropy(F.linear(*leaves), y, weight=w.double(), reduction="sum",
                           label_smoothing=0.1)
    loss.backward(torch.tensor(0.7, dtype=torch.float64))
    ref = reference_loss_and_grads(case, x, W, b, y, w, torch.tensor([0.7], dtype=torch.float64))
    assert np.allclose(ref[0], loss.item())
    for leaf, expected in zip(leaves, ref[2:]):
        assert np.allclose(leaf.grad.numpy(), expected)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.slow  # nvcc
@pytest.mark.parametrize("weighted", [False, True])
def test_cuda_kernels_of_the_sweep_compile_with_nvcc(weighted):
    """The variants the sweep launches: forward ``none`` without ``log_prob``,
    backward ``sum``/``none`` from the logits."""
    from ce_tvm.compiler.build import KernelSpec, compile_spec
    from ce_tvm.kernels.kinds import Variant

    options = (("arch", "sm_90"),)
    for op, variant in (("forward", Variant("none", weighted, log_prob=False)),
                        ("backward", Variant("sum", weighted, grad_source="logits")),
                        ("backward", Variant("none", weighted, grad_source="logits"))):
        compile_spec(KernelSpec(op, "bfloat16", 32003, variant, "cuda", options))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_matches_float64_reference_on_gpu(dtype, reduction):
    check_case(LinearCase(lead=(2, 40), hidden=64, classes=32003, dtype=dtype,
                          reduction=reduction, weighted=True, label_smoothing=0.1,
                          zloss_scale=1e-3, bias=True, chunk_rows=24, device="cuda"))
