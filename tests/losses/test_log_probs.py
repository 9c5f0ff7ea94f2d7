"""``ce_tvm.log_probs`` (SPEC section 6): per-token log-probs and entropy at a
temperature, their gradients, against the float64 reference and TRL."""

import math

import numpy as np
import pytest
import torch

import ce_tvm
import support
from ce_tvm.losses.log_probs import (
    linear_log_probs_forward,
    log_probs_backward,
    log_probs_forward,
)
from ce_tvm.testing import reference

V = 517  # odd: no vector width divides it


def _case(shape, k, dtype, seed, scale=3.0, masked=True):
    """Logits ``shape + (V,)``, indices (``k`` columns, or none for ``k=None``)
    with some ``ignore_index`` entries, a row mask, and upstream weights."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, V, generator=gen) * scale).to(dtype)
    idx_shape = shape if k is None else (*shape, k)
    index = torch.randint(0, V, idx_shape, generator=gen)
    index.view(-1)[::4] = -100
    mask = torch.rand(shape, generator=gen) > 0.25 if masked else None
    a = torch.randn(idx_shape, generator=gen)
    b = torch.randn(shape, generator=gen)
    return x, index, mask, a, b


def _expected(x, index, mask, a, b, temperature, softcap):
    """Reference ``(logp, entropy, x_grad)`` of ``sum a logp + sum b entropy``."""
    v = x.shape[-1]
    xs = x.detach().double().reshape(-1, v).numpy()
    idx = index.reshape(xs.shape[0], -1).numpy()
    live = idx != -100
    if mask is not None:
        live &= mask.reshape(-1, 1).numpy()
    logp, entropy = reference.policy_outputs(xs, idx, live, temperature, softcap)
    grad = reference.policy_grad(xs, idx, live, a.double().reshape(idx.shape).numpy(),
                                 b.double().reshape(-1).numpy(), temperature, softcap)
    return (logp.reshape(index.shape), entropy.reshape(x.shape[:-1]),
            grad.reshape(x.shape))


# 16-bit logits compile kernels of their own: CI runs them, the fast lane float32
SIXTEEN_BIT = pytest.mark.slow


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=SIXTEEN_BIT),
                                   pytest.param(torch.float16, marks=SIXTEEN_BIT)],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("k", [None, 5], ids=["K=()", "K=5"])
@pytest.mark.parametrize("softcap", [0.0, 20.0], ids=["nocap", "cap20"])
def test_values_and_gradients_against_float64(dtype, k, softcap):
    """``a * logp + b * entropy`` at temperatures 0.6, 1 and 1.7 on ``[B, T, V]``
    logits with masked rows and ignored entries: outputs (float32) and the
    logits' gradient (in their dtype) against the float64 reference."""
    for i, temperature in enumerate((0.6, 1.0, 1.7)):
        x, index, mask, a, b = _case((3, 7), k, dtype, seed=i)
        x.requires_grad_()
        logp, entropy = ce_tvm.log_probs(x, index, temperature=temperature, softcap=softcap,
                                         row_mask=mask, return_entropy=True)
        assert logp.dtype == entropy.dtype == torch.float32
        assert logp.shape == index.shape and entropy.shape == x.shape[:-1]
        ((logp * a).sum() + (entropy * b).sum()).backward()
        ref_logp, ref_entropy, ref_grad = _expected(x, index, mask, a, b, temperature, softcap)
        tol = support.TOL[torch.float32]
        support.assert_close(logp, ref_logp, tol, f"logp T={temperature}")
        support.assert_close(entropy, ref_entropy, tol, f"entropy T={temperature}")
        assert x.grad.dtype == dtype
        support.assert_close(x.grad, ref_grad, support.TOL[dtype], f"x_grad T={temperature}")


def test_float64_gradcheck():
    """Both outputs, with softcap, temperature, a mask and an ignored entry."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 7, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    index = torch.randint(0, 7, (2, 3, 2), generator=gen)
    index[0, 1, 0] = -100
    mask = torch.tensor([[True, True, False], [True, True, True]])
    for softcap in (0.0, 3.0):
        def fn(x, softcap=softcap):
            return ce_tvm.log_probs(x, index, temperature=0.8, softcap=softcap, row_mask=mask,
                                    return_entropy=True)

        assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)


def test_equals_trl_on_the_cpu():
    """TRL 1.16's CPU functions (``selective_log_softmax`` with a temperature,
    ``entropy_from_logits`` of the scaled logits) on the materialised logits."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    x, index, _, _, _ = _case((4, 9), None, torch.float32, seed=5)
    for temperature in (0.7, 1.0):
        logp, entropy = ce_tvm.log_probs(x, index.clamp(min=0), temperature=temperature,
                                         return_entropy=True)
        expected = trl_utils.selective_log_softmax(x, index.clamp(min=0), temperature)
        torch.testing.assert_close(logp, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy, trl_utils.entropy_from_logits(x / temperature),
                                   rtol=1e-5, atol=1e-5)
    x, index, _, _, _ = _case((2, 5), 3, torch.float32, seed=6)
    torch.testing.assert_close(ce_tvm.log_probs(x, index.clamp(min=0), temperature=1.3),
                               trl_utils.selective_log_softmax(x, index.clamp(min=0), 1.3),
                               rtol=1e-5, atol=1e-5)


def test_a_large_common_offset_costs_no_accuracy():
    """Logits + 1e4 (float32): log-probs, entropy and gradient within 1e-4 of
    the float64 reference of the same (offset) float32 logits."""
    x, index, mask, a, b = _case((6,), 2, torch.float32, seed=7)
    x = (x + 1e4).requires_grad_()
    logp, entropy = ce_tvm.log_probs(x, index, row_mask=mask, temperature=0.9,
                                     return_entropy=True)
    ((logp * a).sum() + (entropy * b).sum()).backward()
    ref_logp, ref_entropy, ref_grad = _expected(x, index, mask, a, b, 0.9, 0.0)
    np.testing.assert_allclose(logp.detach().numpy(), ref_logp, rtol=0, atol=1e-4)
    np.testing.assert_allclose(entropy.detach().numpy(), ref_entropy, rtol=0, atol=1e-4)
    np.testing.assert_allclose(x.grad.numpy(), ref_grad, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_log_probs_never_above_zero_at_a_large_bf16_vocabulary():
    """V = 262144 in bfloat16 (Gemma's vocabulary): every log-prob <= 0, and the
    values match the reference."""
    v = 262144
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(6, v, generator=gen) * 4).to(torch.bfloat16)
    x[:, ::997] += 30  # many near-ties at the top
    index = torch.randint(0, v, (6, 8), generator=gen)
    index[:, 0] = x.float().argmax(1)
    logp, entropy = ce_tvm.log_probs(x, index, return_entropy=True)
    assert bool((logp <= 0).all())
    ref_logp, ref_entropy = reference.policy_outputs(
        x.double().numpy(), index.numpy(), np.ones(index.shape, bool))
    support.assert_close(logp, ref_logp, support.TOL[torch.float32], "logp")
    support.assert_close(entropy, ref_entropy, support.TOL[torch.float32], "entropy")


def test_minus_inf_logits_give_finite_entropy_and_gradient():
    """Masked-out classes (``-inf``): their probability is 0, the entropy and
    every gradient finite, the masked classes' gradient exactly 0."""
    x, index, _, a, b = _case((5,), 2, torch.float32, seed=8)
    x[:, 100:300] = -math.inf
    index = index.clamp(min=0) % 100
    x.requires_grad_()
    logp, entropy = ce_tvm.log_probs(x, index, temperature=1.3, return_entropy=True)
    ((logp * a).sum() + (entropy * b).sum()).backward()
    assert bool(entropy.isfinite().all()) and bool(x.grad.isfinite().all())
    assert bool((x.grad[:, 100:300] == 0).all())
    ref_logp, ref_entropy, ref_grad = _expected(x, index, None, a, b, 1.3, 0.0)
    support.assert_close(entropy, ref_entropy, support.TOL[torch.float32], "entropy")
    support.assert_close(x.grad, ref_grad, support.TOL[torch.float32], "x_grad")


def test_all_rows_masked_give_zeros():
    """Every row masked: log-probs 0 and no gradient from them; the entropy is
    still every row's."""
    x, index, _, a, b = _case((2, 3), 4, torch.float32, seed=9)
    x.requires_grad_()
    mask = torch.zeros(2, 3, dtype=torch.bool)
    logp, entropy = ce_tvm.log_probs(x, index, row_mask=mask, return_entropy=True)
    assert bool((logp == 0).all())
    (logp * a).sum().backward()
    assert bool((x.grad == 0).all())
    _, ref_entropy, _ = _expected(x, index, mask, a, b, 1.0, 0.0)
    support.assert_close(entropy, ref_entropy, support.TOL[torch.float32], "entropy")


def test_masked_rows_may_hold_any_index():
    """Padding rows' indices are never read or checked (a row mask makes them dead)."""
    x, index, _, _, _ = _case((4,), None, torch.float32, seed=10)
    index[1] = 10**6
    mask = torch.tensor([True, False, True, True])
    logp = ce_tvm.log_probs(x, index, row_mask=mask)
    assert float(logp[1]) == 0.0
    with pytest.raises(ce_tvm.TargetOutOfRangeError, match=r"index\[1, 0\] = 1000000"):
        ce_tvm.log_probs(x, index)


def test_only_one_output_needs_a_gradient():
    """A gradient from the entropy alone, and from the log-probs alone."""
    x, index, _, a, b = _case((4,), 3, torch.float32, seed=11)
    for use_logp in (True, False):
        xg = x.clone().requires_grad_()
        logp, entropy = ce_tvm.log_probs(xg, index, return_entropy=True)
        ((logp * a).sum() if use_logp else (entropy * b).sum()).backward()
        _, _, ref = _expected(x, index, None, a if use_logp else a * 0,
                              b * 0 if use_logp else b, 1.0, 0.0)
        support.assert_close(xg.grad, ref, support.TOL[torch.float32], f"logp={use_logp}")


def test_shapes_at_the_edges():
    """One row of 1-D logits, K = 0, a single class, and no rows."""
    x = torch.randn(V)
    logp = ce_tvm.log_probs(x, torch.tensor(3))
    assert logp.shape == () and float(logp) == pytest.approx(
        float(torch.log_softmax(x.double(), 0)[3]), abs=1e-5)
    logp, entropy = ce_tvm.log_probs(torch.randn(2, V), torch.zeros(2, 0, dtype=torch.long),
                                     return_entropy=True)
    assert logp.shape == (2, 0) and entropy.shape == (2,)
    one = ce_tvm.log_probs(torch.randn(3, 1), torch.zeros(3, dtype=torch.long),
                           return_entropy=True)
    assert bool((one[0] == 0).all()) and bool((one[1] == 0).all())
    empty = torch.zeros(0, 4, V, requires_grad=True)
    logp, entropy = ce_tvm.log_probs(empty, torch.zeros(0, 4, dtype=torch.long),
                                     return_entropy=True)
    assert logp.shape == (0, 4) and entropy.shape == (0, 4)
    (logp.sum() + entropy.sum()).backward()
    assert empty.grad.shape == empty.shape


BAD_INPUTS = [
    ("temperature 0", dict(temperature=0.0), ValueError, "temperature"),
    ("temperature < 0", dict(temperature=-1.0), ValueError, "temperature"),
    ("temperature inf", dict(temperature=math.inf), ValueError, "temperature"),
    ("temperature NaN", dict(temperature=math.nan), ValueError, "temperature"),
    ("index out of range", dict(index=torch.tensor([0, V, 1])), ce_tvm.TargetOutOfRangeError,
     "out of range"),
    ("negative index", dict(index=torch.tensor([0, -1, 1])), ce_tvm.TargetOutOfRangeError,
     "out of range"),
    ("index float", dict(index=torch.zeros(3)), TypeError, "int64 or int32"),
    ("index leading shape", dict(index=torch.zeros(4, dtype=torch.long)), ValueError,
     r"index must have shape"),
    ("row_mask shape", dict(row_mask=torch.ones(4, dtype=torch.bool)), ValueError, "row_mask"),
    ("softcap < 0", dict(softcap=-1.0), ValueError, "softcap"),
    ("logits int", dict(logits=torch.zeros(3, V, dtype=torch.long)), TypeError, "float32"),
    ("logits 0-d", dict(logits=torch.tensor(1.0)), ValueError, "V >= 1"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_raise_clear_errors(case):
    _, changes, error, message = case
    args = dict(logits=torch.randn(3, V), index=torch.tensor([0, 1, 2]))
    args.update(changes)
    with pytest.raises(error, match=message):
        ce_tvm.log_probs(args.pop("logits"), args.pop("index"), **args)


def test_out_of_range_is_both_index_and_value_error():
    with pytest.raises(IndexError):
        ce_tvm.log_probs(torch.randn(2, V), torch.tensor([0, V]))


def test_opcheck_and_compile_fullgraph():
    """The ops pass ``torch.library.opcheck``; ``torch.compile(fullgraph=True)`` of
    a GRPO-like use gives the eager values and gradients."""
    x, index, mask, a, b = _case((2, 3), 2, torch.float32, seed=12)
    flat, idx = x.reshape(-1, V), index.reshape(-1, 2)
    for softcap in (0.0, 15.0):
        torch.library.opcheck(log_probs_forward,
                              (flat.clone().requires_grad_(), idx.clamp(min=0), -100, 0.7,
                               softcap))
        torch.library.opcheck(log_probs_forward,  # the kernel without the entropy
                              (flat.clone().requires_grad_(), idx.clamp(min=0), -100, 0.7,
                               softcap, False))
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(flat.shape[0], 8, generator=gen, requires_grad=True)
    W = torch.randn(V, 8, generator=gen, requires_grad=True)
    for entropy in (True, False):
        torch.library.opcheck(linear_log_probs_forward,
                              (h, W, None, idx.clamp(min=0), -100, 0.7, 0.0, 4, entropy))
        logp, entropy, row_max, log_expsum = log_probs_forward(flat, idx, -100, 0.7, softcap)
        torch.library.opcheck(log_probs_backward,
                              (torch.randn_like(logp), torch.randn_like(entropy), flat, idx,
                               row_max, log_expsum, entropy, -100, 0.7, softcap))

    def objective(x):
        logp, entropy = ce_tvm.log_probs(x, index, temperature=0.7, row_mask=mask,
                                         return_entropy=True)
        return (logp * a).sum() + 0.01 * (entropy * b).sum()

    def logp_only(x):  # the kernel without the entropy
        return (ce_tvm.log_probs(x, index, temperature=0.7, row_mask=mask) * a).sum()

    for fn in (objective, logp_only):
        compiled = torch.compile(fn, fullgraph=True)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager, got = fn(xe), compiled(xc)
        eager.backward()
        got.backward()
        torch.testing.assert_close(got, eager)
        torch.testing.assert_close(xc.grad, xe.grad)


def _torch_reference(h, W, b, index, mask, temperature, softcap):
    """``(logp, entropy)`` of the LM head in float64 torch ops (autograd-able)."""
    logits = h @ W.t() + (b if b is not None else 0)
    z = (softcap * torch.tanh(logits / softcap) if softcap else logits) / temperature
    lp = torch.log_softmax(z, -1)
    entropy = -(lp.exp() * lp).sum(-1)
    live = (index != -100) & mask[..., None]
    return torch.where(live, lp.gather(-1, index.clamp(min=0)), 0.0), entropy


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=SIXTEEN_BIT)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [0.0, 10.0], ids=["nocap", "cap10"])
def test_linear_log_probs_against_float64(dtype, softcap):
    """``linear_log_probs`` over several row chunks: log-probs, entropy and the
    gradients of input, weight and bias against float64 torch autograd."""
    gen = torch.Generator().manual_seed(13)
    h = (torch.randn(2, 9, 32, generator=gen)).to(dtype).requires_grad_()
    W = (torch.randn(V, 32, generator=gen) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=gen) * 0.1).to(dtype).requires_grad_()
    index = torch.randint(0, V, (2, 9, 2), generator=gen)
    index[0, 3, 1] = -100
    mask = torch.rand(2, 9, generator=gen) > 0.2
    a, c = torch.randn(2, 9, 2, generator=gen), torch.randn(2, 9, generator=gen)
    logp, entropy = ce_tvm.linear_log_probs(h, W, index, linear_bias=b, temperature=0.8,
                                            softcap=softcap, row_mask=mask,
                                            return_entropy=True, chunk_rows=5)
    ((logp * a).sum() + (entropy * c).sum()).backward()
    leaves = [t.detach().double().requires_grad_() for t in (h, W, b)]
    ref_logp, ref_entropy = _torch_reference(*leaves, index, mask, 0.8, softcap)
    ((ref_logp * a.double()).sum() + (ref_entropy * c.double()).sum()).backward()
    tol = support.TOL[torch.float32] * 10  # the GEMMs round in float32 too
    support.assert_close(logp, ref_logp.detach().numpy(), max(tol, support.TOL[dtype]), "logp")
    support.assert_close(entropy, ref_entropy.detach().numpy(), max(tol, support.TOL[dtype]),
                        "entropy")
    for name, got, ref in zip(("input", "weight", "bias"), (h, W, b), leaves):
        assert got.grad.dtype == dtype
        support.assert_close(got.grad, ref.grad.numpy(), max(tol, support.TOL[dtype]), name)


def test_linear_log_probs_equals_log_probs_of_the_logits():
    """Without a bias, K = 1, whatever the chunking: the fused head gives the
    values and gradients of ``log_probs`` on the materialised logits."""
    gen = torch.Generator().manual_seed(14)
    h = torch.randn(11, 16, generator=gen, requires_grad=True)
    W = (torch.randn(V, 16, generator=gen) * 0.5).requires_grad_()
    index = torch.randint(0, V, (11,), generator=gen)
    a = torch.randn(11, generator=gen)
    logits = h @ W.t()
    logits.retain_grad()
    (ce_tvm.log_probs(logits, index, temperature=1.2) * a).sum().backward()
    expected = [t.grad.clone() for t in (h, W)]
    for rows in (None, 1, 4):
        h.grad = W.grad = None
        got = ce_tvm.linear_log_probs(h, W, index, temperature=1.2, chunk_rows=rows)
        torch.testing.assert_close(got, ce_tvm.log_probs(logits.detach(), index,
                                                         temperature=1.2))
        (got * a).sum().backward()
        for t, ref in zip((h, W), expected):
            torch.testing.assert_close(t.grad, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="chunk_rows"):
        ce_tvm.linear_log_probs(h, W, index, chunk_rows=0)
    with pytest.raises(ValueError, match="index must have shape"):
        ce_tvm.linear_log_probs(h, W, index[:5])


def test_ascend_style_schedule():
    """The Ascend-style tiled schedule (run on this CPU) gives the reference's
    values and gradient, at a vocabulary of several tiles."""
    gen = torch.Generator().manual_seed(15)
    x = (torch.randn(6, 20011, generator=gen) * 3).requires_grad_()
    index = torch.randint(0, 20011, (6, 3), generator=gen)
    a, b = torch.randn(6, 3, generator=gen), torch.randn(6, generator=gen)
    with ce_tvm.schedule("ascend", profile="910b"):
        logp, entropy = ce_tvm.log_probs(x, index, temperature=0.8, softcap=20.0,
                                         return_entropy=True)
        ((logp * a).sum() + (entropy * b).sum()).backward()
    ref_logp, ref_entropy, ref_grad = _expected(x, index, None, a, b, 0.8, 20.0)
    tol = support.TOL[torch.float32]
    support.assert_close(logp, ref_logp, tol, "logp")
    support.assert_close(entropy, ref_entropy, tol, "entropy")
    support.assert_close(x.grad, ref_grad, tol, "x_grad")


@pytest.mark.parametrize("columns", [64, 100, V], ids=["64", "100", "V"])
@pytest.mark.parametrize("rows", [None, 5], ids=["rows=all", "rows=5"])
@pytest.mark.parametrize("softcap", [0.0, 10.0], ids=["nocap", "cap10"])
def test_linear_log_probs_by_vocabulary_blocks_against_float64(monkeypatch, columns, rows,
                                                                softcap):
    """float32 heads go by vocabulary blocks (``runtime.vocab_blocks``): at block
    widths that divide ``V`` or not, over one or several row chunks, with indices
    on the blocks' first and last classes, log-probs, entropy and the gradients
    of input, weight and bias against float64 torch autograd."""
    monkeypatch.setenv("CE_TVM_LINEAR_BLOCK_COLUMNS", str(columns))
    gen = torch.Generator().manual_seed(21)
    h = torch.randn(3, 6, 24, generator=gen).requires_grad_()
    W = (torch.randn(V, 24, generator=gen) * 0.4).requires_grad_()
    b = (torch.randn(V, generator=gen) * 0.1).requires_grad_()
    index = torch.randint(0, V, (3, 6, 3), generator=gen)
    index[:, :, 0] = torch.tensor([0, 63, 64, 99, 100, V - 1]).repeat(3, 1)
    index[1, 2, 1] = -100
    mask = torch.rand(3, 6, generator=gen) > 0.2
    a, c = torch.randn(3, 6, 3, generator=gen), torch.randn(3, 6, generator=gen)
    logp, entropy = ce_tvm.linear_log_probs(h, W, index, linear_bias=b, temperature=0.7,
                                            softcap=softcap, row_mask=mask,
                                            return_entropy=True, chunk_rows=rows)
    ((logp * a).sum() + (entropy * c).sum()).backward()
    leaves = [t.detach().double().requires_grad_() for t in (h, W, b)]
    ref_logp, ref_entropy = _torch_reference(*leaves, index, mask, 0.7, softcap)
    ((ref_logp * a.double()).sum() + (ref_entropy * c.double()).sum()).backward()
    tol = support.TOL[torch.float32] * 10  # the GEMMs round in float32 too
    support.assert_close(logp, ref_logp.detach().numpy(), tol, "logp")
    support.assert_close(entropy, ref_entropy.detach().numpy(), tol, "entropy")
    for name, got, ref in zip(("input", "weight", "bias"), (h, W, b), leaves):
        support.assert_close(got.grad, ref.grad.numpy(), tol, name)


def test_linear_log_probs_blocks_and_row_chunks_agree(monkeypatch):
    """The statistics variant goes by row chunks, the plain one by vocabulary
    blocks: the same log-probs and entropy, and a float64 gradcheck through
    blocks of 7 classes and chunks of 3 rows; no rows give a zero weight
    gradient."""
    monkeypatch.setenv("CE_TVM_LINEAR_BLOCK_COLUMNS", "7")
    gen = torch.Generator().manual_seed(22)
    h = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    W = torch.randn(40, 6, generator=gen, dtype=torch.float64)
    index = torch.randint(0, 40, (8,), generator=gen)
    plain = ce_tvm.linear_log_probs(h.float(), W.float(), index, temperature=0.9,
                                    return_entropy=True)
    with_stats = ce_tvm.linear_log_probs(h.float(), W.float(), index, temperature=0.9,
                                         return_entropy=True, return_stats=True)
    for got, ref in zip(plain, with_stats[:2]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)

    def head(h, W):
        logp, entropy = ce_tvm.linear_log_probs(h, W, index, temperature=0.9, chunk_rows=3,
                                                return_entropy=True)
        return logp, entropy

    torch.autograd.gradcheck(head, (h.requires_grad_(), W.requires_grad_()))
    none = torch.zeros(0, 6, requires_grad=True)
    W32 = W.detach().float().requires_grad_()
    ce_tvm.linear_log_probs(none, W32, index[:0]).sum().backward()
    assert torch.equal(W32.grad, torch.zeros_like(W32))
