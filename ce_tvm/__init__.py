"""ce_tvm: a fused cross-entropy loss (forward and backward) compiled with Apache TVM.

The contract is docs/spec.md. Public surface:

- ``cross_entropy`` / ``CrossEntropyLoss``: autograd drop-ins for
  ``torch.nn.functional.cross_entropy`` / ``torch.nn.CrossEntropyLoss``, plus z-loss;
- ``linear_cross_entropy`` / ``LinearCrossEntropyLoss``: the output projection
  fused with the loss, rows in chunks (the ``[N, V]`` logits never exist whole);
- ``log_probs`` / ``linear_log_probs``: per-token log-probs (and entropy) at a
  temperature, with gradients, for RL post-training (on logits, or fused with
  the LM head);
- ``topk_distillation_loss``: distillation from a teacher's stored top-k log-probs;
- ``cross_entropy_loss`` / ``cross_entropy_loss_grad``: the seed-compatible pair;
- ``TargetOutOfRangeError``: what every entry point raises for a class index
  outside ``[0, C)`` (an ``IndexError`` and a ``ValueError``);
- ``schedule("ascend", profile=...)``: run CPU calls with another schedule;
- ``use_bundle(DIR)``: run kernels from a bundle (``ce-tvm bundle``), no compiler needed;
- ``ce_tvm.integrations.transformers``: Hugging Face causal LMs on the loss
  (``apply(model)``; the optional extra ``transformers``; imported explicitly).

``import ce_tvm`` loads nothing else: each name (and ``ce_tvm.distributed``)
is imported on first use, and TVM's compiler only when a kernel must be built.
"""

import importlib

from .store.spec import __version__

_LAZY = {"CrossEntropyLoss": "nn", "cross_entropy": "nn", "cross_entropy_loss": "functional",
         "cross_entropy_loss_grad": "functional", "LinearCrossEntropyLoss": "linear",
         "linear_cross_entropy": "linear", "schedule": "store.targets", "use_bundle": "store.paths",
         "TargetOutOfRangeError": "validation", "log_probs": "policy", "linear_log_probs": "policy",
         "topk_distillation_loss": "distill", "linear_distillation_loss": "distill",
         "distillation_loss": "distill",
         "LogProbStats": "policy"}
_SUBMODULES = ("distributed",)

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'ce_tvm' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_LAZY, *_SUBMODULES])
