"""TRL 1.16's fused LM head computed by ce_tvm (``ce_tvm.integrations.trl``).

Through TRL's public path: ``add_fused_lm_head(model, ...)``, then
``model(input_ids, labels=..., fused_lm_head=True)``, once with TRL's own head and
once after ``apply()``: every output and every parameter's gradient equal, for
Llama, Gemma 2 (softcap), Cohere (``logit_scale``) and Granite
(``logits_scaling``), at temperatures 1 and 0.7, with masked labels; the
profiler shows ce_tvm's op ran; ``remove()`` restores TRL's own.
"""

import pytest
import torch
import transformers
from trl.kernels import ChunkedLogProbFunction
from trl.trainer import utils as trl_utils
from trl.trainer.utils import add_fused_lm_head

from ce_tvm.integrations import trl as cetrl

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", SMALL),
    # large weights and a small cap, so that tanh bends the logits of a tiny model
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               dict(SMALL, initializer_range=1.0, final_logit_softcapping=10.0)),
    "cohere": ("CohereForCausalLM", "CohereConfig", dict(SMALL, logit_scale=0.0625)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(SMALL, logits_scaling=8.0)),
}
OUTPUTS = ("log_probs", "entropy", *cetrl.STATISTICS)


def build(family: str):
    model_name, config_name, arguments = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**arguments)
    return getattr(transformers, model_name)(config).eval()


def step(model, ids, labels):
    """The fused head's outputs and every parameter's gradient of the loss plus
    a tenth of the entropy (both differentiable outputs)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    (out.loss + 0.1 * out.entropy.sum()).backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("family", FAMILIES)
def test_trls_fused_head_on_ce_tvm_equals_trls_own(family, temperature):
    model = build(family)
    add_fused_lm_head(model, temperature=temperature, outputs=OUTPUTS)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 11), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[2, 7:] = -100  # padding
    expected, expected_grads = step(model, ids, labels)
    cetrl.apply()
    try:
        with torch.profiler.profile() as trace:
            out, grads = step(model, ids, labels)
    finally:
        cetrl.remove()
    assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction
    ran = {event.key for event in trace.key_averages()}
    # the forward with the statistics TRL asked for, then the backward
    assert {"ce_tvm::linear_log_probs_stats", "ce_tvm::linear_log_probs_backward"} <= ran, ran
    for name in ("loss", "log_probs", "entropy", *OUTPUTS[2:]):
        actual, reference = getattr(out, name), getattr(expected, name)
        if reference.dtype == torch.bool:
            assert torch.equal(actual, reference), name
        else:
            torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(out.label_mask, expected.label_mask)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_an_untested_trl_version_is_refused(monkeypatch):
    monkeypatch.setattr(cetrl.trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError, match=r"tested with TRL >= 1\.16\.0, < 1\.17\.0"):
        cetrl.apply()
    assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction
