"""``loss_dtype`` (docs/spec.md, sections 7, 8, 11): a 16-bit loss returned in float32,
reduced from the kernels' float32 sums, never rounded to 16 bits; and the one rule of
a head's mixed dtypes (``checks.head_dtypes``, section 8)."""

from __future__ import annotations

import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.losses.cross_entropy import cross_entropy_forward, cross_entropy_train
from ce_tvm.losses.linear import linear_cross_entropy_forward
from ce_tvm.testing import reference

HALF = (torch.bfloat16, torch.float16)
REDUCTIONS = ("mean", "sum", "none")
N, C, H = 48, 97, 8


def _close(got: torch.Tensor, want: np.ndarray, rtol=1e-6) -> None:
    assert got.dtype == torch.float32
    got = got.detach().double().numpy()
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-7)


def _targets(n=N, classes=C):
    y = torch.randint(0, classes, (n,))
    y[::5] = -100
    return y


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing,zloss", [(0.0, 0.0), (0.1, 1e-3)])
def test_cross_entropy_float32_loss_matches_float64(dtype, reduction, smoothing, zloss):
    torch.manual_seed(0)
    x = (torch.randn(N, C) * 3).to(dtype)
    y = _targets()
    loss, z = ce_tvm.cross_entropy(x, y, reduction=reduction, label_smoothing=smoothing,
                                   lse_square_scale=zloss, return_zloss=True,
                                   loss_dtype=torch.float32)
    want, _, want_z, _ = reference.forward(x.double().numpy(), y.numpy(), reduction=reduction,
                                           label_smoothing=smoothing, zloss_scale=zloss)
    _close(loss, np.asarray(want).reshape(loss.shape))
    _close(z, np.asarray(want_z).reshape(z.shape))
    default = ce_tvm.cross_entropy(x, y, reduction=reduction, label_smoothing=smoothing,
                                   lse_square_scale=zloss)
    assert default.dtype == dtype  # PyTorch's rule stays the default


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_float32_loss_gradient_equals_default(dtype, reduction):
    torch.manual_seed(1)
    x = (torch.randn(N, C) * 3).to(dtype)
    y = _targets()
    grads = []
    for loss_dtype in (None, torch.float32):
        xi = x.clone().requires_grad_()
        loss = ce_tvm.cross_entropy(xi, y, reduction=reduction, label_smoothing=0.1,
                                    lse_square_scale=1e-3, loss_dtype=loss_dtype)
        loss.sum().backward()
        grads.append(xi.grad)
    assert grads[1].dtype == dtype
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_cross_entropy_probability_targets_float32_loss():
    torch.manual_seed(2)
    x = torch.randn(N, C).bfloat16()
    q = torch.softmax(torch.randn(N, C), -1).bfloat16()
    loss = ce_tvm.cross_entropy(x, q, loss_dtype=torch.float32)
    want = F.cross_entropy(x.double(), q.double())
    _close(loss, want.numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wide_inputs_keep_their_dtype(dtype):
    x, y = torch.randn(N, C, dtype=dtype), _targets()
    loss = ce_tvm.cross_entropy(x, y, loss_dtype=torch.float32)
    assert loss.dtype == dtype
    assert torch.equal(loss, ce_tvm.cross_entropy(x, y))


def _head(dtype, bias=False):
    """A head whose logits are exact in ``dtype`` (small multiples of 1/8), so the
    float64 reference sees the logits the GEMM gives, whatever its order."""
    x = torch.randint(-1, 2, (N, H)).to(dtype)
    W = (torch.randint(-8, 9, (C, H)) / 8).to(dtype)
    b = (torch.randint(-8, 9, (C,)) / 8).to(dtype) if bias else None
    return x, W, b


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing,zloss", [(0.0, 0.0), (0.1, 1e-3)])
def test_linear_cross_entropy_float32_loss_matches_float64(dtype, reduction, smoothing, zloss):
    torch.manual_seed(3)
    x, W, b = _head(dtype, bias=True)
    y = _targets()
    loss, z = ce_tvm.linear_cross_entropy(
        x, W, y, linear_bias=b, reduction=reduction, label_smoothing=smoothing,
        lse_square_scale=zloss, return_zloss=True, chunk_rows=13, loss_dtype=torch.float32)
    logits = (x.double() @ W.double().T + b.double()).numpy()
    want, _, want_z, _ = reference.forward(logits, y.numpy(), reduction=reduction,
                                           label_smoothing=smoothing, zloss_scale=zloss)
    _close(loss, np.asarray(want).reshape(loss.shape))
    _close(z, np.asarray(want_z).reshape(z.shape))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_float32_loss_gradients_equal_default(reduction):
    torch.manual_seed(4)
    x, W, b = _head(torch.bfloat16, bias=True)
    y = _targets()
    grads = []
    for loss_dtype in (None, torch.float32):
        leaves = [t.clone().requires_grad_() for t in (x, W, b)]
        loss = ce_tvm.linear_cross_entropy(leaves[0], leaves[1], y, linear_bias=leaves[2],
                                           reduction=reduction, lse_square_scale=1e-3,
                                           chunk_rows=13, loss_dtype=loss_dtype)
        assert loss.dtype == (torch.float32 if loss_dtype else torch.bfloat16)
        loss.sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_modules_take_loss_dtype():
    x, y = torch.randn(N, C).bfloat16(), _targets()
    assert ce_tvm.CrossEntropyLoss(loss_dtype=torch.float32)(x, y).dtype == torch.float32
    xh, W, _ = _head(torch.bfloat16)
    crit = ce_tvm.LinearCrossEntropyLoss(loss_dtype=torch.float32)
    assert crit(xh, W, y).dtype == torch.float32
    assert "loss_dtype=torch.float32" in repr(crit)


@pytest.mark.parametrize("entry", ["cross_entropy", "CrossEntropyLoss", "linear_cross_entropy",
                                   "LinearCrossEntropyLoss"])
@pytest.mark.parametrize("value,error", [(torch.float16, ValueError), (torch.int64, ValueError),
                                         (torch.float64, ValueError), ("float32", TypeError),
                                         (32, TypeError)])
def test_bad_loss_dtype(entry, value, error):
    x, y = torch.randn(4, 7).bfloat16(), torch.randint(0, 7, (4,))
    W = torch.randn(7, 7).bfloat16()
    calls = {
        "cross_entropy": lambda: ce_tvm.cross_entropy(x, y, loss_dtype=value),
        "CrossEntropyLoss": lambda: ce_tvm.CrossEntropyLoss(loss_dtype=value),
        "linear_cross_entropy": lambda: ce_tvm.linear_cross_entropy(x, W, y, loss_dtype=value),
        "LinearCrossEntropyLoss": lambda: ce_tvm.LinearCrossEntropyLoss(loss_dtype=value),
    }
    with pytest.raises(error, match="loss_dtype"):
        calls[entry]()


def test_opcheck_wide_loss():
    torch.manual_seed(5)
    x, y = torch.randn(6, 11).bfloat16(), torch.randint(0, 11, (6,))
    scalars = dict(reduction="mean", ignore_index=-100, label_smoothing=0.1,
                   lse_square_scale=1e-3, softcap=0.0, temperature=1.0, token_accuracy=False,
                   wide_loss=True)
    torch.library.opcheck(cross_entropy_forward, (x.clone().requires_grad_(), y, None),
                          scalars)
    torch.library.opcheck(cross_entropy_train, (x.clone().requires_grad_(), y, None), scalars)
    xh, W, _ = _head(torch.bfloat16)
    args = (xh[:6].clone().requires_grad_(), W.clone().requires_grad_(), None, y, None)
    kw = dict(reduction="sum", ignore_index=-100, label_smoothing=0.0, lse_square_scale=0.0,
              softcap=0.0, temperature=1.0, token_accuracy=False, chunk_rows=4,
              grad_input=True, grad_weight=True, grad_bias=False, allow_retain_graph=True,
              wide_loss=True)
    torch.library.opcheck(linear_cross_entropy_forward, args, kw)


def test_compile_fullgraph_float32_loss():
    torch.manual_seed(6)
    x, y = torch.randn(N, C).bfloat16(), _targets()
    xh, W, _ = _head(torch.bfloat16)

    def step(logits, hidden, head):
        a = ce_tvm.cross_entropy(logits, y, loss_dtype=torch.float32)
        b = ce_tvm.linear_cross_entropy(hidden, head, y, loss_dtype=torch.float32)
        return a + b

    leaves = [t.clone().requires_grad_() for t in (x, xh, W)]
    eager = step(*leaves)
    eager.backward()
    again = [t.clone().requires_grad_() for t in (x, xh, W)]
    compiled = torch.compile(step, fullgraph=True)(*again)
    compiled.backward()
    assert compiled.dtype == torch.float32
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for a, b in zip(leaves, again):
        torch.testing.assert_close(b.grad, a.grad)


# --- Mixed dtypes of a head (docs/spec.md, section 8) -------------------------


def _mixed_case(input_dtype, head_dtype):
    torch.manual_seed(7)
    x = torch.randn(N, H, dtype=input_dtype, requires_grad=True)
    W = torch.randn(C, H, dtype=head_dtype, requires_grad=True)
    b = torch.randn(C, dtype=head_dtype, requires_grad=True)
    return x, W, b, _targets()


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("input_dtype,head_dtype", [(torch.float32, torch.bfloat16),
                                                    (torch.bfloat16, torch.float32),
                                                    (torch.float16, torch.bfloat16)])
def test_mixed_head_promotes(input_dtype, head_dtype):
    x, W, b, y = _mixed_case(input_dtype, head_dtype)
    wide = torch.promote_types(input_dtype, head_dtype)
    got = ce_tvm.linear_cross_entropy(x, W, y, linear_bias=b)
    want = ce_tvm.linear_cross_entropy(x.to(wide), W.to(wide), y, linear_bias=b.to(wide))
    assert got.dtype == wide
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w, leaf in zip(_grads(got, (x, W, b)), _grads(want, (x, W, b)), (x, W, b)):
        assert g.dtype == leaf.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_mixed_head_under_autocast_follows_autocast():
    x, W, b, y = _mixed_case(torch.float32, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ce_tvm.linear_cross_entropy(x, W, y, linear_bias=b, loss_dtype=torch.float32)
        ref_logits = F.linear(x, W, b)
    assert ref_logits.dtype == torch.bfloat16
    want = ce_tvm.linear_cross_entropy(x.bfloat16(), W, y, linear_bias=b,
                                       loss_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    gx, gW, _ = _grads(got, (x, W, b))
    assert gx.dtype == torch.float32 and gW.dtype == torch.bfloat16


def test_mixed_head_of_log_probs_and_distillation():
    x, W, b, y = _mixed_case(torch.float32, torch.bfloat16)
    index = y.clamp(min=0)
    got = ce_tvm.linear_log_probs(x, W, index, linear_bias=b)
    want = ce_tvm.linear_log_probs(x, W.float(), index, linear_bias=b.float())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    teacher = torch.randn(C, H)
    got = ce_tvm.linear_distillation_loss(x, W, x.detach(), teacher)
    want = ce_tvm.linear_distillation_loss(x, W.float(), x.detach(), teacher)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _grads(got, (W,))[0].dtype == torch.bfloat16


# --- The wide-loss kernels under the other schedules ---------------------------


@pytest.mark.parametrize("op", ["forward", "train", "prob_forward"])
def test_wide_loss_kernels_build_for_cuda(op):
    """The CUDA schedule lays out the float32 ``loss``/``zloss`` stages unchanged (and
    nvcc compiles them, where it is on ``PATH``)."""
    from ce_tvm.compiler.build import compile_spec, cuda_binary
    from ce_tvm.kernels.kinds import Variant
    from ce_tvm.store.spec import KernelSpec

    variant = Variant("mean", weighted=op != "prob_forward", log_prob=False, wide_loss=True)
    spec = KernelSpec(op, "bfloat16", 1001, variant, "cuda", (("arch", "sm_90"),))
    built = cuda_binary(compile_spec(spec), spec)
    assert built is None or built[1][:4] == b"\x7fELF"


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_float32_loss_under_the_ascend_schedule(reduction):
    torch.manual_seed(8)
    x, y = (torch.randn(N, 2003) * 3).bfloat16(), _targets(classes=2003)
    with ce_tvm.schedule("ascend", profile="910b"):
        loss = ce_tvm.cross_entropy(x.clone().requires_grad_(), y, reduction=reduction,
                                    label_smoothing=0.1, lse_square_scale=1e-3,
                                    loss_dtype=torch.float32)
    want = reference.forward(x.double().numpy(), y.numpy(), reduction=reduction,
                             label_smoothing=0.1, zloss_scale=1e-3)[0]
    _close(loss, np.asarray(want).reshape(loss.shape))


VOCAB_PARALLEL = """
import sys, torch, torch.distributed as dist, ce_tvm
from ce_tvm.distributed import (vocab_parallel_cross_entropy as vp,
                                vocab_parallel_linear_cross_entropy as vp_linear)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0,
                        world_size=1)
torch.manual_seed(0)
x, y = (torch.randn(40, 301) * 3).bfloat16(), torch.randint(0, 301, (40,))
h, W = torch.randn(40, 8), torch.randn(301, 8).bfloat16()
for red in ("mean", "sum", "none"):
    kw = dict(reduction=red, label_smoothing=0.1, lse_square_scale=1e-3,
              loss_dtype=torch.float32)
    got, want = vp(x, y, **kw), ce_tvm.cross_entropy(x, y, **kw)
    assert got.dtype == torch.float32, got.dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # a float32 input beside a bf16 head: both in float32 (the one head rule)
    got = vp_linear(h, W, y, **kw)
    want = ce_tvm.linear_cross_entropy(h, W.float(), y, **kw)
    assert got.dtype == torch.float32, got.dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got = vp_linear(h.bfloat16(), W, y, **kw)
    want = ce_tvm.linear_cross_entropy(h.bfloat16(), W, y, **kw)
    assert got.dtype == torch.float32, got.dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
try:
    vp(x, y, loss_dtype=torch.float16)
except ValueError as err:
    assert "loss_dtype" in str(err)
else:
    raise AssertionError("no ValueError")
dist.destroy_process_group()
print("ok")
"""


def test_vocab_parallel_float32_loss_and_mixed_head():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", VOCAB_PARALLEL, str(port)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
