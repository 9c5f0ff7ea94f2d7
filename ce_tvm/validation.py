"""Input checks of SPEC section 3, shared by every entry point.

Each check raises ``TypeError`` (wrong kind of object or dtype) or
``ValueError`` (wrong value or shape) with a message that says what was
expected. Targets outside ``[0, C)`` that are not ``ignore_index`` are
reported with the first bad row; the kernels clamp indices as well, so a
target is never used to read or write out of bounds.
"""

from __future__ import annotations

import math
import numbers

import torch

from .compute import REDUCTIONS
from .targets import cpu_schedule

FLOAT_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}
TARGET_DTYPES = (torch.int64, torch.int32)


def storage_dtype(t: torch.Tensor, name: str) -> str:
    """The TVM dtype name of a floating tensor ``t``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}"
        )
    return FLOAT_DTYPES[t.dtype]


def accum_torch_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def logits(x: torch.Tensor, name: str = "input") -> torch.Tensor:
    """A 2-D ``[N, C]`` float tensor with ``C >= 1``, made contiguous."""
    storage_dtype(x, name)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, C], got shape {tuple(x.shape)}")
    if x.shape[1] < 1:
        raise ValueError(f"{name} must have at least one class (C >= 1), got shape {tuple(x.shape)}")
    return x.contiguous()


def _same_device(t: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but the logits are on {ref.device}")


def targets(y, x: torch.Tensor, ignore_index: int, classes: int | None = None) -> torch.Tensor:
    """int64 contiguous ``[N]`` targets, each in ``[0, C)`` or equal to ``ignore_index``
    (``classes`` overrides ``C = x.shape[1]``, for a vocabulary shard)."""
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(y).__name__}")
    if y.dtype not in TARGET_DTYPES:
        raise TypeError(f"target must be int64 or int32 class indices, got {y.dtype}")
    _same_device(y, x, "target")
    n, c = x.shape[0], classes or x.shape[1]
    if tuple(y.shape) != (n,):
        raise ValueError(f"target must have shape [N] = [{n}], got {tuple(y.shape)}")
    y = y.to(torch.int64).contiguous()
    if y.is_cuda and torch.cuda.is_current_stream_capturing():
        return y  # no host sync inside a CUDA graph; the kernels clamp indices anyway
    bad = (y != ignore_index) & ((y < 0) | (y >= c))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"target[{row}] = {int(y[row])} is out of range: expected a class index in "
            f"[0, {c}) or ignore_index ({ignore_index})"
        )
    return y


def weight(w, x: torch.Tensor) -> torch.Tensor | None:
    """``None``, or a contiguous ``[C]`` weight in the accumulation dtype."""
    if w is None:
        return None
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor or None, got {type(w).__name__}")
    if not w.dtype.is_floating_point:
        raise TypeError(f"weight must be a floating-point tensor, got {w.dtype}")
    _same_device(w, x, "weight")
    c = x.shape[1]
    if tuple(w.shape) != (c,):
        raise ValueError(f"weight must have shape [C] = [{c}], got {tuple(w.shape)}")
    return w.to(accum_torch_dtype(x)).contiguous()


def reduction(r) -> str:
    if r not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {r!r}")
    return r


def ignore_index(ii) -> int:
    if isinstance(ii, bool) or not isinstance(ii, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ii).__name__}")
    return int(ii)


def _real(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    v = float(v)
    if math.isnan(v):
        raise ValueError(f"{name} must not be NaN")
    return v


def label_smoothing(eps) -> float:
    eps = _real(eps, "label_smoothing")
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {eps}")
    return eps


def zloss_scale(s, name: str = "lse_square_scale_for_zloss") -> float:
    s = _real(s, name)
    if s < 0.0 or math.isinf(s):
        raise ValueError(f"{name} must be finite and >= 0, got {s}")
    return s


def row_vector(t, n: int, like: torch.Tensor, name: str, reduction_: str) -> torch.Tensor:
    """A gradient input in the shape of ``loss``: ``[N]`` for ``none``, one value otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    _same_device(t, like, name)
    if reduction_ == "none":
        if tuple(t.shape) != (n,):
            raise ValueError(f"{name} must have shape [N] = [{n}] for reduction='none', got {tuple(t.shape)}")
    elif t.numel() != 1:
        raise ValueError(f"{name} must hold one value for reduction={reduction_!r}, got shape {tuple(t.shape)}")
    return t.to(accum_torch_dtype(like)).reshape(-1).contiguous()


def lse_vector(t, n: int, like: torch.Tensor) -> torch.Tensor:
    """``lse_for_zloss`` as a contiguous ``[N]`` accumulation-dtype vector."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"lse_for_zloss must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"lse_for_zloss must be a floating-point tensor, got {t.dtype}")
    _same_device(t, like, "lse_for_zloss")
    if tuple(t.shape) != (n,):
        raise ValueError(f"lse_for_zloss must have shape [N] = [{n}], got {tuple(t.shape)}")
    return t.to(accum_torch_dtype(like)).contiguous()


def check_device(x: torch.Tensor) -> None:
    """Raise unless ce_tvm has kernels for the device of ``x`` (traceable by dynamo)."""
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"ce_tvm has no kernels for device {x.device} (supported: cpu, cuda)")


def target_for(x: torch.Tensor) -> tuple:
    """``(target name, schedule options)`` for the device of ``x``, here and now."""
    check_device(x)
    if x.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(x.device)
        return "cuda", (("arch", f"sm_{major}{minor}"),)
    return cpu_schedule()


def operator_args(x, name, target, weight_, reduction_, ignore_index_, label_smoothing_,
                  zloss_scale_):
    """Every check of the seed-compatible pair, in order; returns
    ``(x, target, weight, reduction, ignore_index, label_smoothing, zloss_scale)``."""
    x = logits(x, name)
    check_device(x)
    red = reduction(reduction_)
    ii = ignore_index(ignore_index_)
    eps = label_smoothing(label_smoothing_)
    s = zloss_scale(zloss_scale_)
    return x, targets(target, x, ii), weight(weight_, x), red, ii, eps, s
