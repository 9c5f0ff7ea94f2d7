"""One rank of the vocab-parallel test (launched like torchrun: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Every rank checks its loss and gradient shard
against single-process ce_tvm.cross_entropy on the full logits."""

import itertools
import sys

import torch
import torch.distributed as dist

import ce_tvm
from ce_tvm.distributed import VocabParallelCrossEntropyLoss, vocab_parallel_cross_entropy


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n, c = 24, 53  # 53 classes: shards of unequal width for 2 and 3 ranks
    widths = [c // world + (r < c % world) for r in range(world)]
    lo = sum(widths[:rank])
    hi = lo + widths[rank]
    checked = 0
    for reduction, weighted, eps, zloss in itertools.product(
            ("none", "sum", "mean"), (False, True), (0.0, 0.1), (0.0, 1e-2)):
        gen = torch.Generator().manual_seed(7)
        full = torch.randn(n, c, generator=gen) * 3
        y = torch.randint(0, c, (n,), generator=gen)
        y[::5] = -100  # ignored rows
        y[1] = sum(widths[:-1])  # the first column of the last shard
        y[2] = widths[0] - 1  # the last column of the first shard
        w = torch.rand(c, generator=gen) + 0.5 if weighted else None
        opts = dict(ignore_index=-100, reduction=reduction, label_smoothing=eps,
                    lse_square_scale=zloss)
        ref_x = full.clone().requires_grad_()
        ref = ce_tvm.cross_entropy(ref_x, y, w, **opts)
        shard = full[:, lo:hi].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, y, None if w is None else w[lo:hi], **opts)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
        g = torch.rand(ref.shape, generator=gen) + 0.5
        ref.backward(g)
        loss.backward(g)
        torch.testing.assert_close(shard.grad, ref_x.grad[:, lo:hi], rtol=1e-6, atol=1e-7)
        checked += 1
    # The module form, weighted, against torch on the full logits (z-loss added by hand).
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(6, c, generator=gen) * 2
    y = torch.randint(0, c, (6,), generator=gen)
    w = torch.rand(c, generator=gen) + 0.5
    module = VocabParallelCrossEntropyLoss(w[lo:hi], reduction="sum", label_smoothing=0.1,
                                           lse_square_scale=1e-2)
    ref = (torch.nn.functional.cross_entropy(full, y, w, reduction="sum", label_smoothing=0.1)
           + 1e-2 * (torch.logsumexp(full, 1) ** 2).sum())
    torch.testing.assert_close(module(full[:, lo:hi].clone(), y), ref, rtol=1e-6, atol=1e-5)
    dist.barrier()
    print(f"rank {rank}/{world}: {checked} cases ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
