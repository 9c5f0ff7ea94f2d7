"""What a kernel computes per row from the row statistics, and the sums over
rows: the loss and z-loss terms (docs/spec.md, section 2), the token hits
(section 6), the ``loss``/``zloss`` outputs of each reduction and the mean's
normalisers, and the gradient's per-row coefficients (section 3). The row
statistics themselves are ``common.row_stats``'s. A sum over rows is a
serial reduction in row order (no atomics). Stage names are in ``stages``;
``n_rows`` is the symbolic ``N``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import te, tirx

from .common import int64
from .stages import (
    GRAD_HOT,
    GRAD_MASK,
    GRAD_PSCALE,
    GRAD_SMOOTH,
    LOSS,
    ROW_CE,
    ROW_HIT,
    ROW_MASK,
    ROW_WEIGHT,
    ROW_Z,
    TOTAL_CE,
    TOTAL_COUNT,
    TOTAL_WEIGHT,
    TOTAL_Z,
    ZLOSS,
)


def row_hits(n_rows, acc, mask, beats):
    """``ce_row_hit``: 1 where the row counts and its target is the first
    maximal logit, else 0 (token accuracy, docs/spec.md, section 6)."""
    one, zero = tirx.const(1.0, acc), tirx.const(0.0, acc)
    return te.compute((n_rows,), lambda n: tirx.Select(
        tirx.all(mask(n) != 0, beats[n] == zero), one, zero), name=ROW_HIT)


def row_losses(n_rows, classes, acc, eps, s, mask, lse, target_logit, target_weight, wxsum,
                wsum, reduction):
    """The per-row terms of docs/spec.md, section 2, from row statistics.

    ``target_logit(n)``/``target_weight(n)``: ``x[n, y[n]]`` and ``w[y[n]]``;
    ``wxsum(n)``: ``sum_c w[c] x[n, c]``; ``wsum(n)``: ``sum_c w[c]``; ``classes``
    is the full C (an expression for a vocabulary shard). ``eps``: label
    smoothing's scalar; ``None`` for a kernel without it (``Variant.smoothing``
    off: no smoothing term, ``wxsum`` and ``wsum`` never read). Returns the dict
    ``reduce_forward`` reduces.
    """
    one, zero = tirx.const(1.0, acc), tirx.const(0.0, acc)
    m = te.compute((n_rows,), lambda n: mask(n).astype(acc), name=ROW_MASK)

    def masked(n, value):
        # A select, not a product: an ignored row is exactly 0 even when its logits are NaN.
        return tirx.Select(m[n] != zero, value, zero)

    def nll(n):
        return -target_weight(n) * (target_logit(n) - lse[n])

    def ce(n):
        if eps is None:
            return nll(n)
        # -sum_c w[c] logp[n, c]; zero, not 0 * inf, when eps is 0 and a logit
        # is -inf (a masked class).
        smoothing = eps / classes * -(wxsum(n) - lse[n] * wsum(n))
        return (one - eps) * nll(n) + tirx.Select(eps != zero, smoothing, zero)

    rows = {
        "ce": te.compute((n_rows,), lambda n: masked(n, ce(n)), name=ROW_CE),
        "z": te.compute((n_rows,), lambda n: masked(n, s * lse[n] * lse[n]), name=ROW_Z),
    }
    if reduction == "mean":
        rows["weight"] = te.compute((n_rows,), lambda n: target_weight(n) * m[n],
                                    name=ROW_WEIGHT)
        rows["count"] = m
    return rows


def row_total(stage, term, n_rows):
    """Serial, fixed-order sum over rows of a per-row term (deterministic, no atomics)."""
    r = te.reduce_axis((int64(0), n_rows), name="r")
    return te.compute((1,), lambda _: te.sum(term[r], axis=r), name=stage)


_TOTALS = {"ce": TOTAL_CE, "z": TOTAL_Z, "weight": TOTAL_WEIGHT, "count": TOTAL_COUNT}


@dataclass(frozen=True)
class Totals:
    """``outputs``: ``[loss, zloss]``; ``weight``/``count``: the mean's ``D`` and
    ``M`` (``[1]`` stages; ``None`` unless the reduction is ``mean``)."""

    outputs: list
    weight: te.Tensor | None = None
    count: te.Tensor | None = None


def reduce_forward(rows, n_rows, dtype, reduction, wide: bool = False) -> Totals:
    """``loss`` and ``zloss`` outputs from the per-row terms (docs/spec.md, section 2,
    table), written in the storage ``dtype``, or with ``wide`` (``Variant.wide_loss``)
    in the per-row terms' accumulation dtype, never rounded to the storage dtype."""
    ce, z = rows["ce"], rows["z"]
    if wide:
        dtype = ce.dtype
    if reduction == "none":
        loss = te.compute((n_rows,), lambda n: (ce[n] + z[n]).astype(dtype), name=LOSS)
        zloss = te.compute((n_rows,), lambda n: z[n].astype(dtype), name=ZLOSS)
        return Totals([loss, zloss])
    tot = {name: row_total(_TOTALS[name], term, n_rows) for name, term in rows.items()}
    ce_t, z_t = tot["ce"][0], tot["z"][0]
    if reduction == "mean":
        ce_t, z_t = ce_t / tot["weight"][0], z_t / tot["count"][0]
    loss = te.compute((1,), lambda _: (ce_t + z_t).astype(dtype), name=LOSS)
    zloss = te.compute((1,), lambda _: z_t.astype(dtype), name=ZLOSS)
    return Totals([loss, zloss], tot.get("weight"), tot.get("count"))


def mean_totals(n_rows, acc, mask, target_weight):
    """``D = sum_n w[y[n]] m[n]`` and ``M = sum_n m[n]``, serial over rows, from
    the targets alone (``ce_total_weight``, ``ce_total_count``)."""
    r1 = te.reduce_axis((int64(0), n_rows), name="r")
    denom = te.compute(
        (1,), lambda _: te.sum(target_weight(r1) * mask(r1).astype(acc), axis=r1),
        name=TOTAL_WEIGHT)
    r2 = te.reduce_axis((int64(0), n_rows), name="r")
    count = te.compute(
        (1,), lambda _: te.sum(mask(r2).astype(acc), axis=r2), name=TOTAL_COUNT)
    return denom, count


def grad_coefficients(n_rows, acc, eps, s, mask, lse, target_weight, total_w, c_full,
                       row_grad, row_zgrad):
    """Per-row coefficients of docs/spec.md, section 3: ``(hot, smooth, pscale)`` with
    ``x_grad = p * pscale - [c == y] hot - smooth * w[c]``; ``eps`` ``None`` (a
    kernel without label smoothing): ``smooth`` is ``None``, the term absent.

    ``row_grad(n)``/``row_zgrad(n)``: the upstream gradient of row ``n``'s
    loss and z-loss terms, normalisers included; ``total_w(n)``: ``sum_c w[c]``;
    ``c_full``: the number of classes (of the full vocabulary for a shard).
    """
    one, zero = tirx.const(1.0, acc), tirx.const(0.0, acc)

    def row(stage, f):
        return te.compute((n_rows,), f, name=stage)

    m = row(GRAD_MASK, lambda n: mask(n).astype(acc))

    def masked(n, value):
        # An ignored row contributes exactly 0, also when every row is ignored
        # (D = 0 or M = 0 would make the formula 0/0): PyTorch's behaviour, as
        # docs/spec.md, section 3 states.
        return tirx.Select(m[n] != zero, value, zero)

    hot_share = one if eps is None else one - eps
    hot = row(GRAD_HOT, lambda n: masked(n, row_grad(n) * hot_share * target_weight(n)))
    smooth = None if eps is None else row(GRAD_SMOOTH,
                                          lambda n: masked(n, row_grad(n) * eps / c_full))

    def z_term(n):
        return tirx.Select(s != zero, masked(n, tirx.const(2.0, acc) * s * lse[n] * row_zgrad(n)),
                           zero)

    p_scale = row(GRAD_PSCALE, lambda n: hot[n] + z_term(n) if smooth is None
                  else hot[n] + smooth[n] * total_w(n) + z_term(n))
    return hot, smooth, p_scale


def smooth_term(smooth, n, weight):
    """``smooth[n] * weight`` (``grad_coefficients``' ``smooth * w[c]``); ``None``
    for a kernel without label smoothing (``smooth`` ``None``)."""
    return None if smooth is None else smooth[n] * weight


def logit_grad(logit, n, c, p_scaled, onehot, smooth_w, dtype: str):
    """``x_grad[n, c]`` of ``grad_coefficients``' formula, rounded to ``dtype``:
    ``p * pscale - [c == y] hot - smooth * w[c]`` (given as ``p_scaled``,
    ``onehot`` and ``smooth_w``; ``None`` without label smoothing), through the
    slope of the logit as the loss sees it (``Logits.scaled_by_slope``)."""
    g = p_scaled - onehot if smooth_w is None else p_scaled - onehot - smooth_w
    return logit.scaled_by_slope(n, c, g).astype(dtype)
