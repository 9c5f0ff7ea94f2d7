"""Per-token log-probs and entropy at a temperature, with their gradients
(docs/spec.md, section 9): what RL post-training (GRPO, PPO, DPO-style losses) takes
from the LM head, without a ``[N, V]`` intermediate.

``ce_tvm::log_probs`` returns ``(logp, entropy, row_max, log_expsum)`` from
one sweep over the logits (``entropy`` off: zeros in its place, from the
kernel without it, for a call that does not return it); autograd saves the
logits, the indices and the three ``[N]`` vectors, and
``ce_tvm::log_probs_backward`` writes the logits' gradient of both outputs in
one pass (logits read once, gradient written once). Both
ops are opaque to ``torch.compile``; the index range check (a host sync)
runs inside the forward op. ``ce_tvm::log_probs_stats`` (and
``ce_tvm::linear_log_probs_stats``) is the same op with three more,
non-differentiable outputs from the same sweep (``LogProbStats``; the kernels'
stats variant), and the same backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..distributed import dtensors, heads
from ..runtime import launch
from ..runtime import linear_sweep as sweep
from ..runtime.options import LossOptions
from ..runtime.tensors import accum_torch_dtype
from . import checks as check
from .autograd import custom_op, head_gradients, op_gradients
from .outputs import grad_like


class LogProbStats(NamedTuple):
    """Per-token statistics that ``return_stats=True`` adds (docs/spec.md, section 9),
    reduced in the sweep that computes the log-probs; none has a gradient.

    ``log_sum_sq_probs``: ``log sum_v p_v^2`` of each row (the rows' shape;
    float32, float64 for float64 logits). ``mean_logits``: ``(1/V) sum_v z_v``,
    the mean of the row's transformed logits ``z = cap(s x) / T`` (same shape
    and dtype). ``is_top1``: bool of the index's shape, true where the index is
    its row's first argmax of ``z`` (a tie with an earlier column does not
    count); false for ``ignore_index`` and masked entries."""

    log_sum_sq_probs: Tensor
    mean_logits: Tensor
    is_top1: Tensor


def _options(ignore_index: int, temperature: float, softcap: float,
             logit_scale: float = 1.0) -> LossOptions:
    return LossOptions(ignore_index=ignore_index, temperature=temperature, softcap=softcap,
                       logit_scale=logit_scale)


@custom_op("ce_tvm::log_probs", mutates_args=())
def log_probs_forward(x: Tensor, index: Tensor, ignore_index: int, temperature: float,
                      softcap: float, entropy: bool = True
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp[N, K], entropy[N], row_max[N], log_expsum[N])`` (accumulation
    dtype) of the logits ``x[N, V]`` at ``index[N, K]`` (int64; ``ignore_index``
    entries give 0); the last two are for the backward (``launch.log_probs``).
    ``entropy`` off: zeros in its place (``launch.log_probs``)."""
    check.in_range(index, x.shape[1], ignore_index, "index")
    return launch.log_probs(x.contiguous(), index.contiguous(),
                            _options(ignore_index, temperature, softcap), entropy=entropy)


@log_probs_forward.register_fake
def _(x, index, ignore_index, temperature, softcap, entropy=True):
    return _fake_outputs(x, index, stats=False)


@custom_op("ce_tvm::log_probs_stats", mutates_args=())
def log_probs_stats_forward(x: Tensor, index: Tensor, ignore_index: int, temperature: float,
                            softcap: float
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``log_probs_forward``'s outputs, then ``log_sum_sq_probs[N]``,
    ``mean_logits[N]`` (accumulation dtype) and ``is_top1[N, K]`` (bool), from
    the same sweep (``launch.log_probs(stats=True)``)."""
    check.in_range(index, x.shape[1], ignore_index, "index")
    return launch.log_probs(x.contiguous(), index.contiguous(),
                            _options(ignore_index, temperature, softcap), stats=True)


@log_probs_stats_forward.register_fake
def _(x, index, ignore_index, temperature, softcap):
    return _fake_outputs(x, index, stats=True)


def _fake_outputs(x: Tensor, index: Tensor, stats: bool) -> tuple:
    """Empty outputs of the (stats) forward ops, for ``x [N, ...]`` and ``index [N, K]``."""
    acc, n = accum_torch_dtype(x), x.shape[0]
    return (x.new_empty((n, index.shape[1]), dtype=acc),
            *(x.new_empty(n, dtype=acc) for _ in range(5 if stats else 3)),
            *([x.new_empty((n, index.shape[1]), dtype=torch.bool)] if stats else []))


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
    x, index, ignore_index, temperature, softcap = inputs[:5]
    ctx.save_for_backward(x, index, *output[1:4])
    ctx.scalars = dict(ignore_index=ignore_index, temperature=temperature, softcap=softcap)
    ctx.mark_non_differentiable(*output[2:])  # row_max, log_expsum (and the stats)
    ctx.set_materialize_grads(False)


def _backward_of(op):
    """The backward of the forward op ``op`` (its own arguments' gradients)."""
    def backward(ctx, grad_logp, grad_entropy, *_):
        if grad_logp is None and grad_entropy is None:
            return op_gradients(op)
        x, index, entropy, row_max, log_expsum = ctx.saved_tensors
        if grad_logp is None:  # the kernel takes both
            grad_logp = torch.zeros_like(index, dtype=entropy.dtype)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(entropy)
        return op_gradients(op, x=log_probs_backward(
            grad_logp, grad_entropy, x, index, row_max, log_expsum, entropy, **ctx.scalars))

    return backward


log_probs_forward.register_autograd(_backward_of(log_probs_forward),
                                    setup_context=_setup_context)
log_probs_stats_forward.register_autograd(_backward_of(log_probs_stats_forward),
                                          setup_context=_setup_context)


def log_probs(logits: Tensor, index: Tensor, *, temperature: float = 1.0, softcap: float = 0.0,
              row_mask: Tensor | None = None, ignore_index: int = -100,
              return_entropy: bool = False, logit_scale: float = 1.0,
              return_stats: bool = False):
    """Log-probabilities of ``index`` under ``softmax(cap(logits) / temperature)``
    (docs/spec.md, section 9), and with ``return_entropy=True`` the entropy of every row.

    ``logits`` ``[..., V]`` (float32, bfloat16, float16; float64 for gradcheck);
    ``index`` ``[...]`` (one class per row) or ``[..., K]``, int64/int32 class
    ids. Returns ``logp`` of ``index``'s shape, or ``(logp, entropy)`` with
    ``entropy`` of shape ``logits.shape[:-1]``; float32 (float64 for float64
    logits). An entry whose index is ``ignore_index``, and every entry of a row
    whose ``row_mask`` is false/0, is exactly 0 with no gradient (its index is
    not checked); the entropy is computed for every row. Gradients flow to
    the logits from both outputs.

    ``return_stats=True`` appends a ``LogProbStats`` ``(log_sum_sq_probs,
    mean_logits, is_top1)`` computed in the same sweep over the logits, without
    gradients: ``logp, stats`` or ``logp, entropy, stats``. ``log_sum_sq_probs``
    and ``mean_logits`` have the entropy's shape and dtype and are computed for
    every row; ``is_top1`` is bool of ``index``'s shape, one value per index
    (``K > 1`` included), false for ignored and masked entries.
    """
    options = _options(ignore_index, temperature, softcap, logit_scale)  # checks the scalars
    x = check.class_last_logits(logits)
    idx, single = check.index_columns(index, logits)
    idx, k = _live_columns(idx, check.row_mask(row_mask, logits), options.ignore_index)
    forward = log_probs_stats_forward if return_stats else log_probs_forward
    outputs = forward(x, idx, options.ignore_index, options.kernel_temperature,
                      options.kernel_softcap, *(() if return_stats else (return_entropy,)))
    return _shaped(outputs, k, single, tuple(logits.shape[:-1]), return_entropy, return_stats)


def _live_columns(idx: Tensor, mask: Tensor | None, ignore_index: int) -> tuple[Tensor, int]:
    """``(idx [M, max(K, 1)], K)``: a masked row's entries are ``ignore_index``
    (dead, their values never checked); ``K = 0`` gets one dead column, as the
    kernels take at least one."""
    if mask is not None:
        idx = torch.where(mask[:, None], idx, ignore_index)
    k = idx.shape[1]
    if k == 0:
        idx = idx.new_full((idx.shape[0], 1), ignore_index)
    return idx, k


def _shaped(outputs, k: int, single: bool, lead: tuple, return_entropy: bool,
            return_stats: bool = False):
    """The forward op's ``outputs`` in the caller's shapes: ``logp`` (and
    ``is_top1``) as the index, ``entropy`` (and the row stats) ``lead``; what was
    asked for only."""
    def as_index(t):
        return t[:, :k].reshape(lead if single else (*lead, k))

    logp, entropy = outputs[0], outputs[1]
    result = [as_index(logp)] + ([entropy.reshape(lead)] if return_entropy else [])
    if return_stats:
        log_sum_sq, mean_logits, is_top1 = outputs[4:7]
        result.append(LogProbStats(log_sum_sq.reshape(lead), mean_logits.reshape(lead),
                                   as_index(is_top1)))
    return tuple(result) if len(result) > 1 else result[0]


# --- Fused with the LM head: the logits never exist whole ---------------------


@custom_op("ce_tvm::linear_log_probs", mutates_args=())
def linear_log_probs_forward(input: Tensor, linear_weight: Tensor, linear_bias: Tensor | None,
                             index: Tensor, ignore_index: int, temperature: float,
                             softcap: float, chunk_rows: int, entropy: bool = True
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``log_probs_forward`` of ``input [N, H] @ linear_weight.T + linear_bias``,
    rows in chunks (``linear_sweep.chunk_rows``; ``chunk_rows`` 0: the default)."""
    classes = linear_weight.shape[0]
    check.in_range(index, classes, ignore_index, "index")
    rows = sweep.policy_rows(input.shape[0], classes, input.dtype, chunk_rows)
    return tuple(sweep.policy_outputs(input, linear_weight, linear_bias, index,
                                      _options(ignore_index, temperature, softcap), rows,
                                      entropy=entropy))


@linear_log_probs_forward.register_fake
def _(input, linear_weight, linear_bias, index, ignore_index, temperature, softcap, chunk_rows,
      entropy=True):
    return _fake_outputs(input, index, stats=False)


@custom_op("ce_tvm::linear_log_probs_stats", mutates_args=())
def linear_log_probs_stats_forward(
        input: Tensor, linear_weight: Tensor, linear_bias: Tensor | None, index: Tensor,
        ignore_index: int, temperature: float, softcap: float, chunk_rows: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``linear_log_probs_forward`` with ``log_probs_stats_forward``'s three more
    outputs, each chunk's in the same kernel call as its log-probs."""
    classes = linear_weight.shape[0]
    check.in_range(index, classes, ignore_index, "index")
    rows = sweep.policy_rows(input.shape[0], classes, input.dtype, chunk_rows, stats=True)
    return tuple(sweep.policy_outputs(input, linear_weight, linear_bias, index,
                                      _options(ignore_index, temperature, softcap), rows,
                                      stats=True))


@linear_log_probs_stats_forward.register_fake
def _(input, linear_weight, linear_bias, index, ignore_index, temperature, softcap, chunk_rows):
    return _fake_outputs(input, index, stats=True)


@custom_op("ce_tvm::linear_log_probs_backward", mutates_args=())
def linear_log_probs_backward(
        grad_logp: Tensor, grad_entropy: Tensor, input: Tensor, linear_weight: Tensor,
        linear_bias: Tensor | None, index: Tensor, entropy: Tensor, row_max: Tensor,
        log_expsum: Tensor, ignore_index: int, temperature: float, softcap: float,
        chunk_rows: int, grad_input: bool, grad_weight: bool, grad_bias: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_input, grad_weight, grad_bias)`` of ``sum grad_logp logp + sum
    grad_entropy entropy``, each chunk's logits recomputed; an empty tensor for
    each gradient not asked for."""
    acc = accum_torch_dtype(input)
    rows = sweep.policy_rows(input.shape[0], linear_weight.shape[0], input.dtype, chunk_rows)
    needs = sweep.Needs(grad_input, grad_weight, grad_bias and linear_bias is not None)
    return sweep.policy_grads(grad_logp.to(acc).contiguous(), grad_entropy.to(acc).contiguous(),
                              input, linear_weight, linear_bias, index,
                              [row_max, log_expsum, entropy],
                              _options(ignore_index, temperature, softcap), rows, needs)


@linear_log_probs_backward.register_fake
def _(grad_logp, grad_entropy, input, linear_weight, linear_bias, index, entropy, row_max,
      log_expsum, ignore_index, temperature, softcap, chunk_rows, grad_input, grad_weight,
      grad_bias):
    return (grad_like(input, grad_input, input), grad_like(linear_weight, grad_weight, input),
            grad_like(linear_bias, grad_bias, input))


def _setup_linear_context(ctx, inputs, output):
    x, W, b, index, ignore_index, temperature, softcap, chunk_rows = inputs[:8]
    ctx.save_for_backward(x, W, b, index, *output[1:4])
    ctx.options = (ignore_index, temperature, softcap, chunk_rows)
    ctx.mark_non_differentiable(*output[2:])  # row_max, log_expsum (and the stats)
    ctx.set_materialize_grads(False)


def _linear_backward_of(op):
    """The backward of the fused head's forward op ``op``."""
    def backward(ctx, grad_logp, grad_entropy, *_):
        needs = ctx.needs_input_grad[:3]
        if (grad_logp is None and grad_entropy is None) or not any(needs):
            return op_gradients(op)
        x, W, b, index, entropy, row_max, log_expsum = ctx.saved_tensors
        if grad_logp is None:  # the kernel takes both
            grad_logp = torch.zeros_like(index, dtype=entropy.dtype)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(entropy)
        grads = linear_log_probs_backward(grad_logp, grad_entropy, x, W, b, index, entropy,
                                          row_max, log_expsum, *ctx.options, *needs)
        return head_gradients(op, grads, needs)

    return backward


linear_log_probs_forward.register_autograd(_linear_backward_of(linear_log_probs_forward),
                                           setup_context=_setup_linear_context)
linear_log_probs_stats_forward.register_autograd(
    _linear_backward_of(linear_log_probs_stats_forward), setup_context=_setup_linear_context)


def linear_log_probs(input: Tensor, linear_weight: Tensor, index: Tensor, *,
                     linear_bias: Tensor | None = None, temperature: float = 1.0,
                     softcap: float = 0.0, row_mask: Tensor | None = None,
                     ignore_index: int = -100, return_entropy: bool = False,
                     chunk_rows: int | None = None, logit_scale: float = 1.0,
                     return_stats: bool = False):
    """``log_probs(input @ linear_weight.T + linear_bias, index, ...)`` without the
    logits ever existing whole (docs/spec.md, section 9).

    ``input [*, H]``, ``linear_weight [V, H]`` or the head module (run inside
    its own call, as ``linear_cross_entropy`` does), ``linear_bias [V]`` (one dtype);
    ``index`` ``[*]`` or ``[*, K]``; ``row_mask`` ``[*]``. Rows go through in
    chunks of ``chunk_rows`` (default: ``$CE_TVM_LINEAR_CHUNK_ROWS``, else, for
    float32/float64, up to 4096 rows meeting the weight a block of classes at a time
    whose logits stay in the cache (``runtime.vocab_blocks``); for 16-bit heads and
    with ``return_stats``, an eighth of the rows, at least 384, at most 256 MiB of
    logits); the backward recomputes the logits and gives the gradients of
    ``input``, ``linear_weight`` and ``linear_bias``. ``return_stats=True`` appends ``log_probs``'s
    ``LogProbStats``, each chunk's from the kernel call that gives its
    log-probs (not on the vocabulary-parallel path of a DTensor weight).
    """
    return heads.run(input, linear_weight, linear_bias, _fused, dtensors.linear_log_probs, index,
                     row_mask=row_mask, temperature=temperature, softcap=softcap,
                     ignore_index=ignore_index, return_entropy=return_entropy,
                     chunk_rows=chunk_rows, logit_scale=logit_scale, return_stats=return_stats)


def _fused(input: Tensor, linear_weight: Tensor, linear_bias: Tensor | None, index: Tensor, *,
           row_mask, temperature, softcap, ignore_index, return_entropy, chunk_rows,
           logit_scale, return_stats):
    """``linear_log_probs`` of plain tensors (``heads.run``'s local route)."""
    options = _options(ignore_index, temperature, softcap, logit_scale)
    input, linear_weight, linear_bias = check.head_dtypes(input, linear_weight, linear_bias)
    x = check.linear_head(input, linear_weight, linear_bias)
    idx, single = check.index_columns(index, input)
    rows = check.chunk_rows(chunk_rows)
    mask = check.row_mask(row_mask, input)
    idx, k = _live_columns(idx, mask, options.ignore_index)
    forward = linear_log_probs_stats_forward if return_stats else linear_log_probs_forward
    outputs = forward(x, linear_weight, linear_bias, idx, options.ignore_index,
                      options.kernel_temperature, options.kernel_softcap, rows,
                      *(() if return_stats else (return_entropy,)))
    return _shaped(outputs, k, single, tuple(input.shape[:-1]), return_entropy, return_stats)
