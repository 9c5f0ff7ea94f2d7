"""Lowering choices a schedule declares for the compute it is about to lay out.

Each is a yes/no that changes how an expression is written, never its value,
so that the same math lowers well on more than one target. ``compiler.build``
enters all of them (from the schedule module's constants) around the
declaration; the compute reads them with ``.get()`` while it declares:

    with last_chunk_peeled(True), one_hot_by_chunk(False):
        func = declare(...)
"""

from __future__ import annotations

import contextlib
import contextvars


class LoweringChoice:
    """A context manager ``choice(on=True)`` and its current value ``choice.get()``."""

    def __init__(self, name: str, default: bool):
        self._var = contextvars.ContextVar(f"ce_tvm_{name}", default=default)

    @contextlib.contextmanager
    def __call__(self, on: bool = True):
        token = self._var.set(on)
        try:
            yield
        finally:
            self._var.reset(token)

    def get(self) -> bool:
        return self._var.get()


# A lowering that peels a row's last chunk off its chunk loop (TVM's
# LoopPartition on ``likely`` conditions, ``partition_const_loop``): the overlap
# test (``ChunkLayout.fresh``) is then written so that it vanishes from the
# other chunks. Otherwise it is one compare per element against a per-chunk
# bound, which costs less where it stays in every chunk.
last_chunk_peeled = LoweringChoice("last_chunk_peeled", default=False)

# A training gradient looped over its columns chunk by chunk, by a compiler that
# takes a loop-invariant test out of the loop (LLVM): the one-hot term is then
# tested per column only within the target's chunk, behind a test on the chunk.
# Otherwise it is one compare per column (on CUDA the test on the chunk costs
# instructions).
one_hot_by_chunk = LoweringChoice("one_hot_by_chunk", default=False)

# The log-prob kernels with a chunk's ``exp(z - chunk_max)`` kept for its two
# sums (``ce_chunk_exp``), for a schedule that holds it on chip (the CPU's L1);
# off, it is evaluated in each sum (a target where ``exp`` is cheaper than the
# scratch).
chunk_exp_kept = LoweringChoice("chunk_exp_kept", default=True)

# A loss kernel's row (forward, training) reduced against one shift taken first
# (the max of its first chunk), so that a chunk's max and its exp-sum (and kept
# exp) are one loop, for a schedule that streams the chunk once (the CPU's, on
# AVX-512); the row's lse is +inf where its max lies more than
# ``ROW_SHIFT_RANGE`` above the shift, and the caller computes the call again
# exactly (``Variant.shifts_rows``). Otherwise a chunk's exp-sum is against the
# chunk's own max, a second pass over the chunk.
row_shift = LoweringChoice("row_shift", default=False)
