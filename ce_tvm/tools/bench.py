"""``ce-tvm bench``: ce_tvm against PyTorch eager and torch.compile in one run.

For each shape x dtype x mode it times every method and the memory probes
interleaved rep by rep (this machine's bandwidth swings between runs, so
only ratios within one run mean much), keeping each one's best:

- ``forward``: the loss only (``torch.no_grad``); ce_tvm also times the
  seed-compatible ``cross_entropy_loss``, which writes ``log_prob``, against
  PyTorch computing the same outputs (the loss and ``log_softmax``, eager and
  compiled as one function). The floor is ``x.sum()``: one read of the
  logits.
- ``fwd_bwd``: ``loss = f(x, y); loss.backward()`` through autograd; ce_tvm
  runs its one-pass training kernel and, as ``ce_tvm_recompute``, the path
  whose backward recomputes the gradient from the logits. The floor is
  ``dst.copy_(x)`` into a buffer allocated once: one read, one write.

Extra peak memory of one forward+backward beyond the inputs and the gradient
is measured in a fresh process per method (peak RSS, reset through
``/proc/self/clear_refs``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ..losses import cross_entropy as cross_entropy_module
from ..losses.cross_entropy import cross_entropy
from ..losses.seed import cross_entropy_loss
from ..optional import require
from ..runtime.pool import POOL
from ..runtime.tensors import TORCH_DTYPES
from .bench_args import DEFAULT_SHAPES
from .measure import PeakRSS, interleaved_ms


@dataclass
class Row:
    shape: str
    dtype: str
    mode: str
    ms: dict = field(default_factory=dict)       # method or probe -> best milliseconds
    floor: str = ""                              # the probe this mode is judged against
    extra_peak_mb: dict = field(default_factory=dict)

    def vs_floor(self, method: str = "ce_tvm") -> float:
        """Time as a multiple of the floor probe's (1.0 = at the floor)."""
        return self.ms[method] / self.ms[self.floor]


def _inputs(n, c, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=gen).to(TORCH_DTYPES[dtype])
    y = torch.randint(0, c, (n,), generator=gen)
    y[::17] = -100
    return x, y


def _recomputing(eps):
    """ce_tvm with the backward recomputing the gradient (the path before the one-pass kernel)."""
    def fn(x, y):
        cross_entropy_module.ONE_PASS_TRAINING = False
        try:
            return cross_entropy(x, y, label_smoothing=eps)
        finally:
            cross_entropy_module.ONE_PASS_TRAINING = True
    return fn


def _seed_outputs(x, y, eps):
    """What the seed op returns, in PyTorch: the loss and ``log_prob[N, C]``."""
    return F.cross_entropy(x, y, label_smoothing=eps), F.log_softmax(x, dim=-1)


def _loss_fns(eps, with_compile):
    """Methods by name; ``*_seed`` ones (PyTorch producing the seed op's outputs)
    are timed in the forward only."""
    fns = {"ce_tvm": lambda x, y: cross_entropy(x, y, label_smoothing=eps),
           "ce_tvm_recompute": _recomputing(eps),
           "eager": lambda x, y: F.cross_entropy(x, y, label_smoothing=eps),
           "eager_seed": lambda x, y: _seed_outputs(x, y, eps)}
    if with_compile:
        compiled = torch.compile(F.cross_entropy, dynamic=False)
        compiled_seed = torch.compile(_seed_outputs, dynamic=False)
        fns["compile"] = lambda x, y: compiled(x, y, label_smoothing=eps)
        fns["compile_seed"] = lambda x, y: compiled_seed(x, y, eps)
    return fns


def bench_shape(n, c, dtype, modes, reps, warmup, eps, with_compile) -> list[Row]:
    torch._dynamo.reset()  # each shape compiles afresh instead of hitting the recompile limit
    x, y = _inputs(n, c, dtype)
    fns = _loss_fns(eps, with_compile)
    rows = []
    for mode in modes:
        row = Row(f"{n}x{c}", dtype, mode)
        if mode == "forward":
            timed = {name: (lambda fn=fn: fn(x, y)) for name, fn in fns.items()
                     if name != "ce_tvm_recompute"}
            timed["ce_tvm_seed"] = lambda: cross_entropy_loss(x, y, label_smoothing=eps)
            timed["x.sum"] = x.sum
            with torch.no_grad():
                row.ms = interleaved_ms(timed, reps, warmup)
            row.floor = "x.sum"
        else:
            xg = x.clone().requires_grad_()
            out = torch.empty_like(x)

            def step(fn):
                fn(xg, y).backward()
                xg.grad = None

            timed = {name: (lambda fn=fn: step(fn)) for name, fn in fns.items()
                     if not name.endswith("_seed")}
            timed["copy"] = lambda: out.copy_(x)
            row.ms = interleaved_ms(timed, reps, warmup)
            row.floor = "copy"
            del out
        rows.append(row)
    return rows


def peak_child(method: str, n: int, c: int, dtype: str, eps: float) -> float:
    """Extra peak RSS (MB) of one forward+backward beyond inputs and gradient."""
    fn = _loss_fns(eps, method == "compile")[method]
    xs, ys = _inputs(64, c, dtype, seed=1)  # warm up: load kernels / compile
    fn(xs.requires_grad_(), ys).backward()
    x, y = _inputs(n, c, dtype)
    x.requires_grad_()
    with PeakRSS() as peak:
        fn(x, y).backward()
    return peak.mb - x.grad.numel() * x.grad.element_size() / 2**20


def measure_peaks(n, c, dtype, eps, with_compile) -> dict:
    peaks = {}
    for method in ["ce_tvm", "eager"] + (["compile"] if with_compile else []):
        code = (f"from ce_tvm.tools.bench import peak_child; "
                f"print(peak_child({method!r}, {n}, {c}, {dtype!r}, {eps}))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        peaks[method] = float(done.stdout.split()[-1]) if done.returncode == 0 else float("nan")
    return peaks


def format_table(rows: list[Row]) -> str:
    head = ("| shape | dtype | mode | ce_tvm ms | eager ms | compile ms | x eager | x compile "
            "| floor ms | ce_tvm / floor | extra peak MB (ce_tvm / eager / compile) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    nan = float("nan")

    def line(label, r, method, floor=True, peak="", baselines=("eager", "compile")):
        ms, eager, comp = r.ms[method], r.ms[baselines[0]], r.ms.get(baselines[1], nan)
        floor_cells = (f"{r.ms[r.floor]:.1f} ({r.floor}) | {r.vs_floor(method):.2f}x"
                       if floor else " | ")
        return (f"| {r.shape} | {r.dtype} | {label} | {ms:.1f} | {eager:.1f} | {comp:.1f} | "
                f"{eager / ms:.2f} | {comp / ms:.2f} | {floor_cells} | {peak} |")

    for r in rows:
        peak = " / ".join(f"{r.extra_peak_mb.get(m, nan):.0f}"
                          for m in ("ce_tvm", "eager", "compile")) if r.extra_peak_mb else ""
        lines.append(line(r.mode if r.mode == "forward" else "fwd_bwd (one pass)", r, "ce_tvm",
                          peak=peak))
        if r.mode == "forward":
            lines.append(line("forward, seed API (writes log_prob; vs torch's loss + "
                              "log_softmax)", r, "ce_tvm_seed", False,
                              baselines=("eager_seed", "compile_seed")))
        else:
            speedup = r.ms["ce_tvm_recompute"] / r.ms["ce_tvm"]
            lines.append(line(f"fwd_bwd, recompute path (one pass {speedup:.2f}x faster)", r,
                              "ce_tvm_recompute"))
    return head + "\n".join(lines)


def draw_chart(rows: list[Row], path: str) -> None:
    matplotlib = require("matplotlib", "bench", "ce-tvm bench --png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = ["ce_tvm", "ce_tvm_recompute", "eager", "compile"]
    labels = [f"{r.shape}\n{r.dtype}\n{r.mode}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ax.bar([k + i * width for k in range(len(rows))],
               [r.ms.get(m, 0.0) for r in rows], width, label=m)
    ax.set_xticks([k + width for k in range(len(rows))], labels, fontsize=7)
    ax.set_ylabel("ms (lower is better)")
    ax.set_title(f"cross entropy, {torch.get_num_threads()} threads, label smoothing")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args) -> int:
    if args.linear:
        from .bench_linear import run as run_linear

        return run_linear(args)
    if args.policy:
        from .bench_policy import run as run_policy

        return run_policy(args)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    shapes = [tuple(int(v) for v in s.lower().split("x"))
              for s in (args.shapes or DEFAULT_SHAPES).split(",")]
    if args.label_smoothing is None:
        args.label_smoothing = 0.1
    modes = args.modes.split(",")
    rows = []
    for n, c in shapes:
        for dtype in args.dtypes.split(","):
            print(f"bench {n}x{c} {dtype} ...", file=sys.stderr, flush=True)
            new = bench_shape(n, c, dtype, modes, args.reps, args.warmup, args.label_smoothing,
                              not args.no_compile)
            if args.memory:
                peaks = measure_peaks(n, c, dtype, args.label_smoothing, not args.no_compile)
                for r in new:
                    if r.mode == "fwd_bwd":
                        r.extra_peak_mb = peaks
            rows.extend(new)
    table = format_table(rows)
    print(table)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "pool_bytes": POOL.max_bytes, "label_smoothing": args.label_smoothing,
            "command": " ".join(sys.argv)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.png:
        draw_chart(rows, args.png)
    return 0
