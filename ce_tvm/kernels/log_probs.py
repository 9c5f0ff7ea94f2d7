"""Per-token log-probs and entropy at a temperature (docs/spec.md, section 9), and
their gradient: the outputs RL post-training takes from the LM head.

Every read of a logit is ``z = cap(x) / T`` (``Logits`` with the softcap of
a capped variant and the inverse temperature, a scalar argument of every
kernel here). ``index[N, K]`` holds ``K`` class indices per row
(``Variant.columns``); an index equal to ``ignore_index`` is dead: log-prob
0, no gradient. An index outside ``[0, C)`` reads class 0 (the runtime
rejects such indices before any launch).
"""

from __future__ import annotations

import functools

from tvm import te, tirx

from . import fastmath
from .choices import chunk_exp_kept, row_shift
from .common import Logits, int64, row_stats, same_class, symbolic_rows
from .kinds import Variant, accum_dtype
from .stages import (
    GRAD_PSCALE,
    LOGITS,
    ROW_ENTROPY,
    ROW_LOG_EXPSUM,
    ROW_LOG_SUM_SQ,
    ROW_MAX,
    ROW_MEAN_LOGITS,
    TOKEN_LOGP,
    TOKEN_TOP1,
    X_GRAD,
)


def _inputs(classes: int, dtype: str, variant: Variant):
    """``(acc, N, x[N, C], index[N, K], scalars, Logits)``; the scalars are
    ``ignore_index``, ``inv_temperature`` and, capped, ``softcap``."""
    if variant.columns < 1:
        raise ValueError(f"a log-prob kernel needs columns >= 1, got {variant.columns}")
    acc = accum_dtype(dtype)
    n_rows = symbolic_rows()
    x = te.placeholder((n_rows, int64(classes)), dtype, name=LOGITS)
    index = te.placeholder((n_rows, int64(variant.columns)), "int64", name="index")
    inv_t = te.var("inv_temperature", acc)
    cap = (te.var("softcap", acc),) if variant.softcap else ()
    scalars = (te.var("ignore_index", "int64"), inv_t, *cap)
    return acc, n_rows, x, index, scalars, Logits(x, acc, cap, (inv_t,))


def _columns(index, ignore_index, classes: int):
    """``live(n, k)``: entry ``k`` of row ``n`` is not ``ignore_index``;
    ``column(n, k)``: its class, always in ``[0, C)``; ``inside(n, k)``: the
    index is in ``[0, C)`` (a vocabulary shard's gradient passes the live
    entries of other shards out of range: they count in ``G``, match no column)."""

    def at(k):  # a column: a loop variable, or a constant one
        return int64(k) if isinstance(k, int) else k

    def live(n, k):
        return index[n, at(k)] != ignore_index

    def inside(n, k):
        i = index[n, at(k)]
        return tirx.all(i >= int64(0), i < int64(classes))

    def column(n, k):
        return tirx.Select(inside(n, k), index[n, at(k)], int64(0))

    return live, column, inside


def log_probs_func(classes: int, dtype: str, variant: Variant,
                   chunk: int | None = None, stage: bool = False,
                   lanes: int = 0) -> tirx.PrimFunc:
    """Log-probs of ``index`` and the entropy of every row, in one sweep over
    the logits (the forward's chunks, ``row_stats``; ``stage`` and ``lanes`` as there).

    Per chunk ``e = exp(z - chunk_max)`` is kept (unless the schedule asks
    otherwise, ``choices.chunk_exp_kept``) and reduced twice: its sum
    and ``A = sum e (chunk_max - z)``; merged over the chunks into the row's
    ``S`` and ``A``, ``H = log(S) + A / S`` and ``logp = (x' - max) / T -
    log(S)`` (``x'``: the capped logit, ``max`` the row's, before the
    temperature): differences are taken before they are scaled and every sum
    is of non-negative terms, so a large common offset of the logits costs
    no accuracy (``lse = max / T + log(S)`` would round at the offset's scale).

    Arguments, in order: ``x[N, C]`` (dtype), ``index[N, K]`` (int64),
    ``ignore_index``, ``inv_temperature``, ``softcap`` (capped variant only);
    outputs ``logp[N, K]``, ``entropy[N]`` (with ``Variant.entropy``),
    ``row_max[N]`` (``max``) and ``log_expsum[N]`` (``log(S)``), in the
    accumulation dtype. ``logp`` is
    never above 0 (clamped: a rounding of the cap could otherwise leave a
    hair above).

    Without the entropy (``Variant.entropy`` off) neither ``A`` nor ``entropy``
    is declared. Such a kernel, where the schedule asks (``choices.row_shift``,
    ``Variant.shifts_rows``: no softcap, no statistics), takes each row against
    the max of its first chunk instead of each chunk's own (``row_stats``'
    ``row_shift``): ``max`` is then that shift, and ``log(S)`` is ``+inf`` for
    a row whose max lies more than ``ROW_SHIFT_RANGE`` above it (the caller
    computes such a row again).

    The stats variant (``Variant.stats``) reduces three more sums in the same
    chunks (``row_stats(stats=True)``) and writes three more outputs:
    ``log_sum_sq_probs[N] = log(Q) - 2 log(S)`` (``Q = sum e^2``, merged like
    ``S``), ``mean_logits[N] = sum x' / T / C`` (accumulation dtype) and
    ``is_top1[N, K]`` (uint8): 1 where the entry is live and its column is the
    row's first argmax (ties are decided on the capped logits before the
    temperature; a positive temperature keeps their order).
    """
    acc, n_rows, x, index, scalars, logit = _inputs(classes, dtype, variant)
    live, column, inside = _columns(index, scalars[0], classes)
    zero = tirx.const(0.0, acc)
    st = row_stats(logit, None, n_rows, classes, acc, chunk,
                   keep_exp=chunk_exp_kept.get() or bool(lanes), stage=stage,
                   entropy=variant.entropy, weighted_sum=variant.entropy,
                   stats=variant.stats, lanes=lanes,
                   row_shift=row_shift.get() and variant.shifts_rows() and not (stage or lanes))
    row_max = te.compute((n_rows,), lambda n: st.rowmax[n], name=ROW_MAX)
    log_s = te.compute((n_rows,), lambda n: st.log_expsum(n, logit), name=ROW_LOG_EXPSUM)

    def token(n, k):
        shifted = logit.scaled(logit.capped(logit.raw(n, column(n, k))) - row_max[n])
        return tirx.Select(live(n, k), tirx.min(shifted - log_s[n], zero), zero)

    logp = te.compute((n_rows, int64(variant.columns)), token, name=TOKEN_LOGP)
    outputs = [logp, row_max, log_s]
    if variant.entropy:
        outputs.insert(1, te.compute((n_rows,), lambda n: log_s[n] + st.wxsum[n] / st.expsum[n],
                                     name=ROW_ENTROPY))
    if variant.stats:
        two = tirx.const(2.0, acc)
        outputs += [
            te.compute((n_rows,), lambda n: te.log(st.sqsum[n]) - two * log_s[n],
                       name=ROW_LOG_SUM_SQ),
            te.compute((n_rows,), lambda n: logit.scaled(st.zsum[n]) / tirx.const(classes, acc),
                       name=ROW_MEAN_LOGITS),
            te.compute((n_rows, int64(variant.columns)), lambda n, k: tirx.Select(
                tirx.all(live(n, k), inside(n, k), column(n, k).astype("int32") == st.first[n]),
                tirx.const(1, "uint8"), tirx.const(0, "uint8")), name=TOKEN_TOP1),
        ]
    return te.create_prim_func([x, index, *scalars, *outputs]).with_attr(
        "global_symbol", "main")


def log_probs_grad_func(classes: int, dtype: str, variant: Variant) -> tirx.PrimFunc:
    """The logits' gradient of ``sum g logp + sum h H`` (docs/spec.md, section 9) in one
    pass: the logits read once, the gradient written once (in their dtype).

    ``dz = p (h (-log p - H) - G) + sum_k g[k] [c = i_k]`` with
    ``G = sum_k g[k]`` over the live entries (``ce_grad_pscale``; a live
    index outside ``[0, C)`` counts there but matches no column: a vocabulary
    shard's view of another shard's entry), and
    ``log p = (x' - max) / T - log(S)`` from the forward's ``row_max``,
    ``log_expsum`` and ``entropy`` (nothing cancels at a large offset); where
    ``p = 0`` the first term is 0.

    Arguments, in order: ``grad_logp[N, K]``, ``grad_entropy[N]`` (accumulation
    dtype), ``x[N, C]``, ``row_max[N]``, ``log_expsum[N]``, ``entropy[N]``,
    ``index[N, K]``, the scalars of ``log_probs_func``; output ``x_grad[N, C]``.
    """
    acc, n_rows, x, index, scalars, logit = _inputs(classes, dtype, variant)
    live, _, inside = _columns(index, scalars[0], classes)
    zero = tirx.const(0.0, acc)
    g = te.placeholder((n_rows, int64(variant.columns)), acc, name="grad_logp")
    h = te.placeholder((n_rows,), acc, name="grad_entropy")
    row_max = te.placeholder((n_rows,), acc, name="row_max")
    log_s = te.placeholder((n_rows,), acc, name="log_expsum")
    ent = te.placeholder((n_rows,), acc, name="entropy")

    def live_grad(n, k):
        return tirx.Select(live(n, k), g[n, int64(k)], zero)

    ks = range(variant.columns)
    total = te.compute((n_rows,), lambda n: functools.reduce(
        lambda a, k: a + live_grad(n, k), ks, zero), name=GRAD_PSCALE)

    def hot_column(n, k):  # the entry's column; -1 (none) when dead or in another shard
        return tirx.Select(tirx.all(live(n, k), inside(n, k)), index[n, int64(k)], int64(-1))

    def grad(n, c):
        logp = logit.scaled(logit.capped(logit.raw(n, c)) - row_max[n]) - log_s[n]
        p = fastmath.exp(logp, nonpositive=True)
        # h (-log p - H) - G as one multiply-add per element: -h and -(h H + G) per row
        dz = tirx.Select(p == zero, zero, p * (logp * -h[n] - (h[n] * ent[n] + total[n])))
        for k in ks:  # one compare per element: the column is per row (hoisted)
            dz = dz + tirx.Select(same_class(c, hot_column(n, k)), g[n, int64(k)], zero)
        return logit.scaled_by_slope(n, c, dz).astype(dtype)

    x_grad = te.compute((n_rows, int64(classes)), grad, name=X_GRAD)
    return te.create_prim_func([g, h, x, row_max, log_s, ent, index, *scalars,
                                x_grad]).with_attr(
        "global_symbol", "main")
