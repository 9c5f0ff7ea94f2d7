"""Full-vocabulary distillation: the divergence of a student's and a teacher's heads
(``linear_distillation_loss``, fused with both heads: neither model's ``[N, V]`` logits
exist whole) or logits (``distillation_loss``), as ``torch.library`` ops
(``ce_tvm::linear_distillation``, ``ce_tvm::distillation`` and their backwards;
docs/distillation.md, docs/spec.md section 15).

``mean``/``sum`` compute the student's gradients in the forward's sweep
(``autograd.ForwardGradients``: the first backward consumes them unless
``allow_retain_graph``); ``none`` keeps the inputs and sweeps again in the backward. A
student head given as a module is routed by ``ce_tvm.distributed.heads`` (run inside
its own call under FSDP / ZeRO-3); the teacher, which takes no gradient, is used whole
however it is sharded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..distributed import heads
from ..runtime import launch, linear_sweep, pool
from ..runtime.linear_sweep import Needs
from ..runtime.options import DivergenceOptions
from ..runtime.tensors import accum_torch_dtype
from . import checks as check
from .autograd import ForwardGradients, custom_op, head_gradients, op_gradients
from .outputs import grad_like

REDUCTIONS = ("mean", "sum", "none")


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def reduced(per_row: Tensor, kept: Tensor, reduction: str) -> Tensor:
    """``sum`` of the per-position losses, or for ``mean`` over the counted
    positions (0 when none counts, as TRL has it)."""
    total = per_row.sum()
    return total / kept.sum().clamp(min=1) if reduction == "mean" else total


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
    return (per_row if reduction == "none" else reduced(per_row, kept, reduction)), ent * kept


def _loss_like(x: Tensor, reduction: str) -> tuple[Tensor, Tensor]:
    """Empty ``(loss, entropy)`` of the forward ops, for ``x [N, ...]`` (the fakes)."""
    acc, n = accum_torch_dtype(x), x.shape[0]
    return x.new_empty((n,) if reduction == "none" else (), dtype=acc), x.new_empty(n, dtype=acc)


@custom_op("ce_tvm::linear_distillation", mutates_args=())
def linear_distillation_forward(
        student_input: Tensor, student_weight: Tensor, student_bias: Tensor | None,
        teacher_input: Tensor, teacher_weight: Tensor, teacher_bias: Tensor | None,
        kept: Tensor, reduction: str, kind: str, beta: float, student_softcap: float,
        student_inv_temperature: float, teacher_softcap: float,
        teacher_inv_temperature: float, chunk_rows: int, grad_input: bool, grad_weight: bool,
        grad_bias: bool, allow_retain_graph: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, entropy, grad_input, grad_weight, grad_bias)`` of the heads
    ``student_input [N, Hs] @ student_weight.T + student_bias`` and the
    teacher's (same dtype), ``kept [N]`` (accumulation dtype) 1 where a
    position counts; the scalars are ``DivergenceOptions``' fields.

    ``loss``: ``[N]`` for ``none``, else 0-d; ``entropy [N]``. For
    ``mean``/``sum`` the student's gradients of a unit upstream gradient, from
    the same sweep, for each flag set; an empty tensor for each other one (and
    all three for ``none``). ``chunk_rows`` 0: the default
    (``linear_sweep.chunk_rows``). ``allow_retain_graph`` only changes the backward
    (``autograd.ForwardGradients``)."""
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
      teacher_inv_temperature, chunk_rows, grad_input, grad_weight, grad_bias,
      allow_retain_graph):
    scalar = reduction != "none"
    return (*_loss_like(student_input, reduction),
            *(grad_like(like, scalar and wanted, student_input) for like, wanted in
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
    return tuple(grad_like(like, wanted, student_input) for like, wanted in
                 ((student_input, grad_input), (student_weight, grad_weight),
                  (student_bias, grad_bias)))


def _setup_linear_context(ctx, inputs, output):
    (xs, Ws, bs, xt, Wt, bt, kept, reduction, *options, grad_input, grad_weight, grad_bias,
     retain) = inputs
    ctx.reduction, ctx.needs = reduction, (grad_input, grad_weight, grad_bias)
    if reduction == "none":
        ctx.save_for_backward(xs, Ws, bs, xt, Wt, bt, kept)
        ctx.options = tuple(options)  # the scalars and chunk_rows
    else:
        ctx.grads = ForwardGradients(output[2:], allow_retain_graph=retain,
                                     entry="ce_tvm.linear_distillation_loss")
    ctx.mark_non_differentiable(*output[1:])  # the entropy, the gradients
    ctx.set_materialize_grads(False)


def _linear_backward(ctx, grad_loss, *_):
    if grad_loss is None:
        return op_gradients(linear_distillation_forward)
    if ctx.reduction == "none":
        xs, Ws, bs, xt, Wt, bt, kept = ctx.saved_tensors
        grads = linear_distillation_backward(_row_upstream(grad_loss, kept), xs, Ws, bs, xt,
                                             Wt, bt, *ctx.options, *ctx.needs)
    else:
        grads = ctx.grads.scaled(grad_loss)
    return head_gradients(linear_distillation_forward, grads, ctx.needs,
                          ("student_input", "student_weight", "student_bias"))


linear_distillation_forward.register_autograd(_linear_backward,
                                              setup_context=_setup_linear_context)


def _local(what: str, *tensors) -> None:
    """A ``ValueError`` for DTensor rows (inputs, logits): never a guess."""
    if any(check.is_dtensor(t) for t in tensors):
        raise ValueError(
            f"the {what} is a DTensor: the distillation losses take each rank's own rows as "
            f"plain tensors (sequence- or tensor-parallel rows are not supported); pass "
            f".to_local() for data-parallel rows")


def _dtensor_student(student_input, student_weight, student_bias, *args, **kwargs):
    """``heads.run``'s DTensor route for the student: refused, with the readings.
    A DTensor weight beside plain rows has two (``ValueError``); DTensor rows, one
    that is not supported."""
    if not check.is_dtensor(student_weight):
        _local("student's input", student_input)
    raise ValueError(
        f"the student's head weight is a DTensor {tuple(student_weight.placements)} beside "
        f"plain rows, which has two readings; ce_tvm does not guess. (1) Data parallel (FSDP2 "
        f"fully_shard, FSDP, ZeRO-3 shard it outside the head's forward): pass the head "
        f"module, linear_distillation_loss(hidden, model.lm_head, teacher_hidden, "
        f"teacher.lm_head, target), so the loss runs inside its call, where the weight "
        f"is gathered and its gradient reduced. (2) Tensor parallel (a vocabulary-sharded "
        f"student head, also what the module's call holds under FSDP x TP): not supported "
        f"by the distillation losses yet; every rank has the same rows there, so "
        f"weight.full_tensor() gives the right loss and gradients")


def linear_distillation_loss(student_input: Tensor, student_weight, teacher_input: Tensor,
                             teacher_weight, target: Tensor | None = None, *,
                             student_bias: Tensor | None = None,
                             teacher_bias: Tensor | None = None, beta: float = 0.5,
                             temperature: float = 1.0, student_logit_scale: float = 1.0,
                             teacher_logit_scale: float = 1.0, student_softcap: float = 0.0,
                             teacher_softcap: float = 0.0, ignore_index: int = -100,
                             reduction: str = "mean", return_entropy: bool = False,
                             chunk_rows: int | None = None, allow_retain_graph: bool = False):
    """The divergence between a student's and a teacher's LM heads, fused with
    both heads: neither model's ``[N, V]`` logits exist whole.

    ``student_input [*, Hs]``, ``student_weight [V, Hs]`` (or the head module),
    ``teacher_input [*, Ht]``, ``teacher_weight [V, Ht]`` (or the head module):
    the vocabularies must align, the widths may differ. Sharded heads: the
    student's module under FSDP / ZeRO-3 runs the loss inside its own call
    (gathered there, its gradient reduced); a DTensor student weight is a
    ``ValueError`` (data or tensor parallel: two readings). The teacher, which
    takes no gradient, is used whole however it is sharded
    (``heads.whole_frozen_head``). Each side's distribution is
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
    (default as ``linear_cross_entropy``'s). For ``mean``/``sum`` the backward
    consumes gradients computed in the forward, so a second backward through the
    same graph needs ``allow_retain_graph=True``.
    """
    check_reduction(reduction)
    opts = DivergenceOptions.checked(
        beta=beta, temperature=temperature, student_logit_scale=student_logit_scale,
        teacher_logit_scale=teacher_logit_scale, student_softcap=student_softcap,
        teacher_softcap=teacher_softcap)
    Wt, bt = heads.whole_frozen_head(teacher_weight, teacher_bias)
    return heads.run(student_input, student_weight, student_bias, _fused, _dtensor_student,
                     teacher_input, Wt, bt, target, scalars=opts.op_scalars(),
                     ignore_index=ignore_index, reduction=reduction,
                     return_entropy=return_entropy, chunk_rows=chunk_rows,
                     allow_retain_graph=allow_retain_graph)


def _fused(student_input: Tensor, Ws: Tensor, bs: Tensor | None, teacher_input: Tensor,
           Wt: Tensor, bt: Tensor | None, target: Tensor | None, *, scalars: tuple,
           ignore_index: int, reduction: str, return_entropy: bool, chunk_rows: int | None,
           allow_retain_graph: bool):
    """``linear_distillation_loss`` of plain tensors, the teacher's head whole
    (``heads.run``'s local route); ``scalars``: ``DivergenceOptions``' fields."""
    _local("student's input", student_input)
    _local("teacher's input", teacher_input)
    student_input, Ws, bs = check.head_dtypes(student_input, Ws, bs)
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
        *scalars, chunk_rows or 0, needs.input, needs.weight, needs.bias,
        bool(allow_retain_graph))
    if reduction == "none":
        loss = loss.reshape(lead)
    return (loss, ent.reshape(lead)) if return_entropy else loss


@custom_op("ce_tvm::distillation", mutates_args=())
def distillation_forward(student: Tensor, teacher: Tensor, kept: Tensor, reduction: str,
                         kind: str, beta: float, student_softcap: float,
                         student_inv_temperature: float, teacher_softcap: float,
                         teacher_inv_temperature: float, grad: bool, allow_retain_graph: bool
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, entropy, grad)`` of the logits ``student``, ``teacher`` ``[N, V]``
    (one dtype) in one launch, ``kept`` and the scalars as
    ``linear_distillation_forward``'s. ``grad``: for ``mean``/``sum`` also the
    student logits' gradient of a unit upstream gradient (in a buffer of its
    own); else an empty tensor. ``allow_retain_graph`` only changes the backward."""
    opts = DivergenceOptions(kind, beta, student_softcap, student_inv_temperature,
                             teacher_softcap, teacher_inv_temperature)
    grad = grad and reduction != "none"
    buf = pool.empty_like(student) if grad else student.new_empty(0)
    div, ent = launch.divergence(student, teacher, _upstream(kept, reduction) if grad else kept,
                                 opts, grad_out=buf if grad else None)
    return *_outputs(div, ent, kept, reduction), buf


@distillation_forward.register_fake
def _(student, teacher, kept, reduction, kind, beta, student_softcap, student_inv_temperature,
      teacher_softcap, teacher_inv_temperature, grad, allow_retain_graph):
    return (*_loss_like(student, reduction),
            grad_like(student, grad and reduction != "none", student))


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
    s, t, kept, reduction, *scalars, _, retain = inputs
    ctx.reduction = reduction
    if reduction == "none":
        ctx.save_for_backward(s, t, kept)
        ctx.options = tuple(scalars)
    else:
        ctx.grads = ForwardGradients(output[2:], allow_retain_graph=retain,
                                     entry="ce_tvm.distillation_loss")
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, *_):
    if grad_loss is None:
        return op_gradients(distillation_forward)
    if ctx.reduction == "none":
        s, t, kept = ctx.saved_tensors
        grad = distillation_backward(_row_upstream(grad_loss, kept), s, t, *ctx.options)
    else:
        (grad,) = ctx.grads.scaled(grad_loss)
    return op_gradients(distillation_forward, student=grad)


distillation_forward.register_autograd(_backward, setup_context=_setup_context)


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor,
                      target: Tensor | None = None, *, beta: float = 0.5,
                      temperature: float = 1.0, student_logit_scale: float = 1.0,
                      teacher_logit_scale: float = 1.0, student_softcap: float = 0.0,
                      teacher_softcap: float = 0.0, ignore_index: int = -100,
                      reduction: str = "mean", return_entropy: bool = False,
                      allow_retain_graph: bool = False):
    """``linear_distillation_loss`` on materialised logits ``[*, V]`` (one kernel
    launch over all rows; the student's gradient in a buffer of its own, never
    in the caller's tensor). Same options and outputs."""
    check_reduction(reduction)
    opts = DivergenceOptions.checked(
        beta=beta, temperature=temperature, student_logit_scale=student_logit_scale,
        teacher_logit_scale=teacher_logit_scale, student_softcap=student_softcap,
        teacher_softcap=teacher_softcap)
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
    loss, ent, _ = distillation_forward(s, t, kept, reduction, *opts.op_scalars(), grad,
                                        bool(allow_retain_graph))
    if reduction == "none":
        loss = loss.reshape(lead)
    return (loss, ent.reshape(lead)) if return_entropy else loss
