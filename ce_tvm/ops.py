"""The kernels as ``torch.library`` custom ops, with fake (meta) kernels and autograd.

``ce_tvm::cross_entropy_forward`` computes the loss without writing
``log_prob``: it returns ``loss``, ``zloss`` and the per-row ``lse`` (float32,
float64 for float64 inputs). Autograd saves the logits and ``lse`` (``N``
floats), never an ``[N, C]`` intermediate; ``ce_tvm::cross_entropy_backward``
recomputes the probabilities from them in one pass. Both ops are opaque to
``torch.compile`` (no graph break) and do no host synchronisation beyond the
target range check, which needs the target values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import launch
from . import validation as check
from .options import LossOptions
from .tensors import accum_torch_dtype


def schema_scalars(options: LossOptions) -> dict:
    """``options`` by the names of the ops' schema (whose scalars stay primitive)."""
    return dict(reduction=options.reduction, ignore_index=options.ignore_index,
                label_smoothing=options.label_smoothing, lse_square_scale=options.zloss_scale)


def _options(reduction, ignore_index, label_smoothing, lse_square_scale) -> LossOptions:
    return LossOptions(reduction=reduction, ignore_index=ignore_index,
                       label_smoothing=label_smoothing, zloss_scale=lse_square_scale)


def _rows(x: Tensor, reduction: str) -> int:
    return x.shape[0] if reduction == "none" else 1


@torch.library.custom_op("ce_tvm::cross_entropy_forward", mutates_args=())
def cross_entropy_forward(x: Tensor, target: Tensor, weight: Tensor | None, reduction: str,
                          ignore_index: int, label_smoothing: float,
                          lse_square_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, zloss, lse)``; ``loss``/``zloss`` are ``[N]`` for ``none``, else ``[1]``."""
    options = _options(reduction, ignore_index, label_smoothing, lse_square_scale)
    y = check.targets(target, x, options.ignore_index)
    out = launch.forward(x.contiguous(), y, check.weight(weight, x), options, log_prob=False)
    return out.loss, out.zloss, out.lse


@cross_entropy_forward.register_fake
def _(x, target, weight, reduction, ignore_index, label_smoothing, lse_square_scale):
    rows = _rows(x, reduction)
    return (x.new_empty(rows), x.new_empty(rows),
            x.new_empty(x.shape[0], dtype=accum_torch_dtype(x)))


@torch.library.custom_op("ce_tvm::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(grad_loss: Tensor, x: Tensor, lse: Tensor, target: Tensor,
                           weight: Tensor | None, reduction: str, ignore_index: int,
                           label_smoothing: float, lse_square_scale: float) -> Tensor:
    """The logits gradient, recomputed from the logits and their ``lse``."""
    options = _options(reduction, ignore_index, label_smoothing, lse_square_scale)
    g = grad_loss.to(accum_torch_dtype(x)).reshape(-1).contiguous()
    return launch.backward(g, torch.zeros_like(g), x.contiguous(), lse.contiguous(),
                           target.to(torch.int64).contiguous(), check.weight(weight, x),
                           options, source_kind="logits")


@cross_entropy_backward.register_fake
def _(grad_loss, x, lse, target, weight, reduction, ignore_index, label_smoothing,
      lse_square_scale):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, target, weight, reduction, ignore_index, label_smoothing, lse_square_scale = inputs
    ctx.save_for_backward(x, output[2], target, weight)
    ctx.scalars = dict(reduction=reduction, ignore_index=ignore_index,  # checked by the forward
                       label_smoothing=label_smoothing, lse_square_scale=lse_square_scale)


def _backward(ctx, grad_loss, grad_zloss, grad_lse):
    # zloss and lse are reported for logging; gradient flows through loss only.
    x, lse, target, weight = ctx.saved_tensors
    if grad_loss is None:
        return None, None, None, None, None, None, None
    grad = cross_entropy_backward(grad_loss, x, lse, target, weight, **ctx.scalars)
    return grad, None, None, None, None, None, None


cross_entropy_forward.register_autograd(_backward, setup_context=_setup_context)
