"""The shapes of what the losses return: the public results with their extras, and
the ops' empty (fake) outputs, shared by every family."""

from __future__ import annotations

import torch
from torch import Tensor


def with_extras(loss: Tensor, zloss: Tensor | None, accuracy: Tensor | None):
    """The loss alone, or the tuple ``(loss, [zloss], [accuracy])`` of the extras
    asked for, in that order; the extras are detached (logging only)."""
    extras = tuple(t.detach() for t in (zloss, accuracy) if t is not None)
    return (loss, *extras) if extras else loss


def accuracy_like(x: Tensor, wanted: bool) -> Tensor:
    """The token-accuracy output's shape: 0-d float32 when ``wanted``, else empty."""
    return x.new_empty((), dtype=torch.float32) if wanted else x.new_empty(0,
                                                                          dtype=torch.float32)


def loss_rows(x: Tensor, reduction: str) -> int:
    """Rows of the ``loss`` output: ``N`` for ``none``, else 1."""
    return x.shape[0] if reduction == "none" else 1


def grad_like(like: Tensor | None, wanted: bool, x: Tensor) -> Tensor:
    """A gradient output: ``like``'s shape when ``wanted`` (and ``like`` given),
    else an empty tensor of ``x``'s dtype (a gradient not asked for)."""
    return torch.empty_like(like) if wanted and like is not None else x.new_empty(0)


def loss_like(x: Tensor, reduction: str, wide_loss: bool) -> Tensor:
    """A ``loss``/``zloss`` output: ``loss_rows`` long, in ``x``'s dtype, or with
    ``wide_loss`` in its accumulation dtype (float32 for 16-bit ``x``; as
    ``launch.loss_torch_dtype``)."""
    wide = wide_loss and x.dtype in (torch.float16, torch.bfloat16)
    return x.new_empty(loss_rows(x, reduction), dtype=torch.float32 if wide else x.dtype)
