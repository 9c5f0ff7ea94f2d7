"""Train a tiny character-level language model twice from the same seed: once
with ``ce_tvm.cross_entropy`` and once with ``torch.nn.functional.cross_entropy``,
then print both loss curves side by side.

    python examples/train_tiny_lm.py [--steps 60] [--check]

The text is the opening of "Alice's Adventures in Wonderland" (public domain),
shipped beside this file. ``--check`` exits non-zero unless the two curves
agree to a relative 1e-5 at every step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import ce_tvm

CORPUS = Path(__file__).with_name("tiny_corpus.txt")
CONTEXT = 8


class CharMLP(torch.nn.Module):
    """Embeds the last ``CONTEXT`` characters and predicts the next one."""

    def __init__(self, vocab: int, width: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 16)
        self.hidden = torch.nn.Linear(16 * CONTEXT, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(context).flatten(1)))
        return self.head(h)


def progress(step: int, total: int, loss: float, label: str) -> None:
    done = int(30 * step / total)
    sys.stderr.write(f"\r{label:>8} [{'#' * done}{'.' * (30 - done)}] {step}/{total} "
                     f"loss {loss:.4f}")
    if step == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def train(loss_fn, label: str, steps: int, batch: int = 256, seed: int = 0) -> list[float]:
    text = CORPUS.read_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(ch) for ch in text])
    windows = ids.unfold(0, CONTEXT + 1, 1)  # [positions, CONTEXT + 1]
    torch.manual_seed(seed)
    model = CharMLP(len(chars))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    curve = []
    for step in range(1, steps + 1):
        rows = windows[torch.randint(0, len(windows), (batch,), generator=gen)]
        loss = loss_fn(model(rows[:, :CONTEXT]), rows[:, CONTEXT], label_smoothing=0.05)
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(loss.item())
        progress(step, steps, curve[-1], label)
    return curve


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--check", action="store_true", help="fail unless the curves agree to 1e-5")
    args = p.parse_args(argv)
    ours = train(ce_tvm.cross_entropy, "ce_tvm", args.steps)
    ref = train(F.cross_entropy, "torch", args.steps)
    worst = 0.0
    print(f"{'step':>5} {'ce_tvm':>12} {'torch':>12} {'rel diff':>10}")
    for step, (a, b) in enumerate(zip(ours, ref), 1):
        rel = abs(a - b) / abs(b)
        worst = max(worst, rel)
        print(f"{step:5d} {a:12.6f} {b:12.6f} {rel:10.1e}")
    print(f"largest relative difference over {args.steps} steps: {worst:.1e}")
    return 1 if args.check and worst > 1e-5 else 0


if __name__ == "__main__":
    sys.exit(main())
