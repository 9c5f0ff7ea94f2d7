"""Per-target schedules of the ce_tvm compute (installed as ``ce_tvm.schedules``).

Each module exposes ``forward_chunk(classes, dtype, target, **options)``
(the chunk the forward compute should reduce a row in), ``forward(func,
target, **options)`` (the forward and the vocabulary-shard statistics),
``backward(func, target, **options)`` and ``per_row(func, target,
**options)`` (the shard-combine kernel), each taking an unscheduled PrimFunc
from ``ce_tvm.kernels`` and returning it scheduled.
``options`` are the schedule's own (the ascend profile, say). Schedules know
TVM primitives and the compute's stage names (the constants of
``ce_tvm.kernels``); they never know torch, the cache, or each other: what
they share is in ``_common``, and the Ascend tiling plan and cost model in
``ascend_plan``.
"""
