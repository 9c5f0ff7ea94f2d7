"""Recycle large output buffers: ``[N, C]`` ones (``x_grad``, ``log_prob``) and
the fused heads' ``grad_x`` and ``grad_W``.

A fresh 512 MB tensor costs ~120 ms of page faults on glibc (every large
allocation is a new ``mmap``), more than the kernels that fill it. The pool
keeps the buffers it hands out and gives one back out again once nothing
else references its storage (the storage use count has dropped back to the
pool's own), so a training loop touches new pages only in its first step.

Outputs are ordinary tensors that share storage with a pooled buffer; they
are never views of anything the caller owns. ``CE_TVM_POOL_BYTES`` caps the
bytes the pool may keep (default 4 GiB, room for the float32 gradient of a
128256 x 4096 weight, 2.1 GB, beside the rest; 0 turns it off). Only CPU
tensors of at least ``MIN_BYTES`` are pooled.
"""

from __future__ import annotations

import math
import os
import threading

import torch

from .registry import row_major_strides

MIN_BYTES = 1 << 20


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class BufferPool:
    """Byte buffers handed out as tensors and taken back when torch frees them."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._buffers: list[tuple[torch.Tensor, int]] = []  # (bytes, use count when idle)

    def pooled_bytes(self) -> int:
        return sum(b.numel() for b, _ in self._buffers)

    def empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor, from a recycled buffer when one is free."""
        nbytes = math.prod(shape) * dtype.itemsize
        if device.type != "cpu" or nbytes < MIN_BYTES or nbytes > self.max_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:
            buf = self._take(nbytes)
        return torch.empty(0, dtype=dtype).set_(buf.untyped_storage(), 0, shape,
                                                 row_major_strides(shape))

    def _take(self, nbytes: int) -> torch.Tensor:
        idle = [i for i, (b, n) in enumerate(self._buffers) if _use_count(b) == n]
        fits = [i for i in idle if nbytes <= self._buffers[i][0].numel() <= 2 * nbytes]
        if fits:
            return self._buffers[min(fits, key=lambda i: self._buffers[i][0].numel())][0]
        for i in sorted(idle, reverse=True):  # make room: drop idle buffers that do not fit
            if self.pooled_bytes() + nbytes <= self.max_bytes:
                break
            del self._buffers[i]
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if self.pooled_bytes() + nbytes <= self.max_bytes:
            self._buffers.append((buf, _use_count(buf)))
        return buf


POOL = BufferPool(int(os.environ.get("CE_TVM_POOL_BYTES", 4 << 30)))


def empty_like(x: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(x)`` (contiguous), through the pool."""
    return POOL.empty(tuple(x.shape), x.dtype, x.device)
