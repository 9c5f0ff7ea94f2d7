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

import pytest
import torch
from datasets import Dataset

from ce_tvm.integrations import trl as cetrl
from support import assert_same_logs, common, logged, sentence, tiny_llama, tokenizer

pytestmark = pytest.mark.slow


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


@pytest.mark.parametrize("make", [grpo, sft, dpo], ids=["grpo", "sft", "dpo"])
def test_trainer_logs_the_same_with_ce_tvm_under_its_fused_head(make, tmp_path):
    expected = logged(make, tmp_path / "trl")
    cetrl.apply()
    try:
        got = logged(make, tmp_path / "ce_tvm")
    finally:
        cetrl.remove()
    assert_same_logs(got, expected)
