"""``return_stats=True`` of ``ce_tvm.log_probs`` and ``ce_tvm.linear_log_probs``
(docs/spec.md, section 9): ``log sum p^2``, the mean transformed logit and whether
each index is its row's first argmax, from the sweep that computes the
log-probs, against the float64 reference and TRL 1.16's fused LM head."""

import math

import numpy as np
import pytest
import torch

import ce_tvm
import support
from ce_tvm.kernels.kinds import Variant
from ce_tvm.losses.log_probs import linear_log_probs_stats_forward, log_probs_stats_forward
from ce_tvm.store.spec import KernelSpec
from ce_tvm.testing import reference

V = 517  # odd: no vector width divides it
WIDE = 20011  # several chunks on the CPU: the statistics merge across them
TOL = support.TOL[torch.float32]


def _case(shape, k, dtype, seed, classes=V, scale=3.0):
    """Logits ``shape + (classes,)``, indices (``k`` columns, or one per row for
    ``k=None``; a third of the rows' first column at the row's argmax, a quarter
    of the entries ``ignore_index``) and a row mask."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, classes, generator=gen) * scale).to(dtype)
    idx_shape = shape if k is None else (*shape, k)
    index = torch.randint(0, classes, idx_shape, generator=gen)
    first = index if k is None else index[..., 0]
    first.view(-1)[::3] = x.float().argmax(-1).view(-1)[::3]
    index.view(-1)[1::4] = -100
    mask = torch.rand(shape, generator=gen) > 0.25
    return x, index, mask


def _reference(x, index, mask, temperature, softcap, logit_scale):
    """Float64 ``(log_sum_sq_probs, mean_logits, is_top1)`` in the caller's shapes."""
    xs = x.detach().double().reshape(-1, x.shape[-1]).numpy()
    idx = index.reshape(xs.shape[0], -1).numpy()
    live = idx != -100
    if mask is not None:
        live &= mask.reshape(-1, 1).numpy()
    lsq, mean, top = reference.policy_stats(xs, idx, live, temperature, softcap, logit_scale)
    lead = tuple(x.shape[:-1])
    return lsq.reshape(lead), mean.reshape(lead), top.reshape(index.shape)


def _check_once(x, index, mask=None, *, temperature=1.0, softcap=0.0, logit_scale=1.0,
                tol=TOL, what=""):
    """The three statistics against the reference; the log-probs and the entropy
    of the same call equal those of the call without them."""
    options = dict(temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                   row_mask=mask)
    logp, entropy, stats = ce_tvm.log_probs(x, index, return_entropy=True, return_stats=True,
                                            **options)
    assert isinstance(stats, ce_tvm.LogProbStats)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    assert stats.log_sum_sq_probs.dtype == stats.mean_logits.dtype == acc
    assert stats.log_sum_sq_probs.shape == stats.mean_logits.shape == x.shape[:-1]
    assert stats.is_top1.dtype == torch.bool and stats.is_top1.shape == index.shape
    assert not any(t.requires_grad for t in stats)
    ref_lsq, ref_mean, ref_top = _reference(x, index, mask, temperature, softcap, logit_scale)
    support.assert_close(stats.log_sum_sq_probs, ref_lsq, tol, f"log_sum_sq_probs {what}")
    support.assert_close(stats.mean_logits, ref_mean, tol, f"mean_logits {what}")
    np.testing.assert_array_equal(stats.is_top1.numpy(), ref_top, err_msg=f"is_top1 {what}")
    plain_logp, plain_entropy = ce_tvm.log_probs(x, index, return_entropy=True, **options)
    torch.testing.assert_close(logp, plain_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, plain_entropy, rtol=1e-6, atol=1e-6)
    return stats


SIXTEEN_BIT = pytest.mark.slow  # 16-bit logits compile kernels of their own


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=SIXTEEN_BIT)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [None, 3], ids=["K=()", "K=3"])
@pytest.mark.parametrize("softcap", [0.0, 20.0], ids=["nocap", "cap20"])
def test_values_against_float64(dtype, k, softcap):
    """``[B, T, V]`` logits with masked rows and ignored entries, at temperatures
    0.7 and 1, with and without a logit scale."""
    for i, (temperature, scale) in enumerate(((0.7, 1.0), (1.0, 1.0), (0.7, 0.5))):
        x, index, mask = _case((3, 7), k, dtype, seed=i)
        stats = _check_once(x, index, mask, temperature=temperature, softcap=softcap,
                            logit_scale=scale, what=f"T={temperature} s={scale}")
        assert bool(stats.is_top1.any())  # the argmax rows that count


def test_several_chunks_and_float64():
    """A vocabulary of several chunks (the statistics merged over them) and float64
    logits (float64 statistics)."""
    x, index, mask = _case((5,), 2, torch.float32, seed=3, classes=WIDE)
    _check_once(x, index, mask, temperature=0.7, softcap=15.0, what="wide")
    x, index, mask = _case((2, 3), None, torch.float64, seed=4)
    _check_once(x, index, mask, temperature=0.8, tol=1e-9, what="float64")


@pytest.mark.parametrize("classes", [V, WIDE])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=SIXTEEN_BIT)],
                         ids=["fp32", "bf16"])
def test_ties_count_for_the_first_maximum_only(classes, dtype):
    """A row whose maximum appears twice: the index at the first is top-1, at the
    second not (TRL's rule: at least the max, above every earlier logit); also
    two maxima in different chunks, and a row of equal logits."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, classes, generator=gen).to(dtype)
    a, b = 10, classes - 7  # in different chunks when the row has several
    for r in range(3):
        x[r, a] = x[r, b] = x[r].max() + 1
    x[3] = 2.0
    index = torch.tensor([[a, b], [b, a], [b, 3], [0, 1]])
    for softcap, temperature in ((0.0, 1.0), (30.0, 0.7)):
        _, stats = ce_tvm.log_probs(x, index, softcap=softcap, temperature=temperature,
                                    return_stats=True)
        expected = [[True, False], [False, True], [False, False], [True, False]]
        assert stats.is_top1.tolist() == expected, (softcap, temperature)


def test_ignored_and_masked_entries_are_not_top1_and_rows_still_have_stats():
    """``ignore_index`` entries and masked rows: ``is_top1`` false even at the
    argmax; ``log_sum_sq_probs`` and ``mean_logits`` are computed for every row."""
    x, _, _ = _case((4,), None, torch.float32, seed=6)
    top = x.argmax(-1)
    index = torch.stack([top, top, torch.full_like(top, -100)], dim=1)
    mask = torch.tensor([True, False, True, True])
    _, stats = ce_tvm.log_probs(x, index, row_mask=mask, return_stats=True)
    assert stats.is_top1.tolist() == [[True, True, False], [False, False, False],
                                      [True, True, False], [True, True, False]]
    masked = _check_once(x, index, mask, temperature=0.9)
    assert bool(masked.mean_logits[1].isfinite())
    every = torch.zeros(4, dtype=torch.bool)
    _, stats = ce_tvm.log_probs(x, index, row_mask=every, return_stats=True)
    assert not bool(stats.is_top1.any())
    ref_lsq, ref_mean, _ = _reference(x, index, every, 1.0, 0.0, 1.0)
    support.assert_close(stats.log_sum_sq_probs, ref_lsq, TOL, "all masked: log_sum_sq_probs")
    support.assert_close(stats.mean_logits, ref_mean, TOL, "all masked: mean_logits")


def test_a_large_common_offset_costs_no_accuracy():
    """Logits + 1e4 (float32): ``log sum p^2`` within 1e-4 of the float64 reference
    of the same float32 logits (its two sums keep the max apart); the mean
    within float32 rounding of 1e4."""
    x, index, mask = _case((6,), 2, torch.float32, seed=7, classes=WIDE)
    x = x + 1e4
    _, stats = ce_tvm.log_probs(x, index, row_mask=mask, temperature=0.9, return_stats=True)
    ref_lsq, ref_mean, ref_top = _reference(x, index, mask, 0.9, 0.0, 1.0)
    np.testing.assert_allclose(stats.log_sum_sq_probs.numpy(), ref_lsq, rtol=0, atol=1e-4)
    np.testing.assert_allclose(stats.mean_logits.numpy(), ref_mean, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(stats.is_top1.numpy(), ref_top)


def test_minus_inf_logits():
    """Masked-out classes (``-inf``): ``log sum p^2`` finite and right, the mean
    ``-inf`` (as TRL's sum of the logits), the argmax among the finite ones."""
    x, index, _ = _case((5,), 2, torch.float32, seed=8)
    x[:, 100:300] = -math.inf
    index[:, 0] = x.argmax(-1)
    index[:, 1] = 150
    _, stats = ce_tvm.log_probs(x, index, temperature=1.3, return_stats=True)
    ref_lsq, _, ref_top = _reference(x, index, None, 1.3, 0.0, 1.0)
    support.assert_close(stats.log_sum_sq_probs, ref_lsq, TOL, "log_sum_sq_probs")
    assert bool((stats.mean_logits == -math.inf).all())
    np.testing.assert_array_equal(stats.is_top1.numpy(), ref_top)


def test_shapes_at_the_edges():
    """One row of 1-D logits, K = 0, a single class, and no rows."""
    x = torch.randn(V)
    logp, stats = ce_tvm.log_probs(x, x.argmax(), return_stats=True)
    assert logp.shape == stats.log_sum_sq_probs.shape == stats.is_top1.shape == ()
    assert bool(stats.is_top1)
    _, entropy, stats = ce_tvm.log_probs(torch.randn(2, V), torch.zeros(2, 0, dtype=torch.long),
                                         return_entropy=True, return_stats=True)
    assert stats.is_top1.shape == (2, 0) and stats.mean_logits.shape == entropy.shape == (2,)
    one = torch.randn(3, 1)
    _, stats = ce_tvm.log_probs(one, torch.zeros(3, dtype=torch.long), temperature=0.5,
                                return_stats=True)
    assert bool((stats.log_sum_sq_probs == 0).all()) and bool(stats.is_top1.all())
    torch.testing.assert_close(stats.mean_logits, one[:, 0] / 0.5)
    empty = torch.zeros(0, 4, V)
    _, stats = ce_tvm.log_probs(empty, torch.zeros(0, 4, dtype=torch.long), return_stats=True)
    assert stats.log_sum_sq_probs.shape == (0, 4) and stats.is_top1.shape == (0, 4)


def test_the_statistics_are_a_variant_of_their_own():
    """Without ``return_stats`` the kernels, their names and keys are those of
    before; with it one more variant (of the forward only: the gradient is the same)."""
    plain, stats = Variant(columns=1), Variant(columns=1, stats=True)
    assert plain.tag() == "mean-nw-lp-k1-log_prob"
    assert KernelSpec("log_probs", "float32", V, plain).name() == "llvm-log_probs-float32-C517-k1"
    assert KernelSpec("log_probs", "float32", V, stats).name() == (
        "llvm-log_probs-float32-C517-k1-st")
    capped = Variant(columns=2, softcap=True, stats=True)
    assert KernelSpec("log_probs", "float32", V, capped).name().endswith("-k2-sc-st")


def _torch_logits(h, W, b, softcap, temperature, logit_scale):
    logits = (h.double() @ W.double().t() + b.double()) * logit_scale
    return (softcap * torch.tanh(logits / softcap) if softcap else logits) / temperature


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=SIXTEEN_BIT)],
                         ids=["fp32", "bf16"])
def test_linear_log_probs_over_several_chunks(dtype):
    """``linear_log_probs`` with ``return_stats`` over row chunks of 4 (11 rows):
    each chunk's statistics from its kernel call, against float64 torch; the
    log-probs, entropy and gradients are those of the call without them."""
    gen = torch.Generator().manual_seed(13)
    h = torch.randn(11, 32, generator=gen).to(dtype).requires_grad_()
    W = (torch.randn(V, 32, generator=gen) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=gen) * 0.1).to(dtype).requires_grad_()
    index = torch.randint(0, V, (11, 2), generator=gen)
    z = _torch_logits(h.detach(), W.detach(), b.detach(), 10.0, 0.7, 0.5)
    index[::2, 0] = z.argmax(-1)[::2]
    index[3, 1] = -100
    mask = torch.ones(11, dtype=torch.bool)
    mask[5] = False
    options = dict(linear_bias=b, temperature=0.7, softcap=10.0, logit_scale=0.5, row_mask=mask,
                   chunk_rows=4)
    logp, entropy, stats = ce_tvm.linear_log_probs(h, W, index, return_entropy=True,
                                                   return_stats=True, **options)
    p = torch.softmax(z, -1)
    tol = max(TOL * 10, support.TOL[dtype])  # the GEMMs round too
    support.assert_close(stats.log_sum_sq_probs, p.pow(2).sum(-1).log().numpy(), tol,
                        "log_sum_sq_probs")
    support.assert_close(stats.mean_logits, z.mean(-1).numpy(), tol, "mean_logits")
    live = (index != -100) & mask[:, None]
    expected = live & (index == z.argmax(-1, keepdim=True))
    assert torch.equal(stats.is_top1, expected) and bool(expected.any())
    ((logp * 2).sum() + entropy.sum()).backward()
    grads = [t.grad.clone() for t in (h, W, b)]
    for t in (h, W, b):
        t.grad = None
    plain_logp, plain_entropy = ce_tvm.linear_log_probs(h, W, index, return_entropy=True,
                                                        **options)
    ((plain_logp * 2).sum() + plain_entropy.sum()).backward()
    torch.testing.assert_close(logp, plain_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, plain_entropy, rtol=1e-6, atol=1e-6)
    for got, t in zip(grads, (h, W, b)):
        torch.testing.assert_close(got, t.grad, rtol=1e-6, atol=1e-6)


def test_equals_trl_fused_head():
    """TRL 1.16's ``ChunkedLogProbFunction`` (float32, CPU: its torch tiles), all
    five outputs, with and without softcap, temperature and logit scale; its
    vocabulary tiles (128) are not ours."""
    trl = pytest.importorskip("trl.kernels.chunked_logprob")
    gen = torch.Generator().manual_seed(21)
    h = torch.randn(37, 24, generator=gen)
    W = torch.randn(V, 24, generator=gen) * 0.4
    b = torch.randn(V, generator=gen) * 0.1
    targets = torch.randint(0, V, (37,), generator=gen)
    for temperature, softcap, scale in ((1.0, None, 1.0), (0.7, 30.0, 0.5), (1.3, None, 2.0)):
        z = _torch_logits(h, W, b, softcap or 0.0, temperature, scale)
        targets[::3] = z.argmax(-1)[::3]
        with torch.no_grad():
            expected = trl.ChunkedLogProbFunction.apply(h, W, b, targets, temperature, 128,
                                                        softcap, scale, trl.OPTIONAL_OUTPUTS)
        logp, entropy, stats = ce_tvm.linear_log_probs(
            h, W, targets, linear_bias=b, temperature=temperature, softcap=softcap or 0.0,
            logit_scale=scale, return_entropy=True, return_stats=True)
        for name, got, want in zip(("logp", "entropy", "log_sum_sq_probs", "mean_logits"),
                                   (logp, entropy, *stats[:2]), expected[:4]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(stats.is_top1, expected[4]) and bool(expected[4].any())


def test_opcheck_and_compile_fullgraph():
    """The stats ops pass ``torch.library.opcheck``; ``torch.compile(fullgraph=True)``
    of a use that logs the statistics gives the eager values and gradients."""
    x, index, mask = _case((2, 3), 2, torch.float32, seed=12)
    flat, idx = x.reshape(-1, V), index.reshape(-1, 2).clamp(min=0)
    for softcap in (0.0, 15.0):
        torch.library.opcheck(log_probs_stats_forward,
                              (flat.clone().requires_grad_(), idx, -100, 0.7, softcap))
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(6, 8, generator=gen, requires_grad=True)
    W = torch.randn(V, 8, generator=gen, requires_grad=True)
    torch.library.opcheck(linear_log_probs_stats_forward, (h, W, None, idx, -100, 0.7, 0.0, 4))

    def objective(x):
        logp, entropy, stats = ce_tvm.log_probs(x, index, temperature=0.7, row_mask=mask,
                                                return_entropy=True, return_stats=True)
        loss = -(logp * stats.is_top1).sum() + 0.01 * entropy.sum()
        return loss, stats.log_sum_sq_probs.mean(), stats.mean_logits, stats.is_top1

    compiled = torch.compile(objective, fullgraph=True)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager, got = objective(xe), compiled(xc)
    eager[0].backward()
    got[0].backward()
    for a, e in zip(got, eager):
        torch.testing.assert_close(a, e)
    torch.testing.assert_close(xc.grad, xe.grad)


def test_vocabulary_parallel_path_refuses_the_statistics():
    """Not combined over vocabulary shards yet: a clear ``ValueError``."""
    with pytest.raises(ValueError, match="return_stats=True is not supported on the vocabulary"):
        ce_tvm.distributed.vocab_parallel_linear_log_probs(
            torch.randn(3, 8), torch.randn(V, 8), torch.zeros(3, dtype=torch.long),
            return_stats=True)


def test_ascend_style_schedule():
    """The Ascend-style tiled schedule (run on this CPU) gives the statistics too, at
    a vocabulary of several tiles."""
    x, index, mask = _case((6,), 3, torch.float32, seed=15, classes=WIDE)
    with ce_tvm.schedule("ascend", profile="910b"):
        _, stats = ce_tvm.log_probs(x, index, row_mask=mask, temperature=0.8, softcap=20.0,
                                    return_stats=True)
    ref_lsq, ref_mean, ref_top = _reference(x, index, mask, 0.8, 20.0, 1.0)
    support.assert_close(stats.log_sum_sq_probs, ref_lsq, TOL, "log_sum_sq_probs")
    support.assert_close(stats.mean_logits, ref_mean, TOL, "mean_logits")
    np.testing.assert_array_equal(stats.is_top1.numpy(), ref_top)
    assert bool(stats.is_top1.any())
