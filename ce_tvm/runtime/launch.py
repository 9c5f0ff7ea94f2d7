"""Launch the compiled kernels on already-validated torch tensors.

The one place that knows the kernels' argument order (``ce_tvm.kernels``).
Outputs are allocated here (``[N, C]`` ones through ``ce_tvm.runtime.pool``) unless
the caller passes its own buffers (``out=``), which must be contiguous,
64-byte aligned and of the documented shape and dtype. Inputs whose data is
not 64-byte aligned (the kernels assume it) are copied first. An empty batch
launches nothing. The runtime scalars arrive as one ``LossOptions`` (the
divergence's as one ``DivergenceOptions``; both ``ce_tvm.runtime.options``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels.kinds import CUDA_SCRATCH_ROWS, CUDA_SCRATCH_SINGLES, Variant
from ..store.spec import KernelSpec, tuned_spec
from . import pool
from .options import DivergenceOptions, LossOptions
from .registry import call
from .tensors import (
    KERNEL_ALIGNMENT,
    TORCH_DTYPES,
    accum_dtype,
    accum_torch_dtype,
    aligned,
    dtype_name,
    is_aligned,
    kernel_target,
)


@dataclass
class ForwardOutputs:
    """``loss``/``zloss``: ``[N]`` or ``[1]`` in the input dtype (the accumulation
    dtype with ``LossOptions.wide_loss``: ``loss_dtype``); ``lse``: ``[N]``
    in the accumulation dtype; ``log_prob``: ``[N, C]`` or ``None``; ``hit``:
    ``[N]`` in the accumulation dtype, 1 where the row counts and its target
    is its first maximal logit (token accuracy), or ``None``."""

    loss: torch.Tensor
    zloss: torch.Tensor
    lse: torch.Tensor
    log_prob: torch.Tensor | None
    hit: torch.Tensor | None = None


def _spec(op, x, variant) -> KernelSpec:
    """The kernel for ``x``; on the CPU with the tuning record nearest its row count, if any."""
    target, options = kernel_target(x)
    spec = KernelSpec(op, dtype_name(x.dtype), x.shape[1], variant, target, options)
    return tuned_spec(spec, x.shape[0]) if target == "llvm" else spec


def _run(spec: KernelSpec, rows: int, *args) -> None:
    """``call`` the kernel; a CUDA kernel also gets its scratch (``_cuda_scratch``)."""
    if spec.target == "cuda":
        args += tuple(_cuda_scratch(rows, TORCH_DTYPES[accum_dtype(spec.dtype)], args[0].device))
    call(spec, *args)


_SLOT = KERNEL_ALIGNMENT // 4  # float32 elements per aligned slot (float64 slots are wider)


def _cuda_scratch(rows: int, dtype: torch.dtype, device) -> list:
    """The scratch slots every CUDA kernel takes (``kinds.CUDA_SCRATCH_ROWS``
    ``[rows]`` and ``CUDA_SCRATCH_SINGLES`` ``[1]``): views of one torch
    allocation, so on the caller's current stream (ordered with its work,
    capturable in a CUDA graph), each starting ``KERNEL_ALIGNMENT``-aligned."""
    span = -(-max(rows, 1) // _SLOT) * _SLOT
    flat = torch.empty(CUDA_SCRATCH_ROWS * span + CUDA_SCRATCH_SINGLES * _SLOT, dtype=dtype,
                       device=device)
    slots = [flat[i * span:i * span + rows] for i in range(CUDA_SCRATCH_ROWS)]
    base = CUDA_SCRATCH_ROWS * span
    return slots + [flat[base + i * _SLOT:base + i * _SLOT + 1]
                    for i in range(CUDA_SCRATCH_SINGLES)]


def _scalars(options: LossOptions) -> tuple:
    """The kernels' scalar arguments, in their order (``softcap`` only when on,
    the inverse temperature only when not 1: the kernels without them have no
    such arguments)."""
    return (options.ignore_index, options.label_smoothing, options.zloss_scale,
            *_logit_scalars(options))


def _logit_scalars(options: LossOptions) -> tuple:
    """``softcap`` (capped) and the inverse temperature (tempered), as the kernels take them."""
    return ((options.kernel_softcap,) if _capped(options) else ()) + (
        (1.0 / options.kernel_temperature,) if _tempered(options) else ())


def _capped(options: LossOptions) -> bool:
    """Whether the kernels for ``options`` are the softcap variants."""
    return options.kernel_softcap != 0.0


def _tempered(options: LossOptions) -> bool:
    """Whether the kernels for ``options`` divide the logits by a temperature."""
    return options.kernel_temperature != 1.0


def _variant(options: LossOptions, **fields) -> Variant:
    """The loss kernels' ``Variant`` for ``options`` (reduction, softcap, temperature)."""
    return Variant(options.reduction, softcap=_capped(options), tempered=_tempered(options),
                   **fields)


def _smoothing(options: LossOptions) -> bool:
    """Whether the forward and training kernels for ``options`` are those with
    label smoothing's terms (``Variant.smoothing``): ``eps != 0``."""
    return options.label_smoothing != 0.0


def _wide(options: LossOptions, x) -> bool:
    """Whether the loss kernels for ``x`` are the ``wide_loss`` variants: asked for,
    and ``x``'s dtype narrower than the accumulation dtype (else they are the same)."""
    return options.wide_loss and accum_torch_dtype(x) != x.dtype


def loss_torch_dtype(options: LossOptions, x) -> torch.dtype:
    """The dtype the loss kernels write ``loss``/``zloss`` in for ``x``."""
    return accum_torch_dtype(x) if _wide(options, x) else x.dtype


def _prob_scalars(options: LossOptions) -> tuple:
    """The probability-target kernels' scalar arguments: those of ``_scalars``
    but the ignore index."""
    return _scalars(options)[1:]


def _weight(w) -> list:
    return [w] if w is not None else []


def _check_out(*buffers) -> None:
    """Caller-given outputs are written in place, so they cannot be copied to align them."""
    for t in buffers:
        if t is not None and not is_aligned(t):
            raise ValueError(f"ce_tvm: an out= buffer must start {KERNEL_ALIGNMENT}-byte "
                             f"aligned (data_ptr {t.data_ptr():#x})")


MAX_CUDA_ROWS = 2**31 - 1  # gridDim.x: one thread block per row


def _rows_to_run(x) -> int:
    """``x``'s row count; an empty batch is never launched (a zero CUDA grid is an
    error), and a batch beyond CUDA's grid is refused with a clear error."""
    n = x.shape[0]
    if x.is_cuda and n > MAX_CUDA_ROWS:
        raise ValueError(f"ce_tvm: {n} rows exceed the CUDA grid ({MAX_CUDA_ROWS} row "
                         "blocks); split the batch")
    return n


def _empty_reduction(out, reduction: str) -> None:
    """What the kernels give for no rows: ``sum`` 0, ``mean`` 0/0 = NaN (PyTorch's
    rule), ``none`` empty."""
    if reduction != "none":
        for t in (out.loss, out.zloss):
            t.fill_(float("nan") if reduction == "mean" else 0.0)


def token_accuracy(hit: torch.Tensor, y: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The fraction of rows not ignored whose target is their first maximal
    logit, from the kernels' ``hit`` rows: a 0-d float32 tensor, NaN when no
    row counts (0/0); computed on the device, no host sync."""
    counted = (y != ignore_index).sum(dtype=hit.dtype)
    return (hit.sum() / counted).to(torch.float32)


def forward(x, y, w, options: LossOptions, *, log_prob: bool, accuracy: bool = False,
            out: ForwardOutputs | None = None) -> ForwardOutputs:
    """Run the fused forward; writes ``log_prob`` and ``hit`` only when asked
    (a given ``out`` then holds a ``hit`` buffer)."""
    x, y, w = aligned(x), aligned(y), aligned(w)
    n = x.shape[0]
    if out is None:
        rows = n if options.reduction == "none" else 1
        out = ForwardOutputs(
            loss=x.new_empty(rows, dtype=loss_torch_dtype(options, x)),
            zloss=x.new_empty(rows, dtype=loss_torch_dtype(options, x)),
            lse=x.new_empty(n, dtype=accum_torch_dtype(x)),
            log_prob=pool.empty_like(x) if log_prob else None,
            hit=x.new_empty(n, dtype=accum_torch_dtype(x)) if accuracy else None,
        )
    _check_out(out.loss, out.zloss, out.lse, out.log_prob, out.hit if accuracy else None)
    if _rows_to_run(x) == 0:
        _empty_reduction(out, options.reduction)
        return out
    variant = _variant(options, weighted=w is not None, log_prob=log_prob, accuracy=accuracy,
                       wide_loss=_wide(options, x), smoothing=_smoothing(options))
    _run(_spec("forward", x, variant), n, x, y, *_weight(w), *_scalars(options), out.loss,
         out.zloss, out.lse, *([out.log_prob] if log_prob else []),
         *([out.hit] if accuracy else []))
    if _shifted(x, variant) and not bool(out.lse.isfinite().all()):
        _exact_forward(x, y, w, options, out)
    return out


def _shifted(x, variant: Variant) -> bool:
    """Whether the kernel of ``variant`` for ``x`` may have taken its rows against a
    shift (``Variant.shifts_rows``; only CPU schedules do): its ``lse`` (a
    log-prob kernel's ``log_expsum``) then says which calls or rows to compute
    again (``+inf``, as for a row not finite)."""
    return x.device.type == "cpu" and variant.shifts_rows()


def _exact_forward(x, y, w, options: LossOptions, out: ForwardOutputs) -> None:
    """``out``'s loss, z-loss and ``lse`` again, by kernels that take each chunk
    against its own max: a forward or training kernel whose rows were taken
    against a shift (``_shifted``) gives ``lse = +inf`` for a row whose max
    lies too far above its first chunk's. The row is one vocabulary shard
    here, its statistics then combined (``shard_stats``, ``shard_combine``).
    With ``reduction="none"`` only the rows whose ``lse`` is not finite; a
    reduced loss, every row."""
    rows = slice(None)
    if options.reduction == "none":
        rows = (~out.lse.isfinite()).nonzero().squeeze(1)
        x, y = x[rows], y[rows]
    rowmax, expsum, wxsum, logit, weight = shard_stats(x, y, w, 0, options)
    lse = rowmax + torch.log(expsum)
    weight_sum = float(w.sum()) if w is not None else float(x.shape[1])
    loss, zloss = shard_combine(lse, logit, weight, wxsum, y, weight_sum=weight_sum,
                                classes=x.shape[1], dtype=out.loss.dtype, options=options)
    out.lse[rows] = lse
    out.loss[rows] = loss
    out.zloss[rows] = zloss


def train(x, y, w, options: LossOptions, *,
          accuracy: bool = False) -> tuple[ForwardOutputs, torch.Tensor]:
    """The forward and, in the same sweep, the logits gradient for a unit
    upstream gradient (``sum``/``mean`` only); returns ``(ForwardOutputs,
    x_grad)`` with ``x_grad`` from the buffer pool, ``log_prob`` ``None``,
    and ``hit`` when ``accuracy``."""
    x, y, w = aligned(x), aligned(y), aligned(w)
    n = x.shape[0]
    acc = accum_torch_dtype(x)
    loss_dtype = loss_torch_dtype(options, x)
    out = ForwardOutputs(loss=x.new_empty(1, dtype=loss_dtype),
                         zloss=x.new_empty(1, dtype=loss_dtype),
                         lse=x.new_empty(n, dtype=acc), log_prob=None,
                         hit=x.new_empty(n, dtype=acc) if accuracy else None)
    x_grad = pool.empty_like(x)
    if _rows_to_run(x) == 0:
        _empty_reduction(out, options.reduction)
        return out, x_grad
    norms = [x.new_empty(2, dtype=acc)] if options.reduction == "mean" else []
    variant = _variant(options, weighted=w is not None, log_prob=False, accuracy=accuracy,
                       wide_loss=_wide(options, x), smoothing=_smoothing(options))
    _run(_spec("train", x, variant), n, x, y, *_weight(w), *_scalars(options), *norms, x_grad,
         out.lse, out.loss, out.zloss, *([out.hit] if accuracy else []))
    if _shifted(x, variant) and not bool(out.lse.isfinite().all()):
        _exact_forward(x, y, w, options, out)
        g = x.new_ones(1, dtype=acc)
        backward(g, torch.zeros_like(g), x, out.lse, y, w, options, source_kind="logits",
                 out=x_grad)
    return out, x_grad


def backward(grad_loss, grad_zloss, source, lse, y, w, options: LossOptions, *,
             source_kind: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the fused backward from ``log_prob`` (``source_kind='log_prob'``) or
    from the logits and their ``lse`` (``source_kind='logits'``); returns ``x_grad``."""
    grad_loss, grad_zloss, source, lse, y, w = (
        aligned(t) for t in (grad_loss, grad_zloss, source, lse, y, w))
    x_grad = pool.empty_like(source) if out is None else out
    _check_out(x_grad)
    if _rows_to_run(source) == 0:
        return x_grad
    variant = _variant(options, weighted=w is not None, grad_source=source_kind)
    _run(_spec("backward", source, variant), source.shape[0], grad_loss, grad_zloss, source, lse, y,
         *_weight(w), *_scalars(options), x_grad)
    return x_grad


def shard_stats(x, y, w, offset: int, options: LossOptions):
    """Row statistics of a vocabulary shard (its logits capped and scaled as
    ``options`` say): ``(rowmax, expsum, wxsum, target_logit, target_weight)``,
    each ``[N]`` in the accumulation dtype; ``wxsum`` (label smoothing's sum)
    zeros for ``eps = 0``, whose kernel leaves it out."""
    x, y, w = aligned(x), aligned(y), aligned(w)
    smoothing = _smoothing(options)
    outs = [x.new_empty(x.shape[0], dtype=accum_torch_dtype(x)) for _ in range(5)]
    if not smoothing:
        outs[2].zero_()
    if _rows_to_run(x) == 0:
        return outs
    spec = _spec("shard_stats", x, _variant(replace(options, reduction="mean"),
                                            weighted=w is not None, smoothing=smoothing))
    _run(spec, x.shape[0], x, y, *_weight(w), offset, *_logit_scalars(options),
         *(outs if smoothing else outs[:2] + outs[3:]))
    return outs


def shard_combine(lse, target_logit, target_weight, wxsum, y, *, weight_sum: float,
                  classes: int, dtype: torch.dtype, options: LossOptions):
    """``(loss, zloss)`` in ``dtype`` from statistics combined over all shards."""
    lse, target_logit, target_weight, wxsum, y = (
        aligned(t) for t in (lse, target_logit, target_weight, wxsum, y))
    rows = lse.shape[0] if options.reduction == "none" else 1
    loss, zloss = (lse.new_empty(rows, dtype=dtype) for _ in range(2))
    if _rows_to_run(lse) == 0:
        _empty_reduction(ForwardOutputs(loss, zloss, lse, None), options.reduction)
        return loss, zloss
    spec = KernelSpec("shard_combine", dtype_name(dtype), classes, Variant(options.reduction),
                      *kernel_target(lse))
    # the statistics are of the capped, scaled logits already: this kernel has neither
    _run(spec, lse.shape[0], lse, target_logit, target_weight, wxsum, y, weight_sum,
         *_scalars(replace(options, softcap=0.0, temperature=1.0, logit_scale=1.0)), loss, zloss)
    return loss, zloss


def shard_backward(grad_loss, x, lse, y, w, target_weight, *, offset: int, weight_sum: float,
                   global_classes: int, options: LossOptions, grad_zloss=None,
                   out: torch.Tensor | None = None):
    """The gradient of one vocabulary shard, from the full rows' ``lse`` and ``w[y]``
    (``grad_zloss`` as ``backward`` takes it: zeros when ``None``; ``out`` may be
    ``x`` itself, as there)."""
    if grad_zloss is None:
        grad_zloss = torch.zeros_like(grad_loss)
    grad_loss, grad_zloss, x, lse, y, w, target_weight = (
        aligned(t) for t in (grad_loss, grad_zloss, x, lse, y, w, target_weight))
    x_grad = pool.empty_like(x) if out is None else out
    _check_out(x_grad)
    if _rows_to_run(x) == 0:
        return x_grad
    variant = _variant(options, weighted=w is not None, grad_source="shard")
    _run(_spec("backward", x, variant), x.shape[0], grad_loss, grad_zloss, x,
         lse, y, *_weight(w), target_weight, offset, weight_sum, float(global_classes),
         *_scalars(options), x_grad)
    return x_grad


def prob_forward(x, q, w, options: LossOptions) -> tuple[ForwardOutputs, torch.Tensor]:
    """The loss of probability targets ``q`` (``x``'s shape and dtype); returns
    ``(ForwardOutputs, target_mass)``, ``log_prob`` ``None`` and ``target_mass``
    the ``[N]`` row sums of ``w q'`` (accumulation dtype) the backward takes."""
    x, q, w = aligned(x), aligned(q), aligned(w)
    n = x.shape[0]
    rows = n if options.reduction == "none" else 1
    loss_dtype = loss_torch_dtype(options, x)
    out = ForwardOutputs(loss=x.new_empty(rows, dtype=loss_dtype),
                         zloss=x.new_empty(rows, dtype=loss_dtype),
                         lse=x.new_empty(n, dtype=accum_torch_dtype(x)), log_prob=None)
    mass = x.new_empty(n, dtype=accum_torch_dtype(x))
    if _rows_to_run(x) == 0:
        _empty_reduction(out, options.reduction)
        return out, mass
    spec = _spec("prob_forward", x, _variant(options, weighted=w is not None, log_prob=False,
                                             wide_loss=_wide(options, x)))
    _run(spec, n, x, q, *_weight(w), *_prob_scalars(options), out.loss, out.zloss, out.lse, mass)
    return out, mass


def prob_backward(grad_loss, x, q, lse, mass, w, options: LossOptions) -> torch.Tensor:
    """The logits gradient of probability targets, from the logits, their ``lse``
    and the forward's ``target_mass``."""
    grad_loss, x, q, lse, mass, w = (aligned(t) for t in (grad_loss, x, q, lse, mass, w))
    x_grad = pool.empty_like(x)
    if _rows_to_run(x) == 0:
        return x_grad
    spec = _spec("prob_backward", x, _variant(options, weighted=w is not None, log_prob=False))
    _run(spec, x.shape[0], grad_loss, x, q, lse, mass, *_weight(w), *_prob_scalars(options), x_grad)
    return x_grad


def prob_target_grad(grad_loss, x, lse, w, options: LossOptions) -> torch.Tensor:
    """The gradient of the probability-target loss with respect to the targets."""
    grad_loss, x, lse, w = (aligned(t) for t in (grad_loss, x, lse, w))
    target_grad = pool.empty_like(x)
    if _rows_to_run(x) == 0:
        return target_grad
    spec = _spec("prob_target_grad", x, _variant(options, weighted=w is not None,
                                                 log_prob=False))
    _run(spec, x.shape[0], grad_loss, x, lse, *_weight(w), options.label_smoothing,
         *_logit_scalars(options), target_grad)
    return target_grad


# --- Per-token log-probs and entropy (docs/spec.md, section 9) ----------------


def _policy_scalars(options: LossOptions) -> tuple:
    """The log-prob kernels' scalar arguments: the ignore index, the inverse
    temperature and, when on, the softcap."""
    return (options.ignore_index, 1.0 / options.kernel_temperature,
            *((options.kernel_softcap,) if _capped(options) else ()))


def log_probs(x, index, options: LossOptions, *, stats: bool = False, entropy: bool = True):
    """``(logp[N, K], entropy[N], row_max[N], log_expsum[N])`` in the
    accumulation dtype, for the logits ``x[N, C]`` and ``index[N, K]`` (int64,
    each in ``[0, C)`` or ``options.ignore_index``, ``K >= 1``); the last two
    are what the backward takes (``kernels.log_probs``). With ``stats`` (the
    kernel's stats variant, the same sweep) followed by ``log_sum_sq_probs[N]``,
    ``mean_logits[N]`` (accumulation dtype) and ``is_top1[N, K]`` (bool).
    ``entropy`` off (and no ``stats``): the kernel without the entropy
    (``Variant.entropy``), whose place holds zeros, for a caller that neither
    returns it nor takes its gradient."""
    x, index = aligned(x), aligned(index)
    n, k = index.shape
    acc = accum_torch_dtype(x)
    logp = x.new_empty((n, k), dtype=acc)
    rows = [x.new_empty(n, dtype=acc) for _ in range(5 if stats else 3)]
    # the kernel writes uint8 0/1 into the bool tensor's bytes (no conversion)
    top1 = [x.new_empty((n, k), dtype=torch.bool)] if stats else []
    entropy = entropy or stats
    if not entropy:
        rows[0].zero_()
    if _rows_to_run(x) == 0:
        return logp, *rows, *top1
    variant = Variant(columns=k, softcap=_capped(options), stats=stats, entropy=entropy)
    _run(_spec("log_probs", x, variant), n, x, index, *_policy_scalars(options), logp,
         *(rows if entropy else rows[1:]), *(t.view(torch.uint8) for t in top1))
    if _shifted(x, variant):
        _exact_log_probs(x, index, options, [logp, *rows[1:]])
    return logp, *rows, *top1


def _exact_log_probs(x, index, options: LossOptions, outputs: list) -> None:
    """``outputs`` (``[logp, row_max, log_expsum]`` of a kernel without the
    entropy) again for the rows whose ``log_expsum`` is not finite
    (``_shifted``: a row whose max lies too far above its first chunk's, or a
    row not finite), by the kernel with the entropy, which takes each chunk
    against its own max."""
    again = (~outputs[2].isfinite()).nonzero().squeeze(1)
    if again.numel() == 0:
        return
    logp, _, row_max, log_s = log_probs(x[again], index[again], options)
    for out, value in zip(outputs, (logp, row_max, log_s)):
        out[again] = value


def log_probs_backward(grad_logp, grad_entropy, x, index, row_max, log_expsum, entropy,
                       options: LossOptions, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The logits' gradient of ``sum grad_logp logp + sum grad_entropy entropy``
    (the upstream gradients and the forward's row outputs in the accumulation
    dtype). ``out`` may be ``x`` itself: each logit is read before its
    gradient is written in its place."""
    grad_logp, grad_entropy, x, index, row_max, log_expsum, entropy = (
        aligned(t) for t in (grad_logp, grad_entropy, x, index, row_max, log_expsum, entropy))
    x_grad = pool.empty_like(x) if out is None else out
    _check_out(x_grad)
    if _rows_to_run(x) == 0:
        return x_grad
    variant = Variant(columns=index.shape[1], softcap=_capped(options))
    _run(_spec("log_probs_grad", x, variant), x.shape[0], grad_logp, grad_entropy, x, row_max,
         log_expsum, entropy, index, *_policy_scalars(options), x_grad)
    return x_grad


# --- Student-teacher divergence (docs/spec.md, section 15) --------------------


def divergence(student, teacher, g, options: DivergenceOptions, *,
               grad_out: torch.Tensor | None = None):
    """``(divergence[N], entropy[N])`` (accumulation dtype) of the student's and
    the teacher's logits ``[N, C]`` (one dtype); with ``grad_out`` also the
    student logits' gradient of ``sum_n g[n] divergence[n]`` written there
    (``g``: ``[N]``, accumulation dtype; ``grad_out`` may be ``student``
    itself: each logit is read before its gradient takes its place)."""
    student, teacher, g = aligned(student), aligned(teacher), aligned(g)
    n = student.shape[0]
    acc = accum_torch_dtype(student)
    div, ent = student.new_empty(n, dtype=acc), student.new_empty(n, dtype=acc)
    if grad_out is not None:
        _check_out(grad_out)
    if _rows_to_run(student) == 0:
        return div, ent
    grad = grad_out is not None
    _run(_spec("divergence", student, options.variant(grad)), n, student, teacher, g,
         *options.scalars(), div, ent, *([grad_out] if grad else []))
    return div, ent
