"""The one-pass training kernel: the forward and, in the same sweep over
each row, the gradient for a unit upstream gradient.
"""

from __future__ import annotations

from tvm import te, tirx

from . import fastmath
from .choices import one_hot_by_chunk, row_shift
from .common import (
    class_weights,
    int64,
    logits_inputs,
    loss_logits,
    masked_target,
    row_stats,
    same_class,
    scalar_args,
)
from .kinds import Variant
from .loss_terms import (
    grad_coefficients,
    logit_grad,
    reduce_forward,
    row_hits,
    row_losses,
    smooth_term,
)
from .stages import CHUNK_PSCALE, LSE, MEAN_NORMS, X_GRAD


def train_func(classes: int, dtype: str, variant: Variant,
               chunk: int | None = None, lanes: int = 0) -> tirx.PrimFunc:
    """The forward (docs/spec.md, section 2) and, in the same sweep over each row,
    the logits gradient (section 3) for a unit upstream gradient
    (``grad_loss = 1``, no ``grad_zloss``): what autograd needs in training.

    Per row, chunk by chunk (the layout of ``forward_func``): the chunk max,
    ``e = exp(x - chunk_max)`` kept (``ce_chunk_exp``, float32) and summed;
    after the chunks merge into ``lse``, the gradient reads ``e`` back, scaled
    per chunk by ``exp(chunk_max - lse) * pscale`` (``ce_chunk_pscale``: one
    ``exp`` per chunk, not per element). ``D`` and ``M`` of the mean come
    from the targets alone. ``sum`` and ``mean`` only: ``none`` needs an
    upstream gradient per row, so its gradient waits for the backward.

    Where the schedule asks (``choices.row_shift``, ``Variant.shifts_rows``) the
    kept ``exp`` and its sum are against the row's shift, the max of its first
    chunk, instead of each chunk's max (``row_stats``' ``row_shift``), so that a
    chunk is swept once before its gradient; ``lse`` is then ``+inf`` for a
    row whose max lies too far above the shift, and the caller computes the
    call again.

    ``lanes``: the chunks are merged in that many lanes first (``row_stats``)
    and nothing is kept: the gradient recomputes ``exp(z - lse)`` from the
    logits read again after the row's ``lse``, as the backward does (a
    schedule keeps that second read in a cache).

    Arguments: those of ``forward_func``; outputs (``mean`` only) ``norms[2]``
    = ``(D, M)`` (accumulation dtype), ``x_grad[N, C]`` (dtype, rounded once),
    ``lse[N]``, ``loss`` and ``zloss`` as in ``forward_func``, then (accuracy
    variant) ``hit[N]`` as in ``forward_func``.
    """
    if variant.reduction == "none":
        raise ValueError("train_func needs reduction 'sum' or 'mean'")
    acc, n_rows, x, y, w = logits_inputs(classes, dtype, variant.weighted)
    ii, eps, s, *_ = scalars = scalar_args(acc, variant)
    if not variant.smoothing:
        eps = None
    logit = loss_logits(x, acc, variant, scalars)
    mask, index = masked_target(y, ii, classes)
    one, zero = tirx.const(1.0, acc), tirx.const(0.0, acc)
    st = row_stats(logit, class_weights(w), n_rows, classes, acc, chunk, keep_exp=not lanes,
                    target=index if variant.accuracy else None, lanes=lanes,
                    weighted_sum=variant.smoothing,
                    row_shift=row_shift.get() and variant.shifts_rows() and not lanes)
    lse = te.compute((n_rows,), lambda n: st.lse(n, logit), name=LSE)

    def wc(c):
        return w[c] if w is not None else one

    def target_weight(n):
        return wc(index(n))

    rows = row_losses(
        n_rows, tirx.const(float(classes), acc), acc, eps, s, mask, lse,
        target_logit=lambda n: logit(n, index(n)), target_weight=target_weight,
        wxsum=lambda n: st.wxsum[n], wsum=st.weight_sum, reduction=variant.reduction)
    totals = reduce_forward(rows, n_rows, dtype, variant.reduction,
                          variant.wide_loss)
    outs = totals.outputs
    if variant.reduction == "mean":
        denom, count = totals.weight, totals.count
        row_grad, row_zgrad = (lambda n: one / denom[0]), (lambda n: one / count[0])
        norms = [te.compute((2,), lambda i: tirx.Select(i == 0, denom[0], count[0]),
                            name=MEAN_NORMS)]
    else:
        row_grad = row_zgrad = lambda n: one
        norms = []
    hot, smooth, p_scale = grad_coefficients(
        n_rows, acc, eps, s, mask, lse, target_weight, st.weight_sum,
        tirx.const(float(classes), acc), row_grad, row_zgrad)
    if lanes:
        def grad(n, c):
            onehot = tirx.Select(same_class(c, index(n)), hot[n], zero)
            p = fastmath.exp(logit(n, c) - lse[n], nonpositive=True, storage=dtype)
            return logit_grad(logit, n, c, p * p_scale[n], onehot, smooth_term(smooth, n, wc(c)),
                              dtype)
    else:
        grad = _kept_exp_grad(logit, st, lse, p_scale, hot, smooth, index, wc, classes, dtype)
    x_grad = te.compute((n_rows, int64(classes)), grad, name=X_GRAD)
    # Outputs in dependence order (the kernel's stages follow them): the mean's
    # D and M before the row sweep, the sweep's x_grad before the sums over rows.
    args = ([x, y] + ([w] if w is not None else []) + list(scalars) + norms + [x_grad, lse]
            + outs)
    if variant.accuracy:
        args.append(row_hits(n_rows, acc, mask, st.beats))
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def _kept_exp_grad(logit, st, lse, p_scale, hot, smooth, index, wc, classes: int, dtype: str):
    """The gradient of ``train_func``'s chunked rows, from the kept ``e`` scaled per
    chunk by ``exp(chunk_max - lse) * pscale`` (``ce_chunk_pscale``)."""
    zero = tirx.const(0.0, logit.acc)
    n_rows = lse.shape[0]
    lay, kept = st.layout, st.chunk_exp
    chunk_scale = te.compute(
        (n_rows, int64(lay.n_chunks)),
        lambda n, k: fastmath.exp(st.chunk_top(n, k) - lse[n], nonpositive=True) * p_scale[n],
        name=CHUNK_PSCALE)
    size = int64(lay.chunk)

    def grad(n, c):
        if lay.exact:
            k, j = tirx.floordiv(c, size), tirx.floormod(c, size)
        else:  # columns past the last full chunk are read from the (overlapping) last one
            tail = c >= int64(lay.last_full())
            k = tirx.Select(tail, int64(lay.n_chunks - 1), tirx.floordiv(c, size))
            j = tirx.Select(tail, c - int64(classes - lay.chunk), tirx.floormod(c, size))
        onehot = tirx.Select(same_class(c, index(n)), hot[n], zero)
        if one_hot_by_chunk.get():  # see choices.one_hot_by_chunk
            onehot = tirx.if_then_else(
                tirx.floordiv(c, size) == tirx.floordiv(index(n), size), onehot, zero)
        return logit_grad(logit, n, c, kept[n, k, j] * chunk_scale[n, k], onehot,
                          smooth_term(smooth, n, wc(c)), dtype)

    return grad
