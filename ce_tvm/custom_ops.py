"""``torch.library.custom_op`` without importing ``torch._dynamo`` on the first call.

torch wraps every custom op's implementation in ``torch._disable_dynamo``,
which imports ``torch._dynamo`` (1.3 s and 100 MB here) the first time the op
runs, to exclude the implementation from tracing. While ``torch._dynamo`` has
not been imported nothing can be traced, so there is nothing to exclude: the
ops declared here run their implementation directly until then, and from
then on excluded from tracing exactly as torch does it.
"""

from __future__ import annotations

import sys

import torch


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
