"""ce_tvm: a fused cross-entropy loss (forward and backward) compiled with Apache TVM.

The contract is docs/spec.md. Public surface (each name imported on first use):

- ``cross_entropy`` / ``CrossEntropyLoss``: autograd drop-ins for
  ``torch.nn.functional.cross_entropy`` / ``torch.nn.CrossEntropyLoss``, plus z-loss,
  logit softcapping, a temperature, a logit scale and token accuracy;
- ``linear_cross_entropy`` / ``LinearCrossEntropyLoss``: the output projection
  fused with the loss, rows in chunks (the ``[N, V]`` logits never exist whole);
  the head may be the module itself (sharded training: FSDP2, FSDP, ZeRO-3, TP);
- ``log_probs`` / ``linear_log_probs``: per-token log-probs (and entropy) at a
  temperature, with gradients, for RL post-training (on logits, or fused with
  the LM head); ``LogProbStats``: the per-token statistics ``return_stats=True`` adds;
- ``linear_distillation_loss`` / ``distillation_loss``: the full-vocabulary divergence
  (forward / reverse KL, generalized JSD) of a student's and a teacher's heads or logits;
  ``topk_distillation_loss``: distillation from a teacher's stored top-k log-probs;
- ``cross_entropy_loss`` / ``cross_entropy_loss_grad``: the seed-compatible pair;
- ``TargetOutOfRangeError``: what every entry point raises for a class index
  outside ``[0, C)`` (an ``IndexError`` and a ``ValueError``);
- ``schedule("ascend", profile=...)``: run CPU calls with another schedule, and
  ``schedule("cuda", threads=512)`` CUDA calls with other CUDA schedule knobs;
- ``use_bundle(DIR)``: run kernels from a bundle (``ce-tvm bundle``), no compiler needed;
- ``ce_tvm.distributed``: the vocabulary-parallel losses (tensor parallelism);
- ``ce_tvm.integrations.transformers``: Hugging Face causal LMs on the loss
  (``apply(model)``; the extra ``transformers``), ``ce_tvm.integrations.trl``: ce_tvm
  under TRL's fused LM head and distillation trainers (the extra ``trl``); both
  imported explicitly;
- ``ce_tvm.testing``: the float64 references of the contract, for your own checks.

Where things live (docs/architecture.md): ``losses/`` (one module per family: its
``torch.library`` ops and its public API), ``distributed/`` (vocabulary parallelism and
the one rule for sharded heads), ``integrations/``, then the layers below: ``runtime/``
(kernels in a process, all options), ``compiler/``, ``store/``, ``kernels/`` (the math);
``tools/`` holds the ``ce-tvm`` commands. ``import ce_tvm`` loads nothing else, and
TVM's compiler only when a kernel must be built.
"""

import importlib

from .store.spec import __version__

_LAZY = {"CrossEntropyLoss": "losses.cross_entropy", "cross_entropy": "losses.cross_entropy",
         "cross_entropy_loss": "losses.seed", "cross_entropy_loss_grad": "losses.seed",
         "LinearCrossEntropyLoss": "losses.linear", "linear_cross_entropy": "losses.linear",
         "log_probs": "losses.log_probs", "linear_log_probs": "losses.log_probs",
         "LogProbStats": "losses.log_probs",
         "linear_distillation_loss": "losses.distillation",
         "distillation_loss": "losses.distillation",
         "topk_distillation_loss": "losses.topk_distillation",
         "TargetOutOfRangeError": "losses.checks",
         "schedule": "store.targets", "use_bundle": "store.paths"}
_SUBMODULES = ("distributed", "testing")

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
    return sorted({*globals(), *_LAZY, *_SUBMODULES})
