"""ce_tvm under TRL's fused LM head (optional extra ``trl``).

TRL 1.16 gives every trainer that scores tokens (SFT, DPO, KTO, GRPO, RLOO) a
fused LM head: ``trl.trainer.utils.add_fused_lm_head`` patches the model's
forward, and ``model(..., labels=..., fused_lm_head=True)`` returns per-token
log-probs (and, on request, the entropy, ``log_sum_sq_probs``, ``mean_logits``
and ``is_top1``) computed by ``ChunkedLogProbFunction.apply(hidden, weight,
bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
outputs)`` without the ``[N, V]`` logits.

- ``apply()``: that call is computed by ``ce_tvm.linear_log_probs`` (its kernels,
  one sweep per chunk of rows for every output) for every model and trainer,
  with TRL's outputs and autograd contract: gradients of the log-probs and the
  entropy to the hidden states, the weight and the bias; the statistics
  without gradient. TRL's own code around it is unchanged: which positions are
  scored, the loss, the family's logit scale and softcap (read by TRL from
  the config), its FSDP gathering (``full_tensor``) and autocast.
- ``apply()`` also puts ce_tvm under TRL's distillation divergence:
  ``DistillationTrainer`` calls ``ChunkedDivergenceFunction.apply(student_hidden,
  student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
  beta, temperature, student_logit_scale, student_softcap, teacher_logit_scale,
  teacher_softcap)`` (a name of ``trl.trainer.distillation_trainer``) for the
  per-token divergence and student entropy; ``linear_distillation_loss``
  (``reduction="none"``) computes it, the gradient to the student only.
- ``apply()`` also computes GKD's loss: ``trl.experimental.gkd.GKDTrainer``
  calls its ``generalized_jsd_loss(student_logits, teacher_logits, labels, beta,
  temperature, reduction, num_items_in_batch)`` on materialised logits;
  ``distillation_loss`` computes it in one sweep (TRL's reductions over its
  per-element divergence; ``reduction="none"``, per element, stays TRL's).
- ``remove()``: TRL's own functions again.

Under DeepSpeed ZeRO-3 the head's weight is partitioned (``numel 0``) outside
its module's call and TRL gathers it for the fused call only
(``maybe_gather_lm_head_ctx``), which the backward must enter again: there the
calls compute as TRL's own functions do (``_Regathered``): the forward without
a graph inside the gather, the backward gathers the head again with TRL's own
context and recomputes the call with ce_tvm's autograd (one more forward sweep
than without ZeRO-3, as TRL's own backward recomputes its tiles).
A TRL version outside ``TESTED`` is an error, not a silent patch.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from ..losses.distillation import distillation_loss, linear_distillation_loss
from ..losses.log_probs import LogProbStats, linear_log_probs
from ..optional import guard

with guard("trl", "trl", "ce_tvm.integrations.trl"):
    import trl
    from trl.trainer import distillation_trainer as trl_distillation
    from trl.trainer import utils as trl_utils

TESTED = ("1.16.0", "1.17.0")  # [lowest, first untested)
STATISTICS = LogProbStats._fields  # log_sum_sq_probs, mean_logits, is_top1
_TRLS_OWN = trl_utils._ChunkedLogProbFunction
_TRLS_DIVERGENCE = trl_distillation.ChunkedDivergenceFunction


def _check_version() -> None:
    from packaging.version import Version

    low, high = TESTED
    if not Version(low) <= Version(trl.__version__) < Version(high):
        raise RuntimeError(f"ce_tvm.integrations.trl is tested with TRL >= {low}, < {high}; "
                           f"TRL {trl.__version__} is installed: its fused head may call "
                           f"something else. Install trl=={low} (the extra 'trl' pins it).")


def _zero3() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


class _Regathered(torch.autograd.Function):
    """``compute(*inputs)`` (a tuple of outputs, tensors or ``None``; the first
    ``differentiable`` carry gradients) with ZeRO-3's partitioned heads among
    ``inputs``: run inside ``gather(*inputs)`` (a context that gathers them) without
    a graph; the backward enters ``gather`` again and recomputes ``compute`` with
    autograd on the gathered tensors, as TRL's own backward does."""

    @staticmethod
    def forward(ctx, compute, gather, differentiable, *inputs):
        ctx.set_materialize_grads(False)
        ctx.compute, ctx.gather = compute, gather
        ctx.save_for_backward(*inputs)
        with gather(*inputs):
            outputs = tuple(compute(*inputs))
        ctx.mark_non_differentiable(*(t for t in outputs[differentiable:] if t is not None))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        with ctx.gather(*inputs), torch.enable_grad():
            leaves = [t.detach().requires_grad_() if t is not None and need else t
                      for t, need in zip(inputs, needs)]
            outputs = ctx.compute(*leaves)
            pairs = [(o, g) for o, g in zip(outputs, grads)
                     if o is not None and g is not None and o.requires_grad]
            wanted = [t for t in leaves if t is not None and t.requires_grad]
            found = (torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                         allow_unused=True)
                     if pairs and wanted else [None] * len(wanted))
        found = iter(found)
        return (None, None, None,
                *(next(found) if t is not None and t.requires_grad else None for t in leaves))


def _zero3_head(*params):
    """TRL's own gather of ZeRO-3 head parameters (a null context when gathered)."""
    return trl_utils.maybe_gather_lm_head_ctx(*params)


class ChunkedLogProb:
    """TRL's ``ChunkedLogProbFunction`` interface, computed by ``linear_log_probs``."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size,
              final_logit_softcapping=None, logit_scale=1.0,
              outputs=("log_probs", "entropy", *STATISTICS)):
        """``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)`` of the
        rows ``hidden [N, H] @ weight.T + bias`` at ``targets [N]`` (``None``
        for an output not in ``outputs``); ``chunk_size`` (TRL's vocabulary
        tile) has no use here: ce_tvm goes through rows, not columns."""
        dtype = (torch.get_autocast_dtype(hidden.device.type)
                 if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype)
        cast = (lambda t: None if t is None else t.to(dtype))  # noqa: E731
        wanted = [name for name in STATISTICS if name in outputs]

        def compute(hidden, weight, bias, targets):
            with torch.autocast(hidden.device.type, enabled=False):
                result = linear_log_probs(
                    cast(hidden), cast(weight), targets, linear_bias=cast(bias),
                    temperature=float(temperature),
                    softcap=float(final_logit_softcapping or 0.0),
                    logit_scale=float(logit_scale), return_entropy="entropy" in outputs,
                    return_stats=bool(wanted))
            result = list(result) if isinstance(result, tuple) else [result]
            stats = result.pop() if wanted else None
            entropy = result[1] if "entropy" in outputs else None
            return (result[0], entropy,
                    *(getattr(stats, name) if name in wanted else None for name in STATISTICS))

        if _zero3():
            return _Regathered.apply(compute, lambda h, w, b, t: _zero3_head(w, b), 2,
                                     hidden, weight, bias, targets)
        return compute(hidden, weight, bias, targets)


class ChunkedDivergence:
    """TRL's ``ChunkedDivergenceFunction`` interface, computed by
    ``linear_distillation_loss``."""

    @staticmethod
    def apply(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
              teacher_bias, beta, temperature=1.0, student_logit_scale=1.0,
              student_final_logit_softcapping=None, teacher_logit_scale=1.0,
              teacher_final_logit_softcapping=None):
        """``(divergence[N], entropy[N])`` (float32) of the rows of both heads;
        the divergence's gradient reaches the student's hidden states, weight
        and bias, the entropy has none."""
        device = student_hidden.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else student_hidden.dtype)
        cast = (lambda t: None if t is None else t.to(dtype))  # noqa: E731

        def compute(student_hidden, student_weight, student_bias, teacher_hidden,
                    teacher_weight, teacher_bias):
            with torch.autocast(device, enabled=False):
                loss, entropy = linear_distillation_loss(
                    cast(student_hidden), cast(student_weight), cast(teacher_hidden),
                    cast(teacher_weight), student_bias=cast(student_bias),
                    teacher_bias=cast(teacher_bias), beta=float(beta),
                    temperature=float(temperature),
                    student_logit_scale=float(student_logit_scale),
                    teacher_logit_scale=float(teacher_logit_scale),
                    student_softcap=float(student_final_logit_softcapping or 0.0),
                    teacher_softcap=float(teacher_final_logit_softcapping or 0.0),
                    reduction="none", return_entropy=True)
            return loss.float(), entropy.float()

        if _zero3():
            def gather(sh, sw, sb, th, tw, tb):  # as TRL's own: each head on its own
                stack = contextlib.ExitStack()
                stack.enter_context(_zero3_head(sw, sb))
                stack.enter_context(_zero3_head(tw, tb))
                return stack

            return _Regathered.apply(compute, gather, 1, student_hidden, student_weight,
                                     student_bias, teacher_hidden, teacher_weight, teacher_bias)
        return compute(student_hidden, student_weight, student_bias, teacher_hidden,
                       teacher_weight, teacher_bias)


@functools.cache
def _gkd() -> tuple[type, staticmethod]:
    """TRL's ``GKDTrainer`` and its own ``generalized_jsd_loss``, read before
    ``apply()`` replaces it (imported on first use: ``trl.experimental`` warns
    on import and takes seconds)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*trl.experimental")
        from trl.experimental.gkd import GKDTrainer
    return GKDTrainer, GKDTrainer.__dict__["generalized_jsd_loss"]


def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5,
                         temperature=1.0, reduction="batchmean", num_items_in_batch=None):
    """TRL's ``GKDTrainer.generalized_jsd_loss``, its arguments and value: the
    divergence summed over the vocabulary and the positions whose ``labels``
    are not -100 (``distillation_loss``), divided as TRL divides its
    per-element divergence: by ``num_items_in_batch`` when given, else
    ``batchmean`` by the kept positions (the first dimension without labels),
    ``mean`` by the kept elements, ``sum`` not at all; the gradient to the
    student only. ``reduction="none"`` (per element) is TRL's own."""
    if num_items_in_batch is None and reduction not in ("batchmean", "mean", "sum"):
        return _gkd()[1].__func__(
            student_logits, teacher_logits, labels, beta, temperature, reduction)
    total = distillation_loss(student_logits, teacher_logits, labels, beta=float(beta),
                              temperature=float(temperature), reduction="sum")
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    if labels is None:  # TRL's batchmean then divides by the first dimension
        kept, batch = student_logits.shape[:-1].numel(), max(student_logits.shape[0], 1)
    else:
        kept = (labels != -100).sum()
        batch = kept.clamp_min(1)
    return total / (kept * student_logits.shape[-1] if reduction == "mean" else batch)


def apply() -> None:
    """Compute TRL's fused LM head, its distillation divergence and GKD's loss
    with ce_tvm, for every model and trainer, until ``remove()``; applying twice
    is the same as once."""
    _check_version()
    trl_utils._ChunkedLogProbFunction = ChunkedLogProb
    trl_distillation.ChunkedDivergenceFunction = ChunkedDivergence
    _gkd()[0].generalized_jsd_loss = staticmethod(generalized_jsd_loss)


def remove() -> None:
    """TRL's own fused LM head, divergence and GKD loss again."""
    trl_utils._ChunkedLogProbFunction = _TRLS_OWN
    trl_distillation.ChunkedDivergenceFunction = _TRLS_DIVERGENCE
    gkd, trls_own = _gkd()
    gkd.generalized_jsd_loss = trls_own
