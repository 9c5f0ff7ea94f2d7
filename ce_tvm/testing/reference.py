"""Float64 NumPy implementation of SPEC.md, written from the spec alone.

It shares no code with ``ce_tvm``; every kernel and schedule is compared with
it. ``row_terms`` and ``reduce`` split the forward so that large shapes can
be checked a block of rows at a time; ``backward`` takes the global row
totals for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RowTerms:
    lse: np.ndarray       # [n]
    log_prob: np.ndarray  # [n, C]
    ce: np.ndarray        # [n], 0 on ignored rows
    z: np.ndarray         # [n], 0 on ignored rows
    mask: np.ndarray      # [n], 1.0 / 0.0
    weight: np.ndarray    # [n], w[y[n]] * m[n]


def _weights(weight, classes):
    return np.ones(classes) if weight is None else np.asarray(weight, dtype=np.float64)


def _mask_and_index(y, ignore_index, classes):
    y = np.asarray(y, dtype=np.int64)
    m = (y != ignore_index).astype(np.float64)
    t = np.where(m > 0, y, 0)
    assert np.all((t >= 0) & (t < classes)), "reference called with an invalid target"
    return m, t


def _lse(x):
    """Row-wise ``log(sum_c exp(x))``, max-shifted."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        mx = x.max(axis=1, keepdims=True) if x.shape[0] else np.zeros((0, 1))
        # A row of only -inf has lse = log(0) = -inf (as torch.logsumexp), not
        # the NaN of -inf - (-inf): shift it by 0 instead of its max.
        mx = np.where(mx == -np.inf, 0.0, mx)
        return (mx + np.log(np.exp(x - mx).sum(axis=1, keepdims=True)))[:, 0]


def capped(x, softcap):
    """SPEC section 5: the logits ``t * tanh(x / t)`` (``x`` itself for ``t = 0``)."""
    x = np.asarray(x, dtype=np.float64)
    return softcap * np.tanh(x / softcap) if softcap else x


def through_softcap(grad, x, softcap):
    """A gradient with respect to the capped logits as one with respect to
    ``x``: times ``1 - tanh(x / t)^2`` (SPEC section 5)."""
    if not softcap:
        return grad
    return grad * (1.0 - np.tanh(np.asarray(x, dtype=np.float64) / softcap) ** 2)


def row_terms(x, y, weight=None, ignore_index=-100, label_smoothing=0.0, zloss_scale=0.0,
              softcap=0.0):
    """Per-row quantities of SPEC section 1 (of the capped logits, section 5)
    for a block of rows."""
    x = capped(x, softcap)
    n, c = x.shape
    w = _weights(weight, c)
    m, t = _mask_and_index(y, ignore_index, c)
    lse = _lse(x)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        logp = x - lse[:, None]
        nll = -w[t] * logp[np.arange(n), t]
        smooth = -(logp * w[None, :]).sum(axis=1)
        # No smoothing term at all when label_smoothing == 0 (as in PyTorch), so a
        # -inf logit (a masked class) does not turn 0 * inf into NaN.
        ce = (1 - label_smoothing) * nll
        if label_smoothing:
            ce = ce + (label_smoothing / c) * smooth
        z = zloss_scale * lse**2
    # Ignored rows are exactly 0 even when their logits hold NaN/Inf.
    return RowTerms(lse, logp, np.where(m > 0, ce, 0.0), np.where(m > 0, z, 0.0), m, w[t] * m)


def reduce(terms: RowTerms, reduction):
    """SPEC section 1 reductions: returns ``(loss, zloss)``."""
    if reduction == "none":
        return terms.ce + terms.z, terms.z
    ce, z = terms.ce.sum(), terms.z.sum()
    if reduction == "sum":
        return np.array([ce + z]), np.array([z])
    with np.errstate(invalid="ignore", divide="ignore"):
        zmean = np.float64(z) / terms.mask.sum()
        return np.array([np.float64(ce) / terms.weight.sum() + zmean]), np.array([zmean])


def concat(blocks):
    """Join the ``RowTerms`` of consecutive row blocks (``log_prob`` is dropped)."""
    cat = lambda name: np.concatenate([getattr(b, name) for b in blocks])  # noqa: E731
    return RowTerms(cat("lse"), None, cat("ce"), cat("z"), cat("mask"), cat("weight"))


def forward(x, y, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
            zloss_scale=0.0, softcap=0.0):
    """SPEC section 1: ``(loss, log_prob, zloss, lse)`` in float64 (``log_prob``
    of the capped logits when ``softcap``: section 5)."""
    terms = row_terms(x, y, weight, ignore_index, label_smoothing, zloss_scale, softcap)
    loss, zloss = reduce(terms, reduction)
    return loss, terms.log_prob, zloss, terms.lse


def totals(y, weight, ignore_index, classes):
    """``(D, M)`` of SPEC section 1 over all rows."""
    m, t = _mask_and_index(y, ignore_index, classes)
    return (_weights(weight, classes)[t] * m).sum(), m.sum()


def backward(grad_loss, log_prob, y, weight=None, grad_zloss=None, lse=None, reduction="mean",
             ignore_index=-100, label_smoothing=0.0, zloss_scale=0.0, row_totals=None):
    """SPEC section 2: the logits gradient in float64.

    An ignored row contributes exactly 0, also when every row is ignored
    (where SPEC's ``m / D`` is 0/0): PyTorch's behaviour. ``row_totals``
    gives ``(D, M)`` when ``log_prob`` is a block of a larger batch.
    """
    logp = np.asarray(log_prob, dtype=np.float64)
    n, c = logp.shape
    w = _weights(weight, c)
    m, t = _mask_and_index(y, ignore_index, c)
    denom, count = row_totals or totals(y, weight, ignore_index, c)
    g = np.asarray(grad_loss, dtype=np.float64).reshape(-1)
    g = g if reduction == "none" else np.full(n, g[0])
    p = np.exp(logp)
    eps = label_smoothing
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = 1.0 / denom if reduction == "mean" else 1.0
        a = np.where(m > 0, g * (1 - eps) * scale, 0.0)
        b = np.where(m > 0, g * eps * scale / c, 0.0)
        onehot = np.zeros_like(p)
        onehot[np.arange(n), t] = 1.0
        grad = (a * w[t])[:, None] * (p - onehot) + b[:, None] * (p * w.sum() - w[None, :])
        if zloss_scale != 0.0:
            gz = g.copy()
            if grad_zloss is not None:
                gzl = np.asarray(grad_zloss, dtype=np.float64).reshape(-1)
                gz = gz + (gzl if reduction == "none" else gzl[0])
            zg = gz / count if reduction == "mean" else gz
            lse = np.asarray(lse, dtype=np.float64)
            grad = grad + np.where(m > 0, 2 * zloss_scale * lse * zg, 0.0)[:, None] * p
    return grad


# --- Probability targets (SPEC section 5) -----------------------------------


def _smoothed(q, label_smoothing):
    q = np.asarray(q, dtype=np.float64)
    return (1 - label_smoothing) * q + label_smoothing / q.shape[1]


def prob_forward(x, q, weight=None, reduction="mean", label_smoothing=0.0, zloss_scale=0.0,
                 softcap=0.0):
    """SPEC section 5: ``(loss, zloss, lse)`` in float64 for probability targets
    ``q`` of ``x``'s shape: ``l = -sum_c w q' logp`` and ``z = s lse^2`` per
    row (of the capped logits); ``mean`` divides both sums by the number of rows."""
    x = capped(x, softcap)
    n, c = x.shape
    lse = _lse(x)
    loss = -(_weights(weight, c)[None, :] * _smoothed(q, label_smoothing)
             * (x - lse[:, None])).sum(axis=1)
    z = zloss_scale * lse**2
    if reduction == "none":
        return loss + z, z, lse
    scale = 1.0 if reduction == "sum" else (np.float64(1.0) / n if n else np.nan)
    return np.array([(loss.sum() + z.sum()) * scale]), np.array([z.sum() * scale]), lse


def prob_backward(grad_loss, x, q, weight=None, reduction="mean", label_smoothing=0.0,
                  zloss_scale=0.0, softcap=0.0):
    """SPEC section 5: ``(x_grad, target_grad)`` in float64, by the chain rule of
    ``prob_forward``: with ``v = w q'`` and ``r`` the row's upstream gradient,
    ``x_grad = r (sum_c v) p - r v + r 2 s lse p`` (through the softcap) and
    ``target_grad = -r (1 - eps) w logp``."""
    raw, x = x, capped(x, softcap)
    n, c = x.shape
    w = _weights(weight, c)
    lse = _lse(x)
    logp = x - lse[:, None]
    p = np.exp(logp)
    v = w[None, :] * _smoothed(q, label_smoothing)
    g = np.asarray(grad_loss, dtype=np.float64).reshape(-1)
    r = g if reduction == "none" else np.full(n, g[0] / (n if reduction == "mean" else 1))
    x_grad = r[:, None] * (v.sum(axis=1)[:, None] * p - v + 2 * zloss_scale * lse[:, None] * p)
    x_grad = through_softcap(x_grad, raw, softcap)
    target_grad = -r[:, None] * (1 - label_smoothing) * w[None, :] * logp
    return x_grad, target_grad


def policy_outputs(x, index, live, temperature=1.0, softcap=0.0):
    """SPEC section 6 for logits ``x[M, V]``, ``index[M, K]`` and ``live[M, K]``
    (the entries that count): ``(logp[M, K], entropy[M])``."""
    z = capped(x, softcap) / temperature
    lse = _lse(z)
    logp_all = z - lse[:, None]
    p = np.exp(logp_all)
    with np.errstate(invalid="ignore"):
        entropy = -np.where(p > 0, p * logp_all, 0.0).sum(axis=1)
    picked = np.take_along_axis(logp_all, np.where(live, index, 0), axis=1)
    return np.where(live, picked, 0.0), entropy


def policy_grad(x, index, live, grad_logp, grad_entropy, temperature=1.0, softcap=0.0):
    """The logits' gradient of ``sum g logp + sum h entropy`` (SPEC section 6)."""
    z = capped(x, softcap) / temperature
    p = np.exp(z - _lse(z)[:, None])
    with np.errstate(invalid="ignore"):
        pz = np.where(p > 0, p * z, 0.0)
        s = pz.sum(axis=1, keepdims=True)
        dz = grad_entropy[:, None] * np.where(p > 0, p * s - pz, 0.0)
    g = np.where(live, grad_logp, 0.0)
    dz -= g.sum(axis=1, keepdims=True) * p
    rows = np.arange(x.shape[0])
    for k in range(index.shape[1]):
        np.add.at(dz, (rows, np.where(live[:, k], index[:, k], 0)), g[:, k])
    return through_softcap(dz / temperature, x, softcap)


def policy_stats(x, index, live, temperature=1.0, softcap=0.0, logit_scale=1.0):
    """The statistics of ``return_stats`` (docs/spec.md, section 9) for logits
    ``x[M, V]``, ``index[M, K]`` and ``live[M, K]``, on ``z = cap(s x) / T``:
    ``(log_sum_sq_probs[M], mean_logits[M], is_top1[M, K])``. ``log sum p^2`` is
    ``lse(2 z) - 2 lse(z)`` (no underflow of ``p^2``); ``is_top1`` is true where
    the entry is live and its column is the row's first argmax (``np.argmax``
    returns the first)."""
    z = capped(np.asarray(x, dtype=np.float64) * logit_scale, softcap) / temperature
    log_sum_sq = _lse(2 * z) - 2 * _lse(z)
    with np.errstate(invalid="ignore"):
        mean = z.mean(axis=1)
    first = z.argmax(axis=1) if z.shape[1] else np.zeros(z.shape[0], np.int64)
    return log_sum_sq, mean, live & (index == first[:, None])
