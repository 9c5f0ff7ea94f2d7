"""How the losses meet autograd: their ``torch.library`` ops, and the one protocol for
gradients computed in the forward.

``custom_op`` is ``torch.library.custom_op`` without importing ``torch._dynamo`` on the
first call. torch wraps every custom op's implementation in ``torch._disable_dynamo``,
which imports ``torch._dynamo`` (1.3 s and 100 MB here) the first time the op runs, to
exclude the implementation from tracing. While ``torch._dynamo`` has not been imported
nothing can be traced, so there is nothing to exclude: the ops declared here run their
implementation directly until then, and from then on excluded from tracing exactly as
torch does it.

Called eagerly on plain tensors (no ``torch.compile``, no dispatch or function mode,
no functorch transform, no profiler, no tensor subclass but ``nn.Parameter``), an op
runs its implementation and its registered autograd directly, as a
``torch.autograd.Function`` (``EagerCustomOp``): the dispatcher's round trips took
about a quarter of a small training step's host time. Anything else goes through the
dispatcher as registered.

``ForwardGradients`` is the protocol of every loss whose ``sum``/``mean`` forward also
computes the gradients, for a unit upstream gradient, in the same sweep over the logits
(cross-entropy's training op, the fused heads, distillation, their vocabulary-parallel
forms): the backward only scales them by the upstream gradient. ``op_gradients`` lays a
backward's gradients out in the op's schema order.
"""

from __future__ import annotations

import functools
import inspect
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
        op.__class__ = EagerCustomOp  # the same op, called eagerly without the dispatcher
        return op
    return register


class EagerCustomOp(torch.library.CustomOpDef):
    """A custom op whose eager calls on plain tensors (``_plain_eager``) run its
    implementation directly: alone where no gradient is recorded, else with its
    registered autograd as a ``torch.autograd.Function``. Every other call
    (traced, under a mode, on a tensor subclass, or recording a gradient of an
    op without autograd) goes through the dispatcher as torch registered it."""

    def __call__(self, *args, **kwargs):
        if not _plain_eager(args, kwargs):
            return self._opoverload(*args, **kwargs)
        if not (torch.is_grad_enabled() and _any_requires_grad(args, kwargs)):
            return self._init_fn(*args, **kwargs)
        bound = None if self._backward_fn is None else _bound(self, args, kwargs)
        if bound is None:  # no autograd, or a wrong call: the dispatcher says what is wrong
            return self._opoverload(*args, **kwargs)
        return _autograd_function(self).apply(*bound)


def _tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))
        elif isinstance(value, torch.Tensor):
            yield value


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_eager(args, kwargs) -> bool:
    """Whether a call runs eagerly on plain tensors: nothing traces or
    intercepts it, so the dispatcher would only run the implementation."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._autograd._profiler_enabled()  # a trace names the op
            or torch._C._functorch.maybe_current_level() is not None):
        return False
    return all(type(t) in _PLAIN for t in _tensors(args, kwargs))


def _any_requires_grad(args, kwargs) -> bool:
    return any(t.requires_grad for t in _tensors(args, kwargs))


@functools.cache
def _parameters(op) -> tuple:
    """``(name, default)`` of each parameter of ``op``'s implementation, in order."""
    return tuple((name, p.default) for name, p in inspect.signature(op._init_fn).parameters.items())


def _bound(op, args: tuple, kwargs: dict) -> tuple | None:
    """``args`` and ``kwargs`` as the positional arguments of ``op``'s schema,
    defaults filled in; ``None`` for a call that does not fit it."""
    params = _parameters(op)
    if len(args) > len(params):
        return None
    tail = []
    for name, default in params[len(args):]:
        if name in kwargs:
            tail.append(kwargs[name])
        elif default is inspect.Parameter.empty:
            return None
        else:
            tail.append(default)
    if len(kwargs) != sum(name in kwargs for name, _ in params[len(args):]):
        return None
    return (*args, *tail)


@functools.cache
def _autograd_function(op) -> type:
    """``op``'s implementation and registered autograd (``setup_context``,
    ``backward``) as a ``torch.autograd.Function``, as torch's own wrapper runs
    them behind the dispatcher."""
    impl, setup, backward = op._init_fn, op._setup_context_fn, op._backward_fn

    def forward(ctx, *args):
        output = impl(*args)
        setup(ctx, args, output)
        return output

    def backward_(ctx, *grads):
        return backward(ctx, *grads)

    o = op._opoverload  # named as torch names its own: the same autograd node names
    return type(f"GeneratedBackwardFor_{o._namespace}_{o._opname}_{o._overloadname}",
                (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward_)})


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
