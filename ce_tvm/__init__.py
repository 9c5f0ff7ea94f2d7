"""ce_tvm: a fused cross-entropy loss (forward and backward) compiled with Apache TVM.

See SPEC.md for the contract. Public surface:

- ``cross_entropy_loss`` / ``cross_entropy_loss_grad``: the seed-compatible pair.
"""

from .build import __version__
from .functional import cross_entropy_loss, cross_entropy_loss_grad

__all__ = ["__version__", "cross_entropy_loss", "cross_entropy_loss_grad"]
