"""Ascend-style tiled schedule: hardware profiles, a tiling plan, a cost model,
and the schedule built from the plan (validated by compiling through LLVM).

No Ascend compiler is available here, so the schedule is expressed in TVM's
generic language the way an AI Core kernel must be laid out, and its numerics
are checked on the CPU:

1. Rows are split into ``block_dim`` parallel blocks (one per vector core).
2. A row is cut into ``chunk``-element tiles sized so that every live buffer
   of the plan fits the Unified Buffer (UB); each tile of the logits is staged
   into a local scratch buffer (``cache_read`` into ``local`` at the tile loop),
   double-buffered (``double_buffer_scope``) when the plan has room for two.
3. The compute on a tile is vectorised (``lanes`` float32 per instruction).
4. When a whole row fits the UB it is staged once and everything (max,
   exp-sum, ``log_prob``) is computed from UB: one read of the logits. Longer
   rows keep an online max/sum over tiles (the compute's ``_softmax_merge``)
   and read the row a second time only to write ``log_prob``: two reads, where
   the vendor kernel makes three plus the write.

Tile sizes are multiples of 32 bytes of the storage dtype and of one float32
vector repeat (64 elements), unless the tile is the whole row.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from tvm import s_tir
from tvm.target import Target

from ._common import (
    CHUNK_REDUCTIONS,
    DTYPE_BYTES,
    SHARD_GATHERS,
    COMBINE_ROWS,
    ROW_FORWARD_REST,
    ROW_GRAD_COEFS,
    classes_of,
    existing_blocks,
    has_block,
    init_row_totals,
    inline_row_helpers,
    is_per_row,
    row_lanes,
    split_reduction,
    vector_accumulators,
    vectorize_inner,
)

OPS = ("forward", "backward")


@dataclass(frozen=True)
class Profile:
    """Public facts about one Ascend part, as the planner and cost model use them."""

    name: str
    vector_cores: int
    ub_bytes: int
    ub_align: int = 32        # UB addresses and tile sizes are 32-byte aligned
    hbm_gbs: float = 1600.0   # global-memory bandwidth
    launch_us: float = 3.0    # fixed cost of one kernel launch
    repeat_bytes: int = 256   # bytes one vector instruction processes per repeat
    repeat_ns: float = 0.55   # one repeat per cycle at ~1.8 GHz
    note: str = ""


PROFILES = {
    "910b": Profile("910b", vector_cores=48, ub_bytes=196608,
                    note="Ascend 910B: 48 AIV cores, 192 KiB UB, ~1.6 TB/s HBM"),
    "950": Profile("950", vector_cores=64, ub_bytes=253952,
                   note="Ascend 950: 64 vector cores, 248 KiB UB; HBM bandwidth assumed as 910B"),
}

# float32 vector operations per element and pass (cast, max, sub, exp ~4, add,
# the smoothing sum, the log_prob subtract and cast); used by the cost model.
FORWARD_OPS_PER_ELEMENT = 10
BACKWARD_OPS_PER_ELEMENT = 8


@dataclass
class Plan:
    """How one (profile, N, C, dtype, op) is laid out on the cores and the UB."""

    profile: str
    op: str
    dtype: str
    rows: int
    classes: int
    block_dim: int
    rows_per_core: list
    chunk: int
    tiles: int
    ub_bytes: int
    buffers: int
    passes: int

    def as_dict(self) -> dict:
        return asdict(self)


def _align(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


def ub_bytes(profile: Profile, chunk: int, dtype: str, op: str, buffers: int) -> int:
    """Peak UB bytes of one core for tiles of ``chunk`` elements, every live buffer counted.

    Staged input and output tiles (storage dtype, ``buffers`` each), the
    float32 cast of the input for half types, a float32 work tile (x - max,
    exp), the float32 weight tile, and the reduction scratch (partial max and
    sums: four repeats) plus 256 bytes of per-row scalars.
    """
    a, esize = profile.ub_align, DTYPE_BYTES[dtype]
    tile = _align(chunk * esize, a)
    f32 = _align(chunk * 4, a)
    cast = f32 if esize < 4 else 0
    staged = 2 * tile * buffers  # input tile in, output tile (log_prob or x_grad) out
    return staged + cast + f32 + f32 + 4 * profile.repeat_bytes + 256


def _tile_quantum(profile: Profile, dtype: str) -> int:
    """Tile sizes are multiples of this many elements (alignment and one fp32 repeat)."""
    return math.lcm(profile.ub_align // DTYPE_BYTES[dtype], profile.repeat_bytes // 4)


def split_rows(rows: int, cores: int) -> list:
    """Front/tail split: the first ``rows % cores`` cores take one row more."""
    block_dim = max(1, min(cores, rows))
    base, extra = divmod(rows, block_dim)
    return [base + (i < extra) for i in range(block_dim)]


def plan(profile, rows: int, classes: int, dtype: str, op: str = "forward") -> Plan:
    """The tiling plan: whole rows in UB when they fit (one pass), else the
    largest aligned tile that fits, double-buffered when two fit."""
    prof = PROFILES[profile] if isinstance(profile, str) else profile
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
    if classes < 1 or rows < 0:
        raise ValueError(f"need C >= 1 and N >= 0, got C={classes}, N={rows}")
    per_core = split_rows(rows, prof.vector_cores)
    chunk, buffers = None, 2
    for buffers in (2, 1):
        if ub_bytes(prof, classes, dtype, op, buffers) <= prof.ub_bytes:
            chunk = classes
            break
    if chunk is None:
        quantum = _tile_quantum(prof, dtype)
        for buffers in (2, 1):
            one, two = (ub_bytes(prof, q * quantum, dtype, op, buffers) for q in (1, 2))
            per_elem, fixed = (two - one) / quantum, 2 * one - two
            chunk = int((prof.ub_bytes - fixed) / per_elem) // quantum * quantum
            while chunk and ub_bytes(prof, chunk, dtype, op, buffers) > prof.ub_bytes:
                chunk -= quantum
            if chunk >= quantum * 2 or buffers == 1:
                break
    tiles = -(-classes // chunk)
    passes = 1 if (tiles == 1 or op == "backward") else 2
    return Plan(prof.name, op, dtype, rows, classes, len(per_core), per_core, chunk, tiles,
                ub_bytes(prof, chunk, dtype, op, buffers), buffers, passes)


def cost(p: Plan) -> dict:
    """Estimated time of ``p`` and of the vendor's 3-read + 1-write tiling.

    Time = launch + global-memory bytes / HBM bandwidth + vector repeats of
    the busiest core x ``repeat_ns``, with the memory and vector terms added
    (no overlap assumed, for both kernels alike).
    """
    prof = PROFILES[p.profile]
    esize = DTYPE_BYTES[p.dtype]
    row_bytes = p.classes * esize
    total = p.rows * row_bytes
    repeats_per_row = math.ceil(p.classes * 4 / prof.repeat_bytes)
    ops = FORWARD_OPS_PER_ELEMENT if p.op == "forward" else BACKWARD_OPS_PER_ELEMENT
    vector_us = max(p.rows_per_core) * repeats_per_row * ops * prof.repeat_ns / 1e3

    def estimate(reads: int, writes: int) -> dict:
        moved = (reads + writes) * total
        mem_us = moved / (prof.hbm_gbs * 1e3)
        return {"reads": reads, "writes": writes, "bytes_per_pass": total, "bytes_moved": moved,
                "memory_us": mem_us, "vector_us": vector_us,
                "time_us": prof.launch_us + mem_us + vector_us}

    if p.op == "backward":
        return {"ce_tvm": estimate(1, 1), "vendor": estimate(1, 1)}
    return {"ce_tvm": estimate(p.passes, 1), "vendor": estimate(3, 1)}


def _profile(profile: str) -> Profile:
    if profile not in PROFILES:
        raise ValueError(f"unknown Ascend profile {profile!r}; known: {sorted(PROFILES)}")
    return PROFILES[profile]


def forward_chunk(classes: int, dtype: str, target: Target, profile: str = "910b") -> int:
    """The compute's row chunk: the plan's UB tile."""
    return plan(_profile(profile), 1, classes, dtype, "forward").chunk


def _stage(sch, consumers, loop, buffers: int, buffer: str = "x"):
    """Stage the tile of ``buffer`` read by ``consumers`` into a local buffer at ``loop``."""
    reads = [r.source.name for r in sch.get(consumers[0]).reads]
    staged = sch.cache_read(consumers[0], reads.index(buffer), "local",
                            consumer_blocks=consumers)
    sch.compute_at(staged, loop)
    if buffers == 2:
        sch.annotate(staged, "double_buffer_scope", 0)
    return staged


def _parallel_rows(sch, row, cores: int) -> None:
    """Split the row loop into one block of rows per vector core, in parallel."""
    blocks, _ = sch.split(row, [cores, None])
    sch.parallel(blocks)


def forward(func, target: Target, profile: str = "910b"):
    """Schedule ``ce_tvm.compute.forward_func`` (built with ``forward_chunk``) from the plan."""
    prof = _profile(profile)
    sch = s_tir.Schedule(func)
    inline_row_helpers(sch)
    dtype = next(str(p.dtype) for p in func.params if len(getattr(p, "shape", ())) == 2)
    p = plan(prof, 1, classes_of(func), dtype, "forward")
    lanes = row_lanes(p.chunk, prof.repeat_bytes // 4)
    names = [b for b in CHUNK_REDUCTIONS if has_block(sch, b)]
    stages = {name: split_reduction(sch, name, lanes) for name in names}
    row, tile_loop = sch.get_loops(sch.get_sblock("ce_rowstats"))
    for name in reversed(names):
        for blk in reversed(stages[name]):
            sch.compute_at(blk, tile_loop)
    for blk in existing_blocks(sch, ROW_FORWARD_REST):
        if is_per_row(sch, blk):
            sch.reverse_compute_at(blk, row)
    readers = [stages[name][0] for name in names if name != "ce_chunk_wsum"]
    log_prob = existing_blocks(sch, ["log_prob"])
    if p.tiles == 1:
        staged = [_stage(sch, readers + log_prob, row, p.buffers)]
    else:
        staged = [_stage(sch, readers, tile_loop, p.buffers)]
        if log_prob:
            tile, _ = sch.split(sch.get_loops(log_prob[0])[-1], [None, p.chunk])
            staged.append(_stage(sch, log_prob, tile, p.buffers))
    _parallel_rows(sch, row, prof.vector_cores)
    for blk in existing_blocks(sch, SHARD_GATHERS):
        _parallel_rows(sch, sch.get_loops(blk)[0], prof.vector_cores)
    for blocks in stages.values():
        if len(blocks) == 2:
            vector_accumulators(sch, blocks[0], outer=3)
    init_row_totals(sch)
    for blk in staged + log_prob:
        vectorize_inner(sch, blk, lanes)
    return sch.mod["main"]


def backward(func, target: Target, profile: str = "910b"):
    """Schedule ``ce_tvm.compute.backward_func``: per-row coefficients, then the
    gradient tile by tile from a staged copy of ``log_prob`` (or the logits)."""
    prof = _profile(profile)
    sch = s_tir.Schedule(func)
    inline_row_helpers(sch)
    dtype = next(str(p.dtype) for p in func.params if len(getattr(p, "shape", ())) == 2)
    p = plan(prof, 1, classes_of(func), dtype, "backward")
    grad = sch.get_sblock("x_grad")
    row = sch.get_loops(grad)[0]
    for blk in reversed(existing_blocks(sch, ROW_GRAD_COEFS)):
        sch.compute_at(blk, row)
    tile, _ = sch.split(sch.get_loops(grad)[-1], [None, p.chunk])
    source = next(r.source.name for r in sch.get(grad).reads)  # log_prob or the logits
    staged = _stage(sch, [grad], tile, p.buffers, source)
    _parallel_rows(sch, row, prof.vector_cores)
    init_row_totals(sch)
    for blk in (staged, grad):
        vectorize_inner(sch, blk, prof.repeat_bytes // 4)
    return sch.mod["main"]


def per_row(func, target: Target, profile: str = "910b"):
    """Schedule a kernel over rows only (``shard_combine_func``): one block of
    rows per vector core."""
    prof = _profile(profile)
    sch = s_tir.Schedule(func)
    inline_row_helpers(sch)
    for blk in existing_blocks(sch, COMBINE_ROWS):
        if is_per_row(sch, blk):
            _parallel_rows(sch, sch.get_loops(blk)[0], prof.vector_cores)
    init_row_totals(sch)
    return sch.mod["main"]
