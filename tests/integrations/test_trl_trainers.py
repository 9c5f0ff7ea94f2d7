"""TRL 1.16's trainers with ce_tvm under their fused LM head: a few steps of
``GRPOTrainer``, ``SFTTrainer`` and ``DPOTrainer`` on a tiny Llama built from a
config (an in-process word-level tokenizer, no downloads; generation on the CPU),
once with TRL's own head and once after ``ce_tvm.integrations.trl.apply()``:
the same logged losses and metrics, to 1e-3 relative or 1e-4 absolute. Those
bounds are the trainers', not the head's (``test_trl.py`` checks the head to
1e-5): the tiny model's gradient is ill-conditioned (TRL's own head called
through one more autograd node already moves the parameters' gradients by up to
3e-3 of their largest entry, measured on GRPO), and DPO logs differences of
nearly equal numbers (its rewards are beta times policy less reference
log-probs of about -17 each; the mean logit is near 0), where float32 rounding
of another summation order is 1e-5 absolute."""

import math

import pytest
import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers

from ce_tvm.integrations import trl as cetrl

pytestmark = pytest.mark.slow
WORDS = [f"w{i}" for i in range(60)]
SPECIALS = ["<pad>", "<eos>", "<bos>"]


def tokenizer():
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>", bos_token="<bos>")
    fast.chat_template = None
    return fast


def tiny_llama(tok):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id)
    return transformers.LlamaForCausalLM(config)


def sentence(gen, n):
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=gen))


def common(tmp_path):
    # SGD: Adam's first steps move every weight by about the learning rate whatever
    # its gradient's size, so rounding-level differences in tiny gradients would grow
    return dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3,
                logging_steps=1, save_strategy="no", seed=0, per_device_train_batch_size=4,
                optim="sgd", learning_rate=1e-2)


def grpo(tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    tok = tokenizer()
    gen = torch.Generator().manual_seed(2)
    data = Dataset.from_dict({"prompt": [sentence(gen, 4) for _ in range(8)]})
    args = GRPOConfig(**common(tmp_path), num_generations=4, max_completion_length=6,
                      temperature=0.7)
    return GRPOTrainer(model=tiny_llama(tok), processing_class=tok, args=args,
                       train_dataset=data,
                       reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions])


def sft(tmp_path):
    from trl import SFTConfig, SFTTrainer

    tok = tokenizer()
    gen = torch.Generator().manual_seed(3)
    data = Dataset.from_dict({"prompt": [sentence(gen, 4) for _ in range(8)],
                              "completion": [sentence(gen, 5) for _ in range(8)]})
    return SFTTrainer(model=tiny_llama(tok), processing_class=tok, train_dataset=data,
                      args=SFTConfig(**common(tmp_path), max_length=16))


def dpo(tmp_path):
    from trl import DPOConfig, DPOTrainer

    tok = tokenizer()
    gen = torch.Generator().manual_seed(4)
    data = Dataset.from_dict({"prompt": [sentence(gen, 4) for _ in range(8)],
                              "chosen": [sentence(gen, 3) for _ in range(8)],
                              "rejected": [sentence(gen, 3) for _ in range(8)]})
    return DPOTrainer(model=tiny_llama(tok), ref_model=tiny_llama(tok), processing_class=tok,
                      train_dataset=data, args=DPOConfig(**common(tmp_path), max_length=16))


def logged(make, tmp_path) -> list[dict]:
    trainer = make(tmp_path)
    trainer.train()
    return [{k: v for k, v in entry.items() if isinstance(v, float) and "time" not in k
             and "per_second" not in k} for entry in trainer.state.log_history]


@pytest.mark.parametrize("make", [grpo, sft, dpo], ids=["grpo", "sft", "dpo"])
def test_trainer_logs_the_same_with_ce_tvm_under_its_fused_head(make, tmp_path):
    expected = logged(make, tmp_path / "trl")
    cetrl.apply()
    try:
        got = logged(make, tmp_path / "ce_tvm")
    finally:
        cetrl.remove()
    assert_same_logs(got, expected)


def assert_same_logs(got: list[dict], expected: list[dict]) -> None:
    """The same steps logged, each metric within 1e-3 relative or 1e-4 absolute."""
    assert len(got) == len(expected) and any("loss" in e for e in expected), expected
    for mine, theirs in zip(got, expected):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert math.isclose(mine[key], value, rel_tol=1e-3, abs_tol=1e-4), (
                key, mine[key], value)
