"""The row-chunked sweeps behind the fused heads (``linear_cross_entropy``, ``linear_log_probs``,
``linear_distillation_loss``; no autograd here).

For ``x [N, H]``, ``W [V, H]``, ``b [V]`` the logits ``x @ W^T + b`` are never
formed whole. Rows go through in chunks (``chunk_rows``); per chunk:

1. ``logits = addmm(b, x[rows], W^T)`` into the chunk buffer: torch's GEMM
   (MKL/oneDNN on the CPU, cuBLAS on CUDA);
2. ``chunk_loss_and_dlogits`` turns them into the chunk's per-row losses and
   ``G = d(loss)/d(logits)``, in place in the same buffer;
3. ``grad_x[rows] = G @ W``, ``grad_W += G^T @ x[rows]``, ``grad_b += G.sum(0)``
   (``GradSink``), for the gradients asked for only.

The chunk buffer is ours (never the caller's) and is reused from chunk to
chunk (and, on the CPU, from call to call through ``ce_tvm.runtime.pool``), so the
extra memory of a sweep is one chunk of logits plus, for 16-bit weights, a
float32 ``grad_W`` accumulator.

``chunk_loss_and_dlogits`` is the only place the training step calls the
loss kernels: a one-pass kernel that may write the gradient over its own
logits would replace its body.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from . import launch, pool, vocab_blocks
from .options import DivergenceOptions, LossOptions
from .tensors import accum_torch_dtype
from .vocab_blocks import chunks

CHUNK_ROWS_ENV = "CE_TVM_LINEAR_CHUNK_ROWS"
# One chunk's logits: an eighth of the [N, V] logits an unfused head would
# hold. But at least MIN_CHUNK_ROWS rows: every chunk costs a pass over [V, H]
# per GEMM (the library re-packs W), and only rows amortise it (measured on a
# 2-core znver3, fp32 training step at (2048, 256, 128256): 128 rows 4895 ms,
# 256 rows 4543, 384 rows 4294, 512 rows 4176; the sharded head at (2048, 512,
# 128256) over 2 ranks is slower than the unfused path at 256 rows, faster at
# 384). And at most MAX_CHUNK_BYTES of logits for very long batches.
CHUNKS = 8
MIN_CHUNK_ROWS = 384
MAX_CHUNK_BYTES = 256 << 20
# A 16-bit grad_W partial product goes through a scratch of SCRATCH_BYTES, a
# block of classes at a time (not [V, H]; smaller blocks made the GEMM much
# slower here: 16384 x 512 bf16 blocks took 2x the time of 32768 x 512), and
# is added to the float32 sums through a float32 copy of CONVERT_BYTES.
SCRATCH_BYTES = 32 << 20
CONVERT_BYTES = 8 << 20


@dataclass(frozen=True)
class Needs:
    """Which gradients to compute: of ``x``, of ``W``, of ``b``."""

    input: bool = False
    weight: bool = False
    bias: bool = False

    def any(self) -> bool:
        return self.input or self.weight or self.bias

    @classmethod
    def of(cls, x: Tensor, W: Tensor, b: Tensor | None) -> Needs:
        """The gradients autograd will want now: of each tensor that requires one,
        when grad mode is on."""
        on = torch.is_grad_enabled()
        return cls(on and x.requires_grad, on and W.requires_grad,
                   on and b is not None and b.requires_grad)


def chunk_rows(n: int, classes: int, dtype: torch.dtype, requested: int = 0) -> int:
    """Rows per chunk: ``requested`` if positive, else ``$CE_TVM_LINEAR_CHUNK_ROWS``
    if set, else ``n / CHUNKS`` rounded up, but at least ``MIN_CHUNK_ROWS`` and
    no more than fit ``MAX_CHUNK_BYTES`` of logits (unless that is under the
    minimum); never more than ``n``, at least 1."""
    rows = _requested(requested)
    if rows <= 0:
        most = max(MIN_CHUNK_ROWS, MAX_CHUNK_BYTES // (classes * dtype.itemsize))
        rows = min(max(MIN_CHUNK_ROWS, -(-n // CHUNKS)), most)
    return max(1, min(rows, n))


def _requested(requested: int) -> int:
    """``requested``, else ``$CE_TVM_LINEAR_CHUNK_ROWS``, else 0 (none asked for)."""
    return requested or int(os.environ.get(CHUNK_ROWS_ENV, "0") or 0)


def _blocks(n: int, step: int) -> list[tuple[int, int]]:
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def normalisers(y: Tensor, w: Tensor | None, opts: LossOptions, acc: torch.dtype):
    """``(D, M)`` of docs/spec.md, section 2, as one-element device tensors (no host sync)."""
    kept = y != opts.ignore_index
    count = kept.sum(dtype=acc).reshape(1)
    if w is None:
        return count, count
    wy = torch.where(kept, w[torch.where(kept, y, 0)], 0.0)
    return wy.sum(dtype=acc).reshape(1), count


class _ChunkBuffers:
    """The buffer of one chunk's logits (then their gradient) and the chunk's
    per-row outputs, reused by every chunk, and the per-row ``loss``/``zloss``
    (and, for token accuracy, ``hit``) of the whole sweep (``[N]``). The
    kernels write the chunk's own outputs (they start their buffers, so they
    are aligned as the kernels require). The per-row losses are in the dtype
    the kernels write them in (``launch.loss_torch_dtype``: float32 for 16-bit
    logits with ``opts.wide_loss``), so a float32 loss is never rounded to 16 bits."""

    def __init__(self, rows: int, x: Tensor, classes: int, opts: LossOptions,
                 accuracy: bool = False):
        acc, dtype = accum_torch_dtype(x), launch.loss_torch_dtype(opts, x)
        self.logits = pool.POOL.empty((rows, classes), x.dtype, x.device)
        self.chunk = launch.ForwardOutputs(x.new_empty(rows, dtype=dtype),
                                           x.new_empty(rows, dtype=dtype),
                                           x.new_empty(rows, dtype=acc), None,
                                           x.new_empty(rows, dtype=acc) if accuracy else None)
        self.loss = x.new_empty(x.shape[0], dtype=dtype)
        self.zloss = x.new_empty(x.shape[0], dtype=dtype)
        self.hit = x.new_empty(x.shape[0], dtype=acc) if accuracy else None

    def project(self, x_rows: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
        """``x_rows @ W^T + b`` into the logits buffer."""
        return project(self.logits, x_rows, W, b)

    def outputs(self, n: int) -> launch.ForwardOutputs:
        """Where the chunk step writes a chunk of ``n`` rows."""
        c = self.chunk
        return launch.ForwardOutputs(c.loss[:n], c.zloss[:n], c.lse[:n], None,
                                     None if c.hit is None else c.hit[:n])

    def keep(self, rows: slice) -> None:
        """The chunk's per-row outputs into the sweep's ``[N]`` ones."""
        n = rows.stop - rows.start
        self.loss[rows].copy_(self.chunk.loss[:n])
        self.zloss[rows].copy_(self.chunk.zloss[:n])
        if self.hit is not None:
            self.hit[rows].copy_(self.chunk.hit[:n])

    def accuracy(self, y: Tensor, opts: LossOptions) -> Tensor:
        """The sweep's token accuracy (``launch.token_accuracy``), or an empty
        tensor when it was not asked for."""
        if self.hit is None:
            return self.loss.new_empty(0, dtype=torch.float32)
        return launch.token_accuracy(self.hit, y, opts.ignore_index)


def project(buffer: Tensor, x_rows: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
    """``x_rows @ W^T + b`` into the first rows of ``buffer`` (a chunk's logits)."""
    out = buffer[: x_rows.shape[0]]
    if b is None:
        return torch.mm(x_rows, W.t(), out=out)
    return torch.addmm(b, x_rows, W.t(), out=out)


def chunk_loss(logits: Tensor, y: Tensor, w: Tensor | None, opts: LossOptions,
               out: launch.ForwardOutputs) -> None:
    """The chunk's per-row loss (``ce + z``), z-loss, ``lse`` (and ``hit`` when
    ``out`` has it) into ``out`` (docs/spec.md, section 2, ``none``, whatever
    ``opts.reduction``); no gradient."""
    launch.forward(logits, y, w, replace(opts, reduction="none"), log_prob=False,
                   accuracy=out.hit is not None, out=out)


def chunk_loss_and_dlogits(logits: Tensor, y: Tensor, w: Tensor | None, opts: LossOptions,
                           grad_ce: Tensor, grad_z: Tensor, out: launch.ForwardOutputs,
                           dlogits: Tensor, *, per_row: bool) -> None:
    """One chunk's training step: what ``chunk_loss`` writes into ``out``, and
    into ``dlogits`` the gradient of ``sum_n grad_ce * ce[n] + grad_z * z[n]``
    with respect to ``logits``. ``grad_ce``/``grad_z``: one value (``[1]``),
    or one per row when ``per_row``, in the accumulation dtype.

    ``dlogits`` may be ``logits`` itself (the sweep passes the same buffer):
    the backward kernel reads each logit once, before it writes the gradient
    in its place, and its row coefficients do not read the logits.

    The forward kernel, then the backward kernel recomputing the
    probabilities from the logits and their ``lse``. The one-pass training
    kernel does both in one sweep but cannot replace this body: given its own
    logits as the gradient buffer, it reads the target logit after
    overwriting it, and it normalises a mean by the chunk's own targets.
    """
    chunk_loss(logits, y, w, opts, out)
    launch.backward(grad_ce, grad_z - grad_ce, logits, out.lse, y, w,
                    replace(opts, reduction="none" if per_row else "sum"),
                    source_kind="logits", out=dlogits)


class GradSink:
    """``grad_x``, ``grad_W``, ``grad_b`` filled from each chunk's ``dlogits``.

    Over several chunks, ``grad_W`` and ``grad_b`` accumulate in float32 for
    16-bit weights and are cast once in ``finish`` (over one chunk the
    product is written in the weight's dtype: the same single rounding).
    On CUDA each chunk's ``G^T @ x`` is added by one GEMM with 16-bit inputs and
    a float32 output (``addmm(..., out_dtype=float32)``, where torch has it).
    torch's CPU GEMM has no such form, so there each chunk's product goes
    through a scratch in the weight's dtype (``SCRATCH_BYTES``), a block of
    classes at a time, and a smaller float32 copy (``CONVERT_BYTES``; adding a
    16-bit tensor to a float32 one would allocate that copy afresh on every
    call: page faults that cost more than the addition, measured here). On an
    H200 that was some 550 launches per chunk, twice the GEMMs' own time.
    """

    def __init__(self, x: Tensor, W: Tensor, b: Tensor | None, needs: Needs, chunks: int):
        acc = accum_torch_dtype(W) if chunks > 1 else W.dtype
        self.dtype = W.dtype
        # through the pool: a training loop that drops its gradients each step
        # recycles their pages instead of faulting in new ones (runtime/pool.py)
        self.grad_x = pool.empty_like(x) if needs.input else None
        self.grad_W = pool.POOL.empty(tuple(W.shape), acc, W.device) if needs.weight else None
        self.wide_gemm = needs.weight and acc != W.dtype and _wide_gemm(W.device)
        if needs.weight and acc != W.dtype and not self.wide_gemm:
            def rows(nbytes, dtype):
                return max(1, min(W.shape[0], nbytes // (W.shape[1] * dtype.itemsize)))

            self.scratch = W.new_empty(rows(SCRATCH_BYTES, W.dtype), W.shape[1])
            self.converted = W.new_empty(rows(CONVERT_BYTES, acc), W.shape[1], dtype=acc)
        else:
            self.scratch = self.converted = None
        self.grad_b = (torch.zeros(W.shape[0], dtype=acc, device=W.device)
                       if needs.bias and b is not None else None)
        self.empty = True

    def add(self, rows: slice, x_rows: Tensor, G: Tensor, W: Tensor) -> None:
        if self.grad_x is not None:
            torch.mm(G, W, out=self.grad_x[rows])
        if self.grad_W is not None and self.wide_gemm:
            torch.addmm(self.grad_W, G.t(), x_rows, beta=0.0 if self.empty else 1.0,
                        out_dtype=self.grad_W.dtype, out=self.grad_W)
        elif self.grad_W is not None and self.scratch is None:
            # beta 0 on the first chunk: the uninitialised buffer is not read
            self.grad_W.addmm_(G.t(), x_rows, beta=0.0 if self.empty else 1.0)
        elif self.grad_W is not None:
            self._add_through_scratch(G, x_rows)
        if self.grad_b is not None:
            self.grad_b.add_(G.sum(0, dtype=self.grad_b.dtype))
        self.empty = False

    def _add_through_scratch(self, G: Tensor, x_rows: Tensor) -> None:
        for lo, hi in _blocks(G.shape[1], self.scratch.shape[0]):
            part = torch.mm(G[:, lo:hi].t(), x_rows, out=self.scratch[: hi - lo])
            if self.empty:
                self.grad_W[lo:hi].copy_(part)
                continue
            for a, b in _blocks(hi - lo, self.converted.shape[0]):
                self.grad_W[lo + a:lo + b].add_(self.converted[: b - a].copy_(part[a:b]))

    def finish(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(grad_x, grad_W, grad_b)``; an empty tensor for each one not asked for."""
        if self.grad_W is not None and self.empty:
            self.grad_W.zero_()  # no rows: the gradient is 0
        return (x.new_empty(0) if self.grad_x is None else self.grad_x,
                x.new_empty(0) if self.grad_W is None else self.grad_W.to(self.dtype),
                x.new_empty(0) if self.grad_b is None else self.grad_b.to(self.dtype))


@functools.cache
def _wide_gemm(device: torch.device) -> bool:
    """Whether torch multiplies 16-bit matrices into a float32 output on ``device``
    (``addmm(..., out_dtype=torch.float32)``: CUDA, torch 2.8 and later)."""
    if device.type != "cuda":
        return False
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
    out = torch.zeros(2, 2, device=device)
    try:
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return bool((out == 2).all())


def _reduce(bufs: _ChunkBuffers, D: Tensor | None, M: Tensor | None,
            opts: LossOptions) -> tuple[Tensor, Tensor]:
    """``(loss, zloss)`` of docs/spec.md, section 2, from the per-row values, summed in the
    accumulation dtype and cast once to the rows' dtype (the accumulation dtype itself
    with ``wide_loss``: no rounding at all); ``[N]`` for ``none``, else ``[1]``."""
    if opts.reduction == "none":
        return bufs.loss, bufs.zloss
    acc = accum_torch_dtype(bufs.loss)
    total = bufs.loss.sum(dtype=acc).reshape(1)
    z = bufs.zloss.sum(dtype=acc).reshape(1)
    if opts.reduction == "mean":
        total, z = (total - z) / D + z / M, z / M
    return total.to(bufs.loss.dtype), z.to(bufs.loss.dtype)


def loss_only(x: Tensor, W: Tensor, b: Tensor | None, y: Tensor, w: Tensor | None,
              opts: LossOptions, rows: int,
              accuracy: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, zloss, accuracy)`` without any gradient (``accuracy`` empty
    unless asked for)."""
    bufs = _ChunkBuffers(rows, x, W.shape[0], opts, accuracy)
    for sl in chunks(x.shape[0], rows):
        chunk_loss(bufs.project(x[sl], W, b), y[sl], w, opts, bufs.outputs(sl.stop - sl.start))
        bufs.keep(sl)
    D, M = (normalisers(y, w, opts, accum_torch_dtype(x)) if opts.reduction == "mean"
            else (None, None))
    return (*_reduce(bufs, D, M, opts), bufs.accuracy(y, opts))


def loss_and_grads(x: Tensor, W: Tensor, b: Tensor | None, y: Tensor, w: Tensor | None,
                   opts: LossOptions, rows: int, needs: Needs, accuracy: bool = False):
    """``(loss, zloss, accuracy, grad_x, grad_W, grad_b)`` for ``mean``/``sum``
    in one sweep; the gradients are for a unit upstream gradient of ``loss``."""
    acc = accum_torch_dtype(x)
    if opts.reduction == "mean":
        D, M = normalisers(y, w, opts, acc)
        grad_ce, grad_z = 1.0 / D, 1.0 / M
    else:
        D = M = None
        grad_ce = grad_z = torch.ones(1, dtype=acc, device=x.device)
    bufs = _ChunkBuffers(rows, x, W.shape[0], opts, accuracy)
    grads = _sweep_grads(bufs, x, W, b, y, w, opts, needs, grad_ce, grad_z, per_row=False)
    return (*_reduce(bufs, D, M, opts), bufs.accuracy(y, opts), *grads)


def grads_from_rows(grad_loss: Tensor, x: Tensor, W: Tensor, b: Tensor | None, y: Tensor,
                    w: Tensor | None, opts: LossOptions, rows: int, needs: Needs):
    """``(grad_x, grad_W, grad_b)`` for ``none`` with upstream gradient
    ``grad_loss [N]``, recomputing each chunk's logits."""
    g = grad_loss.to(accum_torch_dtype(x)).reshape(-1).contiguous()
    bufs = _ChunkBuffers(rows, x, W.shape[0], opts)  # the losses are recomputed, and unused
    return _sweep_grads(bufs, x, W, b, y, w, opts, needs, g, g, per_row=True)


def _sweep_grads(bufs: _ChunkBuffers, x, W, b, y, w, opts, needs, grad_ce, grad_z, *,
                 per_row: bool):
    slices = chunks(x.shape[0], bufs.logits.shape[0])
    sink = GradSink(x, W, b, needs, len(slices))
    for sl in slices:
        logits = bufs.project(x[sl], W, b)
        chunk_loss_and_dlogits(
            logits, y[sl], w, opts, grad_ce[sl] if per_row else grad_ce,
            grad_z[sl] if per_row else grad_z, bufs.outputs(logits.shape[0]), logits,
            per_row=per_row)
        bufs.keep(sl)
        sink.add(sl, x[sl], logits, W)
    return sink.finish(x)


# --- Per-token log-probs and entropy (docs/spec.md, section 9) ----------------
# The upstream gradients of log-probs arrive only in the backward, so the
# forward sweep computes the outputs and the backward sweep recomputes each
# chunk's logits, turns them into their gradient in place and feeds the
# GradSink: one more GEMM per chunk than the loss, whose forward knows its
# upstream gradient. float32/float64 heads go by vocabulary blocks instead
# (``vocab_blocks``), 16-bit ones and the statistics variant by row chunks.


def policy_rows(n: int, classes: int, dtype: torch.dtype, requested: int = 0,
                stats: bool = False) -> int:
    """Rows per chunk of a log-prob head: ``requested`` if positive, else
    ``$CE_TVM_LINEAR_CHUNK_ROWS`` if set, else all rows up to
    ``vocab_blocks.BLOCK_ROWS`` by vocabulary blocks, ``chunk_rows`` by rows."""
    if vocab_blocks.blocked(dtype, stats):
        rows = _requested(requested)
        return max(1, min(rows if rows > 0 else vocab_blocks.BLOCK_ROWS, n))
    return chunk_rows(n, classes, dtype, requested)


def policy_outputs(x: Tensor, W: Tensor, b: Tensor | None, index: Tensor, opts: LossOptions,
                   rows: int, *, stats: bool = False, entropy: bool = True) -> list[Tensor]:
    """``launch.log_probs``'s outputs ``[logp, entropy, row_max, log_expsum]``
    (with ``stats``, then ``log_sum_sq_probs``, ``mean_logits`` and ``is_top1``,
    from the same kernel call; ``entropy`` off, zeros in its place) for the
    logits ``x @ W^T + b``, chunk by chunk."""
    if vocab_blocks.blocked(x.dtype, stats):
        return vocab_blocks.policy_outputs(x, W, b, index, opts, rows, entropy=entropy)
    n, k = index.shape
    acc = accum_torch_dtype(x)
    logits = pool.POOL.empty((rows, W.shape[0]), x.dtype, x.device)
    outs = [x.new_empty((n, k), dtype=acc)] + [x.new_empty(n, dtype=acc)
                                                for _ in range(5 if stats else 3)]
    if stats:
        outs.append(x.new_empty((n, k), dtype=torch.bool))
    for sl in chunks(n, rows):
        parts = launch.log_probs(project(logits, x[sl], W, b), index[sl], opts, stats=stats,
                                 entropy=entropy)
        for full, part in zip(outs, parts):
            full[sl].copy_(part)
    return outs


def policy_grads(grad_logp: Tensor, grad_entropy: Tensor, x: Tensor, W: Tensor,
                 b: Tensor | None, index: Tensor, saved: list[Tensor], opts: LossOptions,
                 rows: int, needs: Needs) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_x, grad_W, grad_b)`` of ``sum grad_logp logp + sum grad_entropy
    entropy`` (``GradSink.finish``), from the forward's ``saved = [row_max,
    log_expsum, entropy]``, each chunk's logits recomputed."""
    if vocab_blocks.blocked(x.dtype):
        return vocab_blocks.policy_grads(grad_logp, grad_entropy, x, W, b, index, saved, opts,
                                         rows, needs)
    def to_grad(sl: slice, z: Tensor) -> None:
        launch.log_probs_backward(grad_logp[sl], grad_entropy[sl], z, index[sl],
                                  *(t[sl] for t in saved), opts, out=z)

    return recomputed_grads(x, W, b, rows, needs, to_grad).finish(x)


def recomputed_grads(x: Tensor, W: Tensor, b: Tensor | None, rows: int, needs: Needs,
                     to_grad) -> GradSink:
    """A ``GradSink`` fed, chunk by chunk, with each chunk's logits recomputed into
    one buffer and turned into their gradient there by ``to_grad(rows, logits)``
    (a kernel writing in place); not yet finished."""
    buffer = pool.POOL.empty((rows, W.shape[0]), x.dtype, x.device)
    slices = chunks(x.shape[0], rows)
    sink = GradSink(x, W, b, needs, len(slices))
    for sl in slices:
        logits = project(buffer, x[sl], W, b)
        to_grad(sl, logits)
        sink.add(sl, x[sl], logits, W)
    return sink


# --- Student-teacher divergence (docs/spec.md, section 15) --------------------
# Both heads' logits of a row chunk go into two buffers (two GEMMs); one kernel
# reduces both rows and, given the upstream gradient, writes the student's
# logits gradient over the student buffer, which feeds the GradSink.


def divergence_sweep(xs: Tensor, Ws: Tensor, bs: Tensor | None, xt: Tensor, Wt: Tensor,
                     bt: Tensor | None, g: Tensor | None, opts: DivergenceOptions,
                     rows: int, needs: Needs):
    """``(divergence[N], entropy[N], sink)``: the per-row divergence and student
    entropy (accumulation dtype) of the heads ``xs @ Ws^T + bs`` (student) and
    ``xt @ Wt^T + bt`` (teacher, same dtype), chunk by chunk; with ``g`` (``[N]``,
    accumulation dtype) also a finished ``GradSink`` of the student's
    ``(grad_x, grad_W, grad_b)`` of ``sum_n g[n] divergence[n]``, else ``None``."""
    n, classes = xs.shape[0], Ws.shape[0]
    acc = accum_torch_dtype(xs)
    student = pool.POOL.empty((rows, classes), xs.dtype, xs.device)
    teacher = pool.POOL.empty((rows, classes), xs.dtype, xs.device)
    div, ent = xs.new_empty(n, dtype=acc), xs.new_empty(n, dtype=acc)
    slices = chunks(n, rows)
    sink = GradSink(xs, Ws, bs, needs, len(slices)) if g is not None else None
    zeros = None if g is not None else torch.zeros(rows, dtype=acc, device=xs.device)
    for sl in slices:
        s = project(student, xs[sl], Ws, bs)
        t = project(teacher, xt[sl], Wt, bt)
        d, e = launch.divergence(s, t, g[sl] if g is not None else zeros[:s.shape[0]], opts,
                                 grad_out=s if g is not None else None)
        div[sl].copy_(d)
        ent[sl].copy_(e)
        if sink is not None:
            sink.add(sl, xs[sl], s, Ws)
    return div, ent, None if sink is None else sink.finish(xs)
