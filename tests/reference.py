"""Float64 NumPy implementation of SPEC.md, written from the spec alone.

It shares no code with ``ce_tvm``: every kernel is checked against it.
"""

from __future__ import annotations

import numpy as np


def _mask_and_index(y, ignore_index, classes):
    y = np.asarray(y, dtype=np.int64)
    m = (y != ignore_index).astype(np.float64)
    t = np.where(m > 0, y, 0)
    assert np.all((t >= 0) & (t < classes)), "reference called with an invalid target"
    return m, t


def forward(x, y, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
            zloss_scale=0.0):
    """SPEC section 1: returns (loss, log_prob, zloss, lse) in float64."""
    x = np.asarray(x, dtype=np.float64)
    n, c = x.shape
    w = np.ones(c) if weight is None else np.asarray(weight, dtype=np.float64)
    m, t = _mask_and_index(y, ignore_index, c)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        mx = x.max(axis=1, keepdims=True) if c else np.zeros((n, 1))
        lse = (mx + np.log(np.exp(x - mx).sum(axis=1, keepdims=True)))[:, 0]
        logp = x - lse[:, None]
        rows = np.arange(n)
        nll = -w[t] * logp[rows, t] * m
        smooth = -(logp * w[None, :]).sum(axis=1) * m
        ce = (1 - label_smoothing) * nll + (label_smoothing / c) * smooth
        z = zloss_scale * lse**2 * m
        # Ignored rows are exactly 0 even when their logits hold NaN/Inf.
        ce = np.where(m > 0, ce, 0.0)
        z = np.where(m > 0, z, 0.0)
        if reduction == "none":
            return ce + z, logp, z, lse
        denom, count = (w[t] * m).sum(), m.sum()
        if reduction == "sum":
            return np.array([ce.sum() + z.sum()]), logp, np.array([z.sum()]), lse
        zmean = np.float64(z.sum()) / count if count else np.nan
        cmean = np.float64(ce.sum()) / denom if denom else np.nan
        return np.array([cmean + zmean]), logp, np.array([zmean]), lse


def backward(grad_loss, log_prob, y, weight=None, grad_zloss=None, lse=None, reduction="mean",
             ignore_index=-100, label_smoothing=0.0, zloss_scale=0.0):
    """SPEC section 2: the logits gradient in float64."""
    logp = np.asarray(log_prob, dtype=np.float64)
    n, c = logp.shape
    w = np.ones(c) if weight is None else np.asarray(weight, dtype=np.float64)
    m, t = _mask_and_index(y, ignore_index, c)
    g = np.asarray(grad_loss, dtype=np.float64).reshape(-1)
    g = g if reduction == "none" else np.full(n, g[0])
    p = np.exp(logp)
    denom, count = (w[t] * m).sum(), m.sum()
    eps = label_smoothing
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = 1.0 / denom if reduction == "mean" else 1.0
        a = g * (1 - eps) * m * scale
        b = g * eps * m * scale / c
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
            grad = grad + (2 * zloss_scale * lse * m * zg)[:, None] * p
    return grad
