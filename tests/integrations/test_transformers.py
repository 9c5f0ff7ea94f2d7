"""ce_tvm.integrations.transformers against the stock transformers models.

Tiny models built from configs (no downloads), one vocabulary for all of them
(kernels are compiled once per vocabulary). The reference is the stock model
itself: its loss (``ForCausalLMLoss`` on ``F.cross_entropy``) and the gradient
of every parameter, and for the loss options ``F.cross_entropy`` on its logits.
"""

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from ce_tvm.integrations import transformers as cehf

pytestmark = pytest.mark.slow  # whole (tiny) models trained; the example in a process

VOCAB = 96
TOL = dict(rtol=1e-5, atol=1e-6)
ROOT = Path(__file__).resolve().parents[2]

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
CAPPED = dict(SMALL, initializer_range=1.0)
# family -> (model class, config class, config arguments); every one has an lm_head
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", SMALL),
    "mistral": ("MistralForCausalLM", "MistralConfig", SMALL),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", SMALL),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", SMALL),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", SMALL),
    # Large weights and a small cap, so that tanh bends the logits of a tiny model.
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(CAPPED, final_logit_softcapping=10.0)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(CAPPED, final_logit_softcapping=10.0)),
    "gemma2-nocap": ("Gemma2ForCausalLM", "Gemma2Config",
                     dict(CAPPED, final_logit_softcapping=None)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0)),
    # logit scales: a multiplier (Cohere), a divisor (Granite)
    "cohere": ("CohereForCausalLM", "CohereConfig", dict(SMALL, logit_scale=0.0625)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(SMALL, logits_scaling=8.0)),
    # mixtures of experts: the load-balancing loss is part of the loss
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(SMALL, num_local_experts=4, num_experts_per_tok=2,
                     output_router_logits=True, router_aux_loss_coef=0.02)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       output_router_logits=True, router_aux_loss_coef=0.02)),
}


def build(family: str, seed: int = 0):
    model_name, config_name, arguments = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**arguments)
    return getattr(transformers, model_name)(config).eval()


def batch(seed: int = 1, rows: int = 3, length: int = 11):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100   # a prompt
    labels[2, 7:] = -100   # padding
    return ids, labels


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


def assert_same_step(stock, patched, **inputs):
    """Loss and every parameter's gradient of ``patched`` equal ``stock``'s."""
    expected, expected_grads = loss_and_grads(stock, **inputs)
    out, grads = loss_and_grads(patched, **inputs)
    torch.testing.assert_close(out.loss, expected.loss, **TOL)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert grad is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return out


FUSED = [pytest.param(False, id="loss_function"), pytest.param(True, id="fused_linear")]


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("num_items", [None, 13], ids=["mean", "num_items_in_batch"])
def test_loss_and_every_gradient_equal_stock(family, fused, num_items):
    stock = build(family)
    patched = cehf.apply(copy.deepcopy(stock), fused_linear=fused)
    ids, labels = batch()
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    out = assert_same_step(stock, patched, input_ids=ids, labels=labels, **extra)
    if "router_aux_loss_coef" in FAMILIES[family][2]:  # kept, as the stock forward keeps it
        assert out.aux_loss is not None and float(out.aux_loss) > 0
    if fused:
        assert out.logits is None
    else:
        torch.testing.assert_close(out.logits, stock(input_ids=ids).logits, **TOL)


@pytest.mark.parametrize("family", ["gemma2", "gpt2"])  # softcap; tied embedding and head
def test_fused_in_several_chunks(family, monkeypatch):
    """The rows go through linear_cross_entropy's sweep 7 at a time (33 rows)."""
    monkeypatch.setenv("CE_TVM_LINEAR_CHUNK_ROWS", "7")
    stock = build(family)
    patched = cehf.apply(copy.deepcopy(stock), fused_linear=True)
    ids, labels = batch()
    assert_same_step(stock, patched, input_ids=ids, labels=labels,
                     num_items_in_batch=torch.tensor(13))


def test_the_cap_of_the_tiny_gemma_matters():
    """Gemma2's cap of 10 changes the loss (so the softcap cases test it), and
    the fused loss follows it."""
    ids, labels = batch()
    capped, uncapped = build("gemma2"), build("gemma2-nocap")
    loss = capped(input_ids=ids, labels=labels).loss
    assert abs(loss - uncapped(input_ids=ids, labels=labels).loss) > 1.0
    fused = cehf.apply(copy.deepcopy(capped), fused_linear=True)
    torch.testing.assert_close(fused(input_ids=ids, labels=labels).loss, loss, **TOL)


def autograd_nodes(loss) -> list:
    nodes, seen = [loss.grad_fn], []
    while nodes:
        node = nodes.pop()
        seen.append(type(node).__name__)
        nodes += [n for n, _ in node.next_functions if n is not None]
    return seen


@pytest.mark.parametrize("fused, op", [(False, "_ce_tvm_cross_entropy_train_"),
                                       (True, "_ce_tvm_linear_cross_entropy_")])
def test_the_loss_runs_on_ce_tvm(fused, op):
    """The stock loss's graph holds torch's NllLoss; ours ce_tvm's op and no NllLoss."""
    ids, labels = batch()
    stock = build("llama")
    assert any("Nll" in n for n in autograd_nodes(stock(input_ids=ids, labels=labels).loss))
    patched = cehf.apply(copy.deepcopy(stock), fused_linear=fused)
    nodes = autograd_nodes(patched(input_ids=ids, labels=labels).loss)
    assert not any("Nll" in n for n in nodes)
    assert any(op in n for n in nodes), nodes


@pytest.mark.parametrize("fused", FUSED)
def test_shift_labels_and_tuple_output(fused):
    stock = build("qwen3")
    patched = cehf.apply(copy.deepcopy(stock), fused_linear=fused)
    ids, labels = batch()
    shift = torch.roll(labels, -2, dims=1)
    assert_same_step(stock, patched, input_ids=ids, labels=labels, shift_labels=shift)
    expected = stock(input_ids=ids, labels=labels, return_dict=False)
    got = patched(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(got, tuple)
    torch.testing.assert_close(got[0], expected[0], **TOL)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fused_model_without_labels_is_unchanged(family):
    stock = build(family)
    patched = cehf.apply(copy.deepcopy(stock), fused_linear=True)
    ids, _ = batch()
    torch.testing.assert_close(patched(input_ids=ids).logits, stock(input_ids=ids).logits)
    torch.testing.assert_close(patched(ids).logits, stock(ids).logits)


def reference_loss(logits, labels, num_items=None, ignore_index=-100, label_smoothing=0.0,
                   lse_square_scale=0.0):
    """transformers' causal-LM loss with PyTorch's label smoothing, plus z-loss."""
    target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)
    x = logits.reshape(-1, logits.shape[-1]).double()
    loss = F.cross_entropy(x, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction="sum")
    kept = target != ignore_index
    loss = loss + lse_square_scale * (torch.logsumexp(x[kept], -1) ** 2).sum()
    return loss / (kept.sum() if num_items is None else num_items)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("num_items", [None, 13], ids=["mean", "num_items_in_batch"])
def test_loss_options(fused, num_items):
    stock = build("llama")
    options = dict(label_smoothing=0.1, lse_square_scale=1e-2, ignore_index=-1)
    patched = cehf.apply(copy.deepcopy(stock), fused_linear=fused, **options)
    ids, labels = batch()
    labels[labels == -100] = -1
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    loss = patched(input_ids=ids, labels=labels, **extra).loss
    logits = stock(input_ids=ids).logits
    expected = reference_loss(logits, labels, num_items, **options)
    torch.testing.assert_close(loss.double(), expected, **TOL)


def test_bad_options_are_clear_errors():
    model = build("llama")
    with pytest.raises(TypeError, match="unknown loss option.*reduction.*label_smoothing"):
        cehf.apply(model, reduction="sum")
    with pytest.raises(ValueError, match="label_smoothing"):
        cehf.apply(model, label_smoothing=1.5)
    with pytest.raises(TypeError, match="ignore_index"):
        cehf.apply(model, ignore_index=1.5)
    with pytest.raises(TypeError, match="unknown loss option"):
        cehf.compute_loss_func(smoothing=0.1)
    with pytest.raises(TypeError, match="transformers PreTrainedModel"):
        cehf.apply(torch.nn.Linear(2, 2))
    classifier = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32))
    with pytest.raises(TypeError, match="causal language model.*BertForSequenceClassification"):
        cehf.apply(classifier)


def test_unsupported_family_is_a_clear_error():
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                    ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16)
    model = transformers.OPTForCausalLM(config).eval()
    with pytest.raises(TypeError, match="supports LlamaForCausalLM.*GPT2LMHeadModel.*not "
                                        "OPTForCausalLM"):
        cehf.apply(model, fused_linear=True)
    assert cehf.apply(model) is model  # the loss_function route works for any causal LM
    ids, labels = batch()
    stock = transformers.OPTForCausalLM(config).eval()
    stock.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss,
                               stock(input_ids=ids, labels=labels).loss, **TOL)


def test_subclass_that_overrides_forward_is_refused():
    class Custom(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = Custom(build("llama").config)
    with pytest.raises(TypeError, match="Custom overrides LlamaForCausalLM.forward"):
        cehf.apply(model, fused_linear=True)

    class Plain(transformers.LlamaForCausalLM):
        pass

    ids, labels = batch()
    plain = cehf.apply(Plain(build("llama").config), fused_linear=True)
    assert plain(input_ids=ids, labels=labels).logits is None


def test_apply_again_replaces_the_mode():
    stock = build("llama")
    model = cehf.apply(copy.deepcopy(stock), fused_linear=True)
    cehf.apply(model)
    ids, labels = batch()
    out = assert_same_step(stock, model, input_ids=ids, labels=labels)
    assert out.logits is not None


@pytest.mark.parametrize("fused", FUSED)
def test_torch_compile_of_the_patched_model(fused):
    stock = build("llama")
    patched = cehf.apply(copy.deepcopy(stock), fused_linear=fused)
    compiled = torch.compile(patched, backend="aot_eager", fullgraph=True)  # no graph break
    ids, labels = batch()
    expected, expected_grads = loss_and_grads(stock, input_ids=ids, labels=labels)
    out = compiled(input_ids=ids, labels=labels)
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, **TOL)
    for name, p in patched.named_parameters():
        torch.testing.assert_close(p.grad, expected_grads[name], **TOL)


def train_losses(model, tmp_path, **trainer_args):
    """The losses a few Trainer steps log (2 micro-batches per step)."""
    ids, labels = batch(rows=8, length=9)
    data = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=3, logging_steps=1, learning_rate=1e-2, report_to=[], save_strategy="no",
        use_cpu=True, seed=0, dataloader_drop_last=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, **trainer_args)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_logs_the_same_losses(tmp_path):
    stock = train_losses(build("llama").train(), tmp_path)
    assert len(stock) == 3
    for fused in (False, True):
        model = cehf.apply(build("llama").train(), fused_linear=fused)
        assert train_losses(model, tmp_path) == pytest.approx(stock, rel=1e-5)
    ours = train_losses(build("llama").train(), tmp_path,
                        compute_loss_func=cehf.compute_loss_func())
    assert ours == pytest.approx(stock, rel=1e-5)


def test_trainer_example_curves_agree():
    """examples/train_tiny_trainer.py: stock, apply and fused agree to 1e-5."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "train_tiny_trainer.py"),
                           "--steps", "3", "--check"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "largest relative difference from stock over 3 steps" in done.stdout


@pytest.mark.slow
def test_fused_step_memory_at_most_a_third_of_stock():
    """A tiny Llama with Llama 3's vocabulary (128256), 1024 tokens: the extra peak
    memory of a training step (beyond the parameters' gradients), each method in
    a fresh process (benchmarks/hf_train_step.py, memory only)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hf_train_step.py"), "--vocab", "128256",
         "--tokens", "1024", "--methods", "stock,fused_linear", "--reps", "0"],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(done.stdout.splitlines()[-1])["peaks"]
    stock, fused = peaks["stock"], peaks["fused_linear"]
    assert fused["loss"] == pytest.approx(stock["loss"], rel=1e-5)
    assert stock["extra_peak_mb"] > 1000  # the logits alone are 501 MB
    assert fused["extra_peak_mb"] <= stock["extra_peak_mb"] / 3, peaks


@pytest.mark.parametrize("fused", FUSED)
def test_bfloat16_model_is_close_to_stock(fused):
    """A bfloat16 model. ``apply``: the float32 loss of the logits cast to float32,
    like stock. Fused: the logits are bfloat16 chunks and the loss comes back in
    bfloat16 (ce_tvm's output dtype), so it agrees to bfloat16's rounding."""
    stock = build("llama").to(torch.bfloat16)
    patched = cehf.apply(copy.deepcopy(stock), fused_linear=fused)
    ids, labels = batch()
    expected, expected_grads = loss_and_grads(stock, input_ids=ids, labels=labels)
    out, grads = loss_and_grads(patched, input_ids=ids, labels=labels)
    assert expected.loss.dtype == torch.float32
    assert out.loss.dtype == (torch.bfloat16 if fused else torch.float32)
    tol = dict(rtol=2 ** -8, atol=0) if fused else TOL
    torch.testing.assert_close(out.loss.float(), expected.loss, **tol)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name].float(), grad.float(),
                                   **(dict(rtol=2e-2, atol=1e-3) if fused else TOL),
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_token_log_probs_equal_the_stock_logits(family):
    """``token_log_probs`` (next-token log-probs and entropy at a temperature, the
    family's softcap inside) against ``log_softmax`` of the stock model's logits:
    values, and every parameter's gradient of ``a * logp + b * entropy``."""
    model = build(family)
    ids, _ = batch()
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0  # padding
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(ids.shape, generator=g), torch.randn(ids.shape, generator=g)

    def step(logp, entropy):
        model.zero_grad(set_to_none=True)
        ((logp * a).sum() + (entropy * b * mask).sum()).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    logp, entropy = cehf.token_log_probs(model, ids, attention_mask=mask, temperature=0.8,
                                         return_entropy=True)
    grads = step(logp, entropy)
    lp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float() / 0.8, -1)
    live = F.pad((mask[:, :-1] * mask[:, 1:]).bool(), (0, 1), value=False)
    ref_logp = torch.where(live, lp.gather(-1, F.pad(ids[:, 1:], (0, 1))[..., None])[..., 0], 0.0)
    ref_entropy = -(lp.exp() * lp).sum(-1)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    expected = step(ref_logp, ref_entropy)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    k = cehf.token_log_probs(model, ids, attention_mask=mask, temperature=0.8,
                             index=torch.stack([ids, ids.flip(1)], -1))
    torch.testing.assert_close(k[..., 0], torch.where(mask.bool(), lp.gather(
        -1, ids[..., None])[..., 0], 0.0), rtol=1e-5, atol=1e-5)


def test_token_log_probs_refuses_other_models():
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64))
    with pytest.raises(TypeError, match="token_log_probs supports"):
        cehf.token_log_probs(model, torch.zeros(1, 3, dtype=torch.long))


def test_grpo_example_matches_trl():
    """examples/grpo_step.py: GRPO steps through ``token_log_probs`` give TRL's
    losses and gradients on the stock logits (it raises if they part)."""
    spec = importlib.util.spec_from_file_location("grpo_step", ROOT / "examples" / "grpo_step.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    history = example.run(steps=2)
    assert len(history) == 2 and history[1][0] != history[0][0]  # the steps moved the policy
