"""ce_tvm: a fused cross-entropy loss (forward and backward) compiled with Apache TVM.

See SPEC.md for the contract. Public surface:

- ``cross_entropy`` / ``CrossEntropyLoss``: autograd drop-ins for
  ``torch.nn.functional.cross_entropy`` / ``torch.nn.CrossEntropyLoss``, plus z-loss;
- ``cross_entropy_loss`` / ``cross_entropy_loss_grad``: the seed-compatible pair;
- ``schedule("ascend", profile=...)``: run CPU calls with another schedule.
"""

from .build import __version__
from .functional import cross_entropy_loss, cross_entropy_loss_grad
from .nn import CrossEntropyLoss, cross_entropy
from .targets import schedule

__all__ = ["__version__", "CrossEntropyLoss", "cross_entropy", "cross_entropy_loss",
           "cross_entropy_loss_grad", "schedule"]
