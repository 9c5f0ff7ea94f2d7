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

import torch
from torch import Tensor

from . import validation as check
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


class _LinearDivergence(torch.autograd.Function):
    """``(loss, entropy)`` of ``linear_distillation_loss``; for ``mean``/``sum``
    the student's gradients come from the forward's sweep (scaled by the
    upstream gradient in the backward), for ``none`` the backward sweeps again
    with the upstream gradient per row."""

    @staticmethod
    def forward(ctx, xs, Ws, bs, xt, Wt, bt, kept, opts, reduction, rows):
        needs = Needs(*ctx.needs_input_grad[:2], ctx.needs_input_grad[2] and bs is not None)
        g = _upstream(kept, reduction) if reduction != "none" and needs.any() else None
        div, ent, grads = linear_sweep.divergence_sweep(xs, Ws, bs, xt, Wt, bt, g, opts, rows,
                                                        needs)
        per_row = div * kept
        ent = ent * kept
        ctx.mark_non_differentiable(ent)
        ctx.reduction = reduction
        ctx.has_bias = bs is not None
        if reduction == "none":
            ctx.save_for_backward(xs, Ws, bs, xt, Wt, bt, kept)
            ctx.opts, ctx.rows, ctx.needs = opts, rows, needs
            return per_row, ent
        ctx.grads = grads
        return _reduced(per_row, kept, reduction), ent

    @staticmethod
    def backward(ctx, grad_loss, _grad_entropy):
        if ctx.reduction == "none":
            xs, Ws, bs, xt, Wt, bt, kept = ctx.saved_tensors
            g = (grad_loss.to(kept.dtype) * kept).contiguous()
            _, _, grads = linear_sweep.divergence_sweep(xs, Ws, bs, xt, Wt, bt, g, ctx.opts,
                                                        ctx.rows, ctx.needs)
        else:
            grads = tuple(t * grad_loss.to(t.dtype) if t.numel() else t for t in ctx.grads)
            ctx.grads = None
        gx, gW, gb = (t if t.numel() else None for t in grads)
        return gx, gW, gb if ctx.has_bias else None, None, None, None, None, None, None, None


def _local(side: str, *tensors) -> None:
    """A ``ValueError`` for a sharded (DTensor) head or input: never a guess."""
    if any(check.is_dtensor(t) for t in tensors):
        raise ValueError(
            f"the {side}'s head or input is a DTensor: the distillation losses take local "
            f"heads (a sharded head, data- or tensor-parallel, is not supported yet); under "
            f"FSDP2 call them inside the model's forward, or gather the head first")


def _head(weight, bias, side: str):
    """``(weight, bias)`` of a head given as tensors or as a module with ``.weight``
    whose call runs no hooks (a module that gathers its weight in its call is
    refused, as a DTensor weight is)."""
    if isinstance(weight, torch.nn.Module):
        inner, needs_call = check.head_module(weight, bias)
        if needs_call:
            raise ValueError(f"the {side}'s head module has hooks (FSDP, ZeRO-3, tensor "
                             f"parallelism gather or lay out its weight in its call): the "
                             f"distillation losses take local heads; pass its weight inside "
                             f"the model's forward, or gather it first")
        weight, bias = inner.weight, getattr(inner, "bias", None)
    _local(side, weight, bias)
    return weight, bias


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
    ``teacher_input [*, Ht]``, ``teacher_weight [V, Ht]``: the vocabularies must
    align, the widths may differ. Each side's distribution is
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
    Ws, bs = _head(student_weight, student_bias, "student")
    Wt, bt = _head(teacher_weight, teacher_bias, "teacher")
    _local("student", student_input)
    _local("teacher", teacher_input)
    _check_vocab(Ws.shape[0], Wt.shape[0])
    lead = tuple(student_input.shape[:-1])
    if tuple(teacher_input.shape[:-1]) != lead:
        raise ValueError(f"the teacher's positions {tuple(teacher_input.shape[:-1])} must be "
                         f"the student's {lead}")
    xs = student_input.reshape(-1, student_input.shape[-1]).contiguous()
    dtype = xs.dtype
    xt, Wt = (t.detach().to(dtype).contiguous() for t in (teacher_input, Wt))
    bt = None if bt is None else bt.detach().to(dtype)
    n = xs.shape[0]
    acc = accum_torch_dtype(xs)
    kept = _kept(target, n, ignore_index, xs.device, acc)
    rows = linear_sweep.chunk_rows(max(n, 1), Ws.shape[0], dtype, chunk_rows or 0)
    loss, ent = _LinearDivergence.apply(xs, Ws, bs, xt, Wt, bt, kept, opts, reduction, rows)
    if reduction == "none":
        loss = loss.reshape(lead)
    return (loss, ent.reshape(lead)) if return_entropy else loss


class _Divergence(torch.autograd.Function):
    """``(loss, entropy)`` of ``distillation_loss`` on whole logits (one launch)."""

    @staticmethod
    def forward(ctx, s, t, kept, opts, reduction):
        ctx.reduction, ctx.opts = reduction, opts
        grad = reduction != "none" and ctx.needs_input_grad[0]
        buf = pool.empty_like(s) if grad else None
        div, ent = launch.divergence(s, t, _upstream(kept, reduction) if grad else kept, opts,
                                     grad_out=buf)
        per_row, ent = div * kept, ent * kept
        ctx.mark_non_differentiable(ent)
        if reduction == "none":
            ctx.save_for_backward(s, t, kept)
            return per_row, ent
        ctx.grad = buf
        return _reduced(per_row, kept, reduction), ent

    @staticmethod
    def backward(ctx, grad_loss, _grad_entropy):
        if ctx.reduction == "none":
            s, t, kept = ctx.saved_tensors
            grad = pool.empty_like(s)
            launch.divergence(s, t, (grad_loss.to(kept.dtype) * kept).contiguous(), ctx.opts,
                              grad_out=grad)
        else:
            grad, ctx.grad = ctx.grad * grad_loss.to(ctx.grad.dtype), None
        return grad, None, None, None, None


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
    _local("student", student_logits)
    _local("teacher", teacher_logits)
    _check_vocab(student_logits.shape[-1], teacher_logits.shape[-1])
    lead = tuple(student_logits.shape[:-1])
    if tuple(teacher_logits.shape[:-1]) != lead:
        raise ValueError(f"the teacher's positions {tuple(teacher_logits.shape[:-1])} must be "
                         f"the student's {lead}")
    s = student_logits.reshape(-1, student_logits.shape[-1]).contiguous()
    t = teacher_logits.detach().reshape(s.shape).to(s.dtype).contiguous()
    kept = _kept(target, s.shape[0], ignore_index, s.device, accum_torch_dtype(s))
    loss, ent = _Divergence.apply(s, t, kept, opts, reduction)
    if reduction == "none":
        loss = loss.reshape(lead)
    return (loss, ent.reshape(lead)) if return_entropy else loss
