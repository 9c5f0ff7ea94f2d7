"""ce_tvm in Hugging Face transformers' causal language models (optional extra
``transformers``).

- ``apply(model)``: the model's own causal-LM loss (transformers'
  ``ForCausalLMLoss``: labels shifted by one, ``-100`` ignored, the sum over
  ``num_items_in_batch`` when the Trainer passes it, ``shift_labels`` when
  given) runs on ``ce_tvm.cross_entropy``. It goes in through the
  ``loss_function`` attribute transformers' models expose; torch is not patched.
- ``apply(model, fused_linear=True)``: when labels are given, the forward
  computes the loss from the final hidden states with
  ``ce_tvm.linear_cross_entropy`` (the ``lm_head`` module, the family's logit
  scale and ``final_logit_softcapping`` inside the loss; a mixture of experts'
  load-balancing loss added as its stock forward adds it), so the logits never
  exist whole and ``outputs.logits`` is ``None``. Without labels the model's
  own forward runs. Families: ``FUSED_FAMILIES``.
- ``compute_loss_func()``: the same causal-LM loss for
  ``Trainer(compute_loss_func=...)``, from the logits the model returns.
- ``token_log_probs(model, input_ids, ...)``: per-position log-probs of the
  next tokens (and the entropy) at a temperature, for RL post-training: the
  model's body, then ``ce_tvm.linear_log_probs`` on the final hidden states
  (the family's logit scale and softcap applied), without logits, run inside the model's own
  call (so a ``fully_shard`` model gathers its parameters). Families:
  ``FUSED_FAMILIES``.

Loss options (keywords of all three): ``label_smoothing``,
``lse_square_scale`` (z-loss) and ``ignore_index``, as in ``ce_tvm.cross_entropy``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types

import torch
from torch import Tensor, nn

from ..distributed.heads import inside
from ..losses.cross_entropy import cross_entropy
from ..losses.linear import linear_cross_entropy
from ..losses.log_probs import linear_log_probs
from ..optional import guard
from ..runtime.options import LossOptions

with guard("transformers", "transformers", "ce_tvm.integrations.transformers"):
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.modeling_utils import slice_logits_to_keep
    from transformers.utils import can_return_tuple

LOSS_OPTIONS = ("label_smoothing", "lse_square_scale", "ignore_index")
# Causal-LM classes whose forward is: base model -> last_hidden_state ->
# slice_logits_to_keep -> lm_head (-> a logit scale, -> final_logit_softcapping) ->
# loss_function (-> + router_aux_loss_coef * the load-balancing loss, MoE).
FUSED_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                  "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
                  "Gemma3ForCausalLM", "GPT2LMHeadModel", "CohereForCausalLM",
                  "GraniteForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")


def _options(loss_options: dict) -> LossOptions:
    unknown = sorted(set(loss_options) - set(LOSS_OPTIONS))
    if unknown:
        raise TypeError(f"unknown loss option(s) {', '.join(unknown)}; "
                        f"the options are {', '.join(LOSS_OPTIONS)}")
    return LossOptions(ignore_index=loss_options.get("ignore_index", -100),
                       label_smoothing=loss_options.get("label_smoothing", 0.0),
                       zloss_scale=loss_options.get("lse_square_scale", 0.0))


def _causal_lm_loss(loss_of, labels: Tensor | None, shift_labels: Tensor | None,
                    num_items_in_batch, ignore_index: int, device: torch.device) -> Tensor:
    """transformers' ``ForCausalLMLoss`` around ``loss_of(target [N], reduction)``:
    the target is ``labels`` shifted left by one (or ``shift_labels``), the loss
    the mean over non-ignored tokens, or their sum over ``num_items_in_batch``."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(device)
    if num_items_in_batch is None:
        return loss_of(target, "mean")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(device)
    return loss_of(target, "sum") / num_items_in_batch


class CausalLMLoss:
    """A model's ``loss_function``: ``ForCausalLMLoss``'s arguments, the loss
    from ``ce_tvm.cross_entropy`` with the options given at construction (an
    ``ignore_index`` the model passes wins). Like ``ForCausalLMLoss`` it casts
    16-bit logits to float32 first, so the loss is float32 (a no-op for
    float32 models)."""

    def __init__(self, options: LossOptions):
        self.options = options

    def __call__(self, logits: Tensor, labels: Tensor | None, vocab_size: int,
                 num_items_in_batch=None, ignore_index: int | None = None,
                 shift_labels: Tensor | None = None, **kwargs) -> Tensor:
        ii = self.options.ignore_index if ignore_index is None else ignore_index
        logits = logits.float().reshape(-1, vocab_size)

        def loss_of(target, reduction):
            return cross_entropy(logits, target, ignore_index=ii, reduction=reduction,
                                 label_smoothing=self.options.label_smoothing,
                                 lse_square_scale=self.options.zloss_scale)

        return _causal_lm_loss(loss_of, labels, shift_labels, num_items_in_batch, ii,
                               logits.device)


def logit_scale(config) -> float:
    """The multiplier a family applies to its logits before the softcap, read as
    TRL reads it: ``logit_scale`` (Cohere), ``output_multiplier``,
    ``lm_head_multiplier`` (Falcon-H1), or ``logits_scaling`` (a divisor for
    Granite and MiniCPM3, a multiplier for HyperCLOVA X); 1 for the others."""
    text = config.get_text_config()
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if getattr(text, name, None) is not None:
            return float(getattr(text, name))
    scaling = getattr(text, "logits_scaling", None)
    if scaling is None:
        return 1.0
    return float(scaling) if text.model_type == "hyperclovax" else 1.0 / scaling


def _check_fused_family(model: nn.Module, caller: str = "apply(fused_linear=True)") -> type:
    """The ``FUSED_FAMILIES`` class ``model`` is (or a subclass of that keeps its
    forward), else a ``TypeError``."""
    family = next((cls for cls in type(model).__mro__ if cls.__name__ in FUSED_FAMILIES
                   and cls.__module__.startswith("transformers.")), None)
    if family is None:
        raise TypeError(f"{caller} supports {', '.join(FUSED_FAMILIES)} "
                        f"(and subclasses), not {type(model).__name__}"
                        + ("; apply(model) without fused_linear works for any causal LM"
                           if caller.startswith("apply") else ""))
    if type(model).forward is not family.forward:
        raise TypeError(f"{caller}: {type(model).__name__} overrides "
                        f"{family.__name__}.forward, whose head it would compute itself")
    return family


def _fused_forward(model: nn.Module, options: LossOptions, family: type):
    """The model's forward with the loss from the hidden states when labels are given
    (a mixture of experts' load-balancing loss added as the stock forward adds it)."""
    original = type(model).forward.__get__(model)
    balancing = getattr(sys.modules[family.__module__], "load_balancing_loss_func", None)
    names = _parameters(original)
    output_type = _output_type(original)

    # The stock forward's signature: the Trainer reads it to choose dataset columns.
    @functools.wraps(type(model).forward)
    @can_return_tuple
    def forward(self, *args, **kwargs):
        kwargs.update(zip(names, args))
        labels = kwargs.pop("labels", None)
        if labels is None:
            return original(**kwargs)
        logits_to_keep = kwargs.pop("logits_to_keep", 0)
        moe = hasattr(self, "router_aux_loss_coef")
        if moe and kwargs.get("output_router_logits") is None:
            kwargs["output_router_logits"] = self.config.output_router_logits
        outputs = getattr(self, self.base_model_prefix)(**kwargs)
        hidden = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        head = self.lm_head
        ii = kwargs.get("ignore_index", options.ignore_index)
        softcap = getattr(self.config, "final_logit_softcapping", None) or 0.0  # 0: none
        x = hidden.reshape(-1, hidden.shape[-1])

        def loss_of(target, reduction):  # the head as a module: sharded heads gather
            return linear_cross_entropy(x, head, target, ignore_index=ii, reduction=reduction,
                                        label_smoothing=options.label_smoothing,
                                        lse_square_scale=options.zloss_scale, softcap=softcap,
                                        logit_scale=logit_scale(self.config))

        loss = _causal_lm_loss(loss_of, labels, kwargs.get("shift_labels"),
                               kwargs.get("num_items_in_batch"), ii, x.device)
        kept = {name: getattr(outputs, name, None) for name in output_type.__dataclass_fields__
                if name not in ("loss", "logits")}
        if moe and kwargs["output_router_logits"]:
            kept["aux_loss"] = balancing(outputs.router_logits, self.num_experts,
                                         self.num_experts_per_tok, kwargs.get("attention_mask"))
            loss = loss + self.router_aux_loss_coef * kept["aux_loss"].to(loss.device)
        return output_type(loss=loss, logits=None, **kept)

    return types.MethodType(forward, model)


def _parameters(forward) -> list[str]:
    """The names ``forward`` takes positionally, in order (inspect follows the
    decorators' ``__wrapped__``)."""
    return [name for name, p in inspect.signature(forward).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _output_type(forward) -> type:
    """The ``ModelOutput`` class ``forward`` is annotated to return."""
    return inspect.signature(forward).return_annotation


def apply(model: nn.Module, fused_linear: bool = False, **loss_options) -> nn.Module:
    """Route ``model``'s causal-LM loss through ce_tvm; returns ``model``.

    ``fused_linear=False``: ``model.loss_function`` becomes ``CausalLMLoss``
    (any transformers model whose forward calls ``self.loss_function`` with
    ``ForCausalLMLoss``'s arguments). ``fused_linear=True``: the forward of
    a ``FUSED_FAMILIES`` model computes the loss with
    ``ce_tvm.linear_cross_entropy`` when labels are given and returns
    ``logits=None`` then. ``loss_options``: ``LOSS_OPTIONS``. Applying again
    replaces the previous settings.
    """
    options = _options(loss_options)
    if not hasattr(type(model), "loss_function"):
        raise TypeError(f"apply expects a transformers PreTrainedModel, got {type(model).__name__}")
    # transformers' own rule: a model without a known loss_type gets ForCausalLMLoss.
    loss_type = getattr(model, "loss_type", None)
    if LOSS_MAPPING.get(loss_type, ForCausalLMLoss) is not ForCausalLMLoss:
        raise TypeError(f"apply expects a causal language model, got {type(model).__name__} "
                        f"(its loss is {loss_type!r})")
    if fused_linear:
        model.forward = _fused_forward(model, options, _check_fused_family(model))
    else:
        model.__dict__.pop("forward", None)  # a previous fused apply
        model.loss_function = CausalLMLoss(options)
    return model


def compute_loss_func(**loss_options):
    """``Trainer(compute_loss_func=...)``: the causal-LM loss of the logits the
    model returns (labels shifted by one, ``num_items_in_batch`` as the
    Trainer passes it) on ``ce_tvm.cross_entropy``."""
    loss = CausalLMLoss(_options(loss_options))

    def causal_lm_loss(outputs, labels: Tensor, num_items_in_batch=None) -> Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        return loss(logits, labels, logits.shape[-1], num_items_in_batch=num_items_in_batch)

    return causal_lm_loss


def token_log_probs(model: nn.Module, input_ids: Tensor, *, attention_mask: Tensor | None = None,
                    index: Tensor | None = None, temperature: float = 1.0,
                    return_entropy: bool = False, ignore_index: int = -100, **model_kwargs):
    """Per-position log-probs of ``model`` (a ``FUSED_FAMILIES`` causal LM) at
    ``temperature``, with gradients, without the ``[B, T, V]`` logits: the
    model's body on ``input_ids`` (and ``attention_mask``, ``model_kwargs``),
    then ``ce_tvm.linear_log_probs`` on the final hidden states with the
    ``lm_head`` and the family's ``final_logit_softcapping``.

    By default position ``t`` holds ``log p(input_ids[t + 1] | input_ids[:t + 1])``
    (``[B, T]``; the last position, and any whose token or next token is
    padding by ``attention_mask``, is 0). ``index`` ``[B, T]`` or ``[B, T, K]``
    scores those tokens at each position instead (masked where
    ``attention_mask`` is 0; ``ignore_index`` entries are 0). With
    ``return_entropy=True`` returns ``(logp, entropy)``, the entropy ``[B, T]``
    of every position.
    """
    _check_fused_family(model, "token_log_probs")
    if attention_mask is not None:
        model_kwargs["attention_mask"] = attention_mask
    live = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
            else attention_mask != 0)
    if index is None:
        index = nn.functional.pad(input_ids[:, 1:], (0, 1), value=ignore_index)
        live = live & nn.functional.pad(live[:, 1:], (0, 1), value=False)
    softcap = getattr(model.config, "final_logit_softcapping", None) or 0.0  # 0: none

    def body_and_head(ids):
        hidden = getattr(model, model.base_model_prefix)(input_ids=ids,
                                                         **model_kwargs).last_hidden_state
        return linear_log_probs(hidden, model.lm_head, index, temperature=temperature,
                                softcap=softcap, logit_scale=logit_scale(model.config),
                                row_mask=live, ignore_index=ignore_index,
                                return_entropy=return_entropy)

    # inside the model's own call: a sharded (fully_shard) root gathers its parameters
    return inside(model, body_and_head, input_ids)
