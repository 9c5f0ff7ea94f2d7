"""What the ranks of a vocabulary-parallel group exchange (``torch.distributed``;
no autograd): the shard layout, the statistics of full rows from each shard's
logits, token accuracy across shards, and the row blocks of sequence
parallelism. Per call only O(rows) floats cross ranks, or the input's
``[N, H]`` gradient (``summed_input_grad``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import launch
from .options import LossOptions


def shard_layout(local_classes: int, group=None) -> tuple[int, int]:
    """``(offset of this rank's first column, global C)``: one all_gather of the
    widths, on every call. (A cache per rank and width skipped it on a rank
    whose width it had seen while another rank's width was new to it: the
    ranks' collectives then paired up wrongly and the group hung.)"""
    world = dist.get_world_size(group)
    widths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(widths, torch.tensor([local_classes]), group=group)
    widths = [int(w) for w in widths]
    rank = dist.get_rank(group)
    return sum(widths[:rank]), sum(widths)


def global_stats(x, y, w, offset: int, options: LossOptions, group, extra: Tensor):
    """``(lse, target_logit, target_weight, wxsum, extra)`` of the full rows from
    one shard's logits ``x`` (two all_reduces: the row max, then one packed sum,
    which also sums ``extra``, a ``[k]`` accumulation-dtype tensor)."""
    rowmax, expsum, wxsum, logit, weight = launch.shard_stats(x, y, w, offset, options)
    gmax = rowmax.clone()
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
    packed = torch.cat([expsum * torch.exp(rowmax - gmax), logit, weight, wxsum, extra])
    dist.all_reduce(packed, group=group)
    n = rowmax.shape[0]
    sumexp, logit, weight, wxsum = packed[:4 * n].view(4, n)
    return gmax + torch.log(sumexp), logit, weight, wxsum, packed[4 * n:]


def target_raw_logit(x: Tensor, y: Tensor, offset: int) -> Tensor:
    """Each row's raw target logit where the target is in this shard, else 0 (the
    shards' values summed are the global ones)."""
    local = y - offset
    inside = (local >= 0) & (local < x.shape[1])
    picked = x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
    return torch.where(inside, picked.to(torch.float32), 0.0)


def shard_beats(x: Tensor, y: Tensor, offset: int, target: Tensor, group) -> Tensor:
    """Per row, the columns of all shards ahead of the target in argmax order (a
    larger raw logit, or an equal one at a smaller index): 0 iff the target is
    the first maximum (token accuracy; one all_reduce of ``[N]``). The shards'
    raw logits are compared: the cap and the temperature keep the order (ties a
    cap saturates are broken by the raw values)."""
    xs = x.to(torch.float32)
    columns = torch.arange(offset, offset + x.shape[1], device=x.device)
    ahead = (xs > target[:, None]) | ((xs == target[:, None]) & (columns < y[:, None]))
    beats = ahead.sum(1, dtype=torch.float32)
    dist.all_reduce(beats, group=group)
    return beats


def accuracy_of(beats: Tensor, y: Tensor, ignore_index: int) -> Tensor:
    """The fraction of counted rows whose target is the first maximum (NaN: none count)."""
    kept = y != ignore_index
    return ((beats == 0) & kept).sum(dtype=torch.float32) / kept.sum(dtype=torch.float32)


def gathered_rows(x: Tensor, group) -> Tensor:
    """The ranks' equal blocks of rows, in rank order (sequence parallelism)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def own_rows(t: Tensor, group) -> Tensor:
    """This rank's block of the rows of ``t`` (sequence parallelism)."""
    n = t.shape[0] // dist.get_world_size(group)
    rank = dist.get_rank(group)
    return t[rank * n:(rank + 1) * n]


def summed_input_grad(grad: Tensor, group, sequence_parallel: bool) -> Tensor:
    """The input's gradient: the shards' parts summed, this rank's block under SP."""
    dist.all_reduce(grad, group=group)
    return own_rows(grad, group).clone() if sequence_parallel else grad
