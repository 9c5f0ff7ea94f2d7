"""Vocab-parallel cross entropy: the loss of logits sharded along the vocabulary
over ``torch.distributed`` (tensor parallelism, as in Megatron-LM).

Rank ``r`` holds ``logits[:, offset_r : offset_r + C_r]`` (shards may differ
in width; ranks hold consecutive column ranges in rank order) and the same
``target`` (global class ids). Semantics are exactly SPEC.md on the full
logits: smoothing uses the global C and the global sum of weights, the
z-loss the global ``lse``.

Communication per step: two ``all_reduce`` calls in the forward (the row
max, then one packed sum of the rescaled exp-sums, target logits, target
weights, weighted logit sums and the weight sum) and none in the backward.
With ``sum``/``mean`` under autograd the shard's gradient is computed in the
forward, right after the all_reduces, and the backward only scales it (the
shard's logits are not kept); ``none`` keeps the logits and the global row
statistics for a backward that computes it. The shard layout (one
``all_gather`` of the widths) is exchanged once per (group, width) and cached.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import validation as check
from .ops import scale_unit_gradient
from .runtime import launch
from .runtime.options import LossOptions, store_on_module

_LAYOUTS: dict = {}


def shard_layout(local_classes: int, group=None) -> tuple[int, int]:
    """``(offset of this rank's first column, global C)``, cached per group and width."""
    key = (group, local_classes)
    if key not in _LAYOUTS:
        world = dist.get_world_size(group)
        widths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(widths, torch.tensor([local_classes]), group=group)
        widths = [int(w) for w in widths]
        rank = dist.get_rank(group)
        _LAYOUTS[key] = (sum(widths[:rank]), sum(widths))
    return _LAYOUTS[key]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, w, options: LossOptions, group):
        offset, classes = shard_layout(x.shape[1], group)
        y = check.targets(y, x, options.ignore_index, classes)
        w = check.weight(w, x)
        rowmax, expsum, wxsum, logit, weight = launch.shard_stats(x, y, w, offset, options)
        gmax = rowmax.clone()
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        wsum = w.sum().reshape(1) if w is not None else rowmax.new_zeros(1)
        packed = torch.cat([expsum * torch.exp(rowmax - gmax), logit, weight, wxsum, wsum])
        dist.all_reduce(packed, group=group)
        sumexp, logit, weight, wxsum = packed[:-1].view(4, -1)
        lse = gmax + torch.log(sumexp)
        weight_sum = float(packed[-1]) if w is not None else float(classes)
        loss, zloss = launch.shard_combine(lse, logit, weight, wxsum, y, weight_sum=weight_sum,
                                           classes=classes, dtype=x.dtype, options=options)
        layout = dict(offset=offset, weight_sum=weight_sum, global_classes=classes)
        ctx.mark_non_differentiable(zloss)
        if ctx.needs_input_grad[0] and options.reduction != "none":
            # The shard's gradient for a unit upstream gradient, right after the
            # all_reduces: the backward only scales it, and the logits need not be kept.
            ctx.x_grad = launch.shard_backward(lse.new_ones(1), x, lse, y, w, weight, **layout,
                                               options=options)
        else:
            ctx.save_for_backward(x, lse, y, w, weight)
            ctx.layout, ctx.options = layout, options
        return loss, zloss

    @staticmethod
    def backward(ctx, grad_loss, grad_zloss):
        if hasattr(ctx, "x_grad"):
            grad = scale_unit_gradient(ctx.x_grad, grad_loss.reshape(-1))
        else:
            x, lse, y, w, weight = ctx.saved_tensors
            g = grad_loss.to(lse.dtype).reshape(-1).contiguous()
            grad = launch.shard_backward(g, x, lse, y, w, weight, **ctx.layout,
                                         options=ctx.options)
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: Tensor, target: Tensor, weight: Tensor | None = None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                                 group=None, return_zloss: bool = False, *,
                                 softcap: float = 0.0, temperature: float = 1.0):
    """Cross entropy of vocabulary-sharded logits ``[N, C_r]`` (see the module doc).

    ``weight`` is this rank's shard ``[C_r]`` of the class weights;
    ``softcap`` and ``temperature`` act as in ``ce_tvm.cross_entropy``. Returns
    what ``ce_tvm.cross_entropy`` returns on the full logits (a 0-d loss for
    ``mean``/``sum``), the same on every rank; with ``return_zloss`` also the
    z-loss part, without gradient.
    """
    x = check.logits(logits_shard, "logits_shard")
    check.check_device(x)
    if not isinstance(target, Tensor) or target.dtype not in check.TARGET_DTYPES:
        raise TypeError("target must be an int64 or int32 tensor of global class ids")
    options = LossOptions(reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, zloss_scale=lse_square_scale,
                          softcap=softcap, temperature=temperature)
    loss, zloss = _VocabParallelCrossEntropy.apply(x, target, weight, options, group)
    if options.reduction != "none":
        loss, zloss = loss.reshape(()), zloss.reshape(())
    return (loss, zloss) if return_zloss else loss


class VocabParallelCrossEntropyLoss(nn.Module):
    """``vocab_parallel_cross_entropy`` as a module (``weight``: this rank's shard)."""

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0,
                 lse_square_scale: float = 0.0, group=None, *, softcap: float = 0.0,
                 temperature: float = 1.0):
        super().__init__()
        self.register_buffer("weight", weight)
        options = LossOptions(reduction=reduction, ignore_index=ignore_index,
                              label_smoothing=label_smoothing, zloss_scale=lse_square_scale,
                              softcap=softcap, temperature=temperature)
        store_on_module(self, options)
        self.group = group

    def forward(self, logits_shard: Tensor, target: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(
            logits_shard, target, self.weight, ignore_index=self.ignore_index,
            reduction=self.reduction, label_smoothing=self.label_smoothing,
            lse_square_scale=self.lse_square_scale, group=self.group, softcap=self.softcap,
            temperature=self.temperature)
