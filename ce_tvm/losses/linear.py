"""Fused linear + cross-entropy for LM heads (docs/spec.md, section 8).

``linear_cross_entropy(input, linear_weight, target, ...)`` equals
``cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...)``
with the class dimension last, but the ``[N, V]`` logits never exist whole:
``ce_tvm.runtime.linear_sweep`` goes through the rows in chunks.

Autograd, through the ``torch.library`` op ``ce_tvm::linear_cross_entropy``:

- ``mean``/``sum``: the forward computes the gradients (for the inputs that
  require grad) in the same sweep as the loss, for a unit upstream gradient;
  the backward only scales them by the upstream gradient, on the device. In
  eager mode it scales them in place, so a second backward through the same
  graph (``retain_graph=True``) is an error unless ``allow_retain_graph=True``
  (then it scales a copy: one more gradient-sized allocation); under
  ``torch.compile`` it always scales a copy (``autograd.ForwardGradients``).
- ``none``: the forward computes the loss only and keeps the inputs; the
  backward (``ce_tvm::linear_cross_entropy_backward``) recomputes the logits
  chunk by chunk with the per-row upstream gradient.
- No gradient wanted (``no_grad``, nothing requires grad): the loss only.

A head given as a module, or as DTensors, is routed by ``ce_tvm.distributed.heads``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..distributed import dtensors, heads
from ..runtime import linear_sweep as sweep
from ..runtime.options import LossOptions
from . import checks as check
from .autograd import ForwardGradients, custom_op, head_gradients, op_gradients
from .outputs import accuracy_like, grad_like, loss_like, with_extras


@custom_op("ce_tvm::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_forward(
        input: Tensor, linear_weight: Tensor, linear_bias: Tensor | None, target: Tensor,
        weight: Tensor | None, reduction: str, ignore_index: int, label_smoothing: float,
        lse_square_scale: float, softcap: float, temperature: float, token_accuracy: bool,
        chunk_rows: int,
        grad_input: bool, grad_weight: bool, grad_bias: bool, allow_retain_graph: bool,
        wide_loss: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, zloss, accuracy, grad_input, grad_weight, grad_bias)`` for ``input [N, H]``.

    ``loss``/``zloss`` are ``[N]`` for ``none``, else ``[1]``, in ``input``'s dtype
    (float32 for 16-bit ``input`` with ``wide_loss``: the chunks' per-row losses
    are then kept and summed in float32, never rounded to 16 bits); ``accuracy`` is
    0-d when ``token_accuracy``, else empty (``outputs.accuracy_like``). The gradients
    (for a unit upstream gradient) are computed for ``mean``/``sum`` when
    their flag is set, else they are empty tensors. ``chunk_rows`` 0: the
    default chunk size (``linear_sweep.chunk_rows``). ``allow_retain_graph``
    only changes the backward (see the module docstring).
    """
    y = check.targets(target, input, ignore_index, classes=linear_weight.shape[0])
    w = check.weight(weight, input, classes=linear_weight.shape[0])
    opts = LossOptions.from_schema(reduction, ignore_index, label_smoothing, lse_square_scale,
                                   softcap, temperature, wide_loss)
    rows = sweep.chunk_rows(input.shape[0], linear_weight.shape[0], input.dtype, chunk_rows)
    needs = sweep.Needs(grad_input, grad_weight, grad_bias and linear_bias is not None)
    if reduction == "none" or not needs.any():
        empty = input.new_empty(0)
        return (*sweep.loss_only(input, linear_weight, linear_bias, y, w, opts, rows,
                                 token_accuracy), empty, empty.clone(), empty.clone())
    return sweep.loss_and_grads(input, linear_weight, linear_bias, y, w, opts, rows, needs,
                                token_accuracy)


@linear_cross_entropy_forward.register_fake
def _(input, linear_weight, linear_bias, target, weight, reduction, ignore_index,
      label_smoothing, lse_square_scale, softcap, temperature, token_accuracy, chunk_rows,
      grad_input,
      grad_weight, grad_bias, allow_retain_graph, wide_loss=False):
    scalar = reduction != "none"
    return (loss_like(input, reduction, wide_loss), loss_like(input, reduction, wide_loss),
            accuracy_like(input, token_accuracy),
            grad_like(input, scalar and grad_input, input),
            grad_like(linear_weight, scalar and grad_weight, input),
            grad_like(linear_bias, scalar and grad_bias, input))


@custom_op("ce_tvm::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
        grad_loss: Tensor, input: Tensor, linear_weight: Tensor, linear_bias: Tensor | None,
        target: Tensor, weight: Tensor | None, ignore_index: int, label_smoothing: float,
        lse_square_scale: float, softcap: float, temperature: float, chunk_rows: int,
        grad_input: bool,
        grad_weight: bool, grad_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_input, grad_weight, grad_bias)`` of the ``none`` loss for the
    per-row upstream gradient ``grad_loss [N]``, the logits recomputed chunk by
    chunk; an empty tensor for each gradient not asked for."""
    opts = LossOptions.from_schema("none", ignore_index, label_smoothing, lse_square_scale,
                                   softcap, temperature)
    rows = sweep.chunk_rows(input.shape[0], linear_weight.shape[0], input.dtype, chunk_rows)
    needs = sweep.Needs(grad_input, grad_weight, grad_bias and linear_bias is not None)
    return sweep.grads_from_rows(grad_loss, input, linear_weight, linear_bias,
                                 target.to(torch.int64).contiguous(),
                                 check.weight(weight, input, classes=linear_weight.shape[0]),
                                 opts, rows, needs)


@linear_cross_entropy_backward.register_fake
def _(grad_loss, input, linear_weight, linear_bias, target, weight, ignore_index,
      label_smoothing, lse_square_scale, softcap, temperature, chunk_rows, grad_input,
      grad_weight,
      grad_bias):
    return (grad_like(input, grad_input, input), grad_like(linear_weight, grad_weight, input),
            grad_like(linear_bias, grad_bias, input))


def _setup_context(ctx, inputs, output):
    (x, W, b, target, weight, reduction, ii, eps, s, cap, temperature, _, chunk_rows, *needs,
     retain) = inputs[:17]  # wide_loss (last) changes no gradient
    ctx.needs = tuple(needs)
    ctx.reduction = reduction
    if reduction == "none":
        ctx.save_for_backward(x, W, b, target, weight)
        ctx.options = (ii, eps, s, cap, temperature, chunk_rows)
    else:
        ctx.grads = ForwardGradients(output[3:], allow_retain_graph=retain,
                                     entry="ce_tvm.linear_cross_entropy")
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero [V, H] tensors for the unused outputs


def _backward(ctx, grad_loss, *_unused):
    if grad_loss is None:
        return op_gradients(linear_cross_entropy_forward)
    if ctx.reduction == "none":
        x, W, b, target, weight = ctx.saved_tensors
        grads = linear_cross_entropy_backward(grad_loss, x, W, b, target, weight,
                                              *ctx.options, *ctx.needs)
    else:
        grads = ctx.grads.scaled(grad_loss)
    return head_gradients(linear_cross_entropy_forward, grads, ctx.needs)


linear_cross_entropy_forward.register_autograd(_backward, setup_context=_setup_context)


def _flatten(input: Tensor, linear_weight: Tensor, target: Tensor,
             linear_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(x [N, H], y [N])`` from ``input [*, H]`` and ``target [*]``, after checking
    kinds, ranks, shapes, dtypes and devices."""
    x = check.linear_head(input, linear_weight, linear_bias)
    if not isinstance(target, Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype.is_floating_point:
        raise TypeError("ce_tvm supports class-index targets (int64/int32), not probabilities")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"target must have shape {tuple(input.shape[:-1])} (input's leading "
                         f"dimensions), got {tuple(target.shape)}")
    return x, target.reshape(-1)


def linear_cross_entropy(input: Tensor, linear_weight: Tensor, target: Tensor, *,
                         linear_bias: Tensor | None = None, weight: Tensor | None = None,
                         reduction: str = "mean", ignore_index: int = -100,
                         label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                         softcap: float = 0.0, temperature: float = 1.0,
                         return_zloss: bool = False,
                         return_token_accuracy: bool = False, chunk_rows: int | None = None,
                         allow_retain_graph: bool = False, logit_scale: float = 1.0,
                         loss_dtype: torch.dtype | None = None):
    """``cross_entropy(input @ linear_weight.T + linear_bias, target, ...)`` without
    the logits ever existing whole.

    ``input [*, H]`` (any leading dimensions), ``linear_weight [V, H]``,
    ``linear_bias [V]``, ``target [*]`` class indices; the class dimension of
    the logits is the last one. ``linear_weight`` may be the head module itself
    (``model.lm_head``, ``nn.Linear``-like; its bias comes along): the loss then
    runs inside the module's own call, so FSDP2 / FSDP / ZeRO-3 gather its
    weight and reduce its gradient. A DTensor weight needs the input as a
    DTensor on the same mesh (tensor parallelism); ``ce_tvm.distributed.heads``
    has the rule. Returns the loss (0-d for ``mean``/``sum``,
    the target's shape for ``none``), z-loss included when
    ``lse_square_scale > 0``; ``softcap``, ``temperature``, ``logit_scale``,
    ``return_zloss`` and ``return_token_accuracy`` as ``ce_tvm.cross_entropy``
    has them (the
    capped logits and the accuracy are computed chunk by chunk too).
    ``chunk_rows`` (or the environment variable ``CE_TVM_LINEAR_CHUNK_ROWS``)
    sets the rows per chunk; by default an eighth of the rows, at least 384, at most 256 MiB
    of logits (``linear_sweep.chunk_rows``). For ``mean``/``sum`` the
    backward consumes gradients computed in the forward, so a second
    backward through the same graph needs ``allow_retain_graph=True``.
    ``loss_dtype`` as ``ce_tvm.cross_entropy`` takes it (``torch.float32``: the
    per-row losses are kept in float32 too). Input and head of different
    dtypes: ``checks.head_dtypes`` (autocast's rule under ``torch.autocast``,
    else the widest dtype).
    """
    check.loss_dtype(loss_dtype)
    return heads.run(input, linear_weight, linear_bias, _fused, dtensors.linear_cross_entropy,
                     target, weight=weight, reduction=reduction, ignore_index=ignore_index,
                     label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
                     softcap=softcap, temperature=temperature, return_zloss=return_zloss,
                     return_token_accuracy=return_token_accuracy, chunk_rows=chunk_rows,
                     allow_retain_graph=allow_retain_graph, logit_scale=logit_scale,
                     loss_dtype=loss_dtype)


def _fused(input: Tensor, linear_weight: Tensor, linear_bias: Tensor | None, target: Tensor, *,
           weight, reduction, ignore_index, label_smoothing, lse_square_scale, softcap,
           temperature, return_zloss, return_token_accuracy, chunk_rows, allow_retain_graph,
           logit_scale, loss_dtype):
    """``linear_cross_entropy`` of plain tensors (``heads.run``'s local route)."""
    input, linear_weight, linear_bias = check.head_dtypes(input, linear_weight, linear_bias)
    x, y = _flatten(input, linear_weight, target, linear_bias)
    options = LossOptions(reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, zloss_scale=lse_square_scale,
                          softcap=softcap, temperature=temperature, logit_scale=logit_scale,
                          wide_loss=check.wide_loss(loss_dtype, x.dtype))
    rows = check.chunk_rows(chunk_rows)
    grad_on = torch.is_grad_enabled()
    loss, zloss, accuracy, *_ = linear_cross_entropy_forward(
        x, linear_weight, linear_bias, y, weight, **options.schema_scalars(),
        token_accuracy=bool(return_token_accuracy), chunk_rows=rows,
        grad_input=grad_on and input.requires_grad,
        grad_weight=grad_on and linear_weight.requires_grad,
        grad_bias=grad_on and linear_bias is not None and linear_bias.requires_grad,
        allow_retain_graph=bool(allow_retain_graph))
    shape = tuple(target.shape) if options.reduction == "none" else ()
    loss, zloss = loss.reshape(shape), zloss.reshape(shape)
    return with_extras(loss, zloss if return_zloss else None,
                       accuracy if return_token_accuracy else None)


class LinearCrossEntropyLoss(nn.Module):
    """``linear_cross_entropy`` as a module holding the loss options.

    The head is passed at call time, so an ``nn.Linear`` head stays where it
    is; as a module, the loss runs inside its own call (sharded training)::

        criterion = ce_tvm.LinearCrossEntropyLoss(label_smoothing=0.1)
        loss = criterion(hidden, model.lm_head, target)
    """

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0,
                 lse_square_scale: float = 0.0, return_zloss: bool = False,
                 chunk_rows: int | None = None, allow_retain_graph: bool = False, *,
                 softcap: float = 0.0, return_token_accuracy: bool = False,
                 temperature: float = 1.0, logit_scale: float = 1.0,
                 loss_dtype: torch.dtype | None = None):
        super().__init__()
        check.loss_module(self, weight, loss_dtype, reduction=reduction,
                          ignore_index=ignore_index, label_smoothing=label_smoothing,
                          lse_square_scale=lse_square_scale, softcap=softcap,
                          temperature=temperature, logit_scale=logit_scale)
        self.return_zloss = return_zloss
        self.return_token_accuracy = return_token_accuracy
        self.chunk_rows = chunk_rows
        self.allow_retain_graph = allow_retain_graph

    def forward(self, input: Tensor, linear_weight: Tensor | nn.Module, target: Tensor,
                linear_bias: Tensor | None = None):
        return linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
            reduction=self.reduction, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale,
            softcap=self.softcap, temperature=self.temperature, logit_scale=self.logit_scale,
            return_zloss=self.return_zloss,
            return_token_accuracy=self.return_token_accuracy, chunk_rows=self.chunk_rows,
            allow_retain_graph=self.allow_retain_graph, loss_dtype=self.loss_dtype)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, "
                f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}, "
                f"temperature={self.temperature}, logit_scale={self.logit_scale}, "
                f"chunk_rows={self.chunk_rows}, loss_dtype={self.loss_dtype}")
