"""One rank of the vocab-parallel tests (launched like torchrun: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); the modes (``CHECKS``, comma-separated) are the
first argument, run in that order. Every
rank checks its outputs and gradient shards against the float64 reference of
SPEC.md (``ce_tvm.testing.reference``) on the full logits or head, or, for the
DTensor paths, against the single-process ``ce_tvm`` calls they stand for."""

import datetime
import itertools
import re
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ce_tvm
from ce_tvm.distributed import (
    VocabParallelCrossEntropyLoss,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_linear_log_probs,
)
from ce_tvm.testing import reference

C = 53  # shards of unequal width for 2 and 3 ranks


def _halves(n):
    return [n - n // 2, n // 2]


def shard_widths(total, world):
    """Unequal widths in rank order for 2, 3 or 4 ranks, chosen so that the worlds
    share widths (each width compiles its own kernels): 2 ranks take the halves,
    4 the halves of the halves, 3 the first half and the halves of the second."""
    first, second = _halves(total)
    return {2: [first, second], 3: [first, *_halves(second)],
            4: [*_halves(first), *_halves(second)]}[world]


def shard_bounds(rank, world, total=C):
    """``(widths, lo, hi)``: every rank's width and this rank's columns."""
    widths = shard_widths(total, world)
    lo = sum(widths[:rank])
    return widths, lo, lo + widths[rank]


def _float64(t):
    return None if t is None else t.double().numpy()


def _head_grads(dlogits, x, W):
    """``(grad_x, grad_W, grad_b)`` of the head from its logits' gradient."""
    return (torch.from_numpy(dlogits @ _float64(W)), torch.from_numpy(dlogits.T @ _float64(x)),
            torch.from_numpy(dlogits.sum(0)))


def loss_reference(logits, y, w, g, reduction, eps, zloss, softcap, temp):
    """The float64 SPEC reference of the loss of float64 ``logits`` (on
    ``cap(logits) / temp``): ``(loss, zloss, dlogits)``, the gradient for the
    upstream gradient ``g`` of the loss."""
    z = reference.capped(logits, softcap) / temp
    loss, log_prob, zl, lse = reference.forward(z, y.numpy(), _float64(w), reduction, -100, eps,
                                                zloss)
    dz = reference.backward(_float64(g).reshape(-1), log_prob, y.numpy(), _float64(w), None,
                            lse, reduction, -100, eps, zloss)
    return (torch.from_numpy(loss), torch.from_numpy(zl),
            reference.through_softcap(dz / temp, logits, softcap))


def head_loss_reference(x, W, b, y, w, g, *options):
    """``loss_reference`` of the head ``x @ W^T + b``: ``(loss, zloss, grad_x,
    grad_W, grad_b)``."""
    logits = _float64(x) @ _float64(W).T + _float64(b)
    loss, zl, dlogits = loss_reference(logits, y, w, g, *options)
    return (loss, zl, *_head_grads(dlogits, x, W))


def head_log_probs_reference(x, W, b, index, live, a, c, softcap, temp):
    """The float64 SPEC reference of log-probs and entropy of the head: ``(logp,
    entropy, grad_x, grad_W, grad_b)``, the gradients of ``sum a logp + sum c
    entropy``."""
    logits = _float64(x) @ _float64(W).T + _float64(b)
    cols = index.reshape(index.shape[0], -1).numpy()
    live = live.reshape(cols.shape).numpy()
    logp, entropy = reference.policy_outputs(logits, cols, live, temp, softcap)
    dlogits = reference.policy_grad(logits, cols, live, _float64(a).reshape(cols.shape),
                                    _float64(c), temp, softcap)
    return (torch.from_numpy(logp).reshape(index.shape), torch.from_numpy(entropy),
            *_head_grads(dlogits, x, W))


def check_cases(rank, world):
    """24 option combinations, 2 with softcap, 1 with softcap and a temperature;
    returns how many were checked."""
    n, c = 24, C
    widths, lo, hi = shard_bounds(rank, world)
    checked = 0
    plain = itertools.product(("none", "sum", "mean"), (False, True), (0.0, 0.1), (0.0, 1e-2),
                              (0.0,), (1.0,))
    capped = [("none", True, 0.1, 1e-2, 2.0, 1.0), ("mean", True, 0.1, 1e-2, 2.0, 1.0),
              ("none", True, 0.1, 1e-2, 2.0, 0.7)]
    for reduction, weighted, eps, zloss, softcap, temp in itertools.chain(plain, capped):
        gen = torch.Generator().manual_seed(7)
        full = torch.randn(n, c, generator=gen) * 3
        y = torch.randint(0, c, (n,), generator=gen)
        y[::5] = -100  # ignored rows
        y[1] = sum(widths[:-1])  # the first column of the last shard
        y[2] = widths[0] - 1  # the last column of the first shard
        w = torch.rand(c, generator=gen) + 0.5 if weighted else None
        opts = dict(ignore_index=-100, reduction=reduction, label_smoothing=eps,
                    lse_square_scale=zloss, softcap=softcap, temperature=temp)
        g = torch.rand(n if reduction == "none" else (), generator=gen) + 0.5
        ref, _, ref_grad = loss_reference(full.double().numpy(), y, w, g, reduction, eps, zloss,
                                          softcap, temp)
        shard = full[:, lo:hi].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, y, None if w is None else w[lo:hi], **opts)
        torch.testing.assert_close(loss, ref.float().reshape(loss.shape), rtol=1e-5, atol=1e-6)
        loss.backward(g)
        torch.testing.assert_close(shard.grad, torch.from_numpy(ref_grad[:, lo:hi]).float(),
                                   rtol=1e-5, atol=1e-6)
        checked += 1
    # The module form, weighted and softcapped, against torch on the full capped
    # logits (z-loss added by hand).
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(6, c, generator=gen) * 2
    y = torch.randint(0, c, (6,), generator=gen)
    w = torch.rand(c, generator=gen) + 0.5
    module = VocabParallelCrossEntropyLoss(w[lo:hi], reduction="sum", label_smoothing=0.1,
                                           lse_square_scale=1e-2, softcap=2.0)
    capped = 2.0 * torch.tanh(full / 2.0)
    ref = (torch.nn.functional.cross_entropy(capped, y, w, reduction="sum", label_smoothing=0.1)
           + 1e-2 * (torch.logsumexp(capped, 1) ** 2).sum())
    torch.testing.assert_close(module(full[:, lo:hi].clone(), y), ref, rtol=1e-6, atol=1e-5)
    return checked


def check_odd_strides(rank, world):
    """Empty batches with strides 0 (every dtype; every reduction in float32), and
    one row with a row stride of 1000 and a target of stride 7, against PyTorch;
    returns the count. Every rank holds as many columns as rank 0 of
    ``check_cases`` (one set of kernels, shared with it)."""
    width = shard_bounds(0, world)[0][0]
    lo, hi = rank * width, (rank + 1) * width
    checked = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for reduction in ("mean", "sum", "none") if dtype == torch.float32 else ("mean",):
            x = torch.tensor(np.zeros((0, width)), dtype=dtype).requires_grad_()
            y = torch.tensor(np.zeros(0), dtype=torch.int64)
            assert x.stride() == (0, 0) and y.stride() == (0,)
            w = torch.tensor(np.ones(width))  # float64 weights, converted by ce_tvm
            loss = vocab_parallel_cross_entropy(x, y, w, reduction=reduction,
                                                label_smoothing=0.1, lse_square_scale=1e-3)
            ref = F.cross_entropy(x.detach().float(), y, reduction=reduction)
            assert loss.dtype == dtype and loss.shape == ref.shape
            torch.testing.assert_close(loss.float(), ref, equal_nan=True)
            grad = torch.empty_strided((0,), (0,)) if reduction == "none" else None
            loss.backward(grad)
            assert x.grad.shape == (0, width) and x.grad.dtype == dtype
            checked += 1
    gen = torch.Generator().manual_seed(8)
    full = torch.randn(1, width * world, generator=gen) * 3
    y = torch.tensor([width * world - 1])
    ref_x = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_x, y, label_smoothing=0.1)
    ref.backward()
    shard = torch.empty_strided((1, width), (1000, 1)).copy_(full[:, lo:hi]).requires_grad_()
    y_odd = torch.empty_strided((1,), (7,), dtype=torch.int64).copy_(y)
    loss = vocab_parallel_cross_entropy(shard, y_odd, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    loss.backward()
    torch.testing.assert_close(shard.grad, ref_x.grad[:, lo:hi], rtol=1e-5, atol=1e-7)
    return checked + 1


V_HEAD, H_HEAD = 5003, 16  # the LM head of check_linear_head: unequal shards over 3 ranks


def _close_as(dtype):
    """Against the float64 reference: float32 to 1e-4 relative; bfloat16 (the head's
    GEMM rounds the logits to bfloat16) to 3e-2 of the largest reference value."""
    def close(actual, expected):
        if dtype == torch.float32:
            torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=1e-4, atol=1e-5)
        else:
            scale = float(expected.float().abs().max())
            torch.testing.assert_close(actual.float(), expected.float(), rtol=3e-2,
                                       atol=3e-2 * scale)
    return close


def check_linear_head(rank, world):
    """``vocab_parallel_linear_cross_entropy`` against the single-process fused loss
    on the full weight: loss, z-loss and the gradients of the input, the weight
    shard and the bias shard, over option combinations, with and without
    sequence parallelism, in several row chunks; returns how many were checked."""
    widths, lo, hi = shard_bounds(rank, world, V_HEAD)
    cases = [("mean", False, 0.0, 0.0, 0.0, 1.0, False),
             ("sum", True, 0.1, 1e-2, 0.0, 1.0, False),
             ("none", True, 0.1, 1e-2, 0.0, 1.0, False),
             ("mean", True, 0.1, 1e-2, 5.0, 0.7, False),
             ("mean", True, 0.1, 1e-2, 5.0, 0.7, True),
             ("none", False, 0.0, 1e-2, 0.0, 1.3, True)]
    cases = [(*case, torch.float32) for case in cases] + [
        ("mean", True, 0.1, 1e-2, 5.0, 0.7, True, torch.bfloat16)]
    checked = 0
    for reduction, weighted, eps, zloss, softcap, temp, sp, dtype in cases:
        gen = torch.Generator().manual_seed(21)
        n = 6 * world
        x = torch.randn(n, H_HEAD, generator=gen).to(dtype)
        W = (torch.randn(V_HEAD, H_HEAD, generator=gen) * 0.5).to(dtype)
        b = (torch.randn(V_HEAD, generator=gen) * 0.1).to(dtype)
        y = torch.randint(0, V_HEAD, (n,), generator=gen)
        y[::5] = -100
        y[1], y[2] = widths[0] - 1, widths[0]  # the two sides of the first shard's edge
        w = torch.rand(V_HEAD, generator=gen) + 0.5 if weighted else None
        opts = dict(reduction=reduction, label_smoothing=eps, lse_square_scale=zloss,
                    softcap=softcap, temperature=temp)
        g = torch.rand(n if reduction == "none" else (), generator=gen) + 0.5
        ref, ref_z, *ref_grads = head_loss_reference(x, W, b, y, w, g, reduction, eps, zloss,
                                                      softcap, temp)
        block = slice(rank * 6, rank * 6 + 6)
        mine = [(x[block] if sp else x).clone().requires_grad_(), W[lo:hi].clone()
                .requires_grad_(), b[lo:hi].clone().requires_grad_()]
        loss, z = vocab_parallel_linear_cross_entropy(
            mine[0], mine[1], y, local_bias=mine[2], weight=None if w is None else w[lo:hi],
            sequence_parallel=sp, chunk_rows=4, return_zloss=True, **opts)

        def own(t):  # a per-row output of sequence parallelism is the rank's block
            return t[block] if sp and reduction == "none" else t

        close = _close_as(dtype)
        close(loss, own(ref).reshape(loss.shape))
        close(z, own(ref_z).reshape(z.shape))
        loss.backward(own(g))
        close(mine[0].grad, ref_grads[0][block] if sp else ref_grads[0])
        close(mine[1].grad, ref_grads[1][lo:hi])
        close(mine[2].grad, ref_grads[2][lo:hi])
        checked += 1
    # token accuracy, the logits and the head sharded, ties across a shard edge
    gen = torch.Generator().manual_seed(25)
    x = torch.randn(4 * world, H_HEAD, generator=gen)
    W = torch.randn(V_HEAD, H_HEAD, generator=gen)
    W[widths[0]] = W[widths[0] - 1]  # equal logits on both sides of the first edge
    x[1] = x[2] = W[widths[0]] * 10  # rows whose maximum is that tie
    logits = x @ W.t()
    y = logits.argmax(1)
    y[::3] = torch.randint(0, V_HEAD, y[::3].shape, generator=gen)
    y[1], y[2] = widths[0], widths[0] - 1  # the earlier column of the tie is the first maximum
    y[4] = -100
    kept = y != -100
    expected = ((logits.argmax(1) == y) & kept).sum() / kept.sum()  # argmax: the first maximum
    got = vocab_parallel_cross_entropy(logits[:, lo:hi].contiguous(), y, softcap=30.0,
                                       return_token_accuracy=True)[1]
    head = vocab_parallel_linear_cross_entropy(x, W[lo:hi], y, softcap=30.0, chunk_rows=3,
                                               return_token_accuracy=True)[1]
    assert 0 < float(expected) < 1
    assert float(got) == float(expected) == float(head), (got, expected, head)
    return checked + 1



def check_linear_log_probs(rank, world):
    """``vocab_parallel_linear_log_probs`` against the single-process
    ``linear_log_probs`` on the full weight: log-probs, entropy and the gradients
    of ``a * logp + b * entropy`` for the input, the weight and the bias shards
    (without the entropy, of ``a * logp``); returns how many cases were checked."""
    widths, lo, hi = shard_bounds(rank, world, V_HEAD)
    checked = 0
    for temp, softcap, sp, k, with_entropy in [(1.0, 0.0, False, None, True),
                                               (0.7, 5.0, False, 2, True),
                                               (1.3, 0.0, True, 2, True),
                                               (0.7, 0.0, True, None, False)]:
        gen = torch.Generator().manual_seed(22)
        n = 6 * world
        x = torch.randn(n, H_HEAD, generator=gen)
        W = torch.randn(V_HEAD, H_HEAD, generator=gen) * 0.5
        b = torch.randn(V_HEAD, generator=gen) * 0.1
        index = torch.randint(0, V_HEAD, (n,) if k is None else (n, k), generator=gen)
        index.view(-1)[::7] = -100
        index.view(-1)[1], index.view(-1)[2] = widths[0] - 1, widths[0]
        mask = torch.rand(n, generator=gen) > 0.2
        a = torch.randn(index.shape, generator=gen)
        c = torch.randn(n, generator=gen) * with_entropy
        opts = dict(temperature=temp, softcap=softcap, row_mask=mask,
                    return_entropy=with_entropy)
        live = (index != -100) & (mask if k is None else mask[:, None])
        ref_logp, ref_entropy, *ref_grads = head_log_probs_reference(x, W, b, index, live, a, c,
                                                                     softcap, temp)
        block = slice(rank * 6, rank * 6 + 6) if sp else slice(None)
        mine = [x[block].clone().requires_grad_(), W[lo:hi].clone().requires_grad_(),
                b[lo:hi].clone().requires_grad_()]
        result = vocab_parallel_linear_log_probs(
            mine[0], mine[1], index, local_bias=mine[2], sequence_parallel=sp, chunk_rows=4,
            **opts)
        logp, entropy = result if with_entropy else (result, torch.zeros(n)[block])
        close = _close_as(torch.float32)
        close(logp, ref_logp[block].float())
        if with_entropy:
            close(entropy, ref_entropy[block].float())
        ((logp * a[block]).sum() + (entropy * c[block]).sum()).backward()
        close(mine[0].grad, ref_grads[0][block].float())
        close(mine[1].grad, ref_grads[1][lo:hi].float())
        close(mine[2].grad, ref_grads[2][lo:hi].float())
        checked += 1
    return checked


def check_bytes_independent_of_vocabulary(rank, world):
    """The bytes the sharded head's collectives move per training step (loss,
    then log-probs and entropy, forward and backward) are the same at V and 10 V:
    only per-row statistics and the input's gradient cross ranks. And the
    loss's backward hands the forward's gradient buffers to the leaves (no
    copy of the weight shard's gradient; the test runs with every large
    allocation mapped afresh, so that a copy would raise the RSS)."""
    from ce_tvm.tools.measure import PeakRSS

    counted = []

    def counting(collective):
        def call(tensor, *args, **kwargs):
            counted.append(tensor.numel() * tensor.element_size())
            return collective(tensor, *args, **kwargs)
        return call

    def step(vocab):
        gen = torch.Generator().manual_seed(23)
        x = torch.randn(8, H_HEAD, generator=gen, requires_grad=True)
        W = torch.randn(vocab // world, H_HEAD, generator=gen, requires_grad=True)
        y = torch.randint(0, vocab // world * world, (8,), generator=gen)
        vocab_parallel_linear_cross_entropy(x, W, y, label_smoothing=0.1).backward()  # warm-up
        counted.clear()
        loss = vocab_parallel_linear_cross_entropy(x, W, y, label_smoothing=0.1)
        W.grad = None
        with PeakRSS() as backward:
            loss.backward()
        logp, entropy = vocab_parallel_linear_log_probs(x, W, y, return_entropy=True)
        (logp.sum() + entropy.sum()).backward()
        return sum(counted), backward.mb, W.numel() * W.element_size() / 2**20

    saved = dist.all_reduce, dist.all_gather
    dist.all_reduce = counting(dist.all_reduce)
    try:
        (small, _, _), (large, backward_mb, shard_mb) = step(6000), step(60000)
    finally:
        dist.all_reduce, dist.all_gather = saved
    assert small == large > 0, (small, large)
    assert small <= 64 * 8 * H_HEAD, small  # O(N x H)
    assert backward_mb < shard_mb / 2, (backward_mb, shard_mb)
    return 1


def check_dtensor(rank, world):
    """DTensor on a 1-D mesh: logits ``Shard(-1)`` given to ``ce_tvm.cross_entropy``,
    an LM head weight ``Shard(0)`` given to ``linear_cross_entropy`` /
    ``linear_log_probs`` with the input ``Replicate()``, rows ``Shard(0)`` or a
    ``[B, T, H]`` input sequence-sharded (``Shard(1)``): the single-process
    values, and DTensor gradients of the same placements. A plain input beside
    the sharded weight (data or tensor parallel?), other placements and
    mismatched meshes are a clear ``ValueError``. Returns how many checks ran."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(24)
    logits = torch.randn(2, 3 * world, V_HEAD, generator=gen) * 3
    y = torch.randint(0, V_HEAD, (2, 3 * world), generator=gen)
    y[0, 1] = -100
    opts = dict(label_smoothing=0.1, lse_square_scale=1e-2, temperature=0.8)
    ref_x = logits.clone().requires_grad_()
    ref = ce_tvm.cross_entropy(ref_x.reshape(-1, V_HEAD), y.reshape(-1), **opts)
    ref.backward()
    dx = distribute_tensor(logits.clone(), mesh, [Shard(2)]).requires_grad_()
    loss = ce_tvm.cross_entropy(dx, y, **opts)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    loss.backward()
    assert dx.grad.placements == (Shard(2),)
    torch.testing.assert_close(dx.grad.full_tensor(), ref_x.grad, rtol=1e-5, atol=1e-7)
    checked = 1
    # rows [2, 2 * world] of hidden states: flat (2-D) or as [B, T, H]
    x = torch.randn(2, 2 * world, H_HEAD, generator=gen)
    W = torch.randn(V_HEAD, H_HEAD, generator=gen) * 0.5
    t = torch.randint(0, V_HEAD, (2, 2 * world), generator=gen)
    for input_placement, three_d in ((Replicate(), False), (Shard(0), False), (Shard(1), True)):
        shape = x.shape if three_d else (-1, H_HEAD)
        full = [x.reshape(shape).clone().requires_grad_(), W.clone().requires_grad_()]
        tt = t.reshape(shape[:-1])
        ref = ce_tvm.linear_cross_entropy(*full, tt, reduction="none", **opts)
        ref_logp = ce_tvm.linear_log_probs(*full, tt, temperature=0.8)
        (ref.sum() + ref_logp.sum()).backward()
        dW = distribute_tensor(W.clone(), mesh, [Shard(0)]).requires_grad_()
        dh = distribute_tensor(x.reshape(shape).clone(), mesh, [input_placement])
        dh.requires_grad_()
        loss = ce_tvm.linear_cross_entropy(dh, dW, tt, reduction="none", **opts)
        logp = ce_tvm.linear_log_probs(dh, dW, tt, temperature=0.8)
        if input_placement.is_shard():  # per-row outputs: this rank's block of rows
            d = input_placement.dim
            ref, ref_logp = (r.detach().chunk(world, d)[rank] for r in (ref, ref_logp))
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logp, ref_logp.detach(), rtol=1e-5, atol=1e-5)
        (loss.sum() + logp.sum()).backward()
        assert dW.grad.placements == (Shard(0),)
        torch.testing.assert_close(dW.grad.full_tensor(), full[1].grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dh.grad.full_tensor(), full[0].grad, rtol=1e-4, atol=1e-5)
        checked += 1
    flat = x.reshape(-1, H_HEAD)
    # torch.compile: the DTensor path runs eagerly inside the compiled function
    dW = distribute_tensor(W.clone(), mesh, [Shard(0)])
    dh = distribute_tensor(flat.clone(), mesh, [Replicate()])
    compiled = torch.compile(lambda h, w: ce_tvm.linear_cross_entropy(h, w, t.reshape(-1),
                                                                      **opts))
    torch.testing.assert_close(compiled(dh, dW), ce_tvm.linear_cross_entropy(
        flat, W, t.reshape(-1), **opts), rtol=1e-5, atol=1e-5)
    checked += 1
    other_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    sharded_W = distribute_tensor(W.clone(), mesh, [Shard(0)])
    for bad, call in [
        ("Shard\\(-1\\)", lambda: ce_tvm.cross_entropy(
            distribute_tensor(logits.clone(), mesh, [Shard(0)]), y)),
        ("Shard\\(0\\)", lambda: ce_tvm.linear_cross_entropy(
            distribute_tensor(flat, mesh, [Replicate()]),
            distribute_tensor(W.clone(), mesh, [Replicate()]), t.reshape(-1))),
        ("Shard\\(0\\)", lambda: ce_tvm.linear_cross_entropy(
            distribute_tensor(flat, mesh, [Replicate()]),
            distribute_tensor(W.clone(), mesh, [Shard(1)]), t.reshape(-1))),
        ("two readings.*model.lm_head.*Replicate", lambda: ce_tvm.linear_cross_entropy(
            flat, sharded_W, t.reshape(-1))),
        ("two readings", lambda: ce_tvm.linear_log_probs(flat, sharded_W, t.reshape(-1))),
        ("same 1-D", lambda: ce_tvm.linear_cross_entropy(
            distribute_tensor(flat, other_mesh, [Replicate()]), sharded_W, t.reshape(-1))),
        ("row/sequence", lambda: ce_tvm.linear_cross_entropy(
            distribute_tensor(flat, mesh, [Shard(1)]), sharded_W, t.reshape(-1))),
        ("linear_weight is not", lambda: ce_tvm.linear_cross_entropy(
            distribute_tensor(flat, mesh, [Replicate()]), W, t.reshape(-1))),
        ("local logits", lambda: ce_tvm.log_probs(
            distribute_tensor(logits.clone(), mesh, [Shard(0)]), y.clamp(min=0))),
        ("two readings", lambda: ce_tvm.linear_distillation_loss(flat, sharded_W, flat, W)),
    ]:
        try:
            call()
            raise AssertionError(f"no error for {bad}")
        except ValueError as err:
            assert re.search(bad, str(err)), str(err)
            checked += 1
    return checked


def check_relayout(rank, world):
    """Layouts that agree on one rank only, one after another in one process: the
    check_cases widths, then every rank as wide as rank 0 (rank 0's width
    unchanged, the others' new), then the first again; each loss and gradient
    against PyTorch on the full logits. Returns the count."""
    checked = 0
    first = shard_widths(C, world)
    for widths in (first, [first[0]] * world, first):
        lo = sum(widths[:rank])
        gen = torch.Generator().manual_seed(checked + 3)
        full = torch.randn(5, sum(widths), generator=gen) * 3
        y = torch.randint(0, sum(widths), (5,), generator=gen)
        ref_x = full.clone().requires_grad_()
        F.cross_entropy(ref_x, y).backward()
        shard = full[:, lo:lo + widths[rank]].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, y)
        torch.testing.assert_close(loss, F.cross_entropy(full, y), rtol=1e-5, atol=1e-6)
        loss.backward()
        torch.testing.assert_close(shard.grad, ref_x.grad[:, lo:lo + widths[rank]],
                                   rtol=1e-5, atol=1e-7)
        checked += 1
    return checked


def check_logit_scale(rank, world):
    """``logit_scale`` on the vocabulary-parallel loss, head and log-probs: the
    single-process calls (tested against float64 in test_logit_scale.py) on the
    full logits / head. Returns the count."""
    widths, lo, hi = shard_bounds(rank, world, V_HEAD)
    gen = torch.Generator().manual_seed(26)
    x = torch.randn(6, H_HEAD, generator=gen)
    W = torch.randn(V_HEAD, H_HEAD, generator=gen) * 0.5
    y = torch.randint(0, V_HEAD, (6,), generator=gen)
    opts = dict(logit_scale=1.7, softcap=5.0, temperature=0.7)
    logits = x @ W.T
    torch.testing.assert_close(
        vocab_parallel_cross_entropy(logits[:, lo:hi].contiguous(), y, label_smoothing=0.1,
                                     **opts),
        ce_tvm.cross_entropy(logits, y, label_smoothing=0.1, **opts), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        vocab_parallel_linear_cross_entropy(x, W[lo:hi], y, **opts),
        ce_tvm.linear_cross_entropy(x, W, y, **opts), rtol=1e-5, atol=1e-5)
    logp, entropy = vocab_parallel_linear_log_probs(x, W[lo:hi], y, return_entropy=True, **opts)
    ref_logp, ref_entropy = ce_tvm.linear_log_probs(x, W, y, return_entropy=True, **opts)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    return 3


CHECKS = {"logit_scale": check_logit_scale, "cases": check_cases,
          "odd_strides": check_odd_strides, "relayout": check_relayout,
          "linear_head": check_linear_head, "linear_log_probs": check_linear_log_probs,
          "bytes": check_bytes_independent_of_vocabulary, "dtensor": check_dtensor}


def main(checks: dict = CHECKS):
    """Run the ``checks`` the first argument names (comma-separated), in order, on
    this rank; each reports ``rank r/w: N mode ok`` once every rank has passed it."""
    modes = (sys.argv[1] if len(sys.argv) > 1 else "cases").split(",")
    # a collective one rank misses fails (after 5 minutes) instead of hanging
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    for mode in modes:
        checked = checks[mode](rank, world)
        dist.barrier()
        print(f"rank {rank}/{world}: {checked} {mode} ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
