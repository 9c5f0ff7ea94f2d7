"""Distillation from a teacher's stored top-k log-probs (offline teachers):
``topk_distillation_loss`` (docs/distillation.md).

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

import torch
from torch import Tensor

from .distillation import check_reduction, reduced
from .log_probs import linear_log_probs

TAILS = ("bucket", "renormalize")


def _log_rest(logp: Tensor) -> Tensor:
    """``log(1 - sum_k exp(logp_k))`` per row: the log-mass outside the top-k,
    at least ``log(eps)`` of the dtype (a top-k holding all the mass in float32
    would give ``-inf``)."""
    tiny = torch.finfo(logp.dtype).eps
    return torch.log(-torch.expm1(torch.logsumexp(logp, -1).clamp(max=-tiny)))


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
    check_reduction(reduction)
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
    return per_row if reduction == "none" else reduced(per_row, kept, reduction)
