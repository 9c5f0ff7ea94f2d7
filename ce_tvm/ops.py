"""The kernels as ``torch.library`` custom ops, with fake (meta) kernels and autograd.

``ce_tvm::cross_entropy_forward`` computes the loss without writing
``log_prob``: it returns ``loss``, ``zloss`` and the per-row ``lse`` (float32,
float64 for float64 inputs). Autograd saves the logits and ``lse`` (``N``
floats), never an ``[N, C]`` intermediate; ``ce_tvm::cross_entropy_backward``
recomputes the probabilities from them in one pass.

``ce_tvm::cross_entropy_train`` (``sum``/``mean``, when autograd will need
the gradient) also returns the logits gradient for a unit upstream
gradient, computed in the same sweep over the logits (read once, gradient
written once, one ``exp`` per element). Autograd saves only that gradient
(the logits may be freed) and scales it by the upstream gradient when that
is not exactly 1.

Probability targets (docs/spec.md, section 5) have their own pair,
``ce_tvm::cross_entropy_probs`` and ``ce_tvm::cross_entropy_probs_backward``
(below).

The ops are opaque to ``torch.compile`` (no graph break) and do no host
synchronisation beyond the target range check, which needs the target values.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from . import validation as check
from .custom_ops import custom_op
from .runtime import launch, pool
from .runtime.options import LossOptions
from .runtime.tensors import accum_torch_dtype


def schema_scalars(options: LossOptions) -> dict:
    """``options`` by the names of the ops' schema (whose scalars stay primitive; the
    logit scale goes folded into the softcap and the temperature)."""
    return dict(reduction=options.reduction, ignore_index=options.ignore_index,
                label_smoothing=options.label_smoothing, lse_square_scale=options.zloss_scale,
                softcap=options.kernel_softcap, temperature=options.kernel_temperature)


def options_of(reduction, ignore_index, label_smoothing, lse_square_scale,
               softcap, temperature) -> LossOptions:
    """The op schemas' scalars (primitive, as the schemas need) as one ``LossOptions``."""
    return LossOptions(reduction=reduction, ignore_index=ignore_index,
                       label_smoothing=label_smoothing, zloss_scale=lse_square_scale,
                       softcap=softcap, temperature=temperature)


def accuracy_like(x: Tensor, wanted: bool) -> Tensor:
    """The token-accuracy output's shape: 0-d float32 when ``wanted``, else empty."""
    return x.new_empty((), dtype=torch.float32) if wanted else x.new_empty(0,
                                                                          dtype=torch.float32)


def with_extras(loss: Tensor, zloss: Tensor | None, accuracy: Tensor | None):
    """The loss alone, or the tuple ``(loss, [zloss], [accuracy])`` of the extras
    asked for, in that order; the extras are detached (logging only)."""
    extras = tuple(t.detach() for t in (zloss, accuracy) if t is not None)
    return (loss, *extras) if extras else loss


def loss_rows(x: Tensor, reduction: str) -> int:
    """Rows of the ``loss`` output: ``N`` for ``none``, else 1."""
    return x.shape[0] if reduction == "none" else 1


@custom_op("ce_tvm::cross_entropy_forward", mutates_args=())
def cross_entropy_forward(x: Tensor, target: Tensor, weight: Tensor | None, reduction: str,
                          ignore_index: int, label_smoothing: float, lse_square_scale: float,
                          softcap: float, temperature: float, token_accuracy: bool
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, zloss, lse, accuracy)``; ``loss``/``zloss`` are ``[N]`` for
    ``none``, else ``[1]``; ``accuracy`` (``launch.token_accuracy``) is 0-d
    when ``token_accuracy``, else empty."""
    options = options_of(reduction, ignore_index, label_smoothing, lse_square_scale, softcap,
                         temperature)
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
      temperature, token_accuracy):
    rows = loss_rows(x, reduction)
    return (x.new_empty(rows), x.new_empty(rows),
            x.new_empty(x.shape[0], dtype=accum_torch_dtype(x)),
            accuracy_like(x, token_accuracy))


@custom_op("ce_tvm::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(grad_loss: Tensor, x: Tensor, lse: Tensor, target: Tensor,
                           weight: Tensor | None, reduction: str, ignore_index: int,
                           label_smoothing: float, lse_square_scale: float,
                           softcap: float, temperature: float) -> Tensor:
    """The logits gradient, recomputed from the logits and their ``lse``."""
    options = options_of(reduction, ignore_index, label_smoothing, lse_square_scale, softcap,
                         temperature)
    g = grad_loss.to(accum_torch_dtype(x)).reshape(-1).contiguous()
    return launch.backward(g, torch.zeros_like(g), x.contiguous(), lse.contiguous(),
                           target.to(torch.int64).contiguous(), check.weight(weight, x),
                           options, source_kind="logits")


@cross_entropy_backward.register_fake
def _(grad_loss, x, lse, target, weight, reduction, ignore_index, label_smoothing,
      lse_square_scale, softcap, temperature):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_OP_ARGS = 10  # inputs of cross_entropy_forward/_train, for the backward's None slots


def _setup_context(ctx, inputs, output):
    (x, target, weight, reduction, ignore_index, label_smoothing, lse_square_scale, softcap,
     temperature, _) = inputs
    ctx.save_for_backward(x, output[2], target, weight)
    ctx.scalars = dict(reduction=reduction, ignore_index=ignore_index,  # checked by the forward
                       label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
                       softcap=softcap, temperature=temperature)
    ctx.mark_non_differentiable(output[3])


def _backward(ctx, grad_loss, grad_zloss, grad_lse, grad_accuracy):
    # zloss, lse and the accuracy are reported for logging; gradient flows through loss only.
    x, lse, target, weight = ctx.saved_tensors
    none = (None,) * (_OP_ARGS - 1)
    if grad_loss is None:
        return (None, *none)
    grad = cross_entropy_backward(grad_loss, x, lse, target, weight, **ctx.scalars)
    return (grad, *none)


cross_entropy_forward.register_autograd(_backward, setup_context=_setup_context)


@custom_op("ce_tvm::cross_entropy_train", mutates_args=())
def cross_entropy_train(x: Tensor, target: Tensor, weight: Tensor | None, reduction: str,
                        ignore_index: int, label_smoothing: float, lse_square_scale: float,
                        softcap: float, temperature: float, token_accuracy: bool
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, zloss, lse, accuracy, x_grad)``: ``loss``/``zloss`` ``[1]``;
    ``accuracy`` as in ``cross_entropy_forward``; ``x_grad`` is d(loss)/d(x)
    for a unit upstream gradient (``sum``/``mean`` only)."""
    options = options_of(reduction, ignore_index, label_smoothing, lse_square_scale, softcap,
                         temperature)
    y = check.targets(target, x, options.ignore_index)
    out, x_grad = launch.train(x.contiguous(), y, check.weight(weight, x), options,
                               accuracy=token_accuracy)
    return (out.loss, out.zloss, out.lse, _accuracy(out, y, options, x, token_accuracy),
            x_grad)


@cross_entropy_train.register_fake
def _(x, target, weight, reduction, ignore_index, label_smoothing, lse_square_scale, softcap,
      temperature, token_accuracy):
    return (x.new_empty(1), x.new_empty(1),
            x.new_empty(x.shape[0], dtype=accum_torch_dtype(x)),
            accuracy_like(x, token_accuracy),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def _setup_train_context(ctx, inputs, output):
    # The gradient is kept as an attribute, not saved: a saved tensor stays
    # referenced until the graph is freed, so autograd would copy it into a
    # leaf's .grad (a fresh [N, C] buffer every step) instead of taking it.
    # Being non-differentiable, it makes no reference cycle with the graph.
    ctx.mark_non_differentiable(output[3], output[4])
    ctx.set_materialize_grads(False)  # no [N, C] of zeros for the unused outputs' gradients
    ctx.x_grad = output[4]


def graph_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph``, or
    ``autograd.grad``'s default); ``True`` when that cannot be known."""
    if torch.compiler.is_compiling():
        return True
    try:
        return torch._C._autograd._get_current_graph_task_keep_graph()
    except (AttributeError, RuntimeError):
        return True


def _is_exactly_one(g: Tensor) -> bool:
    """Whether ``g`` is 1, when that can be read without a device sync or a trace."""
    if g.device.type != "cpu" or torch.compiler.is_compiling() or is_fake(g):
        return False
    return bool(g == 1)


def _train_backward(ctx, grad_loss, grad_zloss, grad_lse, grad_accuracy, grad_x_grad):
    x_grad = ctx.x_grad
    if not graph_kept():  # the graph dies after this pass: let a leaf's .grad take the buffer
        del ctx.x_grad
    none = (None,) * (_OP_ARGS - 1)
    if grad_loss is None:
        return (None, *none)
    return (scale_unit_gradient(x_grad, grad_loss), *none)


def scale_unit_gradient(x_grad: Tensor, grad_loss: Tensor) -> Tensor:
    """The gradient for upstream ``grad_loss`` from the one for a unit upstream
    gradient: ``x_grad`` itself when ``grad_loss`` is exactly 1 and the graph
    dies after this pass, else a scaled copy (from the buffer pool; ``x_grad``
    is never modified). A kept graph needs ``x_grad`` again, and autograd may
    hand a view of what is returned here to a leaf's ``.grad``, which later
    passes accumulate into."""
    if _is_exactly_one(grad_loss) and not graph_kept():
        return x_grad
    scaled = pool.empty_like(x_grad) if not is_fake(x_grad) else torch.empty_like(x_grad)
    return torch.mul(x_grad, grad_loss.to(x_grad.dtype), out=scaled)


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
                        softcap: float, temperature: float
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, zloss, lse, target_mass)`` for probability targets of ``x``'s shape
    and dtype; ``loss``/``zloss`` are ``[N]`` for ``none``, else ``[1]``."""
    options = options_of(reduction, -100, label_smoothing, lse_square_scale, softcap,
                         temperature)
    q = check.probabilities(target, x)
    out, mass = launch.prob_forward(x.contiguous(), q, check.weight(weight, x), options)
    return out.loss, out.zloss, out.lse, mass


@cross_entropy_probs.register_fake
def _(x, target, weight, reduction, label_smoothing, lse_square_scale, softcap, temperature):
    rows, acc = loss_rows(x, reduction), accum_torch_dtype(x)
    return (x.new_empty(rows), x.new_empty(rows), x.new_empty(x.shape[0], dtype=acc),
            x.new_empty(x.shape[0], dtype=acc))


@custom_op("ce_tvm::cross_entropy_probs_backward", mutates_args=())
def cross_entropy_probs_backward(grad_loss: Tensor, x: Tensor, target: Tensor, lse: Tensor,
                                 target_mass: Tensor, weight: Tensor | None, reduction: str,
                                 label_smoothing: float, lse_square_scale: float,
                                 softcap: float, temperature: float, grad_input: bool,
                                 grad_target: bool) -> tuple[Tensor, Tensor]:
    """``(x_grad, target_grad)`` for probability targets, from the forward's ``lse``
    and ``target_mass``; an empty tensor for a gradient not asked for."""
    options = options_of(reduction, -100, label_smoothing, lse_square_scale, softcap,
                         temperature)
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
    x, target, weight, reduction, label_smoothing, lse_square_scale, softcap, temperature = inputs
    ctx.save_for_backward(x, target, output[2], output[3], weight)
    ctx.scalars = dict(reduction=reduction, label_smoothing=label_smoothing,  # checked already
                       lse_square_scale=lse_square_scale, softcap=softcap,
                       temperature=temperature)


def _probs_backward(ctx, grad_loss, grad_zloss, grad_lse, grad_mass):
    # zloss, lse and the mass are reported for logging; gradient flows through loss only.
    x, target, lse, mass, weight = ctx.saved_tensors
    wanted = ctx.needs_input_grad[:2]
    if grad_loss is None or not any(wanted):
        return (None,) * 8
    x_grad, target_grad = cross_entropy_probs_backward(
        grad_loss, x, target, lse, mass, weight, **ctx.scalars, grad_input=wanted[0],
        grad_target=wanted[1])
    return (x_grad if wanted[0] else None, target_grad if wanted[1] else None, *(None,) * 6)


cross_entropy_probs.register_autograd(_probs_backward, setup_context=_setup_probs_context)
