"""``ce-tvm bench --policy``: per-token log-probs and entropy (RL post-training)
against PyTorch and TRL in one run.

One step is ``logp, H = f(...); (a * logp).sum() + (b * H).sum()`` then
``backward()`` (temperature 0.7, one index per row), for

- logits ``N x V``: ``ce_tvm`` (``ce_tvm.log_probs``); ``eager`` and
  ``compile`` (``torch.compile``) of the reference expression
  (``log_softmax`` of the scaled logits, ``gather``, ``-(p * logp).sum``);
  ``trl``: TRL's ``selective_log_softmax`` and ``entropy_from_logits`` (their
  CPU paths); the floor ``copy`` (``dst.copy_(x)``: the logits read once and
  a gradient written once; the step reads them twice, forward and backward).
- the LM head ``N x H x V``: ``ce_tvm`` (``ce_tvm.linear_log_probs``),
  ``eager`` (``F.linear`` then the reference expression), ``trl``: TRL's own
  fused head (``trl.kernels.ChunkedLogProbFunction``, its CPU path), and the
  floor ``gemm``: the four products of a head that recomputes its logits in
  the backward (the logits, their recompute, the two gradient products), each
  one ``torch.mm`` into a buffer made once.

Methods are interleaved rep by rep and the best rep is kept. With
``--memory``, the extra peak memory of one step beyond the inputs and the
gradients, each method in a fresh process (``bench_linear``'s protocol).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ..losses.log_probs import linear_log_probs, log_probs
from ..optional import guard
from ..runtime.tensors import TORCH_DTYPES
from .measure import PeakRSS, in_fresh_processes, interleaved_ms

DEFAULT_SHAPES = "4096x32000,2048x256x128256"
TEMPERATURE = 0.7


@dataclass
class Row:
    shape: str
    dtype: str
    ms: dict = field(default_factory=dict)            # method -> best milliseconds
    extra_peak_mb: dict = field(default_factory=dict)


def reference(logits, index, temperature=TEMPERATURE):
    """``(logp, entropy)`` in plain torch ops: what ``eager`` and ``compile`` run."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _trl_module(name: str):
    with guard("trl", "trl", "ce-tvm bench --policy (it compares against TRL)",
               "pass --no-trl"):
        return __import__(name, fromlist=["_"])


def _trl(logits, index, temperature=TEMPERATURE):
    utils = _trl_module("trl.trainer.utils")
    return (utils.selective_log_softmax(logits, index, temperature),
            utils.entropy_from_logits(logits / temperature))


def _trl_head(x, W, index, temperature=TEMPERATURE):
    """TRL's fused head, as its trainers call it (vocabulary tiles of 32768)."""
    kernels = _trl_module("trl.kernels")
    return kernels.ChunkedLogProbFunction.apply(x, W, None, index, temperature, 32768, None,
                                                1.0, ("log_probs", "entropy"))[:2]


def inputs(shape, dtype, seed=0):
    """``(tensors, index, a, b)``: the logits ``[N, V]`` (or ``x [N, H]`` and ``W
    [V, H]``), one index per row, and the upstream weights of ``step``."""
    gen = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    if len(shape) == 2:
        n, v = shape
        tensors = [(torch.randn(n, v, generator=gen) * 2).to(dt)]
    else:
        n, h, v = shape
        tensors = [torch.randn(n, h, generator=gen).to(dt),
                   (torch.randn(v, h, generator=gen) * h ** -0.5).to(dt)]
    index = torch.randint(0, shape[-1], (n,), generator=gen)
    return tensors, index, torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def methods(shape, with_compile: bool = True, with_trl: bool = True) -> dict:
    """``{name: f(*tensors, index) -> (logp, entropy)}`` for a logits or a head shape."""
    if len(shape) == 2:
        fns = {"ce_tvm": lambda x, i: log_probs(x, i, temperature=TEMPERATURE,
                                                return_entropy=True),
               "eager": reference}
        if with_compile:
            fns["compile"] = torch.compile(reference, dynamic=False)
        if with_trl:
            fns["trl"] = _trl
        return fns
    fns = {"ce_tvm": lambda x, W, i: linear_log_probs(x, W, i, temperature=TEMPERATURE,
                                                      return_entropy=True),
           "eager": lambda x, W, i: reference(F.linear(x, W), i)}
    if with_trl:
        fns["trl"] = _trl_head
    return fns


def step(fn, leaves, index, a, b):
    """One step: ``(a * logp).sum() + (b * entropy).sum()`` of ``fn(*leaves,
    index)``, backward, the leaves' gradients dropped."""
    logp, entropy = fn(*leaves, index)
    ((logp * a).sum() + (entropy * b).sum()).backward()
    for t in leaves:
        t.grad = None


def gemm_floor(x, W, fresh_grads: bool = False):
    """The floor of a head step that recomputes its logits: the four products (the
    logits, their recompute, the input's and the weight's gradients), each one
    ``torch.mm`` into a buffer made once; with ``fresh_grads`` the two gradients
    go to new tensors each call, as every head's do (autograd keeps them as
    ``.grad``), so the floor pays their first touch too."""
    logits = x.new_empty((x.shape[0], W.shape[0]))
    grad_x, grad_W = torch.empty_like(x), torch.empty_like(W)

    def gemm():
        torch.mm(x, W.t(), out=logits)
        torch.mm(x, W.t(), out=logits)
        torch.mm(logits, W, out=torch.empty_like(x) if fresh_grads else grad_x)
        torch.mm(logits.t(), x, out=torch.empty_like(W) if fresh_grads else grad_W)
    return gemm


def bench_shape(shape, dtype, reps, warmup, with_compile, with_trl) -> Row:
    torch._dynamo.reset()
    tensors, index, a, b = inputs(shape, dtype)
    leaves = [t.clone().requires_grad_() for t in tensors]
    timed = {name: (lambda fn=fn: step(fn, leaves, index, a, b))
             for name, fn in methods(shape, with_compile, with_trl).items()}
    if len(shape) == 2:
        out = torch.empty_like(tensors[0])
        timed["copy"] = lambda: out.copy_(tensors[0])
    else:
        timed["gemm"] = gemm_floor(*tensors)
    return Row("x".join(map(str, shape)), dtype, interleaved_ms(timed, reps, warmup))


def peak_child(method: str, shape: tuple, dtype: str) -> float:
    """Extra peak RSS (MB) of one step beyond the inputs and their gradients,
    after a warm-up step at the same shape."""
    fn = methods(shape, with_compile=method == "compile", with_trl=method == "trl")[method]
    tensors, index, a, b = inputs(shape, dtype)
    leaves = [t.requires_grad_() for t in tensors]
    step(fn, leaves, index, a, b)
    with PeakRSS() as peak:
        logp, entropy = fn(*leaves, index)
        ((logp * a).sum() + (entropy * b).sum()).backward()
    return peak.mb - sum(t.grad.numel() * t.grad.element_size() for t in leaves) / 2**20


def measure_peaks(shape, dtype, names) -> dict:
    return in_fresh_processes(__name__, names, tuple(shape), dtype)


def format_table(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        floor = "copy" if "copy" in r.ms else "gemm"
        cells = "  ".join(f"{k} {v:8.1f} ms" for k, v in r.ms.items())
        ratios = "  ".join(f"{k}/ce_tvm {v / r.ms['ce_tvm']:.2f}x" for k, v in r.ms.items()
                           if k != "ce_tvm")
        mem = "  ".join(f"{k} {v:.0f} MB" for k, v in r.extra_peak_mb.items())
        lines.append(f"{r.shape} {r.dtype}: {cells}\n    {ratios}  (floor: {floor})"
                     + (f"\n    extra peak: {mem}" if mem else ""))
    return "\n".join(lines)


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    shapes = [tuple(int(v) for v in s.lower().split("x"))
              for s in (args.shapes or DEFAULT_SHAPES).split(",")]
    rows = []
    for shape in shapes:
        for dtype in args.dtypes.split(","):
            print(f"bench --policy {shape} {dtype} ...", file=sys.stderr, flush=True)
            row = bench_shape(shape, dtype, args.reps, args.warmup, not args.no_compile,
                              not args.no_trl)
            if args.memory:
                row.extra_peak_mb = measure_peaks(
                    shape, dtype, [m for m in row.ms if m not in ("copy", "gemm")])
            rows.append(row)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                                "temperature": TEMPERATURE, "command": " ".join(sys.argv)},
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0
