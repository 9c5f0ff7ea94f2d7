"""Per-token log-probs and entropy at a temperature, with their gradients
(SPEC section 6): what RL post-training (GRPO, PPO, DPO-style losses) takes
from the LM head, without a ``[N, V]`` intermediate.

``ce_tvm::log_probs`` returns ``(logp, entropy, row_max, log_expsum)`` from
one sweep over the logits; autograd saves the logits, the indices and the
three ``[N]`` vectors, and ``ce_tvm::log_probs_backward`` writes the logits' gradient of
both outputs in one pass (logits read once, gradient written once). Both
ops are opaque to ``torch.compile``; the index range check (a host sync)
runs inside the forward op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import validation as check
from .custom_ops import custom_op
from .runtime import launch
from .runtime.options import LossOptions
from .runtime.tensors import accum_torch_dtype


def _options(ignore_index: int, temperature: float, softcap: float) -> LossOptions:
    return LossOptions(ignore_index=ignore_index, temperature=temperature, softcap=softcap)


@custom_op("ce_tvm::log_probs", mutates_args=())
def log_probs_forward(x: Tensor, index: Tensor, ignore_index: int, temperature: float,
                      softcap: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp[N, K], entropy[N], row_max[N], log_expsum[N])`` (accumulation
    dtype) of the logits ``x[N, V]`` at ``index[N, K]`` (int64; ``ignore_index``
    entries give 0); the last two are for the backward (``launch.log_probs``)."""
    check.in_range(index, x.shape[1], ignore_index, "index")
    return launch.log_probs(x.contiguous(), index.contiguous(),
                            _options(ignore_index, temperature, softcap))


@log_probs_forward.register_fake
def _(x, index, ignore_index, temperature, softcap):
    acc, n = accum_torch_dtype(x), x.shape[0]
    return (x.new_empty((n, index.shape[1]), dtype=acc),
            *(x.new_empty(n, dtype=acc) for _ in range(3)))


@custom_op("ce_tvm::log_probs_backward", mutates_args=())
def log_probs_backward(grad_logp: Tensor, grad_entropy: Tensor, x: Tensor, index: Tensor,
                       row_max: Tensor, log_expsum: Tensor, entropy: Tensor, ignore_index: int,
                       temperature: float, softcap: float) -> Tensor:
    """The logits' gradient of ``sum grad_logp logp + sum grad_entropy entropy``."""
    acc = accum_torch_dtype(x)
    return launch.log_probs_backward(
        grad_logp.to(acc).contiguous(), grad_entropy.to(acc).contiguous(), x.contiguous(),
        index.contiguous(), row_max.contiguous(), log_expsum.contiguous(), entropy.contiguous(),
        _options(ignore_index, temperature, softcap))


@log_probs_backward.register_fake
def _(grad_logp, grad_entropy, x, index, row_max, log_expsum, entropy, ignore_index,
      temperature, softcap):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, index, ignore_index, temperature, softcap = inputs
    ctx.save_for_backward(x, index, *output[1:])
    ctx.scalars = dict(ignore_index=ignore_index, temperature=temperature, softcap=softcap)
    ctx.mark_non_differentiable(output[2], output[3])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, grad_entropy, grad_row_max, grad_log_expsum):
    none = (None,) * 4
    if grad_logp is None and grad_entropy is None:
        return (None, *none)
    x, index, entropy, row_max, log_expsum = ctx.saved_tensors
    if grad_logp is None:  # the kernel takes both
        grad_logp = torch.zeros_like(index, dtype=entropy.dtype)
    if grad_entropy is None:
        grad_entropy = torch.zeros_like(entropy)
    return (log_probs_backward(grad_logp, grad_entropy, x, index, row_max, log_expsum, entropy,
                               **ctx.scalars), *none)


log_probs_forward.register_autograd(_backward, setup_context=_setup_context)


def log_probs(logits: Tensor, index: Tensor, *, temperature: float = 1.0, softcap: float = 0.0,
              row_mask: Tensor | None = None, ignore_index: int = -100,
              return_entropy: bool = False):
    """Log-probabilities of ``index`` under ``softmax(cap(logits) / temperature)``
    (SPEC section 6), and with ``return_entropy=True`` the entropy of every row.

    ``logits`` ``[..., V]`` (float32, bfloat16, float16; float64 for gradcheck);
    ``index`` ``[...]`` (one class per row) or ``[..., K]``, int64/int32 class
    ids. Returns ``logp`` of ``index``'s shape, or ``(logp, entropy)`` with
    ``entropy`` of shape ``logits.shape[:-1]``; float32 (float64 for float64
    logits). An entry whose index is ``ignore_index``, and every entry of a row
    whose ``row_mask`` is false/0, is exactly 0 with no gradient (its index is
    not checked); the entropy is computed for every row. Gradients flow to
    the logits from both outputs.
    """
    options = _options(ignore_index, temperature, softcap)  # checks the scalars
    x = check.class_last_logits(logits)
    idx, single = check.index_columns(index, logits)
    mask = check.row_mask(row_mask, logits)
    if mask is not None:
        idx = torch.where(mask[:, None], idx, options.ignore_index)
    k = idx.shape[1]
    if k == 0:  # the kernels take at least one column: a dead one
        idx = idx.new_full((idx.shape[0], 1), options.ignore_index)
    logp, entropy, _, _ = log_probs_forward(x, idx, options.ignore_index, options.temperature,
                                            options.softcap)
    lead = tuple(logits.shape[:-1])
    logp = logp[:, :k].reshape(lead if single else (*lead, k))
    return (logp, entropy.reshape(lead)) if return_entropy else logp
