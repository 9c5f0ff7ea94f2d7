"""Cross-entropy on logits: the drop-ins for ``torch.nn.functional.cross_entropy`` and
``torch.nn.CrossEntropyLoss`` (class-index and probability targets, PyTorch's signature
and positional order, plus z-loss, logit softcapping, a temperature and token accuracy as
keyword-only additions), and their ``torch.library`` ops (docs/spec.md, sections 4 to 7).

``ce_tvm::cross_entropy_forward`` computes the loss without writing ``log_prob``: it
returns ``loss``, ``zloss`` and the per-row ``lse`` (float32, float64 for float64
inputs). Autograd saves the logits and ``lse`` (``N`` floats), never an ``[N, C]``
intermediate; ``ce_tvm::cross_entropy_backward`` recomputes the probabilities from them
in one pass.

``ce_tvm::cross_entropy_train`` (``sum``/``mean``, when autograd will need the gradient)
also returns the logits gradient for a unit upstream gradient, computed in the same
sweep over the logits (read once, gradient written once, one ``exp`` per element);
autograd keeps only that gradient (``autograd.ForwardGradients``; a kept graph gets
scaled copies, as PyTorch's loss allows).

Probability targets (docs/spec.md, section 5) have their own pair,
``ce_tvm::cross_entropy_probs`` and ``ce_tvm::cross_entropy_probs_backward``.

The ops are opaque to ``torch.compile`` (no graph break) and do no host
synchronisation beyond the target range check, which needs the target values.
DTensor logits sharded on the class dimension go to the vocabulary-parallel loss
(``ce_tvm.distributed.dtensors``), eagerly.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn
from torch.nn import _reduction

from ..distributed import dtensors
from ..runtime import launch
from ..runtime.options import LossOptions
from ..runtime.tensors import accum_torch_dtype
from . import checks as check
from .autograd import ForwardGradients, custom_op, op_gradients
from .outputs import accuracy_like, loss_like, with_extras

# Training with sum/mean computes the gradient in the forward sweep
# (``cross_entropy_train``); ``CE_TVM_TRAINING=recompute`` (or setting
# this to False) keeps the logits for a backward that recomputes it instead.
ONE_PASS_TRAINING = os.environ.get("CE_TVM_TRAINING", "one_pass") != "recompute"
# Devices whose tensors take the one-pass kernel. CUDA recomputes: on an H200 the
# forward (in lanes) and the backward took 1.67 ms at 8192 x 128256 bf16, the CUDA
# one-pass kernel of then 2.17 ms (fp32: 3.14 ms each); the kernel in lanes that
# replaced it is not yet timed on a GPU (docs/targets.md).
TRAINING_KERNEL_DEVICES = ("cpu",)


@custom_op("ce_tvm::cross_entropy_forward", mutates_args=())
def cross_entropy_forward(x: Tensor, target: Tensor, weight: Tensor | None, reduction: str,
                          ignore_index: int, label_smoothing: float, lse_square_scale: float,
                          softcap: float, temperature: float, token_accuracy: bool,
                          wide_loss: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, zloss, lse, accuracy)``; ``loss``/``zloss`` are ``[N]`` for
    ``none``, else ``[1]``, in ``x``'s dtype (float32 for 16-bit ``x`` with
    ``wide_loss``); ``accuracy`` (``launch.token_accuracy``) is 0-d
    when ``token_accuracy``, else empty."""
    options = LossOptions.from_schema(reduction, ignore_index, label_smoothing,
                                      lse_square_scale, softcap, temperature, wide_loss)
    y = check.targets(target, x, options.ignore_index)
    out = launch.forward(x.contiguous(), y, check.weight(weight, x), options, log_prob=False,
                         accuracy=token_accuracy)
    return out.loss, out.zloss, out.lse, _accuracy(out, y, options, x, token_accuracy)


def _accuracy(out: launch.ForwardOutputs, y: Tensor, options: LossOptions, x: Tensor,
              wanted: bool) -> Tensor:
    if not wanted:
        return accuracy_like(x, False)
    return launch.token_accuracy(out.hit, y, options.ignore_index)


@cross_entropy_forward.register_fake
def _(x, target, weight, reduction, ignore_index, label_smoothing, lse_square_scale, softcap,
      temperature, token_accuracy, wide_loss=False):
    return (loss_like(x, reduction, wide_loss), loss_like(x, reduction, wide_loss),
            x.new_empty(x.shape[0], dtype=accum_torch_dtype(x)),
            accuracy_like(x, token_accuracy))


@custom_op("ce_tvm::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(grad_loss: Tensor, x: Tensor, lse: Tensor, target: Tensor,
                           weight: Tensor | None, reduction: str, ignore_index: int,
                           label_smoothing: float, lse_square_scale: float,
                           softcap: float, temperature: float) -> Tensor:
    """The logits gradient, recomputed from the logits and their ``lse``."""
    options = LossOptions.from_schema(reduction, ignore_index, label_smoothing,
                                      lse_square_scale, softcap, temperature)
    g = grad_loss.to(accum_torch_dtype(x)).reshape(-1).contiguous()
    return launch.backward(g, torch.zeros_like(g), x.contiguous(), lse.contiguous(),
                           target.to(torch.int64).contiguous(), check.weight(weight, x),
                           options, source_kind="logits")


@cross_entropy_backward.register_fake
def _(grad_loss, x, lse, target, weight, reduction, ignore_index, label_smoothing,
      lse_square_scale, softcap, temperature):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    (x, target, weight, reduction, ignore_index, label_smoothing, lse_square_scale, softcap,
     temperature, *_) = inputs
    ctx.save_for_backward(x, output[2], target, weight)
    ctx.scalars = dict(reduction=reduction, ignore_index=ignore_index,  # checked by the forward
                       label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
                       softcap=softcap, temperature=temperature)
    ctx.mark_non_differentiable(output[3])


def _backward(ctx, grad_loss, grad_zloss, grad_lse, grad_accuracy):
    # zloss, lse and the accuracy are reported for logging; gradient flows through loss only.
    if grad_loss is None:
        return op_gradients(cross_entropy_forward)
    x, lse, target, weight = ctx.saved_tensors
    return op_gradients(cross_entropy_forward, x=cross_entropy_backward(
        grad_loss, x, lse, target, weight, **ctx.scalars))


cross_entropy_forward.register_autograd(_backward, setup_context=_setup_context)


@custom_op("ce_tvm::cross_entropy_train", mutates_args=())
def cross_entropy_train(x: Tensor, target: Tensor, weight: Tensor | None, reduction: str,
                        ignore_index: int, label_smoothing: float, lse_square_scale: float,
                        softcap: float, temperature: float, token_accuracy: bool,
                        wide_loss: bool = False
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, zloss, lse, accuracy, x_grad)``: ``loss``/``zloss`` ``[1]`` (dtype as
    in ``cross_entropy_forward``); ``accuracy`` as there; ``x_grad`` is d(loss)/d(x)
    for a unit upstream gradient (``sum``/``mean`` only)."""
    options = LossOptions.from_schema(reduction, ignore_index, label_smoothing,
                                      lse_square_scale, softcap, temperature, wide_loss)
    y = check.targets(target, x, options.ignore_index)
    out, x_grad = launch.train(x.contiguous(), y, check.weight(weight, x), options,
                               accuracy=token_accuracy)
    return (out.loss, out.zloss, out.lse, _accuracy(out, y, options, x, token_accuracy),
            x_grad)


@cross_entropy_train.register_fake
def _(x, target, weight, reduction, ignore_index, label_smoothing, lse_square_scale, softcap,
      temperature, token_accuracy, wide_loss=False):
    return (loss_like(x, "sum", wide_loss), loss_like(x, "sum", wide_loss),
            x.new_empty(x.shape[0], dtype=accum_torch_dtype(x)),
            accuracy_like(x, token_accuracy),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def _setup_train_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output[3], output[4])
    ctx.set_materialize_grads(False)  # no [N, C] of zeros for the unused outputs' gradients
    ctx.grads = ForwardGradients(output[4:], allow_retain_graph=True,
                                 entry="ce_tvm.cross_entropy")


def _train_backward(ctx, grad_loss, grad_zloss, grad_lse, grad_accuracy, grad_x_grad):
    if grad_loss is None:
        return op_gradients(cross_entropy_train)
    (x_grad,) = ctx.grads.scaled(grad_loss)
    return op_gradients(cross_entropy_train, x=x_grad)


cross_entropy_train.register_autograd(_train_backward, setup_context=_setup_train_context)


# --- Probability targets (docs/spec.md, section 5) ---------------------------
# ``ce_tvm::cross_entropy_probs`` returns ``(loss, zloss, lse, target_mass)``;
# autograd saves the logits, the targets and the two ``[N]`` vectors, and
# ``ce_tvm::cross_entropy_probs_backward`` recomputes the probabilities for
# the logits' gradient and the log-probabilities for the targets' (each only
# when it is needed).


@custom_op("ce_tvm::cross_entropy_probs", mutates_args=())
def cross_entropy_probs(x: Tensor, target: Tensor, weight: Tensor | None, reduction: str,
                        label_smoothing: float, lse_square_scale: float,
                        softcap: float, temperature: float, wide_loss: bool = False
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, zloss, lse, target_mass)`` for probability targets of ``x``'s shape
    and dtype; ``loss``/``zloss`` are ``[N]`` for ``none``, else ``[1]`` (dtype as in
    ``cross_entropy_forward``)."""
    options = LossOptions.from_schema(reduction, -100, label_smoothing, lse_square_scale,
                                      softcap, temperature, wide_loss)
    q = check.probabilities(target, x)
    out, mass = launch.prob_forward(x.contiguous(), q, check.weight(weight, x), options)
    return out.loss, out.zloss, out.lse, mass


@cross_entropy_probs.register_fake
def _(x, target, weight, reduction, label_smoothing, lse_square_scale, softcap, temperature,
      wide_loss=False):
    acc = accum_torch_dtype(x)
    return (loss_like(x, reduction, wide_loss), loss_like(x, reduction, wide_loss),
            x.new_empty(x.shape[0], dtype=acc),
            x.new_empty(x.shape[0], dtype=acc))


@custom_op("ce_tvm::cross_entropy_probs_backward", mutates_args=())
def cross_entropy_probs_backward(grad_loss: Tensor, x: Tensor, target: Tensor, lse: Tensor,
                                 target_mass: Tensor, weight: Tensor | None, reduction: str,
                                 label_smoothing: float, lse_square_scale: float,
                                 softcap: float, temperature: float, grad_input: bool,
                                 grad_target: bool) -> tuple[Tensor, Tensor]:
    """``(x_grad, target_grad)`` for probability targets, from the forward's ``lse``
    and ``target_mass``; an empty tensor for a gradient not asked for."""
    options = LossOptions.from_schema(reduction, -100, label_smoothing, lse_square_scale,
                                      softcap, temperature)
    g = grad_loss.to(accum_torch_dtype(x)).reshape(-1).contiguous()
    x, lse, w = x.contiguous(), lse.contiguous(), check.weight(weight, x)
    empty = x.new_empty(0)
    x_grad = (launch.prob_backward(g, x, target.contiguous(), lse, target_mass.contiguous(), w,
                                   options) if grad_input else empty)
    target_grad = launch.prob_target_grad(g, x, lse, w, options) if grad_target else empty.clone()
    return x_grad, target_grad


@cross_entropy_probs_backward.register_fake
def _(grad_loss, x, target, lse, target_mass, weight, reduction, label_smoothing,
      lse_square_scale, softcap, temperature, grad_input, grad_target):
    def grad(wanted):
        return torch.empty_like(x, memory_format=torch.contiguous_format) if wanted \
            else x.new_empty(0)

    return grad(grad_input), grad(grad_target)


def _setup_probs_context(ctx, inputs, output):
    x, target, weight, reduction, label_smoothing, lse_square_scale, softcap, temperature, *_ = \
        inputs
    ctx.save_for_backward(x, target, output[2], output[3], weight)
    ctx.scalars = dict(reduction=reduction, label_smoothing=label_smoothing,  # checked already
                       lse_square_scale=lse_square_scale, softcap=softcap,
                       temperature=temperature)


def _probs_backward(ctx, grad_loss, grad_zloss, grad_lse, grad_mass):
    # zloss, lse and the mass are reported for logging; gradient flows through loss only.
    x, target, lse, mass, weight = ctx.saved_tensors
    wanted = ctx.needs_input_grad[:2]
    if grad_loss is None or not any(wanted):
        return op_gradients(cross_entropy_probs)
    x_grad, target_grad = cross_entropy_probs_backward(
        grad_loss, x, target, lse, mass, weight, **ctx.scalars, grad_input=wanted[0],
        grad_target=wanted[1])
    return op_gradients(cross_entropy_probs, x=x_grad if wanted[0] else None,
                        target=target_grad if wanted[1] else None)


cross_entropy_probs.register_autograd(_probs_backward, setup_context=_setup_probs_context)


# --- The drop-ins -------------------------------------------------------------


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
                  logit_scale: float = 1.0, loss_dtype: torch.dtype | None = None):
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
    sweep as the loss. ``loss_dtype``: ``None`` (the input's dtype, PyTorch's rule)
    or ``torch.float32``: the loss and z-loss of 16-bit logits returned in float32,
    reduced from the kernels' float32 sums without rounding to 16 bits (float64
    logits stay float64).
    """
    check.loss_dtype(loss_dtype)
    if check.is_dtensor(input):  # logits sharded on the class dimension
        from ..distributed.eager import eagerly  # imports torch._dynamo: only here

        return eagerly(
            dtensors.cross_entropy, input, target, weight, ignore_index=ignore_index,
            reduction=_reduction_of(size_average, reduce, reduction),
            label_smoothing=label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap,
            temperature=temperature, return_zloss=return_zloss,
            return_token_accuracy=return_token_accuracy, logit_scale=logit_scale,
            loss_dtype=loss_dtype)
    x, y, unflatten = _flatten(input, target)
    dtype = torch.promote_types(x.dtype, y.dtype) if y.dtype.is_floating_point else x.dtype
    options = LossOptions(reduction=_reduction_of(size_average, reduce, reduction),
                          ignore_index=ignore_index, label_smoothing=label_smoothing,
                          zloss_scale=lse_square_scale, softcap=softcap,
                          temperature=temperature, logit_scale=logit_scale,
                          wide_loss=check.wide_loss(loss_dtype, dtype))
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
    loss, zloss, _, hits = op(x, y, weight, **options.schema_scalars(),
                              token_accuracy=accuracy)[:4]
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
                               temperature=options.kernel_temperature,
                               wide_loss=options.wide_loss)[:2]


class CrossEntropyLoss(nn.Module):
    """``torch.nn.CrossEntropyLoss`` (its constructor's signature and positional
    order) backed by ce_tvm, plus z-loss, softcap, temperature and token accuracy
    (keyword-only)."""

    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None,
                 ignore_index: int = -100, reduce: bool | None = None, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0,
                 return_zloss: bool = False, softcap: float = 0.0,
                 return_token_accuracy: bool = False, temperature: float = 1.0,
                 logit_scale: float = 1.0, loss_dtype: torch.dtype | None = None):
        super().__init__()
        check.loss_module(self, weight, loss_dtype,
                          reduction=_reduction_of(size_average, reduce, reduction),
                          ignore_index=ignore_index, label_smoothing=label_smoothing,
                          lse_square_scale=lse_square_scale, softcap=softcap,
                          temperature=temperature, logit_scale=logit_scale)
        self.return_zloss = return_zloss
        self.return_token_accuracy = return_token_accuracy

    def forward(self, input: Tensor, target: Tensor):
        return cross_entropy(input, target, self.weight, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing,
                             lse_square_scale=self.lse_square_scale,
                             return_zloss=self.return_zloss, softcap=self.softcap,
                             return_token_accuracy=self.return_token_accuracy,
                             temperature=self.temperature, logit_scale=self.logit_scale,
                             loss_dtype=self.loss_dtype)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, "
                f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}, "
                f"temperature={self.temperature}, logit_scale={self.logit_scale}, "
                f"loss_dtype={self.loss_dtype}")
