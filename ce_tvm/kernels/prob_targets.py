"""Probability targets (docs/spec.md, section 5): the loss, the logits' gradient
and the targets' gradient.
"""

from __future__ import annotations

from tvm import te, tirx

from . import fastmath
from .common import (
    ElementWeights,
    int64,
    logits_inputs,
    loss_logits,
    row_stats,
    scalar_args,
)
from .kinds import Variant
from .loss_terms import reduce_forward
from .stages import (
    GRAD_PSCALE,
    GRAD_SMOOTH,
    LSE,
    ROW_CE,
    ROW_MASK,
    ROW_MASS,
    ROW_REF,
    ROW_Z,
    TARGET_GRAD,
    X_GRAD,
)


def _target_mass(q, w, eps, classes: int, acc: str):
    """``v(n, c) = w[c] q'[n, c]`` with ``q' = (1 - eps) q + eps / C``
    (docs/spec.md, section 5): the weight of ``logp[n, c]`` in a probability target's loss."""
    one, spread = tirx.const(1.0, acc), eps / tirx.const(float(classes), acc)

    def mass(n, c):
        smoothed = (one - eps) * q[n, c].astype(acc) + spread
        return w[c] * smoothed if w is not None else smoothed

    return mass


def prob_forward_func(classes: int, dtype: str, variant: Variant,
                      chunk: int | None = None) -> tirx.PrimFunc:
    """The loss of probability targets (docs/spec.md, section 5) as a PrimFunc.

    With the target mass ``v = w q'`` (``_target_mass``) as the per-element
    weight of the row statistics (chunked as in ``forward_func``), a row's
    loss is ``-sum_c v logp = (lse - r) sum_c v - sum_c v (x - r)``
    (``ce_row_ce``), with ``r`` the row's first logit (0 if not finite): no
    cancellation of a large common offset, ``lse - r`` taken as
    ``(rowmax - r) + log(expsum)``. Its z-loss is ``s * lse^2``. Every row
    counts: the mean divides both by ``N`` (the ``ce_row_mask`` of this
    kernel is 1).

    Arguments, in order: ``x[N, C]``, ``target[N, C]`` (dtype),
    ``weight[C]`` (accumulation dtype, weighted variant only),
    ``label_smoothing``, ``zloss_scale``, ``softcap`` (capped variant only:
    ``x`` is read as ``t * tanh(x / t)``); outputs ``loss`` and ``zloss``
    (``[N]`` for ``none``, else ``[1]``, dtype), ``lse[N]`` and
    ``target_mass[N]`` (``sum_c v``; accumulation dtype), which the backward
    takes.
    """
    acc, n_rows, x, q, w = logits_inputs(classes, dtype, variant.weighted, probs=True)
    _, eps, s, *rest = scalars = scalar_args(acc, variant)
    logit = loss_logits(x, acc, variant, scalars)

    def first_logit(n):  # a value near the row's others, read before the row's reductions
        first = logit(n, int64(0))
        return tirx.Select(tirx.isfinite(first), first, tirx.const(0.0, acc))

    # a stage of its own for the chunks (whose schedules stage only their chunk of x)
    ref = te.compute((n_rows,), first_logit, name=ROW_REF)
    st = row_stats(logit, ElementWeights(_target_mass(q, w, eps, classes, acc)), n_rows,
                    classes, acc, chunk, shift=lambda n: ref[n])
    lse = te.compute((n_rows,), lambda n: logit.scaled(st.rowmax[n]) + te.log(st.expsum[n]),
                     name=LSE)
    mass = te.compute((n_rows,), st.weight_sum, name=ROW_MASS)
    every = te.compute((n_rows,), lambda n: tirx.const(1.0, acc), name=ROW_MASK)
    rows = {
        "ce": te.compute((n_rows,), lambda n: (
            (logit.scaled(st.rowmax[n]) - first_logit(n)) + te.log(st.expsum[n]))
            * st.weight_sum(n)
            - st.wxsum[n],
            name=ROW_CE),
        "z": te.compute((n_rows,), lambda n: s * lse[n] * lse[n], name=ROW_Z),
    }
    if variant.reduction == "mean":
        rows["weight"] = rows["count"] = every
    outs = reduce_forward(rows, n_rows, dtype, variant.reduction,
                          variant.wide_loss).outputs
    args = [x, q] + ([w] if w is not None else []) + [eps, s, *rest] + outs + [lse, mass]
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def _prob_row_grad(g, n_rows, reduction: str, acc: str):
    """``ce_grad_smooth``: each row's upstream gradient ``r[n]`` (``g[n]`` for
    ``none``; ``g``, divided by ``N`` for ``mean``)."""
    def row_grad(n):
        if reduction == "none":
            return g[n]
        return g[0] / n_rows.astype(acc) if reduction == "mean" else g[0]

    return te.compute((n_rows,), row_grad, name=GRAD_SMOOTH)


def _grad_input(n_rows, acc: str, reduction: str):
    """The ``grad_loss`` placeholder: ``[N]`` for ``none``, else ``[1]``."""
    return te.placeholder((n_rows,) if reduction == "none" else (1,), acc, name="grad_loss")


def prob_backward_func(classes: int, dtype: str, variant: Variant) -> tirx.PrimFunc:
    """The logits gradient of probability targets (docs/spec.md, section 5) as a PrimFunc:
    ``x_grad = r (sum_c v + 2 s lse) p - r v`` with ``v`` the target mass and
    ``r`` the upstream gradient of the row (divided by ``N`` for ``mean``).

    Arguments, in order: ``grad_loss[G]`` (accumulation dtype; ``G = N`` for
    ``none``, else 1), ``x[N, C]``, ``target[N, C]`` (dtype), ``lse[N]``,
    ``target_mass[N]`` (accumulation dtype; the forward's), ``weight[C]``
    (weighted only), ``label_smoothing``, ``zloss_scale``, ``softcap``
    (capped variant only: the gradient is taken through ``t * tanh(x / t)``);
    output ``x_grad[N, C]`` (dtype).
    """
    acc, n_rows, x, q, w = logits_inputs(classes, dtype, variant.weighted, probs=True)
    g = _grad_input(n_rows, acc, variant.reduction)
    lse = te.placeholder((n_rows,), acc, name="lse")
    total = te.placeholder((n_rows,), acc, name="target_mass")
    _, eps, s, *rest = scalars = scalar_args(acc, variant)
    logit = loss_logits(x, acc, variant, scalars)
    mass = _target_mass(q, w, eps, classes, acc)
    zero, two = tirx.const(0.0, acc), tirx.const(2.0, acc)
    coef = _prob_row_grad(g, n_rows, variant.reduction, acc)
    p_scale = te.compute(
        (n_rows,), lambda n: coef[n] * total[n]
        + tirx.Select(s != zero, two * s * lse[n] * coef[n], zero), name=GRAD_PSCALE)

    def grad(n, c):
        p = fastmath.exp(logit(n, c) - lse[n], nonpositive=True, storage=dtype)
        return logit.scaled_by_slope(n, c, p * p_scale[n] - coef[n] * mass(n, c)).astype(dtype)

    x_grad = te.compute((n_rows, int64(classes)), grad, name=X_GRAD)
    args = [g, x, q, lse, total] + ([w] if w is not None else []) + [eps, s, *rest, x_grad]
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def prob_target_grad_func(classes: int, dtype: str, variant: Variant) -> tirx.PrimFunc:
    """The gradient of the probability-target loss with respect to the targets:
    ``target_grad = -r (1 - eps) w[c] (x - lse)`` (``r`` as in
    ``prob_backward_func``; ``x`` capped in the capped variant).

    Arguments, in order: ``grad_loss[G]``, ``x[N, C]`` (dtype), ``lse[N]``,
    ``weight[C]`` (weighted only), ``label_smoothing``, ``softcap`` (capped
    variant only); output ``target_grad[N, C]`` (dtype).
    """
    acc, n_rows, x, _, w = logits_inputs(classes, dtype, variant.weighted, probs=True)
    g = _grad_input(n_rows, acc, variant.reduction)
    lse = te.placeholder((n_rows,), acc, name="lse")
    _, eps, _, *rest = scalars = scalar_args(acc, variant)
    logit = loss_logits(x, acc, variant, scalars)
    coef = _prob_row_grad(g, n_rows, variant.reduction, acc)
    one = tirx.const(1.0, acc)

    def grad(n, c):
        scale = coef[n] * (one - eps) * (w[c] if w is not None else one)
        return (-scale * (logit(n, c) - lse[n])).astype(dtype)

    target_grad = te.compute((n_rows, int64(classes)), grad, name=TARGET_GRAD)
    args = [g, x, lse] + ([w] if w is not None else []) + [eps, *rest, target_grad]
    return te.create_prim_func(args).with_attr("global_symbol", "main")
