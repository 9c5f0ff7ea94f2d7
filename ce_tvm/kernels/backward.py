"""The logits gradient (docs/spec.md, section 3), from log-probs, logits, or a
vocabulary shard's logits.
"""

from __future__ import annotations

from tvm import te, tirx

from . import fastmath
from .common import (
    int64,
    loss_logits,
    masked_target,
    same_class,
    scalar_args,
    symbolic_rows,
    weight_total,
)
from .kinds import Variant, accum_dtype
from .loss_terms import grad_coefficients, logit_grad, mean_totals
from .stages import X_GRAD


def backward_func(classes: int, dtype: str, variant: Variant) -> tirx.PrimFunc:
    """The logits gradient of docs/spec.md, section 3, as a PrimFunc.

    Arguments, in order: ``grad_loss[G]`` and ``grad_zloss[G]`` (accumulation
    dtype; ``G = N`` for ``none``, else 1; pass zeros for an absent
    ``grad_zloss``), the source (``log_prob[N, C]``, or ``x[N, C]`` for the
    ``logits`` and ``shard`` sources), ``lse[N]`` (accumulation dtype; only
    read when ``zloss_scale != 0`` or for a logits source), ``target[N]``,
    ``weight[C]`` (weighted only); for the ``shard`` source (``x`` holds
    columns ``[shard_offset, shard_offset + C)`` of the full logits, ``lse``
    is the full row's) also ``target_weight[N]`` (``w[y[n]]`` over the full
    vocabulary), ``shard_offset``, ``weight_sum`` and ``global_classes``;
    then ``ignore_index``, ``label_smoothing``, ``zloss_scale``, and
    ``softcap`` (capped variant with a logits or shard source: the gradient
    is taken through ``t * tanh(x / t)``), ``inv_temperature`` (tempered
    variant, likewise); output ``x_grad[N, C]`` (dtype).
    """
    acc = accum_dtype(dtype)
    n_rows = symbolic_rows()
    g_shape = (n_rows,) if variant.reduction == "none" else (1,)
    g = te.placeholder(g_shape, acc, name="grad_loss")
    gzl = te.placeholder(g_shape, acc, name="grad_zloss")
    src = te.placeholder((n_rows, int64(classes)), dtype,
                         name="log_prob" if variant.grad_source == "log_prob" else "x")
    lse = te.placeholder((n_rows,), acc, name="lse")
    y = te.placeholder((n_rows,), "int64", name="target")
    w = te.placeholder((int64(classes),), acc, name="weight") if variant.weighted else None
    if variant.softcap and variant.grad_source == "log_prob":
        raise ValueError("the backward from log_prob (the seed pair) has no softcap")
    if variant.tempered and variant.grad_source == "log_prob":
        raise ValueError("the backward from log_prob (the seed pair) has no temperature")
    ii, eps, s, *_ = scalars = scalar_args(acc, variant)
    logit = loss_logits(src, acc, variant, scalars)
    mask, index = masked_target(y, ii, classes)
    one, zero = tirx.const(1.0, acc), tirx.const(0.0, acc)

    def wc(c):
        return w[c] if w is not None else one

    if variant.grad_source == "shard":
        tw = te.placeholder((n_rows,), acc, name="target_weight")
        offset, total_w = te.var("shard_offset", "int64"), te.var("weight_sum", acc)
        c_full = te.var("global_classes", acc)
        shard_args = [tw, offset, total_w, c_full]

        def target_weight(n):
            return tw[n]

        def onehot_index(n):  # -1 (no column) when the target lives in another shard
            local = y[n] - offset
            inside = tirx.all(local >= int64(0), local < int64(classes))
            return tirx.Select(inside, local, int64(-1))
    else:
        shard_args, c_full, onehot_index = [], tirx.const(float(classes), acc), index

        def target_weight(n):
            return wc(index(n))

        if w is not None:
            total_w = weight_total(w)[0]
        else:
            total_w = tirx.const(float(classes), acc)

    def logp(n, c):
        value = logit(n, c)
        return value if variant.grad_source == "log_prob" else value - lse[n]

    if variant.reduction == "mean":
        denom, count = mean_totals(n_rows, acc, mask, target_weight)

    def row_grad(n):
        g_n = g[n if variant.reduction == "none" else 0]
        return g_n / denom[0] if variant.reduction == "mean" else g_n

    def row_zgrad(n):
        gi = n if variant.reduction == "none" else 0
        gz = g[gi] + gzl[gi]
        return gz / count[0] if variant.reduction == "mean" else gz

    hot, smooth, p_scale = grad_coefficients(n_rows, acc, eps, s, mask, lse, target_weight,
                                              lambda n: total_w, c_full, row_grad, row_zgrad)

    def grad(n, c):
        onehot = tirx.Select(same_class(c, onehot_index(n)), hot[n], zero)
        # x - lse <= 0 for a logits source; a caller's log_prob gets the full clamps.
        p = fastmath.exp(logp(n, c), nonpositive=variant.grad_source != "log_prob",
                         storage=dtype)
        return logit_grad(logit, n, c, p * p_scale[n], onehot, smooth[n] * wc(c), dtype)

    x_grad = te.compute((n_rows, int64(classes)), grad, name=X_GRAD)
    args = ([g, gzl, src, lse, y] + ([w] if w is not None else []) + shard_args
            + list(scalars) + [x_grad])
    return te.create_prim_func(args).with_attr("global_symbol", "main")
