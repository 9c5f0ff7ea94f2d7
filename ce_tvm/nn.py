"""Drop-in replacements for ``torch.nn.functional.cross_entropy`` and
``torch.nn.CrossEntropyLoss`` (class-index targets), plus z-loss."""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from . import validation as check
from .ops import cross_entropy_forward, cross_entropy_train, schema_scalars, with_extras
from .options import LossOptions

# Training with sum/mean computes the gradient in the forward sweep
# (``ops.cross_entropy_train``); ``CE_TVM_TRAINING=recompute`` (or setting
# this to False) keeps the logits for a backward that recomputes it instead.
ONE_PASS_TRAINING = os.environ.get("CE_TVM_TRAINING", "one_pass") != "recompute"
# Devices whose schedules have the one-pass kernel (CUDA recomputes for now).
TRAINING_KERNEL_DEVICES = ("cpu",)


def _flatten(input: Tensor, target: Tensor):
    """``(x [M, C], y [M], unflatten)`` for PyTorch's class-index layouts:
    ``(C,)`` with a 0-d target, ``(N, C)``, ``(N, C, d1, ...)``."""
    if not isinstance(input, Tensor) or not isinstance(target, Tensor):
        raise TypeError("input and target must be torch.Tensors")
    if target.dtype.is_floating_point:
        raise TypeError("ce_tvm supports class-index targets (int64/int32), not probabilities")
    if input.dim() == 1:
        if target.dim() != 0:
            raise ValueError(f"a 1-D input [C] needs a 0-d target, got shape {tuple(target.shape)}")
        return input.unsqueeze(0), target.reshape(1), lambda t: t.reshape(())
    if input.dim() == 2:
        return input, target, lambda t: t
    if input.dim() < 1:
        raise ValueError("input must have a class dimension, got a 0-d tensor")
    n, c, spatial = input.shape[0], input.shape[1], tuple(input.shape[2:])
    if tuple(target.shape) != (n, *spatial):
        raise ValueError(f"target must have shape {(n, *spatial)} for input {tuple(input.shape)}, "
                         f"got {tuple(target.shape)}")
    x = input.movedim(1, -1).reshape(-1, c)
    return x, target.reshape(-1), lambda t: t.reshape(n, *spatial)


def cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None,
                  ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                  return_zloss: bool = False, *, softcap: float = 0.0,
                  return_token_accuracy: bool = False):
    """``torch.nn.functional.cross_entropy`` for class-index targets, plus z-loss,
    logit softcapping and token accuracy (SPEC section 5).

    Returns the loss (a 0-d tensor for ``mean``/``sum``, the target's shape for
    ``none``), z-loss included when ``lse_square_scale > 0``. ``softcap`` ``t >
    0``: the loss of the logits ``t * tanh(x / t)`` (Gemma's final logit
    softcapping), computed inside the kernels. With ``return_zloss=True``
    returns ``(loss, zloss)``: ``zloss`` is the z-loss part already inside
    ``loss``, reduced the same way, without gradient. With
    ``return_token_accuracy=True`` the result is a tuple whose last element
    is the fraction of rows not ignored whose first maximal logit is the
    target (a 0-d float32 tensor without gradient, NaN when every row is
    ignored), computed in the same sweep as the loss.
    """
    x, y, unflatten = _flatten(input, target)
    x = check.logits(x)
    check.check_device(x)
    if y.dtype not in check.TARGET_DTYPES:
        raise TypeError(f"target must be int64 or int32 class indices, got {y.dtype}")
    if tuple(y.shape) != (x.shape[0],):
        raise ValueError(f"target must have shape [N] = [{x.shape[0]}], got {tuple(y.shape)}")
    options = LossOptions(reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, zloss_scale=lse_square_scale,
                          softcap=softcap)
    # The gradient in the same sweep as the loss, when autograd will need it
    # and it does not depend on a per-row upstream gradient.
    one_pass = (ONE_PASS_TRAINING and options.reduction != "none" and torch.is_grad_enabled()
                and x.requires_grad and x.device.type in TRAINING_KERNEL_DEVICES)
    op = cross_entropy_train if one_pass else cross_entropy_forward
    loss, zloss, _, accuracy = op(x, y, weight, **schema_scalars(options),
                                  token_accuracy=bool(return_token_accuracy))[:4]
    if options.reduction == "none":
        loss, zloss = unflatten(loss), unflatten(zloss)
    else:
        loss, zloss = loss.reshape(()), zloss.reshape(())
    return with_extras(loss, zloss if return_zloss else None,
                       accuracy if return_token_accuracy else None)


class CrossEntropyLoss(nn.Module):
    """``torch.nn.CrossEntropyLoss`` (class-index targets) backed by ce_tvm, plus z-loss."""

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0,
                 lse_square_scale: float = 0.0, return_zloss: bool = False, *,
                 softcap: float = 0.0, return_token_accuracy: bool = False):
        super().__init__()
        self.register_buffer("weight", weight)
        options = LossOptions(reduction=reduction, ignore_index=ignore_index,
                              label_smoothing=label_smoothing, zloss_scale=lse_square_scale,
                              softcap=softcap)
        self.ignore_index, self.reduction = options.ignore_index, options.reduction
        self.label_smoothing, self.lse_square_scale = options.label_smoothing, options.zloss_scale
        self.softcap = options.softcap
        self.return_zloss = return_zloss
        self.return_token_accuracy = return_token_accuracy

    def forward(self, input: Tensor, target: Tensor):
        return cross_entropy(input, target, self.weight, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing,
                             lse_square_scale=self.lse_square_scale,
                             return_zloss=self.return_zloss, softcap=self.softcap,
                             return_token_accuracy=self.return_token_accuracy)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, "
                f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}")
