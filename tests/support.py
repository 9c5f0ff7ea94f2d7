"""The one comparison every operator test goes through: ce_tvm against ``reference``."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import ce_tvm
import reference

# Per-dtype tolerance (relative, and absolute against the largest reference
# magnitude): float32 to 1e-5 as the issue asks; half types to about one unit
# of their last stored bit.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-10}
# Rows compared at a time: float64 blocks of at most 16 MB stay under glibc's
# mmap threshold, so the reference reuses memory instead of page-faulting.
BLOCK_ELEMS = 1 << 21
# Tests holding gigabytes run one after another on one ``pytest -n`` worker
# (``--dist loadgroup``), so that two of them never meet in memory.
MEMORY = pytest.mark.xdist_group("memory")


@dataclass
class Case:
    n: int
    c: int
    dtype: torch.dtype = torch.float32
    reduction: str = "mean"
    weighted: bool = False
    ignore: bool = False
    label_smoothing: float = 0.0
    zloss_scale: float = 0.0
    ignore_index: int = -100
    seed: int = 0
    scale: float = 3.0
    extra: dict = field(default_factory=dict)

    def inputs(self):
        gen = torch.Generator().manual_seed(self.seed)
        x = (torch.randn(self.n, self.c, generator=gen) * self.scale).to(self.dtype)
        y = torch.randint(0, self.c, (self.n,), generator=gen)
        if self.ignore:
            y[::3] = self.ignore_index
        w = torch.rand(self.c, generator=gen) + 0.5 if self.weighted else None
        return x, y, w

    def options(self):
        return dict(reduction=self.reduction, ignore_index=self.ignore_index,
                    label_smoothing=self.label_smoothing,
                    lse_square_scale_for_zloss=self.zloss_scale)


def assert_close(actual: torch.Tensor, expected, tol: float, what: str) -> None:
    """``|actual - expected| <= tol * (|expected| + max(1, max |expected|))`` elementwise,
    with NaN and infinities in the same places."""
    a = actual.detach().double()
    e = torch.as_tensor(np.asarray(expected, dtype=np.float64))
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != reference {tuple(e.shape)}"
    finite = e.isfinite()
    if bool(finite.all()):  # the common case, without masked copies of the block
        assert bool(a.isfinite().all()), f"{what}: NaN/Inf in different places"
        if e.numel() == 0:
            return
        scale = max(1.0, float(e.abs().max()))
        excess = (a - e).abs_().sub_(e.abs().add_(scale).mul_(tol))
    else:
        assert torch.equal(finite, a.isfinite()), f"{what}: NaN/Inf in different places"
        assert torch.equal(a[~finite].nan_to_num(), e[~finite].nan_to_num()), (
            f"{what}: wrong Inf")
        if not bool(finite.any()):
            return
        scale = max(1.0, float(e[finite].abs().max()))
        excess = torch.where(finite, (a - e).abs() - tol * (e.abs() + scale), 0.0)
    worst = int(excess.argmax())
    if float(excess.reshape(-1)[worst]) > 0:
        idx = np.unravel_index(worst, tuple(e.shape))
        raise AssertionError(
            f"{what}: at {idx} got {float(a[idx])}, expected {float(e[idx])} "
            f"(tol {tol}, scale {scale})")


def _blocks(n, c):
    step = max(1, BLOCK_ELEMS // c)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)] or [slice(0, 0)]


def check_once(case: Case) -> None:
    """Forward and backward of ``case`` against the float64 reference."""
    x, y, w = case.inputs()
    opts = case.options()
    tol = TOL[case.dtype]
    loss, log_prob, zloss, lse = ce_tvm.cross_entropy_loss(x, y, w, return_zloss=True, **opts)
    assert loss.dtype == log_prob.dtype == zloss.dtype == lse.dtype == case.dtype
    wn = None if w is None else w.double().numpy()
    ref_args = (wn, case.ignore_index, case.label_smoothing, case.zloss_scale)

    blocks = []
    for rows in _blocks(case.n, case.c):
        terms = reference.row_terms(x[rows].double().numpy(), y[rows].numpy(), *ref_args)
        assert_close(log_prob[rows], terms.log_prob, tol, f"log_prob rows {rows}")
        assert_close(lse[rows], terms.lse, tol, f"lse rows {rows}")
        terms.log_prob = None
        blocks.append(terms)
    ref_loss, ref_zloss = reference.reduce(reference.concat(blocks), case.reduction)
    assert_close(loss, ref_loss, tol, "loss")
    assert_close(zloss, ref_zloss, tol, "zloss")

    g_rows = case.n if case.reduction == "none" else 1
    gen = torch.Generator().manual_seed(case.seed + 1)
    # the seed pair takes its upstream gradients in log_prob's dtype
    g = (torch.rand(g_rows, generator=gen) + 0.5).to(case.dtype)
    gz = torch.rand(g_rows, generator=gen).to(case.dtype)
    x_grad = ce_tvm.cross_entropy_loss_grad(
        g, log_prob, y, w, grad_zloss=gz,
        lse_for_zloss=lse if case.zloss_scale else None, **opts)
    assert x_grad.dtype == case.dtype and x_grad.shape == x.shape
    row_totals = reference.totals(y.numpy(), wn, case.ignore_index, case.c)
    for rows in _blocks(case.n, case.c):
        per_row = (lambda t: t[rows]) if case.reduction == "none" else (lambda t: t)
        ref = reference.backward(
            per_row(g).double().numpy(), log_prob[rows].double().numpy(), y[rows].numpy(), wn,
            per_row(gz).double().numpy(), lse[rows].double().numpy(), case.reduction,
            case.ignore_index, case.label_smoothing, case.zloss_scale, row_totals=row_totals)
        assert_close(x_grad[rows], ref, tol, f"x_grad rows {rows}")
