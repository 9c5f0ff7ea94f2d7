"""Drop-in replacements for ``torch.nn.functional.cross_entropy`` and
``torch.nn.CrossEntropyLoss`` (class-index and probability targets, PyTorch's
signature and positional order), plus z-loss, logit softcapping and token
accuracy as keyword-only additions."""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn
from torch.nn import _reduction

from . import validation as check
from .ops import (
    cross_entropy_forward,
    cross_entropy_probs,
    cross_entropy_train,
    schema_scalars,
    with_extras,
)
from .runtime.options import LossOptions, store_on_module

# Training with sum/mean computes the gradient in the forward sweep
# (``ops.cross_entropy_train``); ``CE_TVM_TRAINING=recompute`` (or setting
# this to False) keeps the logits for a backward that recomputes it instead.
ONE_PASS_TRAINING = os.environ.get("CE_TVM_TRAINING", "one_pass") != "recompute"
# Devices whose schedules have the one-pass kernel (CUDA recomputes for now).
TRAINING_KERNEL_DEVICES = ("cpu",)


def _flatten(input: Tensor, target: Tensor):
    """``(x [M, C], y, unflatten)`` for PyTorch's layouts: ``(C,)``, ``(N, C)``,
    ``(N, C, d1, ...)``, with the class dimension moved last. ``y`` is ``[M]``
    for class indices (a 0-d target for a ``(C,)`` input, ``(N, d1, ...)``
    otherwise), ``[M, C]`` for probability targets (the input's shape)."""
    if not isinstance(input, Tensor) or not isinstance(target, Tensor):
        raise TypeError("input and target must be torch.Tensors")
    if input.dim() < 1:
        raise ValueError("input must have a class dimension, got a 0-d tensor")
    probs = target.dtype.is_floating_point
    batch, spatial = ((), ()) if input.dim() == 1 else (input.shape[:1], tuple(input.shape[2:]))
    expected = tuple(input.shape) if probs else (*batch, *spatial)
    if tuple(target.shape) != expected:
        kind = "probability" if probs else "class-index"
        hint = ""
        if not probs and tuple(target.shape) == tuple(input.shape[:-1]):  # [B, T, V] logits
            hint = (" (the class dimension is dimension 1, PyTorch's rule: for class-last "
                    "logits pass input.transpose(1, -1) or input.reshape(-1, V) with "
                    "target.reshape(-1))")
        raise ValueError(f"{kind} target must have shape {expected} for input "
                         f"{tuple(input.shape)}, got {tuple(target.shape)}{hint}")

    def class_last(t):  # [M, C] (a view for the (C,) and (N, C) layouts)
        return t.unsqueeze(0) if t.dim() == 1 else t.movedim(1, -1).flatten(0, -2)

    y = class_last(target) if probs else target.reshape(-1)
    return class_last(input), y, lambda t: t.reshape((*batch, *spatial))


def _reduction_of(size_average, reduce, reduction: str) -> str:
    """``reduction``, or PyTorch's reading of the deprecated ``size_average`` and
    ``reduce`` when either is given (with PyTorch's deprecation warning)."""
    if size_average is not None or reduce is not None:
        return _reduction.legacy_get_string(size_average, reduce)
    return reduction


def cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None,
                  size_average: bool | None = None, ignore_index: int = -100,
                  reduce: bool | None = None, reduction: str = "mean",
                  label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0,
                  return_zloss: bool = False, softcap: float = 0.0,
                  return_token_accuracy: bool = False, temperature: float = 1.0,
                  logit_scale: float = 1.0):
    """``torch.nn.functional.cross_entropy``, plus z-loss, logit softcapping,
    a temperature and token accuracy (docs/spec.md, sections 4 to 7).

    ``target``: class indices (int64/int32, ``ignore_index`` skipped) or
    probabilities of the input's shape (no ``ignore_index``; a float target
    of another dtype is promoted with the input as PyTorch does; both get
    their gradient). Returns the loss (a 0-d tensor for ``mean``/``sum``, the
    target's batch shape for ``none``), z-loss ``lse_square_scale * lse^2``
    included when the scale is > 0. ``softcap`` ``t > 0``: the loss of the
    logits ``t * tanh(x / t)`` (Gemma's final logit softcapping), computed
    inside the kernels. ``temperature`` ``T > 0``: every part of the loss is
    computed on ``cap(x) / T`` (with probability targets: a fused
    distillation loss). ``logit_scale`` ``s > 0`` (a model family's logit
    multiplier: Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``):
    on ``cap(s x) / T``, with no kernel of its own. With ``return_zloss=True``
    returns ``(loss, zloss)``:
    ``zloss`` is the z-loss part already inside ``loss``, reduced the same
    way, without gradient. With ``return_token_accuracy=True`` (class-index
    targets) the result is a tuple whose last element is the fraction of rows
    not ignored whose first maximal logit is the target (a 0-d float32 tensor
    without gradient, NaN when every row is ignored), computed in the same
    sweep as the loss.
    """
    if check.is_dtensor(input):  # logits sharded on the class dimension
        from . import sharding

        return sharding.cross_entropy(
            input, target, weight, ignore_index=ignore_index,
            reduction=_reduction_of(size_average, reduce, reduction),
            label_smoothing=label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap,
            temperature=temperature, return_zloss=return_zloss,
            return_token_accuracy=return_token_accuracy, logit_scale=logit_scale)
    x, y, unflatten = _flatten(input, target)
    options = LossOptions(reduction=_reduction_of(size_average, reduce, reduction),
                          ignore_index=ignore_index, label_smoothing=label_smoothing,
                          zloss_scale=lse_square_scale, softcap=softcap,
                          temperature=temperature, logit_scale=logit_scale)
    if y.dtype.is_floating_point:
        if return_token_accuracy:
            raise ValueError("return_token_accuracy needs class-index targets, "
                             "not probabilities")
        loss, zloss = _probability_loss(x, y, weight, options)
        accuracy = None
    else:
        loss, zloss, accuracy = _class_index_loss(x, y, weight, options,
                                                  bool(return_token_accuracy))
    if options.reduction == "none":
        loss, zloss = unflatten(loss), unflatten(zloss)
    else:
        loss, zloss = loss.reshape(()), zloss.reshape(())
    return with_extras(loss, zloss if return_zloss else None,
                       accuracy if return_token_accuracy else None)


def _class_index_loss(x: Tensor, y: Tensor, weight, options: LossOptions, accuracy: bool):
    """``(loss, zloss, accuracy)`` as the kernels return them, for class-index targets."""
    x = check.logits(x)
    check.check_device(x)
    if y.dtype not in check.TARGET_DTYPES:
        raise TypeError(f"target must be int64 or int32 class indices, got {y.dtype}")
    # The gradient in the same sweep as the loss, when autograd will need it
    # and it does not depend on a per-row upstream gradient.
    one_pass = (ONE_PASS_TRAINING and options.reduction != "none" and torch.is_grad_enabled()
                and x.requires_grad and x.device.type in TRAINING_KERNEL_DEVICES)
    op = cross_entropy_train if one_pass else cross_entropy_forward
    loss, zloss, _, hits = op(x, y, weight, **schema_scalars(options), token_accuracy=accuracy)[:4]
    return loss, zloss, hits


def _probability_loss(x: Tensor, q: Tensor, weight, options: LossOptions):
    """``(loss, zloss)`` as the kernels return them, for probability targets."""
    if options.ignore_index >= 0:  # a negative one can match no probability: PyTorch's rule
        raise ValueError("ignore_index is not supported for probability targets "
                         f"(got {options.ignore_index}); PyTorch refuses it too")
    x = check.logits(x)
    check.check_device(x)
    dtype = torch.promote_types(x.dtype, q.dtype)  # PyTorch's result dtype
    return cross_entropy_probs(x.to(dtype), q.to(dtype), weight, reduction=options.reduction,
                               label_smoothing=options.label_smoothing,
                               lse_square_scale=options.zloss_scale,
                               softcap=options.kernel_softcap,
                               temperature=options.kernel_temperature)[:2]


class CrossEntropyLoss(nn.Module):
    """``torch.nn.CrossEntropyLoss`` (its constructor's signature and positional
    order) backed by ce_tvm, plus z-loss, softcap, temperature and token accuracy
    (keyword-only)."""

    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None,
                 ignore_index: int = -100, reduce: bool | None = None, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0,
                 return_zloss: bool = False, softcap: float = 0.0,
                 return_token_accuracy: bool = False, temperature: float = 1.0,
                 logit_scale: float = 1.0):
        super().__init__()
        self.register_buffer("weight", weight)
        options = LossOptions(reduction=_reduction_of(size_average, reduce, reduction),
                              ignore_index=ignore_index, label_smoothing=label_smoothing,
                              zloss_scale=lse_square_scale, softcap=softcap,
                              temperature=temperature, logit_scale=logit_scale)
        store_on_module(self, options)
        self.return_zloss = return_zloss
        self.return_token_accuracy = return_token_accuracy

    def forward(self, input: Tensor, target: Tensor):
        return cross_entropy(input, target, self.weight, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing,
                             lse_square_scale=self.lse_square_scale,
                             return_zloss=self.return_zloss, softcap=self.softcap,
                             return_token_accuracy=self.return_token_accuracy,
                             temperature=self.temperature, logit_scale=self.logit_scale)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, "
                f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}, "
                f"temperature={self.temperature}, logit_scale={self.logit_scale}")
