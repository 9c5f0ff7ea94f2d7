"""What the runtime reads off a torch tensor: its storage dtype name, its
accumulation dtype, the kernel target for its device, and whether its data is
aligned as the kernels assume.

The one table from the compute's storage dtype names to torch dtypes. Inputs
are those ``ce_tvm.losses.checks`` accepted; nothing here checks them again.
"""

from __future__ import annotations

import torch

from ..kernels.kinds import DTYPES, accum_dtype
from ..store.targets import cpu_schedule, cuda_options

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """The compute's name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def accum_torch_dtype(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype of ``t`` (``ce_tvm.kernels.accum_dtype``) as a torch dtype."""
    return TORCH_DTYPES[accum_dtype(dtype_name(t.dtype))]


def kernel_target(t: torch.Tensor) -> tuple:
    """``(target name, schedule options)`` of the kernels for the device of ``t``,
    here and now (a device ``losses.checks.check_device`` accepted: CPU or CUDA)."""
    if t.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(t.device)
        return "cuda", (("arch", f"sm_{major}{minor}"), *cuda_options())
    return cpu_schedule()


KERNEL_ALIGNMENT = 64  # bytes: TVM's host stubs tell the compiler every data pointer is


def aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or a copy of it when its data does not start ``KERNEL_ALIGNMENT``-aligned
    (an offset view of a buffer, an uneven vocabulary shard's weight slice): the
    kernels' vector loads (16-byte CUDA loads, AVX-512 on the CPU) would fault or
    misread it."""
    if t is None or t.data_ptr() % KERNEL_ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % KERNEL_ALIGNMENT == 0
