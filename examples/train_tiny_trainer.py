"""Train a tiny character-level Llama with Hugging Face's Trainer, three times
from the same seed: the stock model, ``apply(model)`` and
``apply(model, fused_linear=True)`` (ce_tvm.integrations.transformers), then
print the three loss curves side by side.

    python examples/train_tiny_trainer.py [--steps 30] [--check]

The text is the opening of "Alice's Adventures in Wonderland" (public domain),
shipped beside this file, cut into windows of ``LENGTH`` characters. The
Trainer accumulates gradients over 2 micro-batches, so it passes
``num_items_in_batch`` to the model's loss. ``--check`` exits non-zero unless
every curve agrees with the stock one to a relative 1e-5 at every step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from ce_tvm.integrations.transformers import apply

CORPUS = Path(__file__).with_name("tiny_corpus.txt")
LENGTH = 32
RUNS = {"stock": None, "apply": False, "fused": True}  # name -> fused_linear (None: stock)


def dataset() -> tuple[list[dict], int]:
    """Windows of the text as ``{"input_ids", "labels"}`` and the vocabulary size."""
    text = CORPUS.read_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(ch) for ch in text])
    windows = ids.unfold(0, LENGTH, LENGTH // 2)
    return [{"input_ids": w, "labels": w.clone()} for w in windows], len(chars)


def train(fused_linear: bool | None, steps: int, seed: int = 0) -> list[float]:
    data, vocab = dataset()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=LENGTH)
    model = transformers.LlamaForCausalLM(config)
    if fused_linear is not None:
        apply(model, fused_linear=fused_linear)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2,
            max_steps=steps, logging_steps=1, learning_rate=3e-3, report_to=[],
            save_strategy="no", use_cpu=True, seed=seed, disable_tqdm=True,
            log_level="error")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.remove_callback(transformers.PrinterCallback)  # the table below says it all
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--check", action="store_true",
                   help="fail unless every curve agrees with stock to 1e-5")
    args = p.parse_args(argv)
    curves = {name: train(fused, args.steps) for name, fused in RUNS.items()}
    print(f"{'step':>5}" + "".join(f"{name:>12}" for name in curves) + f"{'rel diff':>10}")
    worst = 0.0
    for step, losses in enumerate(zip(*curves.values()), 1):
        rel = max(abs(x - losses[0]) / abs(losses[0]) for x in losses[1:])
        worst = max(worst, rel)
        print(f"{step:5d}" + "".join(f"{x:12.6f}" for x in losses) + f"{rel:10.1e}")
    print(f"largest relative difference from stock over {args.steps} steps: {worst:.1e}")
    return 1 if args.check and worst > 1e-5 else 0


if __name__ == "__main__":
    sys.exit(main())
