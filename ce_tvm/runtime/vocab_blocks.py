"""Per-token log-probs and entropy of a fused head over blocks of the vocabulary
(docs/spec.md, section 9; no autograd here).

``linear_sweep``'s row chunks multiply every chunk by the whole ``W [V, H]``:
each GEMM packs ``W`` again, and a chunk's logits (tens of MB) go to memory
between the GEMM that writes them, the kernel and the GEMMs that read them.
Here the rows of a chunk (``BLOCK_ROWS``, usually all of them) meet ``W`` one
block of ``width`` classes at a time, sized so that the block's logits
(``BLOCK_BYTES``) stay in the last-level cache from the GEMM that writes them
to the GEMMs that read their gradient; each block of ``W`` is packed once per
row chunk, and ``grad_W``'s block is written once, not summed over row chunks.

The log-prob kernel runs on each block as on a vocabulary shard (the
tensor-parallel head's algorithm, ``merge_log_probs``): the row max ``m_b``,
``log S_b``, entropy ``H_b`` and the log-probs of the block's own indices are
moved to the global max ``M`` and summed: ``S = sum_b S_b e^((m_b - M)/T)``,
``A = sum_b e^((m_b - M)/T) (A_b + (M - m_b)/T S_b)`` with ``A_b = (H_b - log
S_b) S_b``, an index's log-prob ``logp_b + log S_b + (m_b - M)/T - log S``.
The backward's kernel gets the global ``M``, ``log S`` and ``H`` and each
block's own indices (the others out of range: they count in the sum of the
upstream gradients, match no column). The outputs are those of the row sweep,
so either backward follows either forward.

Blocks need the gradient of ``x`` summed over blocks in the GEMM's own
accumulation (``addmm_``): float32 and float64 heads take this sweep; 16-bit
ones keep the row sweep (the CPU GEMM has no 16-bit-in, float32-out form, and
summing 16-bit partial products over tens of blocks would round each one).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import Tensor

from . import launch, pool
from .options import LossOptions

BLOCK_COLUMNS_ENV = "CE_TVM_LINEAR_BLOCK_COLUMNS"
# One block's logits. Measured on a 2-core znver3 (32 MiB L3), fp32 step of
# log-probs and entropy at 2048 x 256 x 32000, against its four GEMMs: 8 MiB
# 1.11x, 16 MiB 1.08x, 32 MiB 1.03x (the row sweep: 1.16-1.20x in the same runs).
BLOCK_BYTES = 32 << 20
BLOCK_ROWS = 4096
MIN_BLOCK_COLUMNS = 512
BLOCKED_DTYPES = (torch.float32, torch.float64)


def blocked(dtype: torch.dtype, stats: bool = False) -> bool:
    """Whether a head of ``dtype`` goes by vocabulary blocks: float32/float64, and
    not the statistics variant (whose extra outputs have no merge over blocks)."""
    return dtype in BLOCKED_DTYPES and not stats


def block_columns(rows: int, classes: int, dtype: torch.dtype) -> int:
    """Classes per block: ``$CE_TVM_LINEAR_BLOCK_COLUMNS`` if set, else as many as
    ``BLOCK_BYTES`` of logits hold for ``rows`` rows (a multiple of 64, at
    least ``MIN_BLOCK_COLUMNS``); never more than ``classes``."""
    columns = int(os.environ.get(BLOCK_COLUMNS_ENV, "0") or 0)
    if columns <= 0:
        columns = max(MIN_BLOCK_COLUMNS,
                      BLOCK_BYTES // (max(rows, 1) * dtype.itemsize) // 64 * 64)
    return max(1, min(columns, classes))


def chunks(n: int, step: int) -> list[slice]:
    """Slices of ``step`` (the last shorter) covering ``n``: row chunks, class blocks."""
    return [slice(lo, min(lo + step, n)) for lo in range(0, n, step)]


def shard_index(index: Tensor, offset: int, width: int, ignore_index: int,
                others: int) -> Tensor:
    """``index`` (global ids) as the block (or shard) of classes ``[offset,
    offset + width)`` sees it: its own entries local, the other blocks' live
    entries ``others`` (``ignore_index``: dead, or ``width``: out of range),
    dead entries ``ignore_index``."""
    local = index - offset
    mine = (index != ignore_index) & (local >= 0) & (local < width)
    return torch.where(mine, local, torch.where(index == ignore_index, ignore_index, others))


def merge_log_probs(logp: Tensor, entropy: Tensor | None, row_max: Tensor, log_s: Tensor,
                    mine: Tensor, live: Tensor, inv_t: float,
                    max_over: Callable[[Tensor], Tensor],
                    sum_over: Callable[..., list[Tensor]]) -> list[Tensor]:
    """``[logp, entropy, row_max, log_expsum]`` of whole rows from the log-prob
    kernel's outputs on parts of their classes (the module docstring):
    ``max_over(row_max)`` is the rows' max over parts and ``sum_over(*ts)`` sums
    each tensor over parts (a leading dimension of blocks, or an ``all_reduce``
    over shards). ``mine``: where an index lies in its part; ``live``: where
    it is not ``ignore_index``; ``entropy`` ``None``: the parts' kernels had
    none, and the rows' is zeros."""
    top = max_over(row_max)
    shift = (row_max - top) * inv_t  # <= 0
    s = torch.exp(log_s + shift)
    moved = torch.where(mine, logp + (log_s + shift)[..., None], 0.0)
    if entropy is None:
        total_s, total_moved = sum_over(s, moved)
    else:
        total_s, total_a, total_moved = sum_over(s, s * (entropy - log_s - shift), moved)
    log_total = torch.log(total_s)
    merged = torch.where(live, torch.clamp(total_moved - log_total[:, None], max=0.0), 0.0)
    rows_entropy = torch.zeros_like(top) if entropy is None else log_total + total_a / total_s
    return [merged, rows_entropy, top, log_total]


def _logits(buffer: Tensor, x_rows: Tensor, W: Tensor, b: Tensor | None,
            span: slice) -> Tensor:
    """``x_rows @ W[span]^T + b[span]`` into the front of ``buffer`` (contiguous)."""
    out = buffer[: x_rows.shape[0] * (span.stop - span.start)].view(x_rows.shape[0], -1)
    if b is None:
        return torch.mm(x_rows, W[span].t(), out=out)
    return torch.addmm(b[span], x_rows, W[span].t(), out=out)


def policy_outputs(x: Tensor, W: Tensor, b: Tensor | None, index: Tensor, opts: LossOptions,
                   rows: int, *, entropy: bool = True) -> list[Tensor]:
    """``linear_sweep.policy_outputs`` (without statistics) by vocabulary blocks:
    ``[logp, entropy, row_max, log_expsum]`` of the logits ``x @ W^T + b``
    (``entropy`` off: zeros in its place)."""
    n, classes, ii = x.shape[0], W.shape[0], opts.ignore_index
    width = block_columns(rows, classes, x.dtype)
    buffer = pool.POOL.empty((rows * width,), x.dtype, x.device)
    outs = [x.new_empty(index.shape), *(x.new_empty(n) for _ in range(3))]
    for sl in chunks(n, rows):
        parts, owned = [], []
        for span in chunks(classes, width):
            local = shard_index(index[sl], span.start, span.stop - span.start, ii, others=ii)
            parts.append(launch.log_probs(_logits(buffer, x[sl], W, b, span), local, opts,
                                          entropy=entropy))
            owned.append(local != ii)
        logp, blocks_entropy, row_max, log_s = (torch.stack(t) for t in zip(*parts))
        merged = merge_log_probs(logp, blocks_entropy if entropy else None, row_max, log_s,
                                 torch.stack(owned),
                                 index[sl] != ii, 1.0 / opts.kernel_temperature,
                                 lambda t: t.amax(0), lambda *ts: [t.sum(0) for t in ts])
        for full, part in zip(outs, merged):
            full[sl] = part
    return outs


def policy_grads(grad_logp: Tensor, grad_entropy: Tensor, x: Tensor, W: Tensor,
                 b: Tensor | None, index: Tensor, saved: list[Tensor], opts: LossOptions,
                 rows: int, needs) -> tuple[Tensor, Tensor, Tensor]:
    """``linear_sweep.policy_grads`` by vocabulary blocks: ``(grad_x, grad_W,
    grad_b)`` (an empty tensor for each not in ``needs``) of ``sum grad_logp
    logp + sum grad_entropy entropy``, from ``saved = [row_max, log_expsum,
    entropy]``, each block's logits recomputed and turned into their gradient
    in place."""
    n, classes, ii = x.shape[0], W.shape[0], opts.ignore_index
    width = block_columns(rows, classes, x.dtype)
    buffer = pool.POOL.empty((rows * width,), x.dtype, x.device)
    # through the pool, as the row sweep's (linear_sweep.GradSink)
    grad_x = pool.empty_like(x) if needs.input else None
    grad_W = pool.empty_like(W) if needs.weight else None
    grad_b = torch.zeros_like(b) if needs.bias and b is not None else None
    if grad_W is not None and n == 0:
        grad_W.zero_()  # no rows: the gradient is 0
    for i, sl in enumerate(chunks(n, rows)):
        g, h, row_max, log_s, entropy = (t[sl] for t in (grad_logp, grad_entropy, *saved))
        for j, span in enumerate(chunks(classes, width)):
            local = shard_index(index[sl], span.start, span.stop - span.start, ii,
                                others=span.stop - span.start)
            z = _logits(buffer, x[sl], W, b, span)
            launch.log_probs_backward(g, h, z, local, row_max, log_s, entropy, opts, out=z)
            if grad_x is not None:  # beta 0: the uninitialised rows are not read
                grad_x[sl].addmm_(z, W[span], beta=0.0 if j == 0 else 1.0)
            if grad_W is not None:
                grad_W[span].addmm_(z.t(), x[sl], beta=0.0 if i == 0 else 1.0)
            if grad_b is not None:
                grad_b[span] += z.sum(0)
    empty = x.new_empty(0)
    return tuple(empty if t is None else t for t in (grad_x, grad_W, grad_b))
