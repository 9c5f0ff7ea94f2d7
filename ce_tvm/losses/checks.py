"""The one input check: the tensor checks of docs/spec.md, section 11, shared by every
entry point (the scalars are checked by ``ce_tvm.runtime.options``).

Each check raises ``TypeError`` (wrong kind of object or dtype) or
``ValueError`` (wrong value or shape) with a message that says what was
expected. Targets outside ``[0, C)`` that are not ``ignore_index`` are
reported with the first bad row, as a ``TargetOutOfRangeError`` (both an
``IndexError``, PyTorch's type, and a ``ValueError``); the kernels clamp
indices as well, so a target is never used to read or write out of bounds.

On CUDA the range check is a device-side assertion (``torch._assert_async``), as
PyTorch's own losses do there: the host does not wait for the GPU, and a bad
target fails a later synchronising call as a CUDA error naming the check. Reading
the verdict on the host instead cost an H200 0.73 ms of a 2.53 ms training step
(8192 x 128256 bf16). ``CE_TVM_CUDA_TARGET_CHECK=sync`` (``CUDA_TARGET_CHECK``)
gives the ``TargetOutOfRangeError`` there too, at that cost.
"""

from __future__ import annotations

import math
import os
import sys

import torch

from ..runtime.options import LossOptions
from ..runtime.tensors import TORCH_DTYPES, accum_torch_dtype

TARGET_DTYPES = (torch.int64, torch.int32)
KERNEL_DEVICES = ("cpu", "cuda")

# How CUDA targets are range-checked: "async" (a device-side assertion, no wait) or
# "sync" (a TargetOutOfRangeError, the host waiting for the GPU).
CUDA_TARGET_CHECK = os.environ.get("CE_TVM_CUDA_TARGET_CHECK", "async")
if CUDA_TARGET_CHECK not in ("sync", "async"):
    raise ValueError(f"CE_TVM_CUDA_TARGET_CHECK must be sync or async, got {CUDA_TARGET_CHECK!r}")

# The dtypes the kernels take (a tuple: torch.compile traces `in` on it, on every torch
# the package supports; not on a dict's values before 2.9).
KERNEL_DTYPES = tuple(TORCH_DTYPES.values())


class TargetOutOfRangeError(IndexError, ValueError):
    """A class-index target outside ``[0, C)`` that is not ``ignore_index``:
    an ``IndexError`` as PyTorch raises, and a ``ValueError`` (docs/spec.md, section 11)."""


def logits(x: torch.Tensor, name: str = "input") -> torch.Tensor:
    """A 2-D ``[N, C]`` float tensor with ``C >= 1``, made contiguous."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, C], got shape {tuple(x.shape)}")
    if x.shape[1] < 1:
        raise ValueError(f"{name} must have at least one class (C >= 1), "
                         f"got shape {tuple(x.shape)}")
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
    return in_range(y.to(torch.int64).contiguous(), c, ignore_index, "target")


def in_range(y: torch.Tensor, classes: int, ignore_index: int, name: str) -> torch.Tensor:
    """``y`` (int64 class indices), after checking each is in ``[0, classes)``
    or ``ignore_index``; the first that is not is a ``TargetOutOfRangeError``."""
    if y.is_cuda and torch.cuda.is_current_stream_capturing():
        return y  # no host sync inside a CUDA graph; the kernels clamp indices anyway
    bad = (y != ignore_index) & ((y < 0) | (y >= classes))
    if y.is_cuda and CUDA_TARGET_CHECK == "async":
        torch._assert_async(~bad.any(), f"{name} out of range: expected class indices in "
                                        f"[0, {classes}) or ignore_index ({ignore_index})")
        return y
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise TargetOutOfRangeError(
            f"{name}[{', '.join(map(str, at))}] = {int(y[at])} is out of range: expected a "
            f"class index in [0, {classes}) or ignore_index ({ignore_index})"
        )
    return y


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``, without importing
    that module (no DTensor exists before it is imported); the entry points hand
    such tensors to ``ce_tvm.distributed.heads``. Traceable by ``torch.compile``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def head_module(head: torch.nn.Module, linear_bias) -> tuple[torch.nn.Module, bool]:
    """``(module holding .weight, needs its own call)`` for an LM head given as a
    module (``nn.Linear``-like; FSDP1's wrapper holds it as ``_fsdp_wrapped_module``).
    Its own call is needed when hooks would run there (FSDP2, FSDP1, ZeRO-3 and
    tensor-parallel styles gather or lay out through them); without any, reading
    ``.weight`` and ``.bias`` is the same and the plain, traceable path runs."""
    if linear_bias is not None:
        raise ValueError("pass the LM head as a module (its bias comes along) or its weight "
                         "with linear_bias, not a module and linear_bias")
    inner = getattr(head, "_fsdp_wrapped_module", head)
    if not isinstance(getattr(inner, "weight", None), torch.Tensor):
        raise TypeError(f"an LM head module must hold its weight [V, H] as .weight (as "
                        f"nn.Linear does); {type(inner).__name__} has none")
    hooks = torch.nn.modules.module
    needs_call = bool(inner is not head or head._forward_hooks or head._forward_pre_hooks
                      or hooks._global_forward_hooks or hooks._global_forward_pre_hooks)
    return inner, needs_call


def class_last_logits(x, name: str = "logits") -> torch.Tensor:
    """Logits ``[..., V]`` (class dimension last, ``V >= 1``) as a contiguous
    ``[M, V]``, ``M`` the product of the leading dimensions."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if is_dtensor(x):
        raise ValueError(f"{name}: log_probs takes local logits, not a DTensor "
                         f"{tuple(x.placements)}: pass {name}.to_local() for data-parallel "
                         f"rows; for a vocabulary-sharded head, linear_log_probs with the head's "
                         f"weight and the hidden states as DTensors")
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name} must be [..., V] with V >= 1 classes, got shape "
                         f"{tuple(x.shape)}")
    check_device(x)
    return x.reshape(-1, x.shape[-1]).contiguous()


def index_columns(index, rows: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The class indices of ``log_probs`` (docs/spec.md, section 9) for rows of shape
    ``lead = rows.shape[:-1]`` (the logits, or the hidden states of
    ``linear_log_probs``): ``index`` of shape ``lead`` (one per row) or
    ``lead + (K,)``, as an int64 contiguous ``[M, K]``; and whether it had no
    ``K`` dimension. The values are checked by ``in_range``, inside the op (a
    host sync)."""
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"index must be a torch.Tensor, got {type(index).__name__}")
    if index.dtype not in TARGET_DTYPES:
        raise TypeError(f"index must be int64 or int32 class indices, got {index.dtype}")
    _same_device(index, rows, "index")
    lead = tuple(rows.shape[:-1])
    if tuple(index.shape) == lead:
        k, single = 1, True
    elif index.dim() == rows.dim() and tuple(index.shape[:-1]) == lead:
        k, single = index.shape[-1], False
    else:
        raise ValueError(f"index must have shape {lead} or {lead} + (K,), "
                         f"got {tuple(index.shape)}")
    return index.reshape(math.prod(lead), k).to(torch.int64).contiguous(), single


def row_mask(mask, rows: torch.Tensor) -> torch.Tensor | None:
    """``None``, or ``mask`` (bool or numeric, of shape ``rows.shape[:-1]``, as
    for ``index_columns``) as a flat bool ``[M]``: true where the row counts."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"row_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    _same_device(mask, rows, "row_mask")
    lead = tuple(rows.shape[:-1])
    if tuple(mask.shape) != lead:
        raise ValueError(f"row_mask must have shape {lead} (one per row), "
                         f"got {tuple(mask.shape)}")
    return (mask != 0).reshape(-1)


def loss_dtype(value):
    """``loss_dtype`` checked: ``None`` (the input's dtype, PyTorch's rule) or
    ``torch.float32``; another ``torch.dtype`` is a ``ValueError``, anything else a
    ``TypeError`` (docs/spec.md, section 11; ``runtime.options`` holds no torch)."""
    if value is None or value is torch.float32:
        return value
    if not isinstance(value, torch.dtype):
        raise TypeError(f"loss_dtype must be None or a torch.dtype (torch.float32), "
                        f"got {type(value).__name__}")
    raise ValueError(f"loss_dtype must be None (the input's dtype) or torch.float32, "
                     f"got {value}")


def wide_loss(value, dtype) -> bool:
    """Whether ``loss_dtype`` ``value`` (checked by ``loss_dtype``) asks the kernels for
    a float32 loss from logits of ``dtype``: only for 16-bit logits (float32 ones give
    float32 already; float64 ones stay float64)."""
    return loss_dtype(value) is torch.float32 and dtype in (torch.float16, torch.bfloat16)


_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def head_dtypes(input, linear_weight, linear_bias):
    """``(input, linear_weight, linear_bias)`` in one dtype, the one rule of every
    family that takes a head (docs/spec.md, section 8): under ``torch.autocast`` for
    ``input``'s device, autocast's (each float32/16-bit one cast to the autocast
    dtype, as ``F.linear`` does); then, if the dtypes still differ, all in the
    widest (``torch.promote_types``). The casts are differentiable: each
    tensor's gradient comes back in its own dtype. Anything but floating
    tensors (and ``None`` for the bias) is returned as given, for
    ``linear_head`` to refuse."""
    present = [t for t in (input, linear_weight, linear_bias) if t is not None]
    if not all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point and not is_dtensor(t)
               for t in present) or not isinstance(linear_weight, torch.Tensor):
        return input, linear_weight, linear_bias
    device = input.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        present = [t.to(dtype) if t.dtype in _AUTOCAST_ELIGIBLE else t for t in present]
    wide = present[0].dtype
    for t in present[1:]:
        wide = torch.promote_types(wide, t.dtype)
    present = [t.to(wide) for t in present]  # no-op where the dtype already is
    return present[0], present[1], present[2] if linear_bias is not None else None


def linear_head(input, linear_weight, linear_bias) -> torch.Tensor:
    """``input [*, H]`` as ``[N, H]``, after checking it with the head's
    ``linear_weight [V, H]`` and ``linear_bias [V]`` (or ``None``): kinds, ranks,
    shapes, dtypes and devices."""
    for name, t in (("input", input), ("linear_weight", linear_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if input.dtype not in KERNEL_DTYPES:
        raise TypeError(f"input must be float32, float16, bfloat16 or float64, got {input.dtype}")
    if input.dim() < 1:
        raise ValueError("input must be [*, H] with at least one dimension, got a 0-d tensor")
    if linear_weight.dim() != 2:
        raise ValueError(f"linear_weight must be 2-D [V, H], got shape "
                         f"{tuple(linear_weight.shape)}" + _flat_shard_hint(linear_weight))
    hidden, classes = input.shape[-1], linear_weight.shape[0]
    if linear_weight.shape[1] != hidden:
        raise ValueError(f"linear_weight must be [V, H] with H = {hidden} (input's last "
                         f"dimension), got shape {tuple(linear_weight.shape)}")
    if classes < 1:
        raise ValueError("linear_weight must have at least one class (V >= 1)")
    if linear_bias is not None:
        if not isinstance(linear_bias, torch.Tensor):
            raise TypeError(f"linear_bias must be a torch.Tensor or None, "
                            f"got {type(linear_bias).__name__}")
        if tuple(linear_bias.shape) != (classes,):
            raise ValueError(f"linear_bias must have shape [V] = [{classes}], "
                             f"got {tuple(linear_bias.shape)}")
    for name, t in (("linear_weight", linear_weight), ("linear_bias", linear_bias)):
        if t is None:
            continue
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dtype != input.dtype:  # the callers pass the head through head_dtypes first
            raise TypeError(f"{name} must have input's dtype {input.dtype} (head_dtypes), "
                            f"got {t.dtype}")
        if t.device != input.device:
            raise ValueError(f"{name} is on {t.device} but input is on {input.device}")
    check_device(input)
    return input.reshape(-1, hidden)


def is_zero3_parameter(t) -> bool:
    """Whether ``t`` is a DeepSpeed ZeRO-3 parameter (its ``ds_id`` and ``ds_status``);
    DeepSpeed is never imported here: without it in ``sys.modules`` nothing is one."""
    return ("deepspeed" in sys.modules and hasattr(t, "ds_id")
            and hasattr(t, "ds_status"))


def _flat_shard_hint(linear_weight) -> str:
    """What a 1-D head weight most likely is, and the fix (the error of ``linear_head``)."""
    if linear_weight.dim() != 1:
        return ""
    if is_zero3_parameter(linear_weight):
        return (f" (a DeepSpeed ZeRO-3 parameter, {linear_weight.ds_status}, outside its "
                f"module's forward: ZeRO-3 gathers it only inside that call; pass the head "
                f"module, model.lm_head)")
    return " (FSDP's flat shard outside the forward? pass the head module, model.lm_head)"


def chunk_rows(value) -> int:
    """``chunk_rows`` of the linear heads: a positive int, or ``None`` (0: the default)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"chunk_rows must be a positive int or None, got {value!r}")
    return value


def probabilities(q, x: torch.Tensor) -> torch.Tensor:
    """Probability targets: a contiguous float tensor of ``x``'s shape, dtype and device."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != x.dtype:
        raise TypeError(f"probability targets must have the logits' dtype {x.dtype}, "
                        f"got {q.dtype}")
    _same_device(q, x, "target")
    if q.shape != x.shape:
        raise ValueError(f"probability targets must have the logits' shape {tuple(x.shape)}, "
                         f"got {tuple(q.shape)}")
    return q.contiguous()


def weight(w, x: torch.Tensor, classes: int | None = None) -> torch.Tensor | None:
    """``None``, or a contiguous ``[C]`` weight in the accumulation dtype
    (``classes`` overrides ``C = x.shape[1]``, for inputs that are not logits)."""
    if w is None:
        return None
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor or None, got {type(w).__name__}")
    if not w.dtype.is_floating_point:
        raise TypeError(f"weight must be a floating-point tensor, got {w.dtype}")
    _same_device(w, x, "weight")
    c = classes or x.shape[1]
    if tuple(w.shape) != (c,):
        raise ValueError(f"weight must have shape [C] = [{c}], got {tuple(w.shape)}")
    return w.to(accum_torch_dtype(x)).contiguous()


def row_vector(t, n: int, like: torch.Tensor, name: str, reduction: str) -> torch.Tensor:
    """A gradient input in the shape of ``loss``: ``[N]`` for ``none``, one value otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    _same_device(t, like, name)
    if reduction == "none":
        if tuple(t.shape) != (n,):
            raise ValueError(f"{name} must have shape [N] = [{n}] for reduction='none', "
                             f"got {tuple(t.shape)}")
    elif t.numel() != 1:
        raise ValueError(f"{name} must hold one value for reduction={reduction!r}, "
                         f"got shape {tuple(t.shape)}")
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


def one_dtype(**tensors) -> None:
    """The seed operator's rule: the named floating-point tensors share one
    dtype, else ``TypeError`` (anything else is left to its own check)."""
    given = {name: t.dtype for name, t in tensors.items()
             if isinstance(t, torch.Tensor) and t.dtype.is_floating_point}
    if len(set(given.values())) > 1:
        listed = ", ".join(f"{name} ({dtype})" for name, dtype in given.items())
        raise TypeError(f"{listed} must share one dtype (the seed operator requires it)")


def check_device(x: torch.Tensor) -> None:
    """Raise unless ce_tvm has kernels for the device of ``x`` (traceable by dynamo).

    The one device check of every entry point: the runtime picks the kernels'
    target from the device without checking it again."""
    if x.device.type not in KERNEL_DEVICES:
        raise ValueError(f"ce_tvm has no kernels for device {x.device} (supported: cpu, cuda)")


def operator_args(x, name, target, weight_, **options):
    """Every check of the seed-compatible pair, in order; ``options`` are
    ``LossOptions`` fields. Returns ``(x, target, weight, LossOptions)``."""
    x = logits(x, name)
    check_device(x)
    opts = LossOptions(**options, zloss_name="lse_square_scale_for_zloss")
    return x, targets(target, x, opts.ignore_index), weight(weight_, x), opts


def loss_module(module: torch.nn.Module, weight, dtype, *, reduction, ignore_index,
                label_smoothing, lse_square_scale, softcap, temperature, logit_scale) -> None:
    """Check a loss module's options at construction and keep them on it under its
    constructor's names, as torch's loss modules do: the class ``weight`` as a buffer,
    ``dtype`` as ``loss_dtype``, and the ``LossOptions`` fields (``lse_square_scale`` for
    ``zloss_scale``)."""
    module.register_buffer("weight", weight)
    module.loss_dtype = loss_dtype(dtype)
    options = LossOptions(reduction=reduction, ignore_index=ignore_index,
                          label_smoothing=label_smoothing, zloss_scale=lse_square_scale,
                          softcap=softcap, temperature=temperature, logit_scale=logit_scale)
    module.ignore_index, module.reduction = options.ignore_index, options.reduction
    module.label_smoothing, module.lse_square_scale = options.label_smoothing, options.zloss_scale
    module.softcap, module.temperature = options.softcap, options.temperature
    module.logit_scale = options.logit_scale

