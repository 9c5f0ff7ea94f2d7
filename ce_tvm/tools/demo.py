"""``ce-tvm demo``: what a user runs, on this CPU, checked and timed.

The drop-in training step (``ce_tvm.cross_entropy`` forward + backward: the
one-pass kernel) and the fused linear head (``ce_tvm.linear_cross_entropy``)
beside PyTorch eager and ``torch.compile``, each checked against PyTorch,
timed interleaved rep by rep with its floor in the same run (one copy of the
logits for the loss, the GEMMs alone for the head); then the seed-compatible
pair in one line, and which kernels were built or loaded from the cache.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..losses.cross_entropy import cross_entropy
from ..losses.linear import linear_cross_entropy
from ..losses.seed import cross_entropy_loss, cross_entropy_loss_grad
from ..runtime.cache import entries
from ..runtime.registry import loaded_specs
from ..runtime.tensors import TORCH_DTYPES
from ..store.paths import cache_dir
from .measure import interleaved_ms

EPS = 0.1  # label smoothing, as language models train


def _step(loss_fn, leaves, *args) -> None:
    for t in leaves:
        t.grad = None
    loss_fn(*leaves, *args).backward()


def _methods(ce_tvm_fn, eager_fn, with_compile: bool) -> dict:
    fns = {"ce_tvm": ce_tvm_fn, "eager": eager_fn}
    if with_compile:
        fns["torch.compile"] = torch.compile(eager_fn, dynamic=False)
    return fns


def _check(loss_fn, eager_fn, leaves, *args) -> str:
    """Loss and gradients of ``loss_fn`` against ``eager_fn`` in float32."""
    ours = [t.detach().clone().requires_grad_() for t in leaves]
    ref = [t.detach().float().clone().requires_grad_() for t in leaves]
    loss, ref_loss = loss_fn(*ours, *args), eager_fn(*ref, *args)
    loss.backward()
    ref_loss.backward()
    rel = abs(loss.float().item() - ref_loss.item()) / abs(ref_loss.item())
    grad = max((a.grad.float() - b.grad).abs().max().item() for a, b in zip(ours, ref))
    return f"loss {loss.float().item():.6f} vs torch {ref_loss.item():.6f} (rel err {rel:.1e}), " \
           f"max |grad - torch grad| {grad:.1e}"


def _timings(title: str, fns: dict, floor: tuple, leaves, args, reps: int) -> list[str]:
    """Interleaved best-of-``reps`` training steps of ``fns`` and the floor probe."""
    timed = {name: (lambda fn=fn: _step(fn, leaves, *args)) for name, fn in fns.items()}
    timed[floor[0]] = floor[1]
    ms = interleaved_ms(timed, reps=reps, warmup=1)
    lines = [f"  {title}: best of {reps}, interleaved"]
    for name, t in ms.items():
        vs = "" if name == floor[0] else (
            f"   {t / ms[floor[0]]:5.2f}x the floor"
            + ("" if name == "ce_tvm" else f", ce_tvm {t / ms['ce_tvm']:5.1f}x faster"))
        lines.append(f"    {name:<22}{t:9.1f} ms{vs}")
    return lines


def run_demo(rows: int, classes: int, hidden: int, dtype: str, reps: int = 3,
             with_compile: bool = True) -> None:
    torch.manual_seed(0)
    dt = TORCH_DTYPES[dtype]
    before = {p.name for p in entries(cache_dir())}
    t0 = time.perf_counter()
    report = [f"ce_tvm demo: {dtype}, label_smoothing={EPS}, every 7th row ignored "
              f"({torch.get_num_threads()} threads)"]

    x = (torch.randn(rows, classes) * 2).to(dt).requires_grad_()
    y = torch.randint(0, classes, (rows,))
    y[::7] = -100

    def loss(x, y):
        return cross_entropy(x, y, label_smoothing=EPS)

    def eager_loss(x, y):
        return F.cross_entropy(x, y, label_smoothing=EPS)

    report.append(f"drop-in training step, logits {rows} x {classes}: "
                  + _check(loss, eager_loss, [x], y))
    copy_dst = torch.empty_like(x)
    report += _timings("ce_tvm.cross_entropy forward + backward",
                       _methods(loss, eager_loss, with_compile),
                       ("floor: one copy of x", lambda: copy_dst.copy_(x)), [x], (y,), reps)

    h = torch.randn(rows, hidden).to(dt).requires_grad_()
    W = (torch.randn(classes, hidden) / hidden**0.5).to(dt).requires_grad_()

    def head(h, W, y):
        return linear_cross_entropy(h, W, y, label_smoothing=EPS)

    def eager_head(h, W, y):
        return F.cross_entropy(F.linear(h, W), y, label_smoothing=EPS)

    def gemms():  # the three GEMMs of a training step, alone
        logits = h.detach() @ W.detach().T
        return logits @ W.detach(), logits.T @ h.detach()

    report.append(f"fused linear head, hidden {rows} x {hidden}, weight {classes} x {hidden}: "
                  + _check(head, eager_head, [h, W], y))
    report += _timings("ce_tvm.linear_cross_entropy forward + backward",
                       _methods(head, eager_head, with_compile),
                       ("floor: the GEMMs alone", gemms), [h, W], (y,), reps)

    xs = x.detach()
    one = torch.ones(1, dtype=xs.dtype)  # the seed pair's upstream gradient has log_prob's dtype

    def seed_pair():
        _, log_prob, _, _ = cross_entropy_loss(xs, y, label_smoothing=EPS)
        cross_entropy_loss_grad(one, log_prob, y, label_smoothing=EPS)

    seed = interleaved_ms({"pair": seed_pair}, reps=reps)["pair"]
    report.append(f"seed-compatible pair (cross_entropy_loss + _grad, writes log_prob): "
                  f"{seed:.1f} ms")

    specs = loaded_specs()
    built = sorted(p.name for p in entries(cache_dir()) if p.name not in before)
    report.append(f"kernels: {len(specs)} loaded ({len(built)} built in this run, the rest "
                  f"from the cache {cache_dir()}); whole demo {time.perf_counter() - t0:.1f} s")
    report += [f"    {spec.stem()}{'  (built)' if spec.file_name() in built else ''}"
               for spec in specs]
    print("\n".join(report))
