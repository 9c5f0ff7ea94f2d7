"""The losses users call, one module per family, each with its ``torch.library`` ops and
its public API (re-exported lazily as ``ce_tvm.<name>``):

- ``cross_entropy``: the drop-ins ``cross_entropy`` / ``CrossEntropyLoss`` on logits;
- ``linear``: ``linear_cross_entropy`` / ``LinearCrossEntropyLoss``, fused with the head;
- ``log_probs``: ``log_probs`` / ``linear_log_probs`` (and ``LogProbStats``);
- ``distillation``: ``linear_distillation_loss`` / ``distillation_loss``;
- ``topk_distillation``: ``topk_distillation_loss``;
- ``seed``: the seed-compatible operator pair ``cross_entropy_loss`` /
  ``cross_entropy_loss_grad``.

What they share, below them: ``checks`` (the one input check), ``autograd`` (op
registration and the one protocol for gradients computed in the forward), ``outputs``
(result and fake-output shapes). A head passed as a module or as DTensors is routed by
``ce_tvm.distributed.heads``; the options are ``ce_tvm.runtime.options``.
"""
