"""Vocab-parallel cross entropy: the loss of logits sharded along the vocabulary
over ``torch.distributed`` (tensor parallelism, as in Megatron-LM).

Rank ``r`` holds ``logits[:, offset_r : offset_r + C_r]`` (shards may differ
in width; ranks hold consecutive column ranges in rank order) and the same
``target`` (global class ids). Semantics are exactly docs/spec.md on the full
logits: smoothing uses the global C and the global sum of weights, the
z-loss the global ``lse``.

Communication per step: two ``all_reduce`` calls in the forward (the row
max, then one packed sum of the rescaled exp-sums, target logits, target
weights, weighted logit sums and the weight sum) and none in the backward.
With ``sum``/``mean`` under autograd the shard's gradient is computed in the
forward, right after the all_reduces, and the backward only scales it (the
shard's logits are not kept); ``none`` keeps the logits and the global row
statistics for a backward that computes it. The shard layout (one
``all_gather`` of the widths) is exchanged on every call.

These functions take local shards and a process group. What a DTensor (or an
LM head given as a module) means is decided in ``ce_tvm.distributed.heads``; the
DTensor readings (``ce_tvm.distributed.dtensors``) call them.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..losses import checks as check
from ..losses.autograd import ForwardGradients
from ..losses.outputs import with_extras
from ..runtime import launch, pool, vocab_blocks
from ..runtime import linear_sweep as sweep
from ..runtime.collectives import (
    accuracy_of,
    gathered_rows,
    global_stats,
    own_rows,
    shard_beats,
    shard_layout,
    summed_input_grad,
    target_raw_logit,
)
from ..runtime.options import LossOptions
from ..runtime.tensors import accum_torch_dtype


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, w, options: LossOptions, group, accuracy: bool):
        offset, classes = shard_layout(x.shape[1], group)
        y = check.targets(y, x, options.ignore_index, classes)
        w = check.weight(w, x)
        wsum = w.sum().reshape(1) if w is not None else x.new_zeros(1, dtype=torch.float32)
        extra = torch.cat([wsum, target_raw_logit(x, y, offset)]) if accuracy else wsum
        lse, logit, weight, wxsum, extra = global_stats(x, y, w, offset, options, group, extra)
        wsum = extra[:1]
        hits = (accuracy_of(shard_beats(x, y, offset, extra[1:], group), y, options.ignore_index)
                if accuracy else x.new_empty(0, dtype=torch.float32))
        ctx.mark_non_differentiable(hits)
        weight_sum = float(wsum) if w is not None else float(classes)
        loss, zloss = launch.shard_combine(lse, logit, weight, wxsum, y, weight_sum=weight_sum,
                                           classes=classes,
                                           dtype=launch.loss_torch_dtype(options, x),
                                           options=options)
        layout = dict(offset=offset, weight_sum=weight_sum, global_classes=classes)
        ctx.mark_non_differentiable(zloss)
        if ctx.needs_input_grad[0] and options.reduction != "none":
            # The shard's gradient for a unit upstream gradient, right after the
            # all_reduces: the backward only scales it, and the logits need not be kept.
            ctx.grads = ForwardGradients(
                [launch.shard_backward(lse.new_ones(1), x, lse, y, w, weight, **layout,
                                       options=options)],
                allow_retain_graph=True, entry="ce_tvm.distributed.vocab_parallel_cross_entropy")
        else:
            ctx.save_for_backward(x, lse, y, w, weight)
            ctx.layout, ctx.options = layout, options
        return loss, zloss, hits

    @staticmethod
    def backward(ctx, grad_loss, grad_zloss, grad_hits):
        if hasattr(ctx, "grads"):
            (grad,) = ctx.grads.scaled(grad_loss.reshape(-1))
        else:
            x, lse, y, w, weight = ctx.saved_tensors
            g = grad_loss.to(lse.dtype).reshape(-1).contiguous()
            grad = launch.shard_backward(g, x, lse, y, w, weight, **ctx.layout,
                                         options=ctx.options)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: Tensor, target: Tensor, weight: Tensor | None = None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                                 group=None, return_zloss: bool = False, *,
                                 softcap: float = 0.0, temperature: float = 1.0,
                                 logit_scale: float = 1.0,
                                 return_token_accuracy: bool = False,
                                 loss_dtype: torch.dtype | None = None):
    """Cross entropy of vocabulary-sharded logits ``[N, C_r]`` (see the module doc).

    ``weight`` is this rank's shard ``[C_r]`` of the class weights;
    ``softcap`` and ``temperature`` act as in ``ce_tvm.cross_entropy``. Returns
    what ``ce_tvm.cross_entropy`` returns on the full logits (a 0-d loss for
    ``mean``/``sum``), the same on every rank; with ``return_zloss`` also the
    z-loss part, without gradient; with ``return_token_accuracy`` last the
    token accuracy over the full rows (one more ``all_reduce`` of ``[N]``).
    ``loss_dtype`` as ``ce_tvm.cross_entropy`` takes it.
    """
    check.loss_dtype(loss_dtype)
    x = check.logits(logits_shard, "logits_shard")
    check.check_device(x)
    if not isinstance(target, Tensor) or target.dtype not in check.TARGET_DTYPES:
        raise TypeError("target must be an int64 or int32 tensor of global class ids")
    options = LossOptions(reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, zloss_scale=lse_square_scale,
                          softcap=softcap, temperature=temperature,
                          logit_scale=logit_scale,
                          wide_loss=check.wide_loss(loss_dtype, x.dtype))
    loss, zloss, accuracy = _VocabParallelCrossEntropy.apply(x, target, weight, options, group,
                                                             bool(return_token_accuracy))
    if options.reduction != "none":
        loss, zloss = loss.reshape(()), zloss.reshape(())
    return with_extras(loss, zloss if return_zloss else None,
                       accuracy if return_token_accuracy else None)


class VocabParallelCrossEntropyLoss(nn.Module):
    """``vocab_parallel_cross_entropy`` as a module (``weight``: this rank's shard)."""

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0,
                 lse_square_scale: float = 0.0, group=None, *, softcap: float = 0.0,
                 temperature: float = 1.0, logit_scale: float = 1.0,
                 loss_dtype: torch.dtype | None = None):
        super().__init__()
        check.loss_module(self, weight, loss_dtype, reduction=reduction,
                          ignore_index=ignore_index, label_smoothing=label_smoothing,
                          lse_square_scale=lse_square_scale, softcap=softcap,
                          temperature=temperature, logit_scale=logit_scale)
        self.group = group

    def forward(self, logits_shard: Tensor, target: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(
            logits_shard, target, self.weight, ignore_index=self.ignore_index,
            reduction=self.reduction, label_smoothing=self.label_smoothing,
            lse_square_scale=self.lse_square_scale, group=self.group, softcap=self.softcap,
            temperature=self.temperature, logit_scale=self.logit_scale,
            loss_dtype=self.loss_dtype)


# --- The LM head sharded over the vocabulary (docs/spec.md, section 12) -------
# Rank r holds rows [offset_r, offset_r + V_r) of the head's weight. Rows of
# the input go through in chunks (``linear_sweep``): per chunk the shard's
# logits ([rows, V_r], the only logits a rank ever holds), their statistics
# combined over the group (``global_stats``: O(rows) floats), the loss rows,
# and for sum/mean the shard's gradient in the same sweep (the upstream
# gradient is then a scalar the backward multiplies in). The input's
# gradient is a sum over the shards: one all_reduce of [N, H] at the end.


def _head_grads(sink: sweep.GradSink, x: Tensor, needs: sweep.Needs, group,
                sequence_parallel: bool) -> list:
    """The sweep's ``[grad_input, grad_weight, grad_bias]``, ``None`` where not
    needed; the input's summed over the group (this rank's block under SP)."""
    gx, gW, gb = sink.finish(x)
    if needs.input:
        gx = summed_input_grad(gx, group, sequence_parallel)
    return [g if wanted else None for g, wanted in
            zip((gx, gW, gb), (needs.input, needs.weight, needs.bias))]


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_in, W, b, y, w, options: LossOptions, group, sequence_parallel: bool,
                rows: int, needs: sweep.Needs, accuracy: bool):
        offset, classes = shard_layout(W.shape[0], group)
        x = gathered_rows(x_in, group) if sequence_parallel else x_in.contiguous()
        y = check.targets(y, x, options.ignore_index, classes)
        w = check.weight(w, x, classes=W.shape[0])
        acc = accum_torch_dtype(x)
        n, kept = x.shape[0], y != options.ignore_index
        count = kept.sum(dtype=acc).reshape(1)
        if w is not None:  # D = sum_n w[y_n] m_n and sum_c w[c]: the shards' parts summed
            local = y - offset
            inside = kept & (local >= 0) & (local < W.shape[0])
            wy = torch.where(inside, w[local.clamp(0, W.shape[0] - 1)], 0.0)
            totals = torch.cat([wy.sum(dtype=acc).reshape(1), w.sum(dtype=acc).reshape(1)])
            dist.all_reduce(totals, group=group)
            denom, weight_sum = totals[:1], float(totals[1])
        else:
            denom, weight_sum = count, float(classes)
        rows = sweep.chunk_rows(n, W.shape[0], x.dtype, rows)
        buffer = pool.POOL.empty((rows, W.shape[0]), x.dtype, x.device)
        per_row = replace(options, reduction="none")
        loss_dtype = launch.loss_torch_dtype(options, x)
        loss_rows, z_rows = x.new_empty(n, dtype=loss_dtype), x.new_empty(n, dtype=loss_dtype)
        lse_all, wy_all = x.new_empty(n, dtype=acc), x.new_empty(n, dtype=acc)
        beats = x.new_zeros(n, dtype=torch.float32)
        one_pass = options.reduction != "none" and needs.any()
        slices = sweep.chunks(n, rows)
        sink = sweep.GradSink(x, W, b, needs, len(slices)) if one_pass else None
        grad_ce = (1.0 / denom if options.reduction == "mean" else count.new_ones(1))
        grad_z = (1.0 / count if options.reduction == "mean" else count.new_ones(1))
        for sl in slices:
            logits = sweep.project(buffer, x[sl], W, b)
            extra = (target_raw_logit(logits, y[sl], offset) if accuracy
                     else count.new_zeros(0))
            lse, logit, weight, wxsum, target = global_stats(logits, y[sl], w, offset, options,
                                                              group, extra)
            if accuracy:  # before the gradient takes the logits' place
                beats[sl] = shard_beats(logits, y[sl], offset, target, group)
            loss_rows[sl], z_rows[sl] = launch.shard_combine(
                lse, logit, weight, wxsum, y[sl], weight_sum=weight_sum, classes=classes,
                dtype=loss_dtype, options=per_row)
            lse_all[sl], wy_all[sl] = lse, weight
            if one_pass:
                m = sl.stop - sl.start
                launch.shard_backward(grad_ce.expand(m).contiguous(), logits, lse, y[sl], w,
                                      weight, offset=offset, weight_sum=weight_sum,
                                      global_classes=classes, options=per_row,
                                      grad_zloss=(grad_z - grad_ce).expand(m).contiguous(),
                                      out=logits)
                sink.add(sl, x[sl], logits, W)
        ctx.group, ctx.sp, ctx.needs = group, sequence_parallel, needs
        hits = (accuracy_of(beats, y, options.ignore_index) if accuracy
                else x.new_empty(0, dtype=torch.float32))
        ctx.mark_non_differentiable(z_rows, hits)
        if options.reduction == "none":
            ctx.save_for_backward(x, W, b, y, w, lse_all, wy_all)
            ctx.layout = dict(offset=offset, weight_sum=weight_sum, global_classes=classes)
            ctx.options, ctx.rows, ctx.grads = per_row, rows, None
            if sequence_parallel:
                return (own_rows(loss_rows, group).clone(), own_rows(z_rows, group).clone(),
                        hits)
            return loss_rows, z_rows, hits
        if one_pass:
            ctx.grads = ForwardGradients(
                _head_grads(sink, x, needs, group, sequence_parallel), allow_retain_graph=True,
                entry="ce_tvm.distributed.vocab_parallel_linear_cross_entropy")
        total = loss_rows.sum(dtype=acc).reshape(1)
        z = z_rows.sum(dtype=acc).reshape(1)
        if options.reduction == "mean":
            total, z = (total - z) / denom + z / count, z / count
        return total.to(loss_dtype), z.to(loss_dtype), hits

    @staticmethod
    def backward(ctx, grad_loss, grad_zloss, grad_hits):
        needs = ctx.needs
        if ctx.grads is not None:
            grads = ctx.grads.scaled(grad_loss)
        else:
            x, W, b, y, w, lse, wy = ctx.saved_tensors
            g = grad_loss.to(lse.dtype).contiguous()
            if ctx.sp:
                g = gathered_rows(g, ctx.group)
            def to_grad(sl, logits):
                launch.shard_backward(g[sl], logits, lse[sl], y[sl], w, wy[sl], **ctx.layout,
                                      options=ctx.options, out=logits)

            sink = sweep.recomputed_grads(x, W, b, ctx.rows, needs, to_grad)
            grads = _head_grads(sink, x, needs, ctx.group, ctx.sp)
        return (*grads, None, None, None, None, None, None, None, None)


def vocab_parallel_linear_cross_entropy(input: Tensor, local_weight: Tensor, target: Tensor, *,
                                        group=None, local_bias: Tensor | None = None,
                                        weight: Tensor | None = None, reduction: str = "mean",
                                        ignore_index: int = -100, label_smoothing: float = 0.0,
                                        lse_square_scale: float = 0.0, softcap: float = 0.0,
                                        temperature: float = 1.0,
                                        logit_scale: float = 1.0, return_zloss: bool = False,
                                        return_token_accuracy: bool = False,
                                        sequence_parallel: bool = False,
                                        chunk_rows: int | None = None,
                                        loss_dtype: torch.dtype | None = None):
    """``ce_tvm.linear_cross_entropy`` with the LM head's weight sharded over the
    vocabulary (docs/spec.md, section 12): rank ``r`` passes its rows ``local_weight [V_r,
    H]`` (and ``local_bias``, ``weight``: its shards of the bias and the class
    weights; ranks hold consecutive rows in rank order, widths free) and the
    global class ids ``target``. No rank holds more than one chunk of its
    shard's logits; per chunk only per-row statistics cross ranks.

    ``input [*, H]`` is the same on every rank, its gradient the full one; with
    ``sequence_parallel=True`` it is this rank's block of rows (equal blocks,
    rank order) and ``target`` the global rows: a ``none`` loss and the input's
    gradient are then this rank's block. Scalars are global; the weight's and
    bias' gradients are this rank's shards of the full ones. ``return_zloss``
    and ``return_token_accuracy`` add the z-loss part and the token accuracy
    (global) to the result, as ``ce_tvm.linear_cross_entropy`` does, and
    ``loss_dtype`` too.
    """
    check.loss_dtype(loss_dtype)
    input, local_weight, local_bias = check.head_dtypes(input, local_weight, local_bias)
    x = check.linear_head(input, local_weight, local_bias)
    options = LossOptions(reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, zloss_scale=lse_square_scale,
                          softcap=softcap, temperature=temperature,
                          logit_scale=logit_scale,
                          wide_loss=check.wide_loss(loss_dtype, x.dtype))
    if not isinstance(target, Tensor) or target.dtype not in check.TARGET_DTYPES:
        raise TypeError("target must be an int64 or int32 tensor of global class ids")
    rows = check.chunk_rows(chunk_rows)
    needs = sweep.Needs.of(input, local_weight, local_bias)
    loss, zloss, accuracy = _VocabParallelLinearCrossEntropy.apply(
        x, local_weight, local_bias, target.reshape(-1), weight, options, group,
        bool(sequence_parallel), rows, needs, bool(return_token_accuracy))
    shape = tuple(input.shape[:-1]) if options.reduction == "none" else ()
    return with_extras(loss.reshape(shape), zloss.reshape(shape) if return_zloss else None,
                       accuracy if return_token_accuracy else None)


class VocabParallelLinearCrossEntropyLoss(nn.Module):
    """``vocab_parallel_linear_cross_entropy`` as a module holding the loss options
    (``weight``: this rank's shard of the class weights); the head's local weight
    and bias are passed at call time."""

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0,
                 lse_square_scale: float = 0.0, group=None, *, softcap: float = 0.0,
                 temperature: float = 1.0,
                 logit_scale: float = 1.0, sequence_parallel: bool = False,
                 chunk_rows: int | None = None, loss_dtype: torch.dtype | None = None):
        super().__init__()
        check.loss_module(self, weight, loss_dtype, reduction=reduction,
                          ignore_index=ignore_index, label_smoothing=label_smoothing,
                          lse_square_scale=lse_square_scale, softcap=softcap,
                          temperature=temperature, logit_scale=logit_scale)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.chunk_rows = check.chunk_rows(chunk_rows) or None

    def forward(self, input: Tensor, local_weight: Tensor, target: Tensor,
                local_bias: Tensor | None = None) -> Tensor:
        return vocab_parallel_linear_cross_entropy(
            input, local_weight, target, group=self.group, local_bias=local_bias,
            weight=self.weight, reduction=self.reduction, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale,
            softcap=self.softcap, temperature=self.temperature, logit_scale=self.logit_scale,
            sequence_parallel=self.sequence_parallel, chunk_rows=self.chunk_rows,
            loss_dtype=self.loss_dtype)


# Log-probs and entropy of the sharded head (docs/spec.md, sections 9 and 12). Per chunk
# each rank runs the log-prob kernel on its logits, with the indices of other
# shards dead, and the shards' outputs are merged as a single device merges its
# vocabulary blocks (``vocab_blocks.merge_log_probs``: one all_reduce for the
# global max, one for the sums). The backward's kernel gets the global ``M``,
# ``log S`` and ``H``, and the other shards' live entries out of range.


class _VocabParallelLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_in, W, b, index, options: LossOptions, group, sequence_parallel: bool,
                rows: int, needs: sweep.Needs, entropy: bool):
        offset, classes = shard_layout(W.shape[0], group)
        x = gathered_rows(x_in, group) if sequence_parallel else x_in.contiguous()
        check.in_range(index, classes, options.ignore_index, "index")
        ii, width, inv_t = options.ignore_index, W.shape[0], 1.0 / options.kernel_temperature
        forward_index = vocab_blocks.shard_index(index, offset, width, ii, others=ii)
        n, k = index.shape
        rows = sweep.chunk_rows(n, width, x.dtype, rows)
        buffer = pool.POOL.empty((rows, width), x.dtype, x.device)
        acc = accum_torch_dtype(x)
        logp_all, stats = x.new_empty((n, k), dtype=acc), x.new_empty((3, n), dtype=acc)

        def max_over(t):
            top = t.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            return top

        def sum_over(*ts):  # one all_reduce for all
            packed = torch.cat([t.reshape(-1) for t in ts])
            dist.all_reduce(packed, group=group)
            return [part.view(t.shape) for part, t in
                    zip(packed.split([t.numel() for t in ts]), ts)]

        for sl in sweep.chunks(n, rows):
            logits = sweep.project(buffer, x[sl], W, b)
            logp, part_entropy, row_max, log_s = launch.log_probs(
                logits, forward_index[sl], options, entropy=entropy)
            logp, rows_entropy, top, log_total = vocab_blocks.merge_log_probs(
                logp, part_entropy if entropy else None, row_max, log_s,
                forward_index[sl] != ii, index[sl] != ii, inv_t, max_over, sum_over)
            logp_all[sl] = logp
            stats[:, sl] = torch.stack([top, log_total, rows_entropy])
        ctx.save_for_backward(x, W, b,
                              vocab_blocks.shard_index(index, offset, width, ii, others=width),
                              stats)
        ctx.options, ctx.group, ctx.sp, ctx.rows, ctx.needs = (options, group,
                                                               sequence_parallel, rows, needs)
        entropy = stats[2].clone()
        if sequence_parallel:
            return own_rows(logp_all, group).clone(), own_rows(entropy, group).clone()
        return logp_all, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        x, W, b, index, stats = ctx.saved_tensors
        needs = ctx.needs
        none = (None,) * 7
        if (grad_logp is None and grad_entropy is None) or not needs.any():
            return (None, None, None, *none)
        g = (torch.zeros_like(index, dtype=stats.dtype) if grad_logp is None
             else grad_logp.to(stats.dtype))
        h = (torch.zeros(index.shape[0], dtype=stats.dtype, device=stats.device)
             if grad_entropy is None else grad_entropy.to(stats.dtype))
        if ctx.sp:
            g = gathered_rows(g, ctx.group) if grad_logp is not None else g
            h = gathered_rows(h, ctx.group) if grad_entropy is not None else h
        def to_grad(sl, logits):
            launch.log_probs_backward(g[sl].contiguous(), h[sl].contiguous(), logits, index[sl],
                                      stats[0, sl], stats[1, sl], stats[2, sl], ctx.options,
                                      out=logits)

        sink = sweep.recomputed_grads(x, W, b, ctx.rows, needs, to_grad)
        return (*_head_grads(sink, x, needs, ctx.group, ctx.sp), *none)


def vocab_parallel_linear_log_probs(input: Tensor, local_weight: Tensor, index: Tensor, *,
                                    group=None, local_bias: Tensor | None = None,
                                    temperature: float = 1.0,
                                    logit_scale: float = 1.0, softcap: float = 0.0,
                                    row_mask: Tensor | None = None, ignore_index: int = -100,
                                    return_entropy: bool = False,
                                    sequence_parallel: bool = False,
                                    chunk_rows: int | None = None,
                                    return_stats: bool = False):
    """``ce_tvm.linear_log_probs`` with the LM head's weight sharded over the
    vocabulary (docs/spec.md, sections 9 and 12; the layout of
    ``vocab_parallel_linear_cross_entropy``): ``index`` ``[*]`` or ``[*, K]``
    global class ids and ``row_mask`` ``[*]`` for the global rows. Without
    sequence parallelism ``input [*, H]`` is the same on every rank; with it,
    this rank's block of rows, and the log-probs, the entropy and the input's
    gradient are this rank's block. ``return_stats=True`` is refused
    (``ValueError``): the statistics are not combined over shards yet."""
    if return_stats:
        raise ValueError("return_stats=True is not supported on the vocabulary-parallel path "
                         "(a weight sharded over the vocabulary) yet: gather the weight, or "
                         "compute the statistics without it")
    options = LossOptions(ignore_index=ignore_index, temperature=temperature, softcap=softcap,
                          logit_scale=logit_scale)
    input, local_weight, local_bias = check.head_dtypes(input, local_weight, local_bias)
    x = check.linear_head(input, local_weight, local_bias)
    world = dist.get_world_size(group) if sequence_parallel else 1
    rows_of = input.new_empty(()).expand(input.shape[0] * world, *input.shape[1:])  # no memory
    idx, single = check.index_columns(index, rows_of)
    mask = check.row_mask(row_mask, rows_of)
    if mask is not None:
        idx = torch.where(mask[:, None], idx, options.ignore_index)
    k = idx.shape[1]
    if k == 0:  # the kernels take at least one column: a dead one
        idx = idx.new_full((idx.shape[0], 1), options.ignore_index)
    rows = check.chunk_rows(chunk_rows)
    needs = sweep.Needs.of(input, local_weight, local_bias)
    logp, entropy = _VocabParallelLinearLogProbs.apply(x, local_weight, local_bias, idx, options,
                                                       group, bool(sequence_parallel), rows,
                                                       needs, bool(return_entropy))
    lead = tuple(input.shape[:-1])
    logp = logp[:, :k].reshape(lead if single else (*lead, k))
    return (logp, entropy.reshape(lead)) if return_entropy else logp
