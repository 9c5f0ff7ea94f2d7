"""The fused forward (docs/spec.md, section 2): loss, z-loss, lse, and optionally
log-probs and token accuracy.
"""

from __future__ import annotations

from tvm import te, tirx

from .choices import row_shift
from .common import (
    class_weights,
    int64,
    logits_inputs,
    loss_logits,
    masked_target,
    row_stats,
    scalar_args,
)
from .kinds import Variant
from .loss_terms import reduce_forward, row_hits, row_losses
from .stages import LOG_PROB, LSE


def forward_func(classes: int, dtype: str, variant: Variant,
                 chunk: int | None = None, stage: bool = False, lanes: int = 0) -> tirx.PrimFunc:
    """The fused forward of docs/spec.md, section 2, as a PrimFunc.

    A row is reduced in ``ceil(C / chunk)`` chunks of ``chunk`` classes (one
    chunk by default), merged exactly by ``softmax_merge``: a target-free
    regrouping that lets a schedule keep each chunk on chip between its max
    and its exp-sum. ``stage``: each chunk is first copied to float32
    (``ce_chunk_logits``, see ``row_stats``). ``lanes``: the chunks are merged
    in that many round-robin lanes first (``row_stats``).

    Arguments, in order: ``x[N, C]`` (dtype), ``target[N]`` (int64),
    ``weight[C]`` (accumulation dtype, weighted variant only), ``ignore_index``,
    ``label_smoothing``, ``zloss_scale``, ``softcap`` (capped variant only:
    every logit is read as ``t * tanh(x / t)``), ``inv_temperature``
    (tempered variant only: then divided by ``T``); outputs ``loss`` and ``zloss``
    (``[N]`` for ``none``, else ``[1]``, dtype), ``lse[N]`` (accumulation
    dtype), ``log_prob[N, C]`` (dtype, log-prob variant only), and
    ``hit[N]`` (accumulation dtype, accuracy variant only: 1 where the row is
    not ignored and its target is its first maximal logit, else 0).
    """
    acc, n_rows, x, y, w = logits_inputs(classes, dtype, variant.weighted)
    ii, eps, s, *_ = scalars = scalar_args(acc, variant)
    if not variant.smoothing:
        eps = None
    logit = loss_logits(x, acc, variant, scalars)
    mask, index = masked_target(y, ii, classes)
    st = row_stats(logit, class_weights(w), n_rows, classes, acc, chunk,
                    target=index if variant.accuracy else None, stage=stage, lanes=lanes,
                    weighted_sum=variant.smoothing,
                    row_shift=row_shift.get() and variant.shifts_rows() and not (stage or lanes))
    wxsum = st.wxsum
    lse = te.compute((n_rows,), lambda n: st.lse(n, logit), name=LSE)
    rows = row_losses(
        n_rows, tirx.const(float(classes), acc), acc, eps, s, mask, lse,
        target_logit=lambda n: logit(n, index(n)),
        target_weight=lambda n: w[index(n)] if w is not None else tirx.const(1.0, acc),
        wxsum=lambda n: wxsum[n], wsum=st.weight_sum, reduction=variant.reduction)
    outs = reduce_forward(rows, n_rows, dtype, variant.reduction,
                          variant.wide_loss).outputs
    args = [x, y] + ([w] if w is not None else []) + list(scalars) + outs + [lse]
    if variant.log_prob:
        log_prob = te.compute(
            (n_rows, int64(classes)),
            lambda n, c: (logit(n, c) - lse[n]).astype(dtype),
            name=LOG_PROB,
        )
        args.append(log_prob)
    if variant.accuracy:
        args.append(row_hits(n_rows, acc, mask, st.beats))
    return te.create_prim_func(args).with_attr("global_symbol", "main")
