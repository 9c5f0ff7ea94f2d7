"""What the runtime reads off a torch tensor: its storage dtype name, its
accumulation dtype, and the kernel target for its device.

The one table from the compute's storage dtype names to torch dtypes. Inputs
are those ``ce_tvm.validation`` accepted; nothing here checks them again.
"""

from __future__ import annotations

import torch

from .compute import DTYPES, accum_dtype
from .targets import cpu_schedule

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """The compute's name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def accum_torch_dtype(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype of ``t`` (``ce_tvm.compute.accum_dtype``) as a torch dtype."""
    return TORCH_DTYPES[accum_dtype(dtype_name(t.dtype))]


def kernel_target(t: torch.Tensor) -> tuple:
    """``(target name, schedule options)`` of the kernels for the device of ``t``,
    here and now (a device ``validation.check_device`` accepted: CPU or CUDA)."""
    if t.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(t.device)
        return "cuda", (("arch", f"sm_{major}{minor}"),)
    return cpu_schedule()
