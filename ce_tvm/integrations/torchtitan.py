"""ce_tvm as torchtitan's LM-head loss (optional extra ``torchtitan``).

torchtitan 0.3 computes a decoder's loss from the hidden states when the
trainer's loss is a ``ChunkedLossWrapper`` (``torchtitan.components.loss``;
the llama3 and qwen3 configs use it): the trainer then sets the model's
``_skip_lm_head``, hands the loss the ``lm_head`` (``set_lm_head``) and calls
``loss_fn(pred [B, L, D], labels [B, L], global_valid_tokens, **loss_inputs)``
for ``(loss, metrics)``, then ``loss.backward()``. The wrapper splits the
sequence into chunks and computes ``lm_head`` then ``CrossEntropyLoss`` (logits
cast to float32, ``reduction="sum"``, ``ignore_index=-100``, divided by
``global_valid_tokens``) chunk by chunk.

- ``LinearCrossEntropyLoss``: a ``ChunkedLossWrapper`` (so the trainer treats it
  as one) whose call is one ``ce_tvm.linear_cross_entropy(pred, lm_head,
  labels, reduction="sum", ignore_index=-100, loss_dtype=torch.float32) /
  global_valid_tokens`` (the plain sum without ``global_valid_tokens``, as the
  validator calls it): no chunks, no logits, a float32 loss from 16-bit
  hidden states and head, no metrics (the stock wrapper's are those of its
  inner loss, none for ``CrossEntropyLoss``). ``loss_inputs`` (``positions``)
  change nothing, as in the stock loss. The head goes in as the module: under
  FSDP2 (``fully_shard([norm, lm_head])``, its mixed precision) the loss runs
  inside the head's own call, which gathers the weight and reduce-scatters its
  gradient. ``LinearCrossEntropyLoss.Config()`` goes where the stock
  ``ChunkedLossWrapper.Config(...)`` goes (``Trainer.Config(loss=...)``).
- ``apply(config)``: a trainer config with that loss in place of its
  cross-entropy loss (``ChunkedLossWrapper`` around ``CrossEntropyLoss``, or
  ``CrossEntropyLoss`` alone); any other loss is a ``TypeError``.

Tensor parallelism (a vocabulary-sharded ``lm_head``, loss parallel) and
DTensor hidden states (``spmd_backend="full_dtensor"``) are refused with a
``NotImplementedError``, not computed on a shard; the stock loss does those.
Pipeline parallelism passes ``global_valid_tokens`` by keyword, which this
loss takes, but it is untested. A torchtitan version outside ``TESTED`` is
an error.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

import torch
from torch import Tensor, nn

from ..losses.linear import linear_cross_entropy
from ..optional import guard

with guard("torchtitan", "torchtitan", "ce_tvm.integrations.torchtitan"):
    from torch.distributed.tensor import DTensor
    from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.distributed.spmd_types import spmd_mesh_size
    from torchtitan.distributed.utils import get_spmd_backend

TESTED = ("0.3.0", "0.4.0")  # [lowest, first untested)


def _check_version() -> None:
    from packaging.version import Version

    low, high = TESTED
    version = importlib.metadata.version("torchtitan")
    if not Version(low) <= Version(version) < Version(high):
        raise RuntimeError(f"ce_tvm.integrations.torchtitan is tested with torchtitan >= {low}, "
                           f"< {high}; torchtitan {version} is installed: its trainer may call "
                           f"its loss otherwise. Install torchtitan=={low} (the extra "
                           f"'torchtitan' allows it).")


def _check_inner(loss_fn) -> None:
    if type(loss_fn) is not CrossEntropyLoss.Config:
        raise TypeError(f"ce_tvm computes torchtitan's CrossEntropyLoss, not "
                        f"{type(loss_fn).__qualname__}")


class LinearCrossEntropyLoss(ChunkedLossWrapper):
    """torchtitan's ``ChunkedLossWrapper`` around ``CrossEntropyLoss``, computed
    by ``ce_tvm.linear_cross_entropy`` in one call (the module docstring)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        """The stock wrapper's fields: ``loss_fn`` must be ``CrossEntropyLoss.Config``
        (its ``global_vocab_size`` serves loss parallelism, which this loss
        refuses); ``num_chunks`` has no use here (one call, no chunks)."""

    def __init__(self, config: Config, *, compile_config=None):
        # The stock __init__ builds the inner loss, which this one never calls; the
        # lm_head is not compiled by the stock wrapper either (``compile_config``).
        _check_version()
        _check_inner(config.loss_fn)
        self.num_chunks = config.num_chunks
        self.loss_fn = None
        self.lm_head: nn.Module | None = None

    def __call__(self, pred: Tensor, labels: Tensor, global_valid_tokens: Tensor | None = None,
                 **loss_inputs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, {})``: the summed cross-entropy of ``lm_head(pred)`` at ``labels``
        (``-100`` ignored), float32, divided by ``global_valid_tokens`` when given."""
        del loss_inputs  # per-token inputs (positions) that the stock loss ignores too
        if self.lm_head is None:
            raise RuntimeError("LinearCrossEntropyLoss: set_lm_head(model.lm_head) first "
                               "(torchtitan's Trainer does)")
        if isinstance(pred, DTensor):
            raise NotImplementedError(
                "ce_tvm.integrations.torchtitan: DTensor hidden states (spmd_backend "
                "'full_dtensor', or tensor parallelism under 'partial_dtensor') are not "
                "supported; use torchtitan's ChunkedLossWrapper there")
        if _tensor_parallel():
            raise NotImplementedError(
                "ce_tvm.integrations.torchtitan: tensor parallelism (a vocabulary-sharded "
                "lm_head) is not supported; use torchtitan's ChunkedLossWrapper there")
        loss = linear_cross_entropy(pred, self.lm_head, labels, reduction="sum",
                                    ignore_index=IGNORE_INDEX, loss_dtype=torch.float32)
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}


def _tensor_parallel() -> bool:
    """Whether torchtitan shards the head over a tensor-parallel axis (``spmd_types``'s
    current mesh has a ``tp`` axis of size > 1)."""
    return get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1


def loss_config(loss=None) -> LinearCrossEntropyLoss.Config:
    """``LinearCrossEntropyLoss.Config`` in place of ``loss`` (a trainer's
    ``config.loss``: ``ChunkedLossWrapper.Config`` around ``CrossEntropyLoss.Config``,
    or ``CrossEntropyLoss.Config``; ``None``: the default), its inner loss kept."""
    if loss is None:
        return LinearCrossEntropyLoss.Config()
    if type(loss) in (ChunkedLossWrapper.Config, LinearCrossEntropyLoss.Config):
        _check_inner(loss.loss_fn)
        return LinearCrossEntropyLoss.Config(num_chunks=loss.num_chunks,
                                             loss_fn=dataclasses.replace(loss.loss_fn))
    _check_inner(loss)
    return LinearCrossEntropyLoss.Config(loss_fn=dataclasses.replace(loss))


def apply(config):
    """``config`` (a torchtitan ``Trainer.Config``) with its cross-entropy loss
    computed by ``LinearCrossEntropyLoss`` (``loss_config``); returns ``config``."""
    _check_version()
    if not hasattr(config, "loss"):
        raise TypeError(f"apply expects a torchtitan Trainer.Config, got {type(config).__name__}")
    config.loss = loss_config(config.loss)
    return config
