"""The seed-compatible operator pair (docs/spec.md, section 10).

``cross_entropy_loss`` returns ``(loss, log_prob, zloss, lse_for_zloss)``;
``cross_entropy_loss_grad`` returns the logits gradient. Both validate their
inputs (docs/spec.md, section 11), allocate outputs, and call one compiled kernel.
"""

from __future__ import annotations

import torch

from ..runtime import launch
from ..runtime.tensors import accum_torch_dtype
from . import checks as check


def cross_entropy_loss(input, target, weight=None, reduction="mean", ignore_index=-100,
                       label_smoothing=0.0, lse_square_scale_for_zloss=0.0, return_zloss=False):
    """Fused log-softmax + NLL with label smoothing and z-loss (docs/spec.md, section 2).

    Returns ``(loss, log_prob, zloss, lse_for_zloss)``: ``loss`` is ``[N]``
    for ``reduction='none'``, else ``[1]``; ``zloss`` is empty unless
    ``return_zloss``; ``lse_for_zloss`` is empty unless the z-loss scale is
    non-zero or ``return_zloss``. All in the dtype of ``input``.
    """
    x, y, w, options = check.operator_args(
        input, "input", target, weight, reduction=reduction, ignore_index=ignore_index,
        label_smoothing=label_smoothing, zloss_scale=lse_square_scale_for_zloss)
    out = launch.forward(x, y, w, options, log_prob=True)
    empty = x.new_empty(0)
    return (
        out.loss,
        out.log_prob,
        out.zloss if return_zloss else empty,
        out.lse.to(x.dtype) if (options.zloss_scale != 0.0 or return_zloss) else empty,
    )


def cross_entropy_loss_grad(grad_loss, log_prob, target, weight=None, grad_zloss=None,
                            lse_for_zloss=None, reduction="mean", ignore_index=-100,
                            label_smoothing=0.0, lse_square_scale_for_zloss=0.0):
    """Gradient of ``cross_entropy_loss`` with respect to the logits (docs/spec.md, section 3).

    ``grad_loss`` (and ``grad_zloss``) have the shape of ``loss``;
    ``lse_for_zloss`` is required when the z-loss scale is non-zero. All four
    share ``log_prob``'s dtype (``TypeError`` otherwise, as the seed operator). Returns
    ``x_grad [N, C]`` in the dtype of ``log_prob``.
    """
    lp, y, w, options = check.operator_args(
        log_prob, "log_prob", target, weight, reduction=reduction, ignore_index=ignore_index,
        label_smoothing=label_smoothing, zloss_scale=lse_square_scale_for_zloss)
    check.one_dtype(grad_loss=grad_loss, log_prob=lp, grad_zloss=grad_zloss,
                    lse_for_zloss=lse_for_zloss)
    n = lp.shape[0]
    g = check.row_vector(grad_loss, n, lp, "grad_loss", options.reduction)
    gz = (torch.zeros_like(g) if grad_zloss is None
          else check.row_vector(grad_zloss, n, lp, "grad_zloss", options.reduction))
    if lse_for_zloss is None:
        if options.zloss_scale != 0.0:
            raise ValueError(
                "lse_for_zloss is required when lse_square_scale_for_zloss != 0 "
                "(lse cannot be recovered from log_prob)"
            )
        lse = lp.new_zeros(n, dtype=accum_torch_dtype(lp))
    else:
        lse = check.lse_vector(lse_for_zloss, n, lp)
    return launch.backward(g, gz, lp, lse, y, w, options, source_kind="log_prob")
