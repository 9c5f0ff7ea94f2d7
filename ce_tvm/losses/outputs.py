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
