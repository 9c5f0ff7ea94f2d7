"""What a sharded LM head means: the one rule, decided once at the top of every call
that takes a head (``linear_cross_entropy``, ``linear_log_probs``, the distillation
losses), never by a callback into the entry point.

An LM head's weight reaches a loss sharded in two situations that look alike and mean
different things:

- **data parallel** (FSDP2 ``fully_shard``, FSDP1, DeepSpeed ZeRO-3): outside the head's
  forward its weight is a shard of the *same* head on every rank, and every rank has
  *other tokens*. The loss needs the whole weight, which the framework gathers inside the
  module's own call;
- **tensor parallel** (a column-wise parallel ``lm_head``): each rank holds *other
  classes* of the head and the *same tokens*; the loss is the vocabulary-parallel one
  (``ce_tvm.distributed.vocab_parallel``).

A DTensor weight alone cannot tell them apart, so ``run`` routes a call by this rule:

1. the head given as a module (``nn.Linear``-like) whose call runs hooks: the loss runs
   inside the module's own call (``inside``, "forward redirection"), so FSDP / ZeRO-3
   gather the weight and reduce its gradient under their own policy, as for any layer;
   whatever the weight is in there, the rule is applied to it again. A module without
   hooks is read as its weight and bias (the plain, traceable path);
2. a DTensor weight or input: the family's DTensor reading (``ce_tvm.distributed.dtensors``:
   the vocabulary-parallel head for a weight ``Shard(0)`` beside an input on the same
   mesh; a ``ValueError`` naming the readings for anything else; never a guess);
3. plain tensors: the family's local fused loss.

The sharded routes run eagerly under ``torch.compile`` (``eager.eagerly``, a graph break):
the module hooks and collectives they call are not traced.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from ..losses import checks as check

# Where ``torch.distributed.tensor.parallel``'s styles (through ``distribute_module``)
# define the forward hooks that lay out a module's outputs: they expect logits, which the
# fused call does not return. torch documents no public marker for these hooks;
# tests/distributed/test_heads.py fails if torch moves them.
LAYOUT_HOOKS_MODULE = "torch.distributed.tensor._api"


def is_layout_hook(hook) -> bool:
    """Whether a module's forward hook is a tensor-parallel output-layout hook
    (``LAYOUT_HOOKS_MODULE``)."""
    return getattr(hook, "__module__", None) == LAYOUT_HOOKS_MODULE


def run(input, head, bias, local, dtensor, *args, **kwargs):
    """``local(input, weight, bias, *args, **kwargs)`` or ``dtensor(...)`` (the same
    arguments) for the head ``head`` (a weight, or the head module with ``bias``
    ``None``), routed by the rule of the module doc. ``local`` and ``dtensor`` are the
    calling family's module-level functions (traceable where the route is plain; the
    sharded routes run ``eagerly``)."""
    if isinstance(head, nn.Module):
        inner, needs_call = check.head_module(head, bias)
        if needs_call:
            from .eager import eagerly
            return eagerly(_inside_head, head, inner, input, local, dtensor, args, kwargs)
        head, bias = inner.weight, getattr(inner, "bias", None)
    if check.is_dtensor(head) or check.is_dtensor(input):
        from .eager import eagerly
        return eagerly(dtensor, input, head, bias, *args, **kwargs)
    return local(input, head, bias, *args, **kwargs)


def _inside_head(head: nn.Module, inner: nn.Module, input, local, dtensor, args, kwargs):
    """``run`` with the weight and bias the module's own call holds, inside that call."""
    def routed(hidden):
        return run(hidden, inner.weight, getattr(inner, "bias", None), local, dtensor, *args,
                   **kwargs)

    return inside(head, routed, input)


def inside(module: nn.Module, fn, *args):
    """``fn(*args)``, run as ``module(*args)``: the module's hooks see the call
    (FSDP2 / FSDP1 / ZeRO-3 gather its parameters before and reshard after, and
    hook the outputs for the backward), and ``fn`` reads the parameters as the
    module's own forward would. The module's forward is restored before ``fn``
    runs. Output-layout hooks of tensor-parallel styles (``is_layout_hook``; they
    expect logits) are set aside for the call; their input hooks run."""
    inner = getattr(module, "_fsdp_wrapped_module", module)  # FSDP1 wraps the module
    own_forward = inner.__dict__.get("forward")

    def restore():
        if own_forward is None:
            inner.__dict__.pop("forward", None)
        else:
            inner.forward = own_forward

    def redirected(*call_args):
        restore()
        # no views out of a module call: FSDP2 hooks its outputs for the backward
        return torch.utils._pytree.tree_map_only(Tensor, _not_a_view, fn(*call_args))

    kept = {m: OrderedDict(m._forward_hooks) for m in {module, inner}}
    for m, hooks in kept.items():
        for key, hook in hooks.items():
            if is_layout_hook(hook):
                del m._forward_hooks[key]
    inner.forward = redirected
    try:
        return module(*args)
    finally:
        restore()
        for m, hooks in kept.items():
            m._forward_hooks.clear()
            m._forward_hooks.update(hooks)


def _not_a_view(t: Tensor) -> Tensor:
    return t.clone() if t._is_view() else t


def whole_frozen_head(weight, bias) -> tuple:
    """``(weight, bias)`` of a head that takes no gradient (a distillation
    teacher), whole and detached, however it is sharded: one reading, since
    without a gradient a data-parallel shard and a vocabulary shard have the
    same whole. A module with hooks gives them from inside its own call (FSDP /
    ZeRO-3 gather there; copied out, as the gathered storage is freed after the
    call); DTensors (FSDP2 outside the call, tensor-parallel styles inside it)
    give their ``full_tensor()``. A hook-free module, plain tensors: as they are."""
    def whole(t, copy=False):
        if t is None:
            return None
        if check.is_dtensor(t):
            return t.full_tensor().detach()
        return t.detach().clone() if copy else t.detach()

    if not isinstance(weight, nn.Module):
        return whole(weight), whole(bias)
    inner, needs_call = check.head_module(weight, bias)

    def held(copy=False):  # read in the call: FSDP swaps the gathered parameters in there
        return whole(inner.weight, copy), whole(getattr(inner, "bias", None), copy)

    if not needs_call:
        return held()
    with torch.no_grad():
        return inside(weight, lambda _: held(copy=True), torch.empty(0))
