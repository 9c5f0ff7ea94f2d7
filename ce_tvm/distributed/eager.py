"""``eagerly``: a call run eagerly under ``torch.compile`` (a graph break), for the sharded
routes, whose module hooks and collectives are not traced.

Its own module, imported by the first sharded call: ``torch.compiler.disable`` imports
``torch._dynamo`` (1.3 s and 100 MB), which a plain call never needs.
"""

import torch


@torch.compiler.disable
def eagerly(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, not traced."""
    return fn(*args, **kwargs)
