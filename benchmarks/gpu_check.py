"""The prepared GPU check: the CUDA kernels against float64 references computed
here, then timings against PyTorch eager, torch.compile and the Triton kernels
of Liger Kernel and TRL, in sections whose results reach a JSON-lines file as
they come.

    python benchmarks/gpu_check.py [--sections S,...] [--json F] [--bundle DIR]... [--modules DIR]
    python benchmarks/gpu_check.py --device cpu [--export DIR] [--bundle DIR]... [--modules DIR]

Sections (``--sections``: names, or the groups ``checks`` and ``timings``; by
default both). Checks compare every output and gradient by relative error,
``max |ours - ref| / max |ref|``:

- ``correctness``: ``ce_tvm.cross_entropy`` (class weights, ignore_index,
  smoothing 0.1) on a grid of shapes and dtypes, loss and gradient;
- ``training_kernel``: the one-pass training kernel (``launch.train``), which
  CUDA tensors do not use by default yet;
- ``log_probs``: ``log_probs`` and ``linear_log_probs`` with
  ``return_entropy=True`` and ``return_stats=True``, temperature 0.7, with and
  without a softcap, an ignored index and masked rows;
- ``sharded_direct``: the vocabulary-parallel head's kernels on two column
  shards of one logits tensor (each shard's statistics and gradient), and the
  loss from statistics combined over the shards;
- ``sharded_group``: ``ce_tvm.distributed``'s cross entropy, linear cross
  entropy and linear log-probs in a world of one (gloo);
- ``distill``: ``distillation_loss`` and ``linear_distillation_loss`` at beta
  0, 0.5 (temperature 2) and 1 (both softcaps): loss, entropy, gradients.

Timings (forward + backward; every method timed in turn within each rep after
one warm-up call, the best rep kept, a rep on CUDA the mean of five calls back to
back (``Plan.calls``); a method that fails or is not installed is recorded and
left out; on CUDA each method's extra peak memory too, ``extra_peak_mib``):

- ``time_ce``: cross entropy at 8192 x 128256, bf16 and fp32 (also with the
  targets range-checked on the host, ``CE_TVM_CUDA_TARGET_CHECK=sync``), against eager,
  torch.compile, Liger (``liger_cross_entropy``) and flash-attn when
  importable, with the copy floor (one read and one write of the logits);
  where the TVM compiler is installed also the forward against dlight's
  GeneralReduction schedule of the same compute;
- ``time_linear``: fused linear cross entropy at 8192 x 4096 x 128256 bf16
  against Liger's, eager (logits upcast, as Hugging Face models do) and the
  floor of three GEMMs;
- ``time_log_probs``: log-probs and entropy at 8192 x 128256 bf16 against
  TRL's Triton kernel (``selective_log_softmax_and_entropy``), eager and
  torch.compile, with the copy floor; then its forward and gradient kernels
  alone, with the read and copy floors;
- ``time_distill``: the beta 0.5 divergence through both heads at 4096 x 4096
  x 128256 bf16 against TRL's ``ChunkedDivergenceFunction``, eager and the
  floor of the step's four GEMMs (``distillation_bench``'s);
- ``time_training``: the one-pass training kernel against the recompute path;
- ``time_edge``: an empty batch and offset views.

``sanitize`` (run only when named) is a small grid of every kernel family with
an empty batch and offset views, for compute-sanitizer (``gpu_check.sh``).

Every row is appended to ``--json`` as soon as it is done and every section
ends with a record of its verdict and time, so a run stopped by a time limit
keeps what finished; a case or a section that raises (a kernel no bundle
holds, a failed launch) is recorded and the next one runs.
``--bundle DIR`` (``ce-tvm bundle --target cuda``; repeatable) and
``--modules DIR`` (a module directory, as ``--export`` writes one) provide the
kernels and the TVM runtime: the host needs torch and apache-tvm-ffi, not
apache-tvm.

``--device cpu`` rehearses the check without a GPU: the same sections on CPU
tensors, at most 16 rows and a hidden size of 64, the class counts kept
(``--classes C`` replaces them and ``--dtypes`` keeps some dtypes: a quicker
run), one rep, no torch.compile (Triton's kernels fail to import or run, and
are recorded so). It loads the CPU builds of the kernels the GPU run loads
(the one-pass training kernel only where CUDA takes it by default), then looks
for each one's CUDA build (``--arch``) in the ``--bundle`` and ``--modules``
directories, when any is given: the missing ones are built into ``--export
DIR`` (with nvcc), or reported (exit status 1).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib.util
import json
import math
import os
import sys
import time
import traceback
import types
from dataclasses import dataclass, replace
from pathlib import Path

# Every GPU_CHECK_TRACE_EVERY_S seconds, every thread's stack on stderr: device
# time is short, and a run that hangs (one on an H200 printed nothing) shows where.
if int(os.environ.get("GPU_CHECK_TRACE_EVERY_S", "0")) > 0:
    faulthandler.dump_traceback_later(int(os.environ["GPU_CHECK_TRACE_EVERY_S"]), repeat=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ce_tvm  # noqa: E402
from ce_tvm.losses import checks  # noqa: E402
from ce_tvm.runtime import launch, linear_sweep  # noqa: E402
from ce_tvm.runtime.options import LossOptions  # noqa: E402
from ce_tvm.tools import bench_policy  # noqa: E402

CPU_ROWS, CPU_HIDDEN = 16, 64  # a CPU rehearsal's cuts
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ACC_TOL = 1e-4  # values the kernels compute in float32 from the very inputs of the reference
GRID = [(n, c, dtype) for n, c in [(64, 17), (256, 1001), (512, 32000), (128, 128256),
                                   (64, 256000)] for dtype in TOL]
POLICY_GRID = [(256, 32000, dtype) for dtype in TOL] + [(64, 128256, torch.bfloat16)]
HEAD_GRID = [(256, 32000, torch.bfloat16), (256, 32000, torch.float32)]  # shards, distillation
HIDDEN = 256  # the LM heads' width in the checks
SOFTCAP = 30.0
MASK_STRIDE = 5  # the masked vocabulary's: classes 1, 6, 11, ... -inf
# Softcaps with reverse KL: the capped JSD's CPU build (the rehearsal's) takes minutes
DISTILL_CASES = ({"beta": 0.0}, {"beta": 0.5, "temperature": 2.0},
                 {"beta": 1.0, "student_softcap": SOFTCAP, "teacher_softcap": 50.0})
SANITIZE_GRID = [(8, 1001, torch.bfloat16), (4, 9000, torch.float32), (0, 5000, torch.bfloat16)]
CE_TIMED = [(8192, 128256, torch.bfloat16), (8192, 128256, torch.float32)]
LINEAR_TIMED, LINEAR_HIDDEN = [(8192, 128256, torch.bfloat16)], 4096
LOG_PROBS_TIMED = [(8192, 128256, torch.bfloat16)]
DISTILL_TIMED, DISTILL_HIDDEN = [(4096, 128256, torch.bfloat16)], 4096
EDGE_TIMED = [(4096, 32000, torch.bfloat16)]
# Knobs of the CUDA schedule timed beside its own (``ce_tvm.schedule("cuda", ...)``),
# by op, at the shapes timed for it (``KNOB_TIMED``): what a GPU settles that GPGPU-Sim
# could not (its sm_86 model has 46 SMs and 4 MB of L2; an H200 132 and 50 MB): the
# training kernel's rows per SM and gradient order (its second read of the row from
# L2: 512 threads hold 4 rows per SM, two lane rounds 42 registers in bf16, one row),
# one vector per lane or two rounds of the lane loop, and the gradients (the
# recompute path's, the log-probs') with more loads in flight (8 sweeps a thread)
# or 512 threads a row.
KNOB_VARIANTS = {"train": ({"threads": 512}, {"gradient_backwards": False},
                           {"lane_vectors": 1}, {"lane_rounds": 2}),
                 "forward": ({"lane_rounds": 2}, {"lane_vectors": 1}),
                 "backward": ({"unroll": 8}, {"threads": 512}),
                 "log_probs": ({"lane_rounds": 1}, {"lane_vectors": 1}),
                 "log_probs_grad": ({"unroll": 8}, {"threads": 512})}
KNOB_TIMED = {"train": CE_TIMED, "forward": CE_TIMED, "backward": CE_TIMED,
              "log_probs": LOG_PROBS_TIMED, "log_probs_grad": LOG_PROBS_TIMED}
# The fused heads' rows per chunk timed beside the default (an eighth of the rows
# here): with 16-bit weights every chunk after the first reads and writes the float32
# ``grad_W`` once more (2 x 4 x V x H bytes, 4.2 GB at 4096 x 128256: about 0.9 ms of
# an H200's HBM a chunk), and each GEMM has a chunk's rows to amortise its pass
# over ``W``. Fewer, larger chunks trade the logits' memory for both.
CHUNK_ROWS_VARIANTS = (4, 2, 1)  # chunks: the batch's rows divided by each


@dataclass(frozen=True)
class Plan:
    """Where the check runs and, for a CPU rehearsal, how its shapes are cut:
    ``classes`` replaces every class count, ``dtypes`` (when not empty) keeps
    only those dtypes."""

    device: torch.device
    classes: int | None = None
    dtypes: tuple = ()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def reps(self) -> int:
        return 10 if self.cuda else 1

    @property
    def calls(self) -> int:
        """Calls timed back to back in one rep (their mean is the rep's time): on
        CUDA the host then runs ahead, as in a training loop, so a method's host
        overhead shows only where it exceeds its GPU time (or where it waits for
        the GPU, as the default target check does)."""
        return 5 if self.cuda else 1

    def rows(self, n: int) -> int:
        return n if self.cuda else min(n, CPU_ROWS)

    def hidden(self, h: int) -> int:
        return h if self.cuda else min(h, CPU_HIDDEN)

    def width(self, c: int) -> int:
        return self.classes or c

    def cases(self, grid) -> list:
        """``(rows, classes, dtype)`` of ``grid``, cut for this plan."""
        return [(self.rows(n), self.width(c), dtype) for n, c, dtype in grid
                if not self.dtypes or dtype in self.dtypes]

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def name(self) -> str:
        return torch.cuda.get_device_name() if self.cuda else "cpu (rehearsal)"


# --- Inputs and references -------------------------------------------------------


def _inputs(plan: Plan, n: int, c: int, dtype, seed: int = 0):
    """Seeded logits ``[n, c]`` (dtype), targets with every 7th row ignored, class weights."""
    gen = plan.generator(seed)
    x = (torch.randn(n, c, device=plan.device, generator=gen) * 3).to(dtype)
    y = torch.randint(0, c, (n,), device=plan.device, generator=gen)
    y[::7] = -100
    w = torch.rand(c, device=plan.device, generator=gen) + 0.5
    return x, y, w


def _head(plan: Plan, n: int, c: int, dtype, hidden: int = HIDDEN, seed: int = 3):
    """Seeded hidden states ``[n, H]`` and an LM head ``[c, H]`` (logits of unit scale)."""
    gen, h = plan.generator(seed), plan.hidden(hidden)
    x = torch.randn(n, h, device=plan.device, generator=gen).to(dtype)
    W = (torch.randn(c, h, device=plan.device, generator=gen) * h ** -0.5).to(dtype)
    return x, W


def _policy_inputs(plan: Plan, n: int, c: int, dtype):
    """Logits (``_inputs``), one index per row (the row's first argmax on even
    rows, so that ``is_top1`` holds there; every 7th from the 3rd ignored), a
    row mask (every 11th from the 5th masked) and the upstream weights of the
    log-probs and the entropy."""
    x, _, _ = _inputs(plan, n, c, dtype)
    gen = plan.generator(2)
    index = torch.randint(0, c, (n,), device=plan.device, generator=gen)
    index[::2] = x[::2].float().argmax(-1)
    index[3::7] = -100
    mask = torch.ones(n, dtype=torch.bool, device=plan.device)
    mask[5::11] = False
    a, b = (torch.randn(n, device=plan.device, generator=gen) for _ in range(2))
    return x, index, mask, a, b


@contextlib.contextmanager
def _several_chunks(n: int):
    """The fused heads' row sweeps in three chunks of ``n`` rows (one chunk by
    default at the checks' sizes): a 16-bit head's gradient then accumulates
    over chunks in float32 (``linear_sweep.GradSink``)."""
    kept = os.environ.get(linear_sweep.CHUNK_ROWS_ENV)
    os.environ[linear_sweep.CHUNK_ROWS_ENV] = str(max(1, -(-n // 3)))
    try:
        yield
    finally:
        if kept is None:
            del os.environ[linear_sweep.CHUNK_ROWS_ENV]
        else:
            os.environ[linear_sweep.CHUNK_ROWS_ENV] = kept


def _head_logits(x, W, dtype):
    """``x @ W.T`` in float64 with the values of the product in ``dtype`` (the
    logits the kernels get from the head: the reference then does not count
    their rounding as an error) and the gradients of the float64 product."""
    exact = x @ W.T
    return exact + ((x.to(dtype) @ W.to(dtype).T).double() - exact).detach()


def _capped(z, softcap: float):
    return softcap * torch.tanh(z / softcap) if softcap else z


def _loss(loss) -> dict:
    """A loss as ``_evaluated`` takes it: compared, and differentiated."""
    return {"loss": loss, "objective": loss}


# Label smoothing in the correctness rows: on, and off (what most calls run: the
# forward and training kernels without its terms, Variant.smoothing).
SMOOTHINGS = (0.1, 0.0)


def _cross_entropy(x, y, w, eps: float = 0.1) -> dict:
    return _loss(ce_tvm.cross_entropy(x, y, w, label_smoothing=eps))


def _train_kernel(x, y, w, eps: float = 0.1) -> dict:
    """The one-pass training kernel's loss and gradient (no autograd)."""
    out, grad = launch.train(x, y, w, LossOptions(reduction="mean", label_smoothing=eps))
    return {"loss": out.loss, "grad0": grad}


def _torch_cross_entropy(x, y, w, eps: float = 0.1) -> dict:
    return _loss(F.cross_entropy(x, y, w.to(x.dtype), label_smoothing=eps))


def _policy_outputs(a, b, logp, entropy, stats=None) -> dict:
    """``log_probs``' outputs as ``_evaluated`` takes them; the objective weighs
    the log-probs by ``a`` and the entropy by ``b``."""
    out = {"logp": logp, "entropy": entropy, "objective": (a * logp).sum() + (b * entropy).sum()}
    if stats is not None:
        out.update(stats._asdict())
    return out


def _policy_reference(z, index, live, a, b, *, stats: bool, temperature: float,
                      softcap: float = 0.0) -> dict:
    """``_policy_outputs`` from the definitions (docs/spec.md, section 9) on
    float64 logits ``z``; ``live``: the entries that count."""
    z = _capped(z, softcap) / temperature
    logp_all = torch.log_softmax(z, -1)
    logp = torch.where(live, logp_all.gather(-1, index.clamp(min=0)[:, None])[:, 0], 0.0)
    # p log p is 0 where p is (a -inf logit): log p read as 0 there, for the gradient too
    finite = torch.where(logp_all.isfinite(), logp_all, 0.0)
    out = _policy_outputs(a, b, logp, -(logp_all.exp() * finite).sum(-1))
    if stats:
        out.update(log_sum_sq_probs=torch.logsumexp(2 * logp_all, -1), mean_logits=z.mean(-1),
                   is_top1=live & (index == z.argmax(-1)))
    return out


def _divergence_reference(s, t, kept, *, beta: float, temperature: float = 1.0,
                          student_softcap: float = 0.0, teacher_softcap: float = 0.0) -> dict:
    """``distillation_loss``'s mean loss and per-row entropy from the definitions
    (docs/spec.md, section 15) on float64 logits; ``kept``: 1.0 where a row counts."""
    ls = torch.log_softmax(_capped(s, student_softcap) / temperature, -1)
    lt = torch.log_softmax(_capped(t, teacher_softcap) / temperature, -1)

    def kl(lp, lq):  # KL(p || q) per row
        return (lp.exp() * (lp - lq)).sum(-1)

    if beta == 0.0:
        rows = kl(lt, ls)
    elif beta == 1.0:
        rows = kl(ls, lt)
    else:
        lm = torch.logsumexp(torch.stack([ls + math.log1p(-beta), lt + math.log(beta)]), 0)
        rows = beta * kl(lt, lm) + (1 - beta) * kl(ls, lm)
    out = _loss((rows * kept).sum() / kept.sum().clamp(min=1))
    out["entropy"] = -(ls.exp() * ls).sum(-1) * kept
    return out


# --- Comparing ---------------------------------------------------------------------


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:500]


def _rel_err(ours, ref) -> float:
    """``max |ours - ref| / max |ref|`` (NaN where both are NaN counts as equal);
    for booleans the fraction of entries that differ."""
    if ref.numel() == 0:
        return 0.0
    if ref.dtype == torch.bool:
        return (ours != ref).double().mean().item()
    ours, ref = ours.double(), ref.double()
    diff = torch.where(ours.isnan() & ref.isnan(), 0.0, ours - ref).abs().max()
    return (diff / torch.nan_to_num(ref, nan=0.0).abs().max().clamp_min(1e-30)).item()


def _evaluated(fn, leaves) -> dict:
    """``fn(*leaves)``: a dict of outputs; with an ``"objective"`` (a scalar), its
    gradients with respect to the leaves join as ``"grad0"``, ``"grad1"``...
    Each leaf is the caller's tensor detached (an offset view stays one)."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = fn(*leaves)
    objective = out.pop("objective", None)
    if objective is not None:
        out.update((f"grad{i}", g) for i, g in enumerate(torch.autograd.grad(objective, leaves)))
    return {k: v.detach() for k, v in out.items()}


def _verdict(label: str, ours: dict, ref: dict, tol: float, grad_tol: float, **fields) -> dict:
    """Every output of ``ref`` against ``ours``: values within ``tol``,
    gradients (``grad*``) within ``grad_tol``. Prints and returns the row."""
    errors = {k: _rel_err(ours[k], v) for k, v in ref.items()}
    ok = all(e <= (grad_tol if k.startswith("grad") else tol) for k, e in errors.items())
    print(f"  {'ok ' if ok else 'BAD'} {label}: "
          + " ".join(f"{k} {e:.1e}" for k, e in errors.items()), flush=True)
    return dict(fields, case=label, errors=errors, ok=ok)


def _compare(label: str, fn, reference, leaves, tol: float, grad_tol: float, **fields) -> dict:
    """``fn`` on ``leaves`` against ``reference`` on float64 copies of them (``_verdict``)."""
    return _verdict(label, _evaluated(fn, leaves),
                    _evaluated(reference, [t.double() for t in leaves]), tol, grad_tol, **fields)


def _against_torch(label: str, run, x, y, w, eps: float = 0.1) -> dict:
    """``run(x, y, w, eps)`` (a dict: ``_cross_entropy``, ``_train_kernel``...) against
    F.cross_entropy in float64 (weights, ignore_index, smoothing ``eps``)."""
    n, c = x.shape
    smoothing = "" if eps == 0.1 else f"eps {eps} "
    return _compare(f"{label}{smoothing}{n}x{c} {x.dtype}", lambda t: run(t, y, w, eps),
                    lambda t: _torch_cross_entropy(t, y, w, eps), [x], TOL[x.dtype],
                    2 * TOL[x.dtype], n=n, c=c, dtype=str(x.dtype))


# --- Checks ------------------------------------------------------------------------


def _each(plan: Plan, grid, rows):
    """``rows(plan, n, c, dtype)`` (a generator of rows) for each case of
    ``grid``; a case that raises (a kernel no bundle holds, a failed launch) is
    recorded as a failed row, and the next case runs."""
    for n, c, dtype in plan.cases(grid):
        try:
            yield from rows(plan, n, c, dtype)
        except Exception as err:  # noqa: BLE001 - recorded; the next case runs
            traceback.print_exc()
            print(f"  BAD {n}x{c} {dtype}: {_error(err)}", flush=True)
            yield dict(n=n, c=c, dtype=str(dtype), case=f"{n}x{c} {dtype}", ok=False,
                       error=_error(err))


def _ce_rows(plan: Plan, n: int, c: int, dtype):
    for eps in SMOOTHINGS:
        yield _against_torch("", _cross_entropy, *_inputs(plan, n, c, dtype), eps)


def correctness(plan: Plan):
    yield from _each(plan, GRID, _ce_rows)


def _train_kernel_rows(plan: Plan, n: int, c: int, dtype):
    for eps in SMOOTHINGS:
        yield _against_torch("train kernel ", _train_kernel, *_inputs(plan, n, c, dtype), eps)


def training_kernel(plan: Plan):
    yield from _each(plan, GRID, _train_kernel_rows)


def _policy_rows(plan: Plan, n: int, c: int, dtype):
    """``log_probs`` and ``linear_log_probs`` (entropy and statistics), with and
    without a softcap, against ``_policy_reference``."""
    x, index, mask, a, b = _policy_inputs(plan, n, c, dtype)
    live = mask & (index != -100)
    h, W = _head(plan, n, c, dtype)
    fields = dict(n=n, c=c, dtype=str(dtype))
    for softcap in (0.0, SOFTCAP):
        opts = dict(temperature=bench_policy.TEMPERATURE, softcap=softcap)
        call = dict(row_mask=mask, return_entropy=True, return_stats=True, **opts)

        def reference(z, opts=opts):
            return _policy_reference(z, index, live, a, b, stats=True, **opts)

        yield _compare(f"log_probs {n}x{c} {dtype} softcap {softcap}",
                       lambda t, call=call: _policy_outputs(a, b, *ce_tvm.log_probs(t, index,
                                                                                  **call)),
                       reference, [x], ACC_TOL, 2 * TOL[dtype], softcap=softcap, **fields)
        with _several_chunks(n):
            row = _compare(f"linear_log_probs {n}x{c} {dtype} softcap {softcap}",
                           lambda t, V, call=call: _policy_outputs(
                               a, b, *ce_tvm.linear_log_probs(t, V, index, **call)),
                           lambda t, V, reference=reference: reference(
                               _head_logits(t, V, dtype)),
                           [h, W], TOL[dtype], 2 * TOL[dtype], softcap=softcap, **fields)
        yield row
    # A masked vocabulary: every fifth class -inf, the live indices on others
    x = x.clone()
    x[:, 1::MASK_STRIDE] = float("-inf")
    index = torch.where(index >= 0, index - index % MASK_STRIDE, index)
    opts = dict(temperature=bench_policy.TEMPERATURE)
    yield _compare(f"log_probs {n}x{c} {dtype} masked vocabulary",
                   lambda t: _policy_outputs(a, b, *ce_tvm.log_probs(
                       t, index, row_mask=mask, return_entropy=True, **opts)),
                   lambda z: _policy_reference(z, index, live, a, b, stats=False, **opts),
                   [x], ACC_TOL, 2 * TOL[dtype], softcap=0.0, **fields)


def log_probs(plan: Plan):
    yield from _each(plan, POLICY_GRID, _policy_rows)


def _shard_rows(plan: Plan, n: int, c: int, dtype):
    """The vocabulary-parallel kernels on the two halves of ``[n, c]`` logits:
    each shard's statistics (``launch.shard_stats``) and gradient
    (``launch.shard_backward``, from the full rows' float64 statistics) against
    float64, then the loss from statistics combined over the shards
    (``launch.shard_combine``) against F.cross_entropy."""
    x, y, w = _inputs(plan, n, c, dtype)
    options = LossOptions(reduction="mean", label_smoothing=0.1)
    full = _evaluated(lambda t: _torch_cross_entropy(t, y, w), [x.double()])
    x64, w64 = x.double(), w.double()
    kept = y != -100
    lse = torch.logsumexp(x64, -1)
    wy = torch.where(kept, w64[y.clamp(min=0)], 0.0)
    fields = dict(n=n, c=c, dtype=str(dtype))
    for offset, width in ((0, c // 2), (c // 2, c - c // 2)):
        cols = slice(offset, offset + width)
        xs, ws = x[:, cols].contiguous(), w[cols].contiguous()
        local = y - offset  # ignored rows are < 0: in no shard
        inside = (local >= 0) & (local < width)
        picked = local.clamp(0, width - 1)
        xd, wd = xs.double(), ws.double()
        top = xd.max(-1).values
        ref = {"rowmax": top, "expsum": (xd - top[:, None]).exp().sum(-1), "wxsum": xd @ wd,
               "target_logit": torch.where(inside, xd.gather(1, picked[:, None])[:, 0], 0.0),
               "target_weight": torch.where(inside, wd[picked], 0.0),
               "grad0": full["grad0"][:, cols]}
        ours = dict(zip(ref, launch.shard_stats(xs, y, ws, offset, options)))
        ours["grad0"] = launch.shard_backward(
            lse.new_ones(1, dtype=torch.float32), xs, lse.float(), y, ws, wy.float(),
            offset=offset, weight_sum=float(w64.sum()), global_classes=c, options=options)
        yield _verdict(f"shard [{offset}, {offset + width}) of {n}x{c} {dtype}", ours, ref,
                       ACC_TOL, 2 * TOL[dtype], **fields)
    logit = torch.where(kept, x64.gather(1, y.clamp(min=0)[:, None])[:, 0], 0.0)
    loss, _ = launch.shard_combine(lse.float(), logit.float(), wy.float(), (x64 @ w64).float(), y,
                                   weight_sum=float(w64.sum()), classes=c, dtype=dtype,
                                   options=options)
    yield _verdict(f"shard_combine {n}x{c} {dtype}", {"loss": loss}, {"loss": full["loss"]},
                   TOL[dtype], 2 * TOL[dtype], **fields)


def sharded_direct(plan: Plan):
    yield from _each(plan, HEAD_GRID, _shard_rows)


def _group_rows(plan: Plan, n: int, c: int, dtype):
    """``ce_tvm.distributed``'s cross entropy, linear cross entropy and linear
    log-probs in the process group of one (the shard is the whole vocabulary)."""
    from ce_tvm import distributed as vp

    x, y, w = _inputs(plan, n, c, dtype)
    yield _against_torch(
        "vocab_parallel_cross_entropy ",
        lambda t, y, w, eps: _loss(vp.vocab_parallel_cross_entropy(t, y, w, label_smoothing=eps)),
        x, y, w)
    h, W = _head(plan, n, c, dtype)
    fields = dict(n=n, c=c, dtype=str(dtype))
    yield _compare(f"vocab_parallel_linear_cross_entropy {n}x{c} {dtype}",
                   lambda t, V: _loss(vp.vocab_parallel_linear_cross_entropy(t, V, y)),
                   lambda t, V: _loss(F.cross_entropy(_head_logits(t, V, dtype), y)),
                   [h, W], TOL[dtype], 2 * TOL[dtype], **fields)
    _, index, mask, a, b = _policy_inputs(plan, n, c, dtype)
    live = mask & (index != -100)
    temperature = bench_policy.TEMPERATURE
    yield _compare(f"vocab_parallel_linear_log_probs {n}x{c} {dtype}",
                   lambda t, V: _policy_outputs(a, b, *vp.vocab_parallel_linear_log_probs(
                       t, V, index, row_mask=mask, temperature=temperature,
                       return_entropy=True)),
                   lambda t, V: _policy_reference(_head_logits(t, V, dtype), index, live, a, b,
                                                  stats=False, temperature=temperature),
                   [h, W], TOL[dtype], 2 * TOL[dtype], **fields)


def sharded_group(plan: Plan):
    """``_group_rows`` in a world of one (gloo, in this process)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield from _each(plan, HEAD_GRID, _group_rows)
    finally:
        dist.destroy_process_group()


def _distill_rows(plan: Plan, n: int, c: int, dtype):
    """``distillation_loss`` and ``linear_distillation_loss`` (the teacher's head
    wider than the student's) for each of ``DISTILL_CASES``, with the entropy,
    against ``_divergence_reference``."""
    s, y, _ = _inputs(plan, n, c, dtype)
    t, _, _ = _inputs(plan, n, c, dtype, seed=4)
    kept = (y != -100).double()
    hs, Ws = _head(plan, n, c, dtype)
    ht, Wt = _head(plan, n, c, dtype, hidden=HIDDEN * 3 // 2, seed=5)
    fields = dict(n=n, c=c, dtype=str(dtype))
    for case in DISTILL_CASES:
        def ours(loss, entropy):
            return {**_loss(loss), "entropy": entropy}

        yield _compare(f"distillation_loss {n}x{c} {dtype} {case}",
                       lambda z, case=case: ours(*ce_tvm.distillation_loss(
                           z, t, y, return_entropy=True, **case)),
                       lambda z, case=case: _divergence_reference(z, t.double(), kept, **case),
                       [s], ACC_TOL, 2 * TOL[dtype], **case, **fields)
        with _several_chunks(n):
            row = _compare(f"linear_distillation_loss {n}x{c} {dtype} {case}",
                           lambda u, V, case=case: ours(*ce_tvm.linear_distillation_loss(
                               u, V, ht, Wt, y, return_entropy=True, **case)),
                           lambda u, V, case=case: _divergence_reference(
                               _head_logits(u, V, dtype), _head_logits(ht, Wt, dtype), kept,
                               **case),
                           [hs, Ws], TOL[dtype], 2 * TOL[dtype], **case, **fields)
        yield row


def distill(plan: Plan):
    yield from _each(plan, HEAD_GRID, _distill_rows)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values one element into a fresh buffer (not 16-byte aligned)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


def _sanitize_rows(plan: Plan, n: int, c: int, dtype):
    x, y, w = _inputs(plan, n, c, dtype, seed=1)
    for label, tensors in (("", (x, y, w)),
                           ("offset views ", tuple(_misaligned(t) for t in (x, y, w)))):
        for path, run in (("autograd ", _cross_entropy), ("train kernel ", _train_kernel)):
            yield _against_torch(label + path, run, *tensors)
    if n:
        yield from _policy_rows(plan, n, c, dtype)
        yield from _shard_rows(plan, n, c, dtype)
        yield from _distill_rows(plan, n, c, dtype)


def sanitize(plan: Plan):
    """A small grid for compute-sanitizer (memcheck, racecheck): cross entropy
    through autograd and the training kernel, on aligned tensors and offset
    views, short and chunked rows and an empty batch; and the log-prob, shard
    and divergence kernels on the non-empty shapes."""
    yield from _each(plan, SANITIZE_GRID, _sanitize_rows)


# --- Timings -----------------------------------------------------------------------


def _ms_of_one_call(plan: Plan, fn) -> float:
    """The mean milliseconds of ``plan.calls`` calls of ``fn`` back to back."""
    if plan.cuda:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(plan.calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / plan.calls
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleaved_ms(plan: Plan, fns: dict) -> tuple[dict, dict]:
    """``(best milliseconds of each callable, {name: error})``: one warm-up call
    each (a callable that raises there, or whose kernels fail, is left out),
    then ``plan.reps`` reps, each timing every callable in turn."""
    ready, errors = {}, {}
    for name, fn in fns.items():
        try:
            fn()
            if plan.cuda:
                torch.cuda.synchronize()
            ready[name] = fn
        except Exception as err:  # noqa: BLE001 - recorded, the others are timed
            errors[name] = _error(err)
            if plan.cuda:
                torch.cuda.empty_cache()
    best = dict.fromkeys(ready, math.inf)
    for _ in range(plan.reps):
        for name, fn in ready.items():
            best[name] = min(best[name], _ms_of_one_call(plan, fn))
    return best, errors


class CudaMemory:
    """The counters of torch's CUDA caching allocator that ``extra_peak_mib`` reads."""

    synchronize = staticmethod(torch.cuda.synchronize)
    allocated = staticmethod(torch.cuda.memory_allocated)
    reset_peak = staticmethod(torch.cuda.reset_peak_memory_stats)
    peak = staticmethod(torch.cuda.max_memory_allocated)


def extra_peak_mib(fns: dict, memory=CudaMemory) -> dict:
    """Each callable's extra peak memory in MiB: the most allocated during one call
    of it beyond what was allocated before the call (its inputs), so what it holds
    at once, the gradients it allocates included (Liger writes its gradient into
    the logits and allocates none)."""
    peaks = {}
    for name, fn in fns.items():
        memory.synchronize()
        before = memory.allocated()
        memory.reset_peak()
        fn()
        memory.synchronize()
        peaks[name] = (memory.peak() - before) / 2**20
    return peaks


def _timing_row(plan: Plan, label: str, fns: dict, left_out: dict, base: str, **fields) -> dict:
    """``interleaved_ms`` of ``fns`` as a row: milliseconds, each over ``base``'s
    (a floor, or ce_tvm), what was left out (not installed, or failed) and, on
    CUDA, each timed callable's ``extra_peak_mib`` (one more call each)."""
    ms, errors = interleaved_ms(plan, fns)
    left_out = {**left_out, **errors}
    ratio = {k: v / ms[base] for k, v in ms.items()} if base in ms else {}
    peak_mib = extra_peak_mib({k: fns[k] for k in ms}) if plan.cuda else {}
    print(f"  {label}: " + ", ".join(f"{k} {v:.3f} ms" + (f" ({ratio[k]:.2f}x)" if ratio else "")
                                     + (f" {peak_mib[k]:.0f} MiB" if peak_mib else "")
                                     for k, v in ms.items())
          + f"  [x: over {base}" + ("; MiB: extra peak" if peak_mib else "") + "]"
          + "".join(f"\n    left out {k}: {v}" for k, v in left_out.items()), flush=True)
    return dict(fields, case=label, ms=ms, over=base, ratio=ratio, left_out=left_out,
                peak_mib=peak_mib)


def _fwd_bwd(objective, leaves):
    """A training step: ``objective(*leaves).backward()``, the gradients then
    dropped. The step has its own copies of the leaves (Liger writes its
    gradient into the logits it is given)."""
    own = [t.detach().clone().requires_grad_() for t in leaves]

    def step():
        objective(*own).backward()
        for t in own:
            t.grad = None
    return step


def _peers(plan: Plan, factories: dict) -> tuple[dict, dict]:
    """``({name: factory()}, {name: why not})`` for the factories that work
    here; torch.compile only on CUDA (its CPU build would dominate a rehearsal)."""
    found, left_out = {}, {}
    for name, factory in factories.items():
        if name == "compile" and not plan.cuda:
            left_out[name] = "CUDA only in this check"
            continue
        try:
            found[name] = factory()
        except Exception as err:  # noqa: BLE001 - an optional peer
            left_out[name] = _error(err)
    return found, left_out


def _liger(name: str):
    from liger_kernel.transformers import functional

    return getattr(functional, name)


def _flash_attn_cross_entropy():
    from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

    return lambda x, y: cross_entropy_loss(x, y)[0].mean()


def _trl_importable() -> str | None:
    """Let TRL's kernels import where its trainer utilities cannot (a host
    without ``datasets``): the kernels take only its ZeRO-3 gather of the head
    from there, a no-op outside ZeRO-3. Returns why a stand-in was needed."""
    if importlib.util.find_spec("trl") is None:
        return None
    try:
        import trl.trainer.utils  # noqa: F401
    except ImportError as err:
        stand_in = types.ModuleType("trl.trainer.utils")
        stand_in.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        sys.modules["trl.trainer.utils"] = stand_in
        return f"trl.trainer.utils replaced by a stand-in (no ZeRO-3 gather): {_error(err)}"
    return None


def dlight_forward(x, y):
    """Our forward compute scheduled by dlight.gpu.GeneralReduction (a baseline
    that needs the TVM compiler), as a callable on ``x``, ``y``."""
    import tvm
    import tvm_ffi
    from tvm.s_tir import dlight as dl

    from ce_tvm.kernels.forward import forward_func
    from ce_tvm.kernels.kinds import Variant
    from ce_tvm.runtime.tensors import dtype_name

    n, c = x.shape
    major, minor = torch.cuda.get_device_capability()
    target = tvm.target.Target({"kind": "cuda", "arch": f"sm_{major}{minor}"})
    func = forward_func(c, dtype_name(x.dtype), Variant("mean", False, False))
    mod = tvm.IRModule({"main": func})
    with target:
        mod = dl.ApplyDefaultSchedule(dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
    fn = tvm.compile(mod, target=target)["main"]
    outs = [x.new_empty(1), x.new_empty(1), x.new_empty(n, dtype=torch.float32)]

    def run():
        with tvm_ffi.use_torch_stream():
            fn(x, y, -100, 0.0, 0.0, *outs)
    return run


def _sync_target_check(f):
    """``f`` with CUDA targets range-checked on the host
    (``checks.CUDA_TARGET_CHECK = "sync"``): a TargetOutOfRangeError, a host wait."""
    def run(*args):
        kept, checks.CUDA_TARGET_CHECK = checks.CUDA_TARGET_CHECK, "sync"
        try:
            return f(*args)
        finally:
            checks.CUDA_TARGET_CHECK = kept
    return run


def time_ce(plan: Plan):
    from ce_tvm.store.tvmlib import compiler_installed

    losses, left_out = _peers(plan, {
        "compile": lambda: torch.compile(F.cross_entropy),
        "liger": lambda: _liger("liger_cross_entropy"),
        "flash_attn": _flash_attn_cross_entropy})
    losses = {"ce_tvm": ce_tvm.cross_entropy,
              "ce_tvm_sync_check": _sync_target_check(ce_tvm.cross_entropy),
              "eager": F.cross_entropy, **losses}
    for n, c, dtype in plan.cases(CE_TIMED):
        x, y, _ = _inputs(plan, n, c, dtype)
        fns = {name: _fwd_bwd(lambda t, f=f: f(t, y), [x]) for name, f in losses.items()}
        copy = torch.empty_like(x)
        fns["copy"] = lambda: copy.copy_(x)
        row = _timing_row(plan, f"cross entropy {n}x{c} {dtype}", fns, left_out, "copy",
                          n=n, c=c, dtype=str(dtype))
        if plan.cuda and compiler_installed():
            row["forward"] = _timing_row(plan, "  forward", {
                "ce_tvm": lambda: ce_tvm.cross_entropy(x, y), "dlight": dlight_forward(x, y)},
                {}, "ce_tvm")
        yield row


def time_linear(plan: Plan):
    peers, left_out = _peers(plan, {"liger": lambda: _liger("liger_fused_linear_cross_entropy")})
    losses = {"ce_tvm": ce_tvm.linear_cross_entropy,
              "eager": lambda t, V, y: F.cross_entropy(F.linear(t, V).float(), y), **peers}
    for n, v, dtype in plan.cases(LINEAR_TIMED):
        x, W = _head(plan, n, v, dtype, hidden=LINEAR_HIDDEN, seed=6)
        _, y, _ = _inputs(plan, n, v, dtype)
        fns = {name: _fwd_bwd(lambda t, V, f=f: f(t, V, y), [x, W]) for name, f in losses.items()}
        fns.update({f"ce_tvm chunk_rows={rows}": _fwd_bwd(
            lambda t, V, rows=rows: ce_tvm.linear_cross_entropy(t, V, y, chunk_rows=rows), [x, W])
            for rows in _chunk_rows_variants(n)})
        logits, gx, gW = x.new_empty(n, v), torch.empty_like(x), torch.empty_like(W)

        def gemm3():  # the logits, then the input's and the weight's gradients
            torch.mm(x, W.t(), out=logits)
            torch.mm(logits, W, out=gx)
            torch.mm(logits.t(), x, out=gW)
        fns["gemm3"] = gemm3
        h = x.shape[1]
        yield _timing_row(plan, f"linear cross entropy {n}x{h}x{v} {dtype}", fns, left_out,
                          "gemm3", n=n, h=h, v=v, dtype=str(dtype))


def time_log_probs(plan: Plan):
    stand_in = _trl_importable()

    def trl_triton():
        from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

        return lambda t, i: selective_log_softmax_and_entropy(t, i, bench_policy.TEMPERATURE)

    peers, left_out = _peers(plan, {
        "compile": lambda: torch.compile(bench_policy.reference, dynamic=False),
        "trl": trl_triton})
    for n, c, dtype in plan.cases(LOG_PROBS_TIMED):
        x, index, _, a, b = _policy_inputs(plan, n, c, dtype)
        index = index.clamp(min=0)
        methods = bench_policy.methods((n, c), with_compile=False, with_trl=False)
        methods = {**methods, "ce_tvm_sync_check": _sync_target_check(methods["ce_tvm"]),
                   **peers}
        fns = {name: _fwd_bwd(lambda t, f=f: sum((u * o).sum() for u, o in zip((a, b),
                                                                                 f(t, index))),
                              [x]) for name, f in methods.items()}
        copy = torch.empty_like(x)
        fns["copy"] = lambda: copy.copy_(x)
        yield _timing_row(plan, f"log-probs + entropy {n}x{c} {dtype} "
                          f"(temperature {bench_policy.TEMPERATURE})", fns, left_out, "copy",
                          n=n, c=c, dtype=str(dtype), trl_note=stand_in)
        kernels = _log_prob_kernels(x, index, a, b)
        if "trl" in peers:  # its forward kernel alone: no input asks for a gradient
            kernels["trl_forward"] = lambda f=peers["trl"]: f(x, index)
        yield _timing_row(plan, f"log-prob kernels {n}x{c} {dtype}", kernels, {}, "copy",
                          n=n, c=c, dtype=str(dtype))


def _log_prob_kernels(x, index, a, b) -> dict:
    """The log-prob forward kernel alone with its floor (one read of the logits),
    its gradient kernel alone and the two in turn (what a step launches), beside
    the copy floor: where a log-probs step's time goes."""
    options = LossOptions(temperature=bench_policy.TEMPERATURE)
    index = index[:, None].contiguous()
    _, entropy, row_max, log_expsum = launch.log_probs(x, index, options)
    grad_logp = a[:, None].contiguous()
    copy = torch.empty_like(x)

    def both():
        _, ent, top, lse = launch.log_probs(x, index, options)
        return launch.log_probs_backward(grad_logp, b, x, index, top, lse, ent, options)

    def backward():
        return launch.log_probs_backward(grad_logp, b, x, index, row_max, log_expsum, entropy,
                                         options)

    return {"forward": lambda: launch.log_probs(x, index, options),
            **_knob_variants("log_probs", "forward", lambda: launch.log_probs(x, index, options)),
            "backward": backward, **_knob_variants("log_probs_grad", "backward", backward),
            "both": both, "read": lambda: x.sum(dtype=torch.float32),
            "copy": lambda: copy.copy_(x)}


def time_distill(plan: Plan):
    import distillation_bench

    stand_in = _trl_importable()
    for n, v, dtype in plan.cases(DISTILL_TIMED):
        xs, Ws = _head(plan, n, v, dtype, hidden=DISTILL_HIDDEN, seed=7)
        xt, Wt = _head(plan, n, v, dtype, hidden=DISTILL_HIDDEN, seed=8)
        fns = {name: _fwd_bwd(lambda u, V, f=f: f(u, V, xt, Wt), [xs, Ws])
               for name, f in distillation_bench.METHODS.items()}
        fns.update({f"ce_tvm chunk_rows={rows}": _fwd_bwd(
            lambda u, V, rows=rows: ce_tvm.linear_distillation_loss(
                u, V, xt, Wt, beta=distillation_bench.BETA, chunk_rows=rows), [xs, Ws])
            for rows in _chunk_rows_variants(n)})
        fns["gemm"] = distillation_bench.gemm_floor(xs, Ws, xt, Wt)
        h = xs.shape[1]
        yield _timing_row(plan, f"distillation (beta {distillation_bench.BETA}) {n}x{h}x{v} "
                          f"{dtype}", fns, {}, "gemm", n=n, h=h, v=v, dtype=str(dtype),
                          beta=distillation_bench.BETA, trl_note=stand_in)


def _chunk_rows_variants(n: int) -> list[int]:
    """Rows per chunk of the fused heads timed beside the default: the batch in
    ``CHUNK_ROWS_VARIANTS`` chunks."""
    return sorted({max(1, -(-n // chunks)) for chunks in CHUNK_ROWS_VARIANTS})


def time_training(plan: Plan):
    """A training step (loss + logits gradient, mean, no label smoothing, as most
    calls and the peers' rows in ``time_ce``; every 7th row ignored), so the
    kernels without label smoothing's terms: the one-pass kernel alone and with
    the in-place scaling its autograd backward makes on CUDA
    (``ForwardGradients``: the upstream gradient cannot be read there without a
    host sync), the recompute path
    (forward, then the backward from the logits), the forward and the backward
    alone, the forward's floor (one read of the logits) and the copy floor; each
    kernel also with its ``KNOB_VARIANTS``."""
    options = LossOptions(reduction="mean")
    for n, c, dtype in plan.cases(CE_TIMED):
        x, y, _ = _inputs(plan, n, c, dtype)
        one = torch.ones(1, device=plan.device)
        copy = torch.empty_like(x)

        def backward(lse):
            return launch.backward(one, torch.zeros_like(one), x, lse, y, None, options,
                                   source_kind="logits")

        def recompute():
            return backward(launch.forward(x, y, None, options, log_prob=False).lse)

        lse = launch.forward(x, y, None, options, log_prob=False).lse

        yield _timing_row(plan, f"training step {n}x{c} {dtype}", {
            "one_pass": lambda: launch.train(x, y, None, options),
            "one_pass_scaled": lambda: launch.train(x, y, None, options)[1].mul_(one),
            **_knob_variants("train", "one_pass", lambda: launch.train(x, y, None, options)),
            "recompute": recompute,
            "forward": lambda: launch.forward(x, y, None, options, log_prob=False),
            **_knob_variants("forward", "forward",
                             lambda: launch.forward(x, y, None, options, log_prob=False)),
            "backward": lambda: backward(lse),
            **_knob_variants("backward", "backward", lambda: backward(lse)),
            "read": lambda: x.sum(dtype=torch.float32), "copy": lambda: copy.copy_(x)},
            {}, "copy", n=n, c=c, dtype=str(dtype))


def _knob_variants(op: str, name: str, fn) -> dict:
    """``fn`` (a call of ``op``'s kernel) in the scope of each of ``op``'s
    ``KNOB_VARIANTS``, named ``"<name> knob=value"``. On the CPU the knobs
    change nothing: a rehearsal runs the calls, ``cuda_builds`` builds their
    kernels."""
    def scoped(knobs):
        with ce_tvm.schedule("cuda", **knobs):
            return fn()

    return {f"{name} " + ",".join(f"{k}={v}" for k, v in knobs.items()):
            lambda knobs=knobs: scoped(knobs) for knobs in KNOB_VARIANTS[op]}


def knob_specs(specs) -> list:
    """The CUDA kernels ``_knob_variants`` asks for: each of ``specs`` (CUDA
    kernels) of an op and a shape in ``KNOB_TIMED``, with each of its op's
    ``KNOB_VARIANTS`` among its options."""
    timed = {(op, str(dtype).removeprefix("torch."), c)
             for op, grid in KNOB_TIMED.items() for _, c, dtype in grid}
    from ce_tvm.store.targets import options_of

    return [replace(s, options=s.options + options_of(knobs))
            for s in specs if (s.op, s.dtype, s.classes) in timed
            for knobs in KNOB_VARIANTS[s.op]]


def time_edge(plan: Plan):
    """An empty batch (nothing may launch: about the Python overhead) and offset
    views (copied to aligned memory first: the copy's cost shows)."""
    def step(x, y):
        return _evaluated(lambda t: _cross_entropy(t, y, None), [x])

    for n, c, dtype in plan.cases(EDGE_TIMED):
        x, y, _ = _inputs(plan, n, c, dtype)
        xm, ym = _misaligned(x), _misaligned(y)
        yield _timing_row(plan, f"edge cases ({n}x{c} {dtype})", {
            "N=0 fwd+bwd": lambda: step(x[:0], y[:0]),
            "N=0 train kernel": lambda: _train_kernel(x[:0], y[:0], None),
            "aligned fwd+bwd": lambda: step(x, y),
            "offset views fwd+bwd": lambda: step(xm, ym),
            "offset views train kernel": lambda: _train_kernel(xm, ym, None)},
            {}, "aligned fwd+bwd", n=n, c=c, dtype=str(dtype))


# --- Running -----------------------------------------------------------------------

SECTIONS = {f.__name__: f for f in (correctness, training_kernel, log_probs, sharded_direct,
                                    sharded_group, distill, time_ce, time_linear, time_log_probs,
                                    time_distill, time_training, time_edge, sanitize)}
GROUPS = {"checks": ["correctness", "training_kernel", "log_probs", "sharded_direct",
                     "sharded_group", "distill"],
          "timings": ["time_ce", "time_linear", "time_log_probs", "time_distill",
                      "time_training", "time_edge"]}


def _record(path: str, record: dict) -> None:
    """Append one JSON line to ``path``, on disk before this returns."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_section(plan: Plan, name: str, path: str) -> bool:
    """Run one section, each of its rows recorded as it comes, then its verdict
    and time (or its error: the caller goes on). Returns whether it passed."""
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    done = {"section": name, "done": True, "ok": True, "device": plan.name()}
    try:
        for row in SECTIONS[name](plan):
            done["ok"] = done["ok"] and row.get("ok", True)
            _record(path, {"section": name, **row})
    except Exception as err:  # noqa: BLE001 - recorded; the next section runs
        traceback.print_exc()
        done.update(ok=False, error=_error(err))
    done["seconds"] = round(time.perf_counter() - t0, 1)
    _record(path, done)
    print(f"== {name}: {'ok' if done['ok'] else 'FAILED'} in {done['seconds']} s", flush=True)
    if plan.cuda:
        torch.cuda.empty_cache()
    return done["ok"]


def _take_cuda_paths() -> None:
    """On the CPU, load the kernels CUDA loads: the one-pass training kernel
    only if CUDA tensors take it by default."""
    import ce_tvm.losses.cross_entropy as ce_nn

    ce_nn.TRAINING_KERNEL_DEVICES = ("cpu",) if "cuda" in ce_nn.TRAINING_KERNEL_DEVICES else ()


def cuda_builds(dirs: list, arch: str, export: str | None, path: str) -> bool:
    """After a CPU rehearsal: the CUDA build (``arch``) of each kernel it loaded,
    looked for in ``dirs``; the missing ones built into ``export`` when given,
    else reported. Recorded as the section ``cuda_builds``; returns whether
    none is missing now."""
    from ce_tvm.runtime import cache
    from ce_tvm.runtime.registry import loaded_specs
    from ce_tvm.store.files import make_private_dir
    from ce_tvm.store.spec import KernelSpec

    specs = {KernelSpec(s.op, s.dtype, s.classes, s.variant, "cuda", (("arch", arch),))
             for s in loaded_specs()}
    specs = sorted(specs | set(knob_specs(specs)), key=KernelSpec.name)
    places = [Path(d) for d in dirs + ([export] if export else [])]
    missing = [s for s in specs
               if all(cache.check_module(d / s.file_name(), s) is not None for d in places)]
    print(f"cuda_builds: {len(specs)} kernels loaded; {len(missing)} of their {arch} builds in "
          f"none of {[str(d) for d in places]}", flush=True)
    if export:
        make_private_dir(Path(export))
    for spec in missing:
        if export:
            cache.export_module(spec, Path(export))
        print(f"  {'built' if export else 'missing'} {spec.name()}", flush=True)
    ok = bool(export) or not missing
    _record(path, {"section": "cuda_builds", "done": True, "ok": ok, "loaded": len(specs),
                   "arch": arch, "built" if export else "missing": [s.name() for s in missing]})
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="checks,timings",
                   help=f"comma-separated: {', '.join(GROUPS)}, {', '.join(SECTIONS)}")
    p.add_argument("--json", default="gpu_check.jsonl", help="JSON lines, appended")
    p.add_argument("--bundle", action="append", default=[],
                   help="run the kernels of this bundle (ce-tvm bundle --target cuda); repeatable")
    p.add_argument("--modules", action="append", default=[],
                   help="a module directory (ce-tvm compile --out, --export); repeatable")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a rehearsal without a GPU (see the module doc)")
    p.add_argument("--classes", type=int, help="cpu: every class count replaced by this")
    p.add_argument("--dtypes", default="", help="cpu: only these dtypes (float32,bfloat16,...)")
    p.add_argument("--arch", default="sm_90", help="cpu: the CUDA arch of the builds looked for")
    p.add_argument("--export", help="cpu: build the missing CUDA kernels into this directory")
    args = p.parse_args(argv)
    names = [s for part in args.sections.split(",") for s in GROUPS.get(part, [part])]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}")
    if args.device == "cuda" and (args.classes or args.dtypes or args.export):
        p.error("--classes, --dtypes and --export are for a rehearsal (--device cpu)")
    for directory in reversed(args.bundle):
        ce_tvm.use_bundle(directory)
    if args.modules:
        os.environ["CE_TVM_MODULE_DIR"] = os.pathsep.join(
            args.modules + [d for d in [os.environ.get("CE_TVM_MODULE_DIR")] if d])
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    if args.device == "cpu":
        _take_cuda_paths()
    plan = Plan(torch.device(args.device), args.classes,
                tuple(getattr(torch, d) for d in args.dtypes.split(",") if d))
    print(f"device: {plan.name()}", flush=True)
    passed = [run_section(plan, name, args.json) for name in names]
    if not plan.cuda and (args.bundle or args.modules or args.export):
        passed.append(cuda_builds(args.bundle + args.modules, args.arch, args.export, args.json))
    print(f"wrote {args.json}")
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
