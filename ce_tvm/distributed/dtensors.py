"""DTensors given to the losses, read one way (the rule is ``ce_tvm.distributed.heads``):

- a weight ``Shard(0)`` (a column-wise parallel ``lm_head``) on a 1-D mesh and the
  input a DTensor on the same mesh, ``Replicate()`` or sharded on a row / sequence
  dimension: the vocabulary-parallel head (sequence parallel when the rows are sharded);
- logits given to ``cross_entropy`` sharded on the class dimension (``Shard(-1)``):
  the vocabulary-parallel loss;
- anything else with a DTensor (a plain input beside a sharded weight, a 2-D mesh, a
  weight sharded on H, mismatched meshes): a ``ValueError`` that names the readings and
  what to pass for each.

Each function here takes a family's arguments (``heads.run``'s ``dtensor``) and calls
``ce_tvm.distributed.vocab_parallel`` with the local shards and the mesh's group.
"""

from __future__ import annotations

from torch import Tensor

from ..losses import checks as check
from ..runtime.collectives import shard_layout
from .vocab_parallel import (
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_linear_log_probs,
)


def _placement(t, name: str, supported: str):
    """The placement of ``t`` on its 1-D mesh, else a ``ValueError`` naming ``supported``."""
    if t.device_mesh.ndim != 1:
        names = t.device_mesh.mesh_dim_names
        raise ValueError(
            f"{name} is a DTensor on a {t.device_mesh.ndim}-D mesh{f' {names}' if names else ''}"
            f" with placements {tuple(t.placements)}; ce_tvm takes DTensors on a 1-D mesh "
            f"({supported}). Under FSDP x TP the LM head's weight is 2-D outside its forward: "
            f"pass the head module (linear_cross_entropy(hidden, model.lm_head, target)), "
            f"whose call holds the 1-D tensor-parallel weight")
    return t.placements[0]


def _sharded_on(placement, dim: int, ndim: int) -> bool:
    return placement.is_shard() and placement.dim % ndim == dim % ndim


def _full(t):
    """A DTensor's full value (targets, indices and masks are global), else ``t``."""
    return t.full_tensor() if check.is_dtensor(t) else t


def _local_rows_of(t, width: int, group):
    """A per-class tensor (class weights, bias) for this rank's classes: a
    DTensor's local shard, or the rank's slice of a full tensor."""
    if t is None:
        return None
    if check.is_dtensor(t):
        return t.to_local()
    offset, _ = shard_layout(width, group)
    return t[offset:offset + width]


_HEAD = "linear_weight Shard(0) (a column-wise parallel lm_head) on a 1-D mesh"


def _ambiguous(input, weight) -> ValueError:
    return ValueError(
        f"linear_weight is a DTensor {tuple(weight.placements)} on mesh "
        f"{weight.device_mesh} but the input is a plain tensor, which has two readings; "
        f"ce_tvm does not guess. (1) Data parallel (FSDP2 fully_shard, FSDP, ZeRO-3 shard "
        f"the weight outside the head's forward, each rank its own tokens): pass the head "
        f"module, linear_cross_entropy(hidden, model.lm_head, target), so the loss runs "
        f"inside its forward where the weight is gathered and its gradient reduced. (2) "
        f"Tensor parallel (a column-wise parallel lm_head, every rank the same tokens): pass "
        f"the hidden states as a DTensor on the same mesh, DTensor.from_local(hidden, mesh, "
        f"[Replicate()]) (or its rows sharded for sequence parallelism), or call "
        f"ce_tvm.distributed.vocab_parallel_linear_cross_entropy / _log_probs with the local "
        f"shard and the process group")


class Shards:
    """The vocabulary-parallel reading of a DTensor head and input: local
    tensors, the group, and where this rank's rows sit among the global ones."""

    def __init__(self, input, linear_weight, linear_bias):
        if not check.is_dtensor(linear_weight):
            raise ValueError("input is a DTensor but linear_weight is not: ce_tvm takes a "
                             f"DTensor input beside {_HEAD} (tensor parallelism); pass "
                             "input.to_local() with a plain weight otherwise")
        if not _sharded_on(_placement(linear_weight, "linear_weight", _HEAD), 0, 2):
            raise ValueError(f"linear_weight: ce_tvm takes an LM head DTensor as {_HEAD}, got "
                             f"{linear_weight.placements[0]} (a weight sharded on H, or "
                             f"replicated, is not a vocabulary-parallel head)")
        if not check.is_dtensor(input):
            raise _ambiguous(input, linear_weight)
        supported = "the hidden states Replicate() or sharded on a row/sequence dimension"
        placement = _placement(input, "input", supported)
        if input.device_mesh != linear_weight.device_mesh:
            raise ValueError(f"input is on mesh {input.device_mesh} but linear_weight on "
                             f"{linear_weight.device_mesh}: ce_tvm takes both on the same "
                             f"1-D tensor-parallel mesh")
        self.group = linear_weight.device_mesh.get_group()
        self.world = linear_weight.device_mesh.size()
        self.lead = tuple(input.shape[:-1])  # the global rows
        self.sequence_dim = None
        if placement.is_shard() and placement.dim % input.dim() < input.dim() - 1:
            self.sequence_dim = placement.dim % input.dim()
            if self.lead[self.sequence_dim] % self.world:
                raise ValueError(f"input: sequence parallelism takes equal blocks of rows; "
                                 f"dimension {self.sequence_dim} ({self.lead[self.sequence_dim]}"
                                 f") does not divide over {self.world} ranks")
        elif not placement.is_replicate():
            raise ValueError(f"input: ce_tvm takes {supported} beside {_HEAD}, got {placement}")
        local = input.to_local()
        self.local_lead = tuple(local.shape[:-1])
        self.x = local.reshape(-1, local.shape[-1])
        self.W = linear_weight.to_local()
        self.b = _local_rows_of(linear_bias, self.W.shape[0], self.group)

    @property
    def sequence_parallel(self) -> bool:
        return self.sequence_dim is not None

    def global_rows(self, labels):
        """Per-row labels of the global rows (``lead`` or ``lead + (K,)``), flat in
        the order the ranks' local rows follow one another (rank order)."""
        labels = _full(labels)
        if labels is None or not isinstance(labels, Tensor):
            return labels
        if tuple(labels.shape[:len(self.lead)]) != self.lead:
            raise ValueError(f"labels of the rows must have shape {self.lead} (+ (K,)), got "
                             f"{tuple(labels.shape)}")
        if self.sequence_parallel:
            labels = labels.unflatten(self.sequence_dim, (self.world, -1))
            labels = labels.movedim(self.sequence_dim, 0)
        return labels.reshape(-1, *labels.shape[len(self.lead) + self.sequence_parallel:])

    def shaped(self, t: Tensor) -> Tensor:
        """A per-row output of the flat local rows in the local input's shape."""
        return t.reshape(*self.local_lead, *t.shape[1:])


# --- The families' DTensor forms -----------------------------------------------


def linear_cross_entropy(input, linear_weight, linear_bias, target, *, weight=None,
                         **options):
    """``ce_tvm.linear_cross_entropy`` of a DTensor weight and input (the module doc)."""
    shards = Shards(input, linear_weight, linear_bias)
    options.pop("allow_retain_graph", None)  # the vocabulary-parallel backward keeps its own
    result = vocab_parallel_linear_cross_entropy(
        shards.x, shards.W, shards.global_rows(target), group=shards.group,
        local_bias=shards.b, weight=_local_rows_of(weight, shards.W.shape[0], shards.group),
        sequence_parallel=shards.sequence_parallel, **options)
    if options.get("reduction", "mean") != "none":
        return result
    if not isinstance(result, tuple):
        return shards.shaped(result)
    per_row = 1 + bool(options.get("return_zloss"))  # loss (and z-loss) per row
    return (*(shards.shaped(t) for t in result[:per_row]), *result[per_row:])


def linear_log_probs(input, linear_weight, linear_bias, index, *, row_mask=None,
                     return_entropy=False, **options):
    """``ce_tvm.linear_log_probs`` of a DTensor weight and input (the module doc)."""
    shards = Shards(input, linear_weight, linear_bias)
    result = vocab_parallel_linear_log_probs(
        shards.x, shards.W, shards.global_rows(index), group=shards.group, local_bias=shards.b,
        row_mask=shards.global_rows(row_mask), sequence_parallel=shards.sequence_parallel,
        return_entropy=return_entropy, **options)
    if not return_entropy:
        return shards.shaped(result)
    logp, entropy = result
    return shards.shaped(logp), shards.shaped(entropy)


def cross_entropy(input, target, weight=None, *, reduction: str = "mean", **options):
    """``ce_tvm.cross_entropy`` of DTensor logits ``[..., V]`` sharded on the class
    dimension (``Shard(-1)``, 1-D mesh): the vocabulary-parallel loss."""
    supported = "logits Shard(-1), the class dimension last"
    placement = _placement(input, "input", supported)
    if not _sharded_on(placement, -1, input.dim()):
        raise ValueError(f"input: ce_tvm.cross_entropy takes DTensor logits as {supported}, "
                         f"got {placement} (logits sharded on the rows are data parallel: "
                         f"pass each rank's local logits, input.to_local())")
    group = input.device_mesh.get_group()
    local = input.to_local()
    y = _full(target)
    if y.dtype.is_floating_point:
        raise ValueError("DTensor logits take class-index targets, not probabilities")
    loss = vocab_parallel_cross_entropy(
        local.reshape(-1, local.shape[-1]), y.reshape(-1),
        _local_rows_of(weight, local.shape[-1], group), reduction=reduction, group=group,
        **options)
    if reduction != "none":
        return loss
    shape = tuple(input.shape[:-1])  # the per-row parts (loss, zloss) back in the rows' shape
    if not isinstance(loss, tuple):
        return loss.reshape(shape)
    per_row = 1 + bool(options.get("return_zloss"))
    return (*(t.reshape(shape) for t in loss[:per_row]), *loss[per_row:])

