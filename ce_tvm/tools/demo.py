"""``ce-tvm demo``: compile for this CPU, run forward+backward once on a sample
batch, check it against PyTorch, and print a short timing report."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..functional import cross_entropy_loss, cross_entropy_loss_grad
from ..runtime import launch
from ..runtime.options import LossOptions
from ..runtime.registry import loaded_specs
from ..runtime.tensors import TORCH_DTYPES
from .bench import best_ms


def run_demo(rows: int, classes: int, dtype: str) -> None:
    torch.manual_seed(0)
    x = (torch.randn(rows, classes) * 2).to(TORCH_DTYPES[dtype])
    y = torch.randint(0, classes, (rows,))
    y[::7] = -100
    opts = dict(label_smoothing=0.1)

    t0 = time.perf_counter()
    loss, log_prob, _, _ = cross_entropy_loss(x, y, **opts)
    one = torch.ones(1, dtype=x.dtype)  # the seed pair's upstream gradient has log_prob's dtype
    grad = cross_entropy_loss_grad(one, log_prob, y, **opts)
    first = time.perf_counter() - t0

    xr = x.detach().float().requires_grad_()
    ref = F.cross_entropy(xr, y, **opts)
    ref.backward()
    loss_err = abs(loss.float().item() - ref.item()) / abs(ref.item())
    grad_err = (grad.float() - xr.grad).abs().max().item()

    fwd_ms = best_ms(lambda: cross_entropy_loss(x, y, **opts))
    bwd_ms = best_ms(lambda: cross_entropy_loss_grad(one, log_prob, y, **opts))
    # The same kernels writing into buffers allocated once (the API call gets
    # its [N, C] output from the buffer pool).
    options = LossOptions(**opts)
    out = launch.forward(x, y, None, options, log_prob=True)
    fwd_k = best_ms(lambda: launch.forward(x, y, None, options, log_prob=True, out=out))
    g, gz, lse, x_grad = torch.ones(1), torch.zeros(1), out.lse, torch.empty_like(x)
    bwd_k = best_ms(lambda: launch.backward(g, gz, log_prob, lse, y, None, options,
                                             source_kind="log_prob", out=x_grad))
    xe = x.detach().requires_grad_()
    eager_fwd = best_ms(lambda: F.cross_entropy(xe, y, **opts))
    eager_fb = best_ms(lambda: F.cross_entropy(xe, y, **opts).backward())

    print(f"ce_tvm demo: N={rows} C={classes} {dtype}, label_smoothing=0.1, every 7th row ignored")
    print(f"  kernels: {len(loaded_specs())} loaded, "
          f"first call (build or cache load) {first:.2f} s")
    print(f"  loss {loss.float().item():.6f} vs torch {ref.item():.6f} (rel err {loss_err:.1e}); "
          f"max |grad - torch grad| {grad_err:.1e}")
    print("  best of 5, ms                   API call   kernel only   torch eager")
    print(f"  forward  (loss + log_prob)      {fwd_ms:8.2f}   {fwd_k:11.2f}   {eager_fwd:11.2f}")
    print(f"  backward (x_grad from log_prob) {bwd_ms:8.2f}   {bwd_k:11.2f}")
    print(f"  forward + backward              {fwd_ms + bwd_ms:8.2f}   {fwd_k + bwd_k:11.2f}   "
          f"{eager_fb:11.2f}")
