"""Multi-device use: the vocabulary-parallel losses, and the one rule for sharded heads.

- ``vocab_parallel_cross_entropy`` / ``VocabParallelCrossEntropyLoss``: logits sharded
  along the vocabulary, over a process group (tensor parallelism, as in Megatron-LM);
- ``vocab_parallel_linear_cross_entropy`` / ``VocabParallelLinearCrossEntropyLoss`` and
  ``vocab_parallel_linear_log_probs``: the LM head's weight sharded along the vocabulary,
  fused with the loss (``vocab_parallel.py``);
- ``heads.py``: what a sharded head passed to ``ce_tvm.linear_cross_entropy``,
  ``linear_log_probs`` or the distillation losses means (the head module under FSDP2 /
  FSDP / ZeRO-3 / tensor-parallel styles, DTensors), decided once at the top of a call;
  ``dtensors.py``: the DTensor readings it routes to.

docs/distributed.md says what to pass under DDP, FSDP2, FSDP1, ZeRO-3, TP and FSDP x TP.
"""

from .vocab_parallel import (
    VocabParallelCrossEntropyLoss,
    VocabParallelLinearCrossEntropyLoss,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_linear_log_probs,
)

__all__ = ["VocabParallelCrossEntropyLoss", "VocabParallelLinearCrossEntropyLoss",
           "vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy",
           "vocab_parallel_linear_log_probs"]
