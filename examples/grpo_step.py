"""GRPO-style training steps on ce_tvm's fused LM head, checked against TRL.

A tiny causal LM (built from a config, no download) samples nothing: the
rollouts are random prompts and completions with group-normalised rewards.
Each step computes, for the completion tokens, the policy's log-probs and
entropy at the sampling temperature, the clipped GRPO objective with a KL
penalty to a frozen reference model and an entropy bonus, and takes an
optimizer step. Two copies of the policy run side by side:

- ``ce_tvm``: ``token_log_probs`` (the model's body, then the fused head:
  no ``[B, T, V]`` logits);
- ``trl``: TRL's ``selective_log_softmax`` and ``entropy_from_logits`` on the
  logits the stock model returns.

Every step prints both losses and the largest gradient difference; the run
fails if they part. ``python examples/grpo_step.py [--steps 3]``
"""

from __future__ import annotations

import argparse
import copy

import torch
import transformers
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

from ce_tvm.integrations.transformers import token_log_probs

VOCAB, PROMPT, COMPLETION, GROUP, GROUPS = 256, 6, 10, 4, 2
TEMPERATURE, CLIP, BETA, ENTROPY_BONUS = 0.7, 0.2, 0.04, 0.01


def tiny_policy(seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16)
    return transformers.LlamaForCausalLM(config)


def rollouts(seed: int = 1):
    """``(ids [B, P + C], mask [B, P + C], completion [B, P + C - 1], advantages [B])``:
    ``completion`` marks the positions whose next token is a (non-padding)
    completion token; advantages are rewards normalised within each group."""
    g = torch.Generator().manual_seed(seed)
    rows = GROUP * GROUPS
    ids = torch.randint(0, VOCAB, (rows, PROMPT + COMPLETION), generator=g)
    mask = torch.ones_like(ids)
    lengths = torch.randint(COMPLETION // 2, COMPLETION + 1, (rows,), generator=g)
    for r, n in enumerate(lengths.tolist()):
        mask[r, PROMPT + n:] = 0  # padding after a shorter completion
    completion = torch.zeros_like(ids[:, 1:], dtype=torch.bool)
    completion[:, PROMPT - 1:] = mask[:, PROMPT:].bool()
    rewards = torch.rand(GROUPS, GROUP, generator=g)
    advantages = ((rewards - rewards.mean(1, keepdim=True))
                  / (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)
    return ids, mask, completion, advantages


def ce_tvm_outputs(model, ids, mask):
    """Next-token log-probs and entropy ``[B, T - 1]`` through the fused head."""
    logp, entropy = token_log_probs(model, ids, attention_mask=mask, temperature=TEMPERATURE,
                                    return_entropy=True)
    return logp[:, :-1], entropy[:, :-1]


def trl_outputs(model, ids, mask):
    """The same from the stock model's logits and TRL's functions."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return (selective_log_softmax(logits, ids[:, 1:], TEMPERATURE),
            entropy_from_logits(logits / TEMPERATURE))


def grpo_loss(logp, entropy, old_logp, ref_logp, advantages, completion):
    """Clipped policy objective, KL to the reference (k3 estimator) and an
    entropy bonus, averaged over the completion tokens."""
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    policy = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a)
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    per_token = policy + BETA * kl - ENTROPY_BONUS * entropy
    return (per_token * completion).sum() / completion.sum()


def run(steps: int = 3, tol: float = 1e-4) -> list[tuple[float, float, float]]:
    """``steps`` optimizer steps of both copies; returns per step ``(ce_tvm
    loss, trl loss, largest gradient difference relative to the largest
    gradient)`` and raises if the two part by more than ``tol``."""
    ids, mask, completion, advantages = rollouts()
    reference = tiny_policy(seed=0).eval()
    policies = {"ce_tvm": tiny_policy(seed=0).train(), "trl": None}
    policies["trl"] = copy.deepcopy(policies["ce_tvm"])
    outputs = {"ce_tvm": ce_tvm_outputs, "trl": trl_outputs}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in policies.items()}
    with torch.no_grad():
        ref_logp = ce_tvm_outputs(reference, ids, mask)[0]
        old_logp = ce_tvm_outputs(policies["ce_tvm"], ids, mask)[0]
    history = []
    for step in range(steps):
        losses, grads = {}, {}
        for name, model in policies.items():
            optims[name].zero_grad(set_to_none=True)
            logp, entropy = outputs[name](model, ids, mask)
            losses[name] = grpo_loss(logp, entropy, old_logp, ref_logp, advantages, completion)
            losses[name].backward()
            grads[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        scale = float(grads["trl"].abs().max())
        diff = float((grads["ce_tvm"] - grads["trl"]).abs().max()) / scale
        history.append((float(losses["ce_tvm"]), float(losses["trl"]), diff))
        print(f"step {step}: loss ce_tvm {history[-1][0]:+.6f}  trl {history[-1][1]:+.6f}  "
              f"max grad difference {diff:.1e} of the largest gradient")
        if abs(history[-1][0] - history[-1][1]) > tol * max(1.0, abs(history[-1][1])) \
                or diff > tol:
            raise AssertionError(f"step {step}: ce_tvm and TRL part: {history[-1]}")
        for opt in optims.values():
            opt.step()
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    run(parser.parse_args().steps)
