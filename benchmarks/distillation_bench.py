"""Student-teacher distillation through both LM heads: one training step
(``loss = divergence(...)``, ``loss.backward()``; the student's input and
weight take gradients, the teacher none), at TRL's default-like beta 0.5.

Methods, interleaved rep by rep (best rep kept; ``ce_tvm.tools.measure``):

- ``ce_tvm``: ``ce_tvm.linear_distillation_loss`` (row chunks, two GEMM
  buffers, one TVM kernel per chunk; the gradient from the forward's sweep);
- ``trl``: TRL 1.16's ``ChunkedDivergenceFunction`` (its CPU path: torch on
  vocabulary tiles), reduced as ``DistillationTrainer`` does;
- ``eager``: ``F.linear`` for both heads, then the divergence in torch
  (``generalized_jsd_loss``'s expression on the whole logits);
- the floor ``gemm``: the step's four products alone (both heads' logits,
  the student's input and weight gradients), into buffers made beforehand.

With ``--memory`` the extra peak RSS of one step beyond the inputs and the
gradients, each method in a fresh process (``bench_policy``'s protocol).

    .venv/bin/python benchmarks/distillation_bench.py --memory \\
        --out benchmarks/results/llvm-znver5-2c/distillation_bench.json
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.store.targets import host_cpu
from ce_tvm.tools.measure import PeakRSS, in_fresh_processes, interleaved_ms, write_report

BETA = 0.5


def inputs(n, h, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, h, generator=g)
    Ws = torch.randn(v, h, generator=g) * h ** -0.5
    xt = torch.randn(n, h, generator=g)
    Wt = torch.randn(v, h, generator=g) * h ** -0.5
    return xs.requires_grad_(), Ws.requires_grad_(), xt, Wt


def eager(xs, Ws, xt, Wt):
    lp = F.log_softmax(F.linear(xs, Ws), -1)
    with torch.no_grad():
        lq = F.log_softmax(F.linear(xt, Wt), -1)
    lm = torch.logsumexp(torch.stack([lp + math.log1p(-BETA), lq + math.log(BETA)]), 0)
    jsd = (BETA * F.kl_div(lm, lq, reduction="none", log_target=True)
           + (1 - BETA) * F.kl_div(lm, lp, reduction="none", log_target=True))
    return jsd.sum() / xs.shape[0]


def trl(xs, Ws, xt, Wt):
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    div, _ = ChunkedDivergenceFunction.apply(xs, Ws, None, xt, Wt, None, BETA)
    return div.sum() / xs.shape[0]


def fused(xs, Ws, xt, Wt):
    return ce_tvm.linear_distillation_loss(xs, Ws, xt, Wt, beta=BETA)


METHODS = {"ce_tvm": fused, "trl": trl, "eager": eager}


def gemm_floor(xs, Ws, xt, Wt):
    """The step's four GEMMs alone, as a callable (its buffers made here, once)."""
    xs, Ws = xs.detach(), Ws.detach()
    logits = xs.new_empty((xs.shape[0], Ws.shape[0]))
    grad_x, grad_W = torch.empty_like(xs), torch.empty_like(Ws)

    def gemm():
        torch.mm(xs, Ws.t(), out=logits)
        torch.mm(xt, Wt.t(), out=logits)
        torch.mm(logits, Ws, out=grad_x)
        torch.mm(logits.t(), xs, out=grad_W)
    return gemm


def step(fn, leaves, xt, Wt):
    for t in leaves:
        t.grad = None
    fn(*leaves, xt, Wt).backward()


def peak_child(method: str, shape: tuple) -> float:
    """Extra peak RSS (MB) of one step beyond the inputs and the gradients."""
    xs, Ws, xt, Wt = inputs(*shape)
    step(METHODS[method], [xs, Ws], xt, Wt)
    for t in (xs, Ws):
        t.grad = torch.zeros_like(t)  # held, as a training loop holds them
    with PeakRSS() as peak:
        METHODS[method](xs, Ws, xt, Wt).backward()
    return peak.mb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2048x256x128256", help="N x H x V")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split("x"))
    xs, Ws, xt, Wt = inputs(*shape)
    # the same loss from each method first (a benchmark of wrong answers is no benchmark)
    with torch.no_grad():
        values = {name: float(fn(xs, Ws, xt, Wt)) for name, fn in METHODS.items()}
    timed = {name: (lambda fn=fn: step(fn, [xs, Ws], xt, Wt)) for name, fn in METHODS.items()}
    timed["gemm"] = gemm_floor(xs, Ws, xt, Wt)
    ms = interleaved_ms(timed, reps=args.reps)
    result = {
        "what": "one step of the beta 0.5 generalized JSD through both LM heads (fp32), "
                "loss.backward() to the student's input and weight",
        "machine": f"{platform.node()}: {os.cpu_count()} cores, LLVM {host_cpu()}",
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "shape_NxHxV": args.shape,
        "loss": values, "ms": ms,
        "speedup": {name: ms[name] / ms["ce_tvm"] for name in METHODS if name != "ce_tvm"},
        "of_gemm_floor": ms["ce_tvm"] / ms["gemm"],
    }
    if args.memory:  # the children import this file as a module
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (here, os.environ.get("PYTHONPATH")) if p)
        peaks = in_fresh_processes("distillation_bench", list(METHODS), shape)
        result["extra_peak_mb"] = peaks
        result["peak_vs_eager"] = peaks["ce_tvm"] / peaks["eager"]
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
