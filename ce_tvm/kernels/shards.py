"""A vocabulary shard's row statistics, and the loss from statistics
combined over all shards (``ce_tvm.distributed``).
"""

from __future__ import annotations

from tvm import te, tirx

from .common import (
    class_weights,
    int64,
    logits_inputs,
    loss_logits,
    masked_target,
    row_stats,
    scalar_args,
    symbolic_rows,
)
from .kinds import Variant, accum_dtype
from .loss_terms import reduce_forward, row_losses
from .stages import ROW_MAX, SHARD_LOCAL, SHARD_TARGET_LOGIT, SHARD_TARGET_WEIGHT


def shard_stats_func(classes: int, dtype: str, variant: Variant,
                     chunk: int | None = None, stage: bool = False) -> tirx.PrimFunc:
    """Per-row statistics of one vocabulary shard ``x[N, C_r]`` (columns
    ``[shard_offset, shard_offset + C_r)`` of the full logits), chunked and
    staged (``stage``) as in ``forward_func``.

    Arguments: ``x``, ``target[N]`` (global class ids), ``weight[C_r]``
    (weighted only), ``shard_offset``, ``softcap`` (capped variant only);
    outputs (accumulation dtype, ``[N]``): the shard's row max,
    ``sum exp(x - max)``, ``sum w x`` (label smoothing's, not declared
    without it: ``Variant.smoothing``), and the target's logit and weight
    where the target falls in this shard (0 elsewhere).
    """
    acc, n_rows, x, y, w = logits_inputs(classes, dtype, variant.weighted)
    offset = te.var("shard_offset", "int64")
    scalars = scalar_args(acc, variant)
    logit = loss_logits(x, acc, variant, scalars)
    st = row_stats(logit, class_weights(w), n_rows, classes, acc, chunk, stage=stage,
                   weighted_sum=variant.smoothing)
    rowmax, expsum, wxsum = st.rowmax, st.expsum, st.wxsum
    if variant.tempered:  # the row max of the scaled logits, as the shards combine it
        rowmax = te.compute((n_rows,), lambda n: logit.scaled(st.rowmax[n]), name=ROW_MAX)
    local = te.compute((n_rows,), lambda n: y[n] - offset, name=SHARD_LOCAL)

    def here(n):
        return tirx.all(local[n] >= int64(0), local[n] < int64(classes))

    def clamp(n):
        return tirx.Select(here(n), local[n], int64(0))

    zero = tirx.const(0.0, acc)
    xt = te.compute((n_rows,), lambda n: tirx.Select(here(n), logit(n, clamp(n)), zero),
                    name=SHARD_TARGET_LOGIT)
    wy = te.compute((n_rows,), lambda n: tirx.Select(
        here(n), w[clamp(n)] if w is not None else tirx.const(1.0, acc), zero),
        name=SHARD_TARGET_WEIGHT)
    args = ([x, y] + ([w] if w is not None else []) + [offset, *scalars[3:]]
            + [rowmax, expsum, *([wxsum] if wxsum is not None else []), xt, wy])
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def shard_combine_func(classes: int, dtype: str, variant: Variant) -> tirx.PrimFunc:
    """The loss from statistics already combined over all shards (docs/spec.md, section 2).

    Arguments: ``lse[N]``, ``target_logit[N]``, ``target_weight[N]``,
    ``wxsum[N]`` (accumulation dtype), ``target[N]``, ``weight_sum`` (the
    global ``sum_c w[c]``, or C), ``ignore_index``, ``label_smoothing``,
    ``zloss_scale``; outputs ``loss`` and ``zloss`` as in ``forward_func``.
    ``classes`` is the full C.
    """
    acc = accum_dtype(dtype)
    n_rows = symbolic_rows()
    vec = {name: te.placeholder((n_rows,), acc, name=name)
           for name in ("lse", "target_logit", "target_weight", "wxsum")}
    y = te.placeholder((n_rows,), "int64", name="target")
    wsum = te.var("weight_sum", acc)
    ii, eps, s = scalar_args(acc)
    mask, _ = masked_target(y, ii, classes)
    rows = row_losses(
        n_rows, tirx.const(float(classes), acc), acc, eps, s, mask, vec["lse"],
        target_logit=lambda n: vec["target_logit"][n],
        target_weight=lambda n: vec["target_weight"][n],
        wxsum=lambda n: vec["wxsum"][n], wsum=lambda n: wsum, reduction=variant.reduction)
    outs = reduce_forward(rows, n_rows, dtype, variant.reduction,
                          variant.wide_loss).outputs
    args = list(vec.values()) + [y, wsum, ii, eps, s] + outs
    return te.create_prim_func(args).with_attr("global_symbol", "main")
