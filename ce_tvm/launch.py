"""Launch the compiled kernels on already-validated torch tensors.

The one place that knows the kernels' argument order (``ce_tvm.compute``).
Outputs are allocated here (``[N, C]`` ones through ``ce_tvm.pool``) unless
the caller passes its own buffers (``out=``), which must be contiguous and of
the documented shape and dtype. The runtime scalars arrive as one
``LossOptions``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import pool
from .build import KernelSpec, tuned_spec
from .compute import Variant
from .options import LossOptions
from .runtime import call
from .tensors import accum_torch_dtype, dtype_name, kernel_target


@dataclass
class ForwardOutputs:
    """``loss``/``zloss``: ``[N]`` or ``[1]`` in the input dtype; ``lse``: ``[N]``
    in the accumulation dtype; ``log_prob``: ``[N, C]`` or ``None``."""

    loss: torch.Tensor
    zloss: torch.Tensor
    lse: torch.Tensor
    log_prob: torch.Tensor | None


def _spec(op, x, variant) -> KernelSpec:
    """The kernel for ``x``; on the CPU with the tuning record nearest its row count, if any."""
    target, options = kernel_target(x)
    spec = KernelSpec(op, dtype_name(x.dtype), x.shape[1], variant, target, options)
    return tuned_spec(spec, x.shape[0]) if target == "llvm" else spec


def _scalars(options: LossOptions) -> tuple:
    """The kernels' scalar arguments, in their order."""
    return options.ignore_index, options.label_smoothing, options.zloss_scale


def _weight(w) -> list:
    return [w] if w is not None else []


def forward(x, y, w, options: LossOptions, *, log_prob: bool,
            out: ForwardOutputs | None = None) -> ForwardOutputs:
    """Run the fused forward; writes ``log_prob`` only when asked."""
    n = x.shape[0]
    if out is None:
        rows = n if options.reduction == "none" else 1
        out = ForwardOutputs(
            loss=x.new_empty(rows),
            zloss=x.new_empty(rows),
            lse=x.new_empty(n, dtype=accum_torch_dtype(x)),
            log_prob=pool.empty_like(x) if log_prob else None,
        )
    spec = _spec("forward", x, Variant(options.reduction, w is not None, log_prob=log_prob))
    call(spec, x, y, *_weight(w), *_scalars(options), out.loss, out.zloss, out.lse,
         *([out.log_prob] if log_prob else []))
    return out


def train(x, y, w, options: LossOptions) -> tuple[ForwardOutputs, torch.Tensor]:
    """The forward and, in the same sweep, the logits gradient for a unit
    upstream gradient (``sum``/``mean`` only); returns ``(ForwardOutputs,
    x_grad)`` with ``x_grad`` from the buffer pool and ``log_prob`` ``None``."""
    n = x.shape[0]
    out = ForwardOutputs(loss=x.new_empty(1), zloss=x.new_empty(1),
                         lse=x.new_empty(n, dtype=accum_torch_dtype(x)), log_prob=None)
    x_grad = pool.empty_like(x)
    norms = [x.new_empty(2, dtype=accum_torch_dtype(x))] if options.reduction == "mean" else []
    spec = _spec("train", x, Variant(options.reduction, w is not None, log_prob=False))
    call(spec, x, y, *_weight(w), *_scalars(options), *norms, x_grad, out.lse, out.loss,
         out.zloss)
    return out, x_grad


def backward(grad_loss, grad_zloss, source, lse, y, w, options: LossOptions, *,
             source_kind: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the fused backward from ``log_prob`` (``source_kind='log_prob'``) or
    from the logits and their ``lse`` (``source_kind='logits'``); returns ``x_grad``."""
    x_grad = pool.empty_like(source) if out is None else out
    variant = Variant(options.reduction, w is not None, grad_source=source_kind)
    call(_spec("backward", source, variant), grad_loss, grad_zloss, source, lse, y,
         *_weight(w), *_scalars(options), x_grad)
    return x_grad


def shard_stats(x, y, w, offset: int):
    """Row statistics of a vocabulary shard: ``(rowmax, expsum, wxsum,
    target_logit, target_weight)``, each ``[N]`` in the accumulation dtype."""
    outs = [x.new_empty(x.shape[0], dtype=accum_torch_dtype(x)) for _ in range(5)]
    spec = _spec("shard_stats", x, Variant(weighted=w is not None))
    call(spec, x, y, *_weight(w), offset, *outs)
    return outs


def shard_combine(lse, target_logit, target_weight, wxsum, y, *, weight_sum: float,
                  classes: int, dtype: torch.dtype, options: LossOptions):
    """``(loss, zloss)`` in ``dtype`` from statistics combined over all shards."""
    rows = lse.shape[0] if options.reduction == "none" else 1
    loss, zloss = (lse.new_empty(rows, dtype=dtype) for _ in range(2))
    spec = KernelSpec("shard_combine", dtype_name(dtype), classes, Variant(options.reduction),
                      *kernel_target(lse))
    call(spec, lse, target_logit, target_weight, wxsum, y, weight_sum, *_scalars(options),
         loss, zloss)
    return loss, zloss


def shard_backward(grad_loss, x, lse, y, w, target_weight, *, offset: int, weight_sum: float,
                   global_classes: int, options: LossOptions):
    """The gradient of one vocabulary shard, from the full rows' ``lse`` and ``w[y]``."""
    x_grad = pool.empty_like(x)
    variant = Variant(options.reduction, w is not None, grad_source="shard")
    call(_spec("backward", x, variant), grad_loss, torch.zeros_like(grad_loss), x, lse, y,
         *_weight(w), target_weight, offset, weight_sum, float(global_classes),
         *_scalars(options), x_grad)
    return x_grad
