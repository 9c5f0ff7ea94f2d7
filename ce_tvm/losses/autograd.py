"""How the losses meet autograd: their ``torch.library`` ops, and the one protocol for
gradients computed in the forward.

``custom_op`` is ``torch.library.custom_op`` without importing ``torch._dynamo`` on the
first call. torch wraps every custom op's implementation in ``torch._disable_dynamo``,
which imports ``torch._dynamo`` (1.3 s and 100 MB here) the first time the op runs, to
exclude the implementation from tracing. While ``torch._dynamo`` has not been imported
nothing can be traced, so there is nothing to exclude: the ops declared here run their
implementation directly until then, and from then on excluded from tracing exactly as
torch does it.

``ForwardGradients`` is the protocol of every loss whose ``sum``/``mean`` forward also
computes the gradients, for a unit upstream gradient, in the same sweep over the logits
(cross-entropy's training op, the fused heads, distillation, their vocabulary-parallel
forms): the backward only scales them by the upstream gradient. ``op_gradients`` lays a
backward's gradients out in the op's schema order.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ..runtime import pool


def custom_op(name: str, **options):
    """``torch.library.custom_op(name, **options)`` as a decorator, deferring
    the ``torch._dynamo`` import of its implementation (see the module doc)."""
    def register(fn):
        op = torch.library.custom_op(name, **options)(fn)
        for wrapped in getattr(op, "_backend_fns", {}).values():
            impl = getattr(wrapped, "__wrapped__", None)
            if impl is not None:
                # The attribute torch._disable_dynamo caches its wrapper in.
                setattr(impl, "__dynamo_disable", _excluded_once_traceable(impl))
        return op
    return register


def _excluded_once_traceable(impl):
    """``impl`` as is while ``torch._dynamo`` is absent, then ``torch._dynamo.disable(impl)``."""
    disabled = []

    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return impl(*args, **kwargs)
        if not disabled:
            import torch._dynamo
            disabled.append(torch._dynamo.disable(impl, recursive=True, wrapping=False))
        return disabled[0](*args, **kwargs)

    return call


def op_gradients(op, **grads) -> tuple:
    """A backward's return for the custom op ``op``: one slot per argument of its
    schema, ``grads`` (by argument name) in theirs, ``None`` in the others."""
    names = _argument_names(op)
    unknown = set(grads) - set(names)
    if unknown:
        raise TypeError(f"{op._name} has no arguments {sorted(unknown)}")
    return tuple(grads.get(name) for name in names)


@functools.cache
def _argument_names(op) -> tuple:
    """The names of ``op``'s schema arguments, in order (read once per op)."""
    return tuple(argument.name for argument in op._opoverload._schema.arguments)


def head_gradients(op, grads: Sequence[Tensor | None], needs: Sequence[bool],
                   names: tuple = ("input", "linear_weight", "linear_bias")) -> tuple:
    """``op_gradients`` of a fused head's op: the gradients of its input, weight and
    bias (``grads``, under ``names``), each where ``needs`` asks for it."""
    return op_gradients(op, **{name: g if wanted else None
                               for name, g, wanted in zip(names, grads, needs)})


def graph_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph``);
    ``True`` when that cannot be known (under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return True
    try:
        return torch._C._autograd._get_current_graph_task_keep_graph()
    except (AttributeError, RuntimeError):
        return True


def _is_exactly_one(g: Tensor) -> bool:
    """Whether ``g`` is 1, when that can be read without a device sync or a trace."""
    if g.device.type != "cpu" or torch.compiler.is_compiling() or is_fake(g):
        return False
    return bool(g == 1)


class ForwardGradients:
    """Gradients that a forward computed for a unit upstream gradient, kept for the
    backward, which scales them by the upstream gradient: the one protocol.

    Kept on the autograd ``ctx`` as an attribute, not saved (a saved tensor stays
    referenced until the graph is freed, so autograd would copy it into a leaf's
    ``.grad``: a fresh buffer every step), detached (a forward output kept with its
    ``grad_fn`` would be a reference cycle). ``None`` entries stay ``None``.

    ``scaled(grad_loss)``: a backward after which the graph dies *takes* the buffers:
    scaled in place (as they are when ``grad_loss`` is exactly 1), so a leaf's
    ``.grad`` can take them without a copy. A backward that keeps the graph
    (``retain_graph=True``) gets scaled copies and the buffers stay, when
    ``allow_retain_graph``; without it, it takes them too, and a later backward is a
    ``RuntimeError`` that says so (``entry`` names the entry point). Under
    ``torch.compile`` every pass gets copies. The buffers are never changed while
    they are kept.
    """

    def __init__(self, grads: Sequence[Tensor | None], *, allow_retain_graph: bool,
                 entry: str):
        self._grads = tuple(None if g is None else g.detach() for g in grads)
        self._allow_retain_graph = allow_retain_graph
        self._entry = entry

    @property
    def held(self) -> tuple | None:
        """The kept gradients (for a unit upstream gradient), ``None`` once consumed."""
        return self._grads

    def scaled(self, grad_loss: Tensor) -> tuple:
        grads = self._grads
        if grads is None:
            raise RuntimeError(
                f"{self._entry}: backward ran twice through the same graph; with reduction "
                f"'mean'/'sum' the forward's gradients are consumed by the first backward "
                f"(pass allow_retain_graph=True to keep them)")
        kept = graph_kept()
        if not kept or not self._allow_retain_graph:
            self._grads = None
        own = not kept or not (self._allow_retain_graph or torch.compiler.is_compiling())
        return tuple(None if g is None else _scale(g, grad_loss, own) for g in grads)


def _scale(g: Tensor, grad_loss: Tensor, own: bool) -> Tensor:
    """``g * grad_loss``: ``g`` itself (scaled in place) when this pass ``own``s it,
    else a copy (from the buffer pool; a traced pass, whose tensors are fake, never
    writes into a forward output)."""
    if is_fake(g):
        return torch.mul(g, grad_loss, out=torch.empty_like(g))
    if own:
        return g if _is_exactly_one(grad_loss) else g.mul_(grad_loss)
    return torch.mul(g, grad_loss, out=pool.empty_like(g))
