"""Distillation losses: from a teacher's stored top-k log-probs (offline
teachers), and the full-vocabulary divergence of a student's and a teacher's
heads (``linear_distillation_loss``, ``distillation_loss``; docs/distillation.md).

A teacher that was run once and stored, per position, its ``K`` most likely
tokens and their log-probs leaves no logits to compare with. The student's
log-probs at those ``K`` tokens come from ``linear_log_probs`` (the student's
logits never whole), and the loss is the forward KL between the two
distributions coarse-grained to ``K + 1`` outcomes, the top-k tokens and the
rest ("bucket"), or between both renormalised over the top-k tokens
("renormalize"). Either is a KL between proper distributions, so it is >= 0
and 0 when the student matches the teacher on them.
"""

from __future__ import annotations

import math
from dataclasses import astuple

import torch
from torch import Tensor

from . import sharding
from . import validation as check
from .custom_ops import custom_op
from .policy import linear_log_probs
from .runtime import launch, linear_sweep, pool
from .runtime.launch import DivergenceOptions
from .runtime.linear_sweep import Needs
from .runtime.tensors import accum_torch_dtype

TAILS = ("bucket", "renormalize")
_REDUCTIONS = ("mean", "sum", "none")


def _log_rest(logp: Tensor) -> Tensor:
    """``log(1 - sum_k exp(logp_k))`` per row: the log-mass outside the top-k,
    at least ``log(eps)`` of the dtype (a top-k holding all the mass in float32
    would give ``-inf``)."""
    tiny = torch.finfo(logp.dtype).eps
    return torch.log(-torch.expm1(torch.logsumexp(logp, -1).clamp(max=-tiny)))


def _reduced(per_row: Tensor, kept: Tensor, reduction: str) -> Tensor:
    """``sum`` of the per-position losses, or for ``mean`` over the counted
    positions (0 when none counts, as TRL has it)."""
    total = per_row.sum()
    return total / kept.sum().clamp(min=1) if reduction == "mean" else total


def topk_kl(student_logp: Tensor, teacher_logp: Tensor, tail: str = "bucket") -> Tensor:
    """Per-row forward KL(teacher || student) over the top-k tokens ``[..., K]``
    (log-probs of the same tokens under each model), with the tail as ``tail``
    says (``TAILS``; see the module doc). Returns ``[...]``."""
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    if tail == "renormalize":
        teacher_logp = teacher_logp - torch.logsumexp(teacher_logp, -1, keepdim=True)
        student_logp = student_logp - torch.logsumexp(student_logp, -1, keepdim=True)
        return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    head = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    teacher_rest = _log_rest(teacher_logp)
    return head + teacher_rest.exp() * (teacher_rest - _log_rest(student_logp))


def topk_distillation_loss(student_input: Tensor, student_weight, teacher_index: Tensor,
                           teacher_logprobs: Tensor, target: Tensor | None = None, *,
                           student_bias: Tensor | None = None, temperature: float = 1.0,
                           student_logit_scale: float = 1.0, student_softcap: float = 0.0,
                           tail: str = "bucket", ignore_index: int = -100,
                           reduction: str = "mean", chunk_rows: int | None = None) -> Tensor:
    """Forward KL from a teacher's stored top-k to the student's LM head.

    ``student_input [*, H]``, ``student_weight [V, H]`` (or the head module);
    ``teacher_index [*, K]`` the teacher's top-k token ids and
    ``teacher_logprobs [*, K]`` its log-probs of them at ``temperature`` (the
    student's distribution is ``softmax(cap(s x) / temperature)``, as
    ``linear_log_probs`` has it). ``target [*]``: only its ``ignore_index``
    entries count (those positions are left out); ``None``: every position
    counts. ``reduction``: ``mean`` over the counted positions, ``sum``, or
    ``none`` (``[*]``, 0 where left out). Gradients reach the student's input,
    weight and bias; the teacher's tensors get none.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if teacher_index.shape != teacher_logprobs.shape or teacher_index.dim() < 2:
        raise ValueError(f"teacher_index and teacher_logprobs must both be [*, K], got "
                         f"{tuple(teacher_index.shape)} and {tuple(teacher_logprobs.shape)}")
    if tuple(teacher_index.shape[:-1]) != tuple(student_input.shape[:-1]):
        raise ValueError(f"the teacher's top-k must be of the student's positions "
                         f"{tuple(student_input.shape[:-1])} + (K,), got "
                         f"{tuple(teacher_index.shape)}")
    kept = (torch.ones(teacher_index.shape[:-1], dtype=torch.bool, device=teacher_index.device)
            if target is None else target != ignore_index)
    student_logp = linear_log_probs(student_input, student_weight, teacher_index,
                                    linear_bias=student_bias, temperature=temperature,
                                    softcap=student_softcap, logit_scale=student_logit_scale,
                                    row_mask=kept, chunk_rows=chunk_rows)
    # a left-out position's teacher values may be padding (-inf): never read
    teacher = torch.where(kept[..., None], teacher_logprobs.detach().to(student_logp.dtype), 0.0)
    per_row = torch.where(kept, topk_kl(student_logp, teacher, tail), 0.0)
    return per_row if reduction == "none" else _reduced(per_row, kept, reduction)


# --- Full-vocabulary distillation: the student-teacher divergence -------------
# (docs/distillation.md; docs/spec.md, section 15)


def _kind(beta: float) -> str:
    """The kernel direction of TRL's ``beta``: 0 forward KL, 1 reverse KL, else the JSD."""
    return "fkl" if beta == 0.0 else "rkl" if beta == 1.0 else "jsd"


def _real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def divergence_options(*, beta, temperature, student_logit_scale, teacher_logit_scale,
                       student_softcap, teacher_softcap) -> DivergenceOptions:
    """The kernels' ``DivergenceOptions``, every option checked (``ValueError``
    saying what was expected): ``beta`` in ``[0, 1]``, ``temperature`` finite and
    ``> 0``, logit scales finite and ``> 0``, softcaps finite and ``>= 0`` (0: off).
    A logit scale folds into its side's cap and temperature:
    ``cap_t(s x) / T = cap_{t / s}(x) * s / T``."""
    beta = _real(beta, "beta")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}")
    temp = _real(temperature, "temperature")
    if not 0.0 < temp < math.inf:
        raise ValueError(f"temperature must be finite and > 0, got {temp}")
    sides = []
    for side, scale, cap in (("student", student_logit_scale, student_softcap),
                             ("teacher", teacher_logit_scale, teacher_softcap)):
        scale = _real(scale, f"{side}_logit_scale")
        cap = _real(cap, f"{side}_softcap")
        if not 0.0 < scale < math.inf:
            raise ValueError(f"{side}_logit_scale must be finite and > 0, got {scale}")
        if not 0.0 <= cap < math.inf:
            raise ValueError(f"{side}_softcap must be finite and >= 0 (0 turns it off), got {cap}")
        sides += [cap / scale, scale / temp]
    return DivergenceOptions(_kind(beta), beta, *sides)


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _check_vocab(student: int, teacher: int) -> None:
    if student != teacher:
        raise ValueError(f"the student's and the teacher's vocabularies must align (one "
                         f"token id, one column): the student has {student} classes, the "
                         f"teacher {teacher}")


def _kept(target: Tensor | None, rows: int, ignore_index: int, device, dtype) -> Tensor:
    """``[N]`` 1 where the position counts, 0 where ``target`` is ``ignore_index``."""
    if target is None:
        return torch.ones(rows, dtype=dtype, device=device)
    if target.numel() != rows:
        raise ValueError(f"target must hold one entry per position ({rows}), got "
                         f"{tuple(target.shape)}")
    return (target.reshape(-1) != ignore_index).to(dtype)


def _upstream(kept: Tensor, reduction: str) -> Tensor:
    """Each row's weight in the reduced loss: ``kept / max(count, 1)`` for
    ``mean`` (TRL's normalisation: a batch with no counted position gives 0),
    ``kept`` for ``sum``."""
    return kept / kept.sum().clamp(min=1) if reduction == "mean" else kept


def _row_upstream(grad_loss: Tensor, kept: Tensor) -> Tensor:
    """The ``none`` loss's upstream gradient as the kernels take it: ``[N]``,
    accumulation dtype, 0 where the position is left out."""
    return (grad_loss.to(kept.dtype) * kept).contiguous()


def _outputs(div: Tensor, ent: Tensor, kept: Tensor, reduction: str) -> tuple[Tensor, Tensor]:
    """``(loss, entropy)`` from the kernels' per-row values: left-out positions
    0, the loss reduced as ``reduction`` says (0-d for ``mean``/``sum``)."""
    per_row = div * kept
    return (per_row if reduction == "none" else _reduced(per_row, kept, reduction)), ent * kept


def _loss_like(x: Tensor, reduction: str) -> tuple[Tensor, Tensor]:
    """Empty ``(loss, entropy)`` of the forward ops, for ``x [N, ...]`` (the fakes)."""
    acc, n = accum_torch_dtype(x), x.shape[0]
    return x.new_empty((n,) if reduction == "none" else (), dtype=acc), x.new_empty(n, dtype=acc)


def _grad_like(like: Tensor | None, wanted: bool, x: Tensor) -> Tensor:
    """A fake gradient output: ``like``'s when ``wanted`` (and ``like`` given),
    else an empty tensor of ``x``'s dtype."""
    return torch.empty_like(like) if wanted and like is not None else x.new_empty(0)


@custom_op("ce_tvm::linear_distillation", mutates_args=())
def linear_distillation_forward(
        student_input: Tensor, student_weight: Tensor, student_bias: Tensor | None,
        teacher_input: Tensor, teacher_weight: Tensor, teacher_bias: Tensor | None,
        kept: Tensor, reduction: str, kind: str, beta: float, student_softcap: float,
        student_inv_temperature: float, teacher_softcap: float,
        teacher_inv_temperature: float, chunk_rows: int, grad_input: bool, grad_weight: bool,
        grad_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, entropy, grad_input, grad_weight, grad_bias)`` of the heads
    ``student_input [N, Hs] @ student_weight.T + student_bias`` and the
    teacher's (same dtype), ``kept [N]`` (accumulation dtype) 1 where a
    position counts; the scalars are ``DivergenceOptions``' fields.

    ``loss``: ``[N]`` for ``none``, else 0-d; ``entropy [N]``. For
    ``mean``/``sum`` the student's gradients of a unit upstream gradient, from
    the same sweep, for each flag set; an empty tensor for each other one (and
    all three for ``none``). ``chunk_rows`` 0: the default
    (``linear_sweep.chunk_rows``)."""
    opts = DivergenceOptions(kind, beta, student_softcap, student_inv_temperature,
                             teacher_softcap, teacher_inv_temperature)
    xs, Ws, bs = student_input, student_weight, student_bias
    rows = linear_sweep.chunk_rows(xs.shape[0], Ws.shape[0], xs.dtype, chunk_rows)
    needs = Needs(grad_input, grad_weight, grad_bias and bs is not None)
    g = _upstream(kept, reduction) if reduction != "none" and needs.any() else None
    div, ent, grads = linear_sweep.divergence_sweep(xs, Ws, bs, teacher_input, teacher_weight,
                                                    teacher_bias, g, opts, rows, needs)
    if grads is None:
        grads = tuple(xs.new_empty(0) for _ in range(3))
    return *_outputs(div, ent, kept, reduction), *grads


@linear_distillation_forward.register_fake
def _(student_input, student_weight, student_bias, teacher_input, teacher_weight, teacher_bias,
      kept, reduction, kind, beta, student_softcap, student_inv_temperature, teacher_softcap,
      teacher_inv_temperature, chunk_rows, grad_input, grad_weight, grad_bias):
    scalar = reduction != "none"
    return (*_loss_like(student_input, reduction),
            *(_grad_like(like, scalar and wanted, student_input) for like, wanted in
              ((student_input, grad_input), (student_weight, grad_weight),
               (student_bias, grad_bias))))


@custom_op("ce_tvm::linear_distillation_backward", mutates_args=())
def linear_distillation_backward(
        grad_rows: Tensor, student_input: Tensor, student_weight: Tensor,
        student_bias: Tensor | None, teacher_input: Tensor, teacher_weight: Tensor,
        teacher_bias: Tensor | None, kind: str, beta: float, student_softcap: float,
        student_inv_temperature: float, teacher_softcap: float,
        teacher_inv_temperature: float, chunk_rows: int, grad_input: bool, grad_weight: bool,
        grad_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_input, grad_weight, grad_bias)`` of ``sum_n grad_rows[n] D[n]``
    (``grad_rows [N]``, accumulation dtype), both heads swept again; an empty
    tensor for each gradient not asked for."""
    opts = DivergenceOptions(kind, beta, student_softcap, student_inv_temperature,
                             teacher_softcap, teacher_inv_temperature)
    xs, Ws, bs = student_input, student_weight, student_bias
    rows = linear_sweep.chunk_rows(xs.shape[0], Ws.shape[0], xs.dtype, chunk_rows)
    needs = Needs(grad_input, grad_weight, grad_bias and bs is not None)
    return linear_sweep.divergence_sweep(xs, Ws, bs, teacher_input, teacher_weight,
                                         teacher_bias, grad_rows, opts, rows, needs)[2]


@linear_distillation_backward.register_fake
def _(grad_rows, student_input, student_weight, student_bias, teacher_input, teacher_weight,
      teacher_bias, kind, beta, student_softcap, student_inv_temperature, teacher_softcap,
      teacher_inv_temperature, chunk_rows, grad_input, grad_weight, grad_bias):
    return tuple(_grad_like(like, wanted, student_input) for like, wanted in
                 ((student_input, grad_input), (student_weight, grad_weight),
                  (student_bias, grad_bias)))


def _forward_grads(ctx) -> tuple:
    """The forward's gradients kept on ``ctx``, consumed (the backward of a
    ``mean``/``sum`` loss runs once per graph)."""
    grads, ctx.grads = ctx.grads, None
    if grads is None:
        raise RuntimeError("ce_tvm: backward ran twice through a distillation loss's graph; "
                           "with reduction 'mean'/'sum' the first backward consumes the "
                           "gradients its forward computed")
    return grads


def _setup_linear_context(ctx, inputs, output):
    xs, Ws, bs, xt, Wt, bt, kept, reduction, *options, grad_input, grad_weight, grad_bias = inputs
    ctx.reduction, ctx.needs = reduction, (grad_input, grad_weight, grad_bias)
    if reduction == "none":
        ctx.save_for_backward(xs, Ws, bs, xt, Wt, bt, kept)
        ctx.options = tuple(options)  # the scalars and chunk_rows
    else:
        # detached: an output kept on ctx with its grad_fn would be a reference cycle
        ctx.grads = tuple(t.detach() for t in output[2:])
    ctx.mark_non_differentiable(*output[1:])  # the entropy, the gradients
    ctx.set_materialize_grads(False)


def _linear_backward(ctx, grad_loss, *_):
    none = (None,) * 15
    if grad_loss is None:
        return (None, None, None, *none)
    if ctx.reduction == "none":
        xs, Ws, bs, xt, Wt, bt, kept = ctx.saved_tensors
        grads = linear_distillation_backward(_row_upstream(grad_loss, kept), xs, Ws, bs, xt,
                                             Wt, bt, *ctx.options, *ctx.needs)
    else:
        grads = tuple(t * grad_loss.to(t.dtype) for t in _forward_grads(ctx))
    return (*(g if wanted else None for g, wanted in zip(grads, ctx.needs)), *none)


linear_distillation_forward.register_autograd(_linear_backward,
                                              setup_context=_setup_linear_context)


def _local(what: str, *tensors) -> None:
    """A ``ValueError`` for DTensor rows (inputs, logits): never a guess."""
    if any(check.is_dtensor(t) for t in tensors):
        raise ValueError(
            f"the {what} is a DTensor: the distillation losses take each rank's own rows as "
            f"plain tensors (sequence- or tensor-parallel rows are not supported); pass "
            f".to_local() for data-parallel rows")


def _student_weight(weight) -> None:
    """A ``ValueError`` for a DTensor student weight (beside plain rows): two readings."""
    if check.is_dtensor(weight):
        raise ValueError(
            f"the student's head weight is a DTensor {tuple(weight.placements)} beside plain "
            f"rows, which has two readings; ce_tvm does not guess. (1) Data parallel (FSDP2 "
            f"fully_shard, FSDP, ZeRO-3 shard it outside the head's forward): pass the head "
            f"module, linear_distillation_loss(hidden, model.lm_head, teacher_hidden, "
            f"teacher.lm_head, target), so the loss runs inside its call, where the weight "
            f"is gathered and its gradient reduced. (2) Tensor parallel (a vocabulary-sharded "
            f"student head, also what the module's call holds under FSDP x TP): not supported "
            f"by the distillation losses yet; every rank has the same rows there, so "
            f"weight.full_tensor() gives the right loss and gradients")


@torch.compiler.disable
def _through_student_head(head: torch.nn.Module, student_input: Tensor, fused):
    """``fused(hidden, weight, bias)`` inside the student head module's own call
    (``sharding.inside``: FSDP / ZeRO-3 gather its weight there and reduce its
    gradient); eager under ``torch.compile`` (its hooks are not traced)."""
    inner, _ = check.head_module(head, None)
    return sharding.inside(
        head, lambda hidden: fused(hidden, inner.weight, getattr(inner, "bias", None)),
        student_input)


def linear_distillation_loss(student_input: Tensor, student_weight, teacher_input: Tensor,
                             teacher_weight, target: Tensor | None = None, *,
                             student_bias: Tensor | None = None,
                             teacher_bias: Tensor | None = None, beta: float = 0.5,
                             temperature: float = 1.0, student_logit_scale: float = 1.0,
                             teacher_logit_scale: float = 1.0, student_softcap: float = 0.0,
                             teacher_softcap: float = 0.0, ignore_index: int = -100,
                             reduction: str = "mean", return_entropy: bool = False,
                             chunk_rows: int | None = None):
    """The divergence between a student's and a teacher's LM heads, fused with
    both heads: neither model's ``[N, V]`` logits exist whole.

    ``student_input [*, Hs]``, ``student_weight [V, Hs]`` (or the head module),
    ``teacher_input [*, Ht]``, ``teacher_weight [V, Ht]`` (or the head module):
    the vocabularies must align, the widths may differ. Sharded heads: the
    student's module under FSDP / ZeRO-3 runs the loss inside its own call
    (gathered there, its gradient reduced); a DTensor student weight is a
    ``ValueError`` (data or tensor parallel: two readings). The teacher, which
    takes no gradient, is used whole however it is sharded
    (``sharding.whole_frozen_head``). Each side's distribution is
    ``softmax(cap(s x) / temperature)`` (its logit scale ``s`` and softcap).
    ``beta`` as TRL's ``generalized_jsd_loss``: 0 is ``KL(teacher || student)``,
    1 is ``KL(student || teacher)``, in between the generalized JSD
    ``beta KL(teacher || m) + (1 - beta) KL(student || m)`` with
    ``m = beta teacher + (1 - beta) student``.

    ``target [*]`` only masks: positions equal to ``ignore_index`` are left
    out (loss and entropy 0 there). ``reduction``: ``mean`` over the counted
    positions (0 when none counts, as TRL has it), ``sum``, or ``none``
    (``[*]``). The loss is in the accumulation dtype (float32; float64 for
    float64). Gradients reach the student's input, weight and bias; the
    teacher takes none. ``return_entropy``: also the student's entropy per
    position (``[*]``, no gradient). ``chunk_rows``: rows per chunk
    (default as ``linear_cross_entropy``'s).
    """
    _check_reduction(reduction)
    opts = divergence_options(beta=beta, temperature=temperature,
                              student_logit_scale=student_logit_scale,
                              teacher_logit_scale=teacher_logit_scale,
                              student_softcap=student_softcap, teacher_softcap=teacher_softcap)
    Wt, bt = sharding.whole_frozen_head(teacher_weight, teacher_bias)

    def fused(student_input, Ws, bs):
        _student_weight(Ws)
        _local("student's input", student_input)
        _local("teacher's input", teacher_input)
        _check_vocab(Ws.shape[0], Wt.shape[0])
        lead = tuple(student_input.shape[:-1])
        if tuple(teacher_input.shape[:-1]) != lead:
            raise ValueError(f"the teacher's positions {tuple(teacher_input.shape[:-1])} must "
                             f"be the student's {lead}")
        xs = student_input.reshape(-1, student_input.shape[-1]).contiguous()
        xt = teacher_input.detach().reshape(-1, teacher_input.shape[-1])
        xt, wt = (t.to(xs.dtype).contiguous() for t in (xt, Wt))
        kept = _kept(target, xs.shape[0], ignore_index, xs.device, accum_torch_dtype(xs))
        needs = Needs.of(xs, Ws, bs)
        loss, ent, *_ = linear_distillation_forward(
            xs, Ws, bs, xt, wt, None if bt is None else bt.to(xs.dtype), kept, reduction,
            *astuple(opts), chunk_rows or 0, needs.input, needs.weight, needs.bias)
        if reduction == "none":
            loss = loss.reshape(lead)
        return (loss, ent.reshape(lead)) if return_entropy else loss

    if isinstance(student_weight, torch.nn.Module):
        inner, needs_call = check.head_module(student_weight, student_bias)
        if needs_call:
            return _through_student_head(student_weight, student_input, fused)
        student_weight, student_bias = inner.weight, getattr(inner, "bias", None)
    return fused(student_input, student_weight, student_bias)


@custom_op("ce_tvm::distillation", mutates_args=())
def distillation_forward(student: Tensor, teacher: Tensor, kept: Tensor, reduction: str,
                         kind: str, beta: float, student_softcap: float,
                         student_inv_temperature: float, teacher_softcap: float,
                         teacher_inv_temperature: float, grad: bool
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, entropy, grad)`` of the logits ``student``, ``teacher`` ``[N, V]``
    (one dtype) in one launch, ``kept`` and the scalars as
    ``linear_distillation_forward``'s. ``grad``: for ``mean``/``sum`` also the
    student logits' gradient of a unit upstream gradient (in a buffer of its
    own); else an empty tensor."""
    opts = DivergenceOptions(kind, beta, student_softcap, student_inv_temperature,
                             teacher_softcap, teacher_inv_temperature)
    grad = grad and reduction != "none"
    buf = pool.empty_like(student) if grad else student.new_empty(0)
    div, ent = launch.divergence(student, teacher, _upstream(kept, reduction) if grad else kept,
                                 opts, grad_out=buf if grad else None)
    return *_outputs(div, ent, kept, reduction), buf


@distillation_forward.register_fake
def _(student, teacher, kept, reduction, kind, beta, student_softcap, student_inv_temperature,
      teacher_softcap, teacher_inv_temperature, grad):
    return (*_loss_like(student, reduction),
            _grad_like(student, grad and reduction != "none", student))


@custom_op("ce_tvm::distillation_backward", mutates_args=())
def distillation_backward(grad_rows: Tensor, student: Tensor, teacher: Tensor, kind: str,
                          beta: float, student_softcap: float, student_inv_temperature: float,
                          teacher_softcap: float, teacher_inv_temperature: float) -> Tensor:
    """The student logits' gradient of ``sum_n grad_rows[n] D[n]`` (``grad_rows
    [N]``, accumulation dtype), in a buffer of its own."""
    opts = DivergenceOptions(kind, beta, student_softcap, student_inv_temperature,
                             teacher_softcap, teacher_inv_temperature)
    grad = pool.empty_like(student)
    launch.divergence(student, teacher, grad_rows, opts, grad_out=grad)
    return grad


@distillation_backward.register_fake
def _(grad_rows, student, teacher, kind, beta, student_softcap, student_inv_temperature,
      teacher_softcap, teacher_inv_temperature):
    return torch.empty_like(student, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    s, t, kept, reduction, *scalars, _ = inputs
    ctx.reduction = reduction
    if reduction == "none":
        ctx.save_for_backward(s, t, kept)
        ctx.options = tuple(scalars)
    else:
        ctx.grads = (output[2].detach(),)  # detached: see _setup_linear_context
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, *_):
    none = (None,) * 10
    if grad_loss is None:
        return (None, *none)
    if ctx.reduction == "none":
        s, t, kept = ctx.saved_tensors
        return (distillation_backward(_row_upstream(grad_loss, kept), s, t, *ctx.options), *none)
    (grad,) = _forward_grads(ctx)
    return (grad * grad_loss.to(grad.dtype), *none)


distillation_forward.register_autograd(_backward, setup_context=_setup_context)


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor,
                      target: Tensor | None = None, *, beta: float = 0.5,
                      temperature: float = 1.0, student_logit_scale: float = 1.0,
                      teacher_logit_scale: float = 1.0, student_softcap: float = 0.0,
                      teacher_softcap: float = 0.0, ignore_index: int = -100,
                      reduction: str = "mean", return_entropy: bool = False):
    """``linear_distillation_loss`` on materialised logits ``[*, V]`` (one kernel
    launch over all rows; the student's gradient in a buffer of its own, never
    in the caller's tensor). Same options and outputs."""
    _check_reduction(reduction)
    opts = divergence_options(beta=beta, temperature=temperature,
                              student_logit_scale=student_logit_scale,
                              teacher_logit_scale=teacher_logit_scale,
                              student_softcap=student_softcap, teacher_softcap=teacher_softcap)
    _local("student's logits", student_logits)
    _local("teacher's logits", teacher_logits)
    _check_vocab(student_logits.shape[-1], teacher_logits.shape[-1])
    lead = tuple(student_logits.shape[:-1])
    if tuple(teacher_logits.shape[:-1]) != lead:
        raise ValueError(f"the teacher's positions {tuple(teacher_logits.shape[:-1])} must be "
                         f"the student's {lead}")
    s = student_logits.reshape(-1, student_logits.shape[-1]).contiguous()
    t = teacher_logits.detach().reshape(s.shape).to(s.dtype).contiguous()
    kept = _kept(target, s.shape[0], ignore_index, s.device, accum_torch_dtype(s))
    grad = torch.is_grad_enabled() and s.requires_grad
    loss, ent, _ = distillation_forward(s, t, kept, reduction, *astuple(opts), grad)
    if reduction == "none":
        loss = loss.reshape(lead)
    return (loss, ent.reshape(lead)) if return_entropy else loss
