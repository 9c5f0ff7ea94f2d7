"""``ce-tvm bench --linear``: the fused linear + cross-entropy against PyTorch in one run.

For each shape ``N x H x V`` and dtype it times one training step
(``loss = f(x, W, y); loss.backward()``, gradients of ``x`` and ``W``) for

- ``ce_tvm``: ``ce_tvm.linear_cross_entropy``;
- ``eager``: ``F.cross_entropy(F.linear(x, W), y)``;
- ``compile``: ``torch.compile`` of the same function;
- ``torch_chunked``: PyTorch's ``F.linear_cross_entropy(...,
  options=LinearCrossEntropyOptions())`` (it falls back to the unchunked
  path when label smoothing is on);
- ``gemm``: the probe ``F.linear(x, W).sum().backward()``, the three matrix
  products of a step and no loss: the floor to compare with.

Methods are interleaved rep by rep and the minimum of the reps is kept. Extra
peak memory (RSS high-water mark of one step beyond the inputs and the
gradients) is measured in a fresh process per method, after one warm-up step
at the same shape, with glibc's mmap threshold fixed (so freed memory leaves
the RSS at once) and ce_tvm's buffer pool off (so its chunk buffer counts).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ..losses.linear import linear_cross_entropy
from ..optional import require
from ..runtime.tensors import TORCH_DTYPES
from .measure import PeakRSS, in_fresh_processes, interleaved_ms

DEFAULT_SHAPES = "2048x256x32000,1024x512x128256"
METHODS = ("ce_tvm", "eager", "compile", "torch_chunked", "gemm")
LABELS = {"ce_tvm": "ce_tvm", "eager": "eager", "compile": "torch.compile",
          "torch_chunked": "torch chunked", "gemm": "GEMM probe"}
# The fused head's goals: memory within max(eager / 8, 1.25 x torch chunked);
# time within eager's and within 1.05 x the GEMM probe's.
MEMORY_SHARE_OF_EAGER, MEMORY_X_CHUNKED, TIME_X_GEMM = 1 / 8, 1.25, 1.05


@dataclass
class Row:
    shape: str
    dtype: str
    ms: dict = field(default_factory=dict)            # method -> best milliseconds
    extra_peak_mb: dict = field(default_factory=dict)

    def goals(self) -> dict:
        """Each goal (the limits above) as ``(value, limit, met)``."""
        ms, mb = self.ms, self.extra_peak_mb
        out = {"time <= eager": (ms["ce_tvm"], ms["eager"], ms["ce_tvm"] <= ms["eager"]),
               "time <= 1.05 x GEMM": (ms["ce_tvm"], TIME_X_GEMM * ms["gemm"],
                                       ms["ce_tvm"] <= TIME_X_GEMM * ms["gemm"])}
        if mb:
            limit = max(MEMORY_SHARE_OF_EAGER * mb["eager"], MEMORY_X_CHUNKED * mb["torch_chunked"])
            out["memory"] = (mb["ce_tvm"], limit, mb["ce_tvm"] <= limit)
        return out


def _inputs(n, h, v, dtype, seed=0):
    """``x [n, h]``, ``W [v, h]`` (leaves requiring grad), ``y [n]`` with every 17th row ignored."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).to(TORCH_DTYPES[dtype]).requires_grad_()
    W = (torch.randn(v, h, generator=gen) / h**0.5).to(TORCH_DTYPES[dtype]).requires_grad_()
    y = torch.randint(0, v, (n,), generator=gen)
    y[::17] = -100
    return x, W, y


def loss_fns(eps: float, methods=METHODS) -> dict:
    """``name -> f(x, W, y)`` returning the scalar to call ``backward`` on."""

    def eager(x, W, y):
        return F.cross_entropy(F.linear(x, W), y, label_smoothing=eps)

    fns = {
        "ce_tvm": lambda x, W, y: linear_cross_entropy(x, W, y, label_smoothing=eps),
        "eager": eager,
        "torch_chunked": lambda x, W, y: F.linear_cross_entropy(
            x, W, y, label_smoothing=eps, options=torch.nn.LinearCrossEntropyOptions()),
        "gemm": lambda x, W, y: F.linear(x, W).sum(),
    }
    if "compile" in methods:  # wrapped only when asked for (it imports dynamo)
        fns["compile"] = torch.compile(eager, dynamic=False)
    return {name: fns[name] for name in methods}


def _step(fn, x, W, y) -> None:
    x.grad = W.grad = None
    fn(x, W, y).backward()


def time_shape(n, h, v, dtype, eps, methods, reps, warmup) -> dict:
    """Best milliseconds of a training step per method, interleaved rep by rep."""
    torch._dynamo.reset()
    x, W, y = _inputs(n, h, v, dtype)
    return interleaved_ms({name: (lambda fn=fn: _step(fn, x, W, y))
                           for name, fn in loss_fns(eps, methods).items()}, reps, warmup)


def peak_child(method: str, n: int, h: int, v: int, dtype: str, eps: float) -> float:
    """Extra peak RSS (MB) of one training step beyond the inputs and the gradients."""
    fn = loss_fns(eps, (method,))[method]
    x, W, y = _inputs(n, h, v, dtype)
    _step(fn, x, W, y)  # warm up: kernels loaded, graph compiled
    x.grad = W.grad = None
    with PeakRSS() as peak:
        fn(x, W, y).backward()
    return peak.mb - sum(t.grad.numel() * t.grad.element_size() for t in (x, W)) / 2**20


def measure_peaks(n, h, v, dtype, eps, methods) -> dict:
    return in_fresh_processes(__name__, methods, n, h, v, dtype, eps)


def format_table(rows: list[Row]) -> str:
    methods = [m for m in METHODS if m in rows[0].ms]
    head = ("| shape NxHxV | dtype | " + " | ".join(f"{LABELS[m]} ms" for m in methods)
            + " | x eager | x GEMM | extra peak MB (" + " / ".join(LABELS[m] for m in methods)
            + ") |\n|" + "---|" * (len(methods) + 5) + "\n")
    lines = []
    for r in rows:
        peaks = " / ".join(f"{r.extra_peak_mb.get(m, float('nan')):.0f}" for m in methods)
        lines.append(f"| {r.shape} | {r.dtype} | "
                     + " | ".join(f"{r.ms[m]:.0f}" for m in methods)
                     + f" | {r.ms['ce_tvm'] / r.ms['eager']:.2f} | "
                     f"{r.ms['ce_tvm'] / r.ms['gemm']:.2f} | {peaks if r.extra_peak_mb else ''} |")
    return head + "\n".join(lines)


def format_goals(rows: list[Row]) -> str:
    lines = ["Goals: time <= eager, time <= 1.05 x GEMM probe, "
             "extra peak memory <= max(eager / 8, 1.25 x torch chunked):"]
    for r in rows:
        parts = [f"{name}: {value:.0f} vs {limit:.0f} {'met' if met else 'MISSED'}"
                 for name, (value, limit, met) in r.goals().items()]
        lines.append(f"  {r.shape} {r.dtype}: " + "; ".join(parts))
    return "\n".join(lines)


def draw_chart(rows: list[Row], path: str) -> None:
    matplotlib = require("matplotlib", "bench", "ce-tvm bench --png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if m in rows[0].ms]
    labels = [f"{r.shape}\n{r.dtype}" for r in rows]
    panels = [("ms per training step (lower is better)", lambda r, m: r.ms.get(m, 0.0))]
    if rows[0].extra_peak_mb:
        panels.append(("extra peak MB (lower is better)",
                       lambda r, m: r.extra_peak_mb.get(m, 0.0)))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7, 2.4 * len(rows)) * len(panels), 4.5))
    width = 0.8 / len(methods)
    for ax, (title, value) in zip(axes if len(panels) > 1 else [axes], panels):
        for i, m in enumerate(methods):
            ax.bar([k + i * width for k in range(len(rows))], [value(r, m) for r in rows],
                   width, label=LABELS[m])
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(rows))], labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_yscale("log")
    axes_list = axes if len(panels) > 1 else [axes]
    axes_list[0].legend(fontsize=8)
    fig.suptitle(f"linear + cross entropy, fwd+bwd, {torch.get_num_threads()} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args) -> int:
    """``ce-tvm bench --linear`` (the bench parser's options; shapes are NxHxV)."""
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    warnings.filterwarnings("ignore", message="linear_cross_entropy")
    eps = args.label_smoothing if args.label_smoothing is not None else 0.0
    methods = [m for m in METHODS if not (args.no_compile and m == "compile")]
    shapes = [tuple(int(v) for v in s.lower().split("x"))
              for s in (args.shapes or DEFAULT_SHAPES).split(",")]
    rows = []
    for n, h, v in shapes:
        for dtype in args.dtypes.split(","):
            print(f"bench linear {n}x{h}x{v} {dtype} ...", file=sys.stderr, flush=True)
            row = Row(f"{n}x{h}x{v}", dtype,
                      ms=time_shape(n, h, v, dtype, eps, methods, args.reps, args.warmup))
            if args.memory:
                row.extra_peak_mb = measure_peaks(n, h, v, dtype, eps, methods)
            rows.append(row)
    print(format_table(rows))
    print()
    print(format_goals(rows))
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "label_smoothing": eps, "ignored_rows": "every 17th", "reps": args.reps,
            "load_average": os.getloadavg(), "command": " ".join(sys.argv)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [{**asdict(r), "goals": r.goals()} for r in rows]},
                      f, indent=1)
    if args.png:
        draw_chart(rows, args.png)
    return 0
