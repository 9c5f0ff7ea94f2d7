"""Ascend hardware profiles, the tiling plan and the cost model (``ce-tvm plan``).

Plain arithmetic on public facts about the parts: how one (profile, N, C,
dtype, op) is laid out on the vector cores and the Unified Buffer (UB), and
what that costs next to the vendor's kernels (the loss's 3-read + 1-write
tiling; ``OpModel.vendor``). The tiled schedule (``ascend.py``) is built from these plans.

Tile sizes are multiples of 32 bytes of the storage dtype and of one float32
vector repeat (64 elements), unless the tile is the whole row.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..kernels.kinds import DTYPE_BYTES


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
    # Assumed, not measured: a tile's DMA latency (exposed once per tile when
    # single-buffered, once per kernel when double-buffered) and its fixed
    # scalar work per tile (issue, sync), never hidden.
    dma_us: float = 1.0
    tile_us: float = 0.1
    note: str = ""


PROFILES = {
    "910b": Profile("910b", vector_cores=48, ub_bytes=196608,
                    note="Ascend 910B: 48 AIV cores, 192 KiB UB, ~1.6 TB/s HBM"),
    "950": Profile("950", vector_cores=64, ub_bytes=253952,
                   note="Ascend 950: 64 vector cores, 248 KiB UB; HBM bandwidth assumed as 910B"),
}


# The student-teacher divergence's op (also the name of its per-row stage, which
# schedules look up through ce_tvm.kernels.stages, never as a literal).
DIVERGENCE = "divergence"


@dataclass(frozen=True)
class OpModel:
    """What the plan and the cost model know of one kernel: float32 vector
    operations per element and pass; the ``[N, C]`` tiles it writes (staged in UB);
    whether it reads the logits once whatever its tiles; whether it keeps
    ``exp(x - max)`` in UB; the vendor's passes over ``[N, C]`` (reads, writes);
    the ``[N, C]`` inputs it reads (staged side by side); its float32 work tiles;
    its passes over each input when a row takes several tiles."""

    ops_per_element: int
    writes: int
    one_pass: bool
    keeps_exp: bool
    vendor: tuple
    inputs: int = 1
    work_tiles: int = 2
    tiled_passes: int = 2


# The kernels a plan lays out: the loss (forward, backward, the one-pass training
# kernel) and the per-token log-probs with entropy (docs/spec.md, section 9) and their
# gradient.
# Vector operations: the forward's cast, max, sub, exp ~4, add, the smoothing sum,
# the log_prob subtract and cast; the backward's 8; the log-probs' cast, max, sub,
# the 1/T scale, exp ~4, the sum and the entropy's sum (sub, mul, add); their
# gradient's cast, sub, scale, exp ~4, the entropy term (add, mul), the index's
# select, the multiply and cast. The gradients read once; so do the log-probs,
# their chunks' sums merging as they stream by. The vendor's log-probs are its
# log_softmax (3 reads, 1 write), the gather and the entropy over the log_softmax
# (1 read); their gradient at best one fused log_softmax backward (its output and
# the dense upstream gradient read, the gradient written); its training step is
# its forward then its backward. Per-row outputs (log-probs of K indices,
# entropy) are not counted.
# The student-teacher divergence (docs/spec.md, section 15; the generalized JSD
# with its gradient, the costliest direction) reads two rows (student, teacher)
# and computes ~100 operations per element: both maxima, both exp-sums (sub,
# scale, exp ~4, add), the student's entropy sum, the two KL sums over the
# mixture (two log-probs, two exps, the mixture's log ~4, their terms) and the
# gradient, recomputing what a later pass needs rather than keeping tiles. A row
# that fits the UB is staged once (one read of each side); otherwise every pass
# stages its tiles again: six over the student's row (maxima, exp-sum, entropy,
# the two KL sums, the gradient), five over the teacher's, counted as six (an
# upper bound). Its three float32 work tiles: log p, log q, log m. No vendor
# kernel fuses it; the unfused chain counted is the least an eager port needs:
# two log_softmax (3 + 1 each), one fused divergence reading both (2 + 0), its
# backward reading both (2 + 1) and the log_softmax backward (2 + 1).
OP_MODELS = {
    "forward": OpModel(10, writes=1, one_pass=False, keeps_exp=False, vendor=(3, 1)),
    "backward": OpModel(8, writes=1, one_pass=True, keeps_exp=False, vendor=(1, 1)),
    "train": OpModel(18, writes=1, one_pass=False, keeps_exp=True, vendor=(4, 2)),
    "log_probs": OpModel(13, writes=0, one_pass=True, keeps_exp=True, vendor=(4, 1)),
    "log_probs_grad": OpModel(13, writes=1, one_pass=True, keeps_exp=False, vendor=(2, 1)),
    DIVERGENCE: OpModel(100, writes=1, one_pass=False, keeps_exp=False, vendor=(12, 4),
                          inputs=2, work_tiles=3, tiled_passes=6),
}
OPS = tuple(OP_MODELS)
ONE_PASS_OPS = tuple(op for op, model in OP_MODELS.items() if model.one_pass)


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

    Staged input and output tiles (storage dtype, ``buffers`` each; the
    log-probs write no tile; the divergence stages two inputs), the float32
    cast of each input for half types,
    the kept float32 ``exp(x - max)`` (the training kernel's, for the
    gradient; the log-probs', reduced twice), a float32 work tile (x - max,
    exp), the float32 weight tile (the log-probs': their ``x - max``; the
    divergence has a third work tile), and the reduction scratch (partial max
    and sums: four repeats) plus 256 bytes of per-row scalars.
    """
    a, esize = profile.ub_align, DTYPE_BYTES[dtype]
    tile = _align(chunk * esize, a)
    f32 = _align(chunk * 4, a)
    model = OP_MODELS[op]
    cast = model.inputs * f32 if esize < 4 else 0
    staged = (model.inputs + model.writes) * tile * buffers  # inputs in, output out
    kept = f32 if model.keeps_exp else 0
    return staged + cast + kept + model.work_tiles * f32 + 4 * profile.repeat_bytes + 256


def _tile_quantum(profile: Profile, dtype: str) -> int:
    """Tile sizes are multiples of this many elements (alignment and one fp32 repeat)."""
    return math.lcm(profile.ub_align // DTYPE_BYTES[dtype], profile.repeat_bytes // 4)


def get_profile(profile: str) -> Profile:
    """The profile named ``profile`` (``ValueError`` naming the known ones otherwise)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown Ascend profile {profile!r}; known: {sorted(PROFILES)}")
    return PROFILES[profile]


def split_rows(rows: int, cores: int) -> list:
    """Front/tail split: the first ``rows % cores`` cores take one row more."""
    block_dim = max(1, min(cores, rows))
    base, extra = divmod(rows, block_dim)
    return [base + (i < extra) for i in range(block_dim)]


def _check(prof, rows: int, classes: int, dtype: str, op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
    if classes < 1 or rows < 0:
        raise ValueError(f"need C >= 1 and N >= 0, got C={classes}, N={rows}")


def plan(profile, rows: int, classes: int, dtype: str, op: str = "forward") -> Plan:
    """The tiling plan: whole rows in UB when they fit (one pass), else the
    largest aligned tile that fits, double-buffered when two fit."""
    prof = get_profile(profile) if isinstance(profile, str) else profile
    _check(prof, rows, classes, dtype, op)
    chunk, buffers = None, 2
    for buffers in (2, 1):
        if ub_bytes(prof, classes, dtype, op, buffers) <= prof.ub_bytes:
            chunk = classes
            break
    if chunk is None:
        quantum = _tile_quantum(prof, dtype)
        for buffers in (2, 1):
            chunk = _largest_tile(prof, dtype, op, buffers)
            if chunk >= quantum * 2 or buffers == 1:
                break
    return tiled(prof, rows, classes, dtype, op, chunk, buffers)


def _largest_tile(prof: Profile, dtype: str, op: str, buffers: int) -> int:
    """The largest multiple of the tile quantum whose buffers fit the UB (0 if none)."""
    quantum = _tile_quantum(prof, dtype)
    one, two = (ub_bytes(prof, q * quantum, dtype, op, buffers) for q in (1, 2))
    per_elem, fixed = (two - one) / quantum, 2 * one - two
    chunk = int((prof.ub_bytes - fixed) / per_elem) // quantum * quantum
    while chunk and ub_bytes(prof, chunk, dtype, op, buffers) > prof.ub_bytes:
        chunk -= quantum
    return chunk


def tiled(profile, rows: int, classes: int, dtype: str, op: str, chunk: int,
          buffers: int) -> Plan:
    """The plan with tiles of ``chunk`` elements (``C`` at most) and ``buffers`` buffers."""
    prof = get_profile(profile) if isinstance(profile, str) else profile
    per_core = split_rows(rows, prof.vector_cores)
    chunk = min(chunk, classes)
    tiles = -(-classes // chunk)
    # One read of the logits when the row's tiles fit the UB (the training
    # kernel keeps exp(x - max) there); else a second read (log_prob, or the
    # training kernel's gradient, recomputing exp), unless the op reads once
    # anyway; the divergence reads each side once per pass (``tiled_passes``).
    model = OP_MODELS[op]
    passes = 1 if (tiles == 1 or model.one_pass) else model.tiled_passes
    return Plan(prof.name, op, dtype, rows, classes, len(per_core), per_core, chunk, tiles,
                ub_bytes(prof, chunk, dtype, op, buffers), buffers, passes)


def candidate_plans(profile, rows: int, classes: int, dtype: str, op: str = "forward") -> list:
    """Every plan that fits the UB: tiles of each multiple of the tile quantum
    below ``C`` (and the whole row), single- or double-buffered; the search
    space of ``search_plan``."""
    prof = get_profile(profile) if isinstance(profile, str) else profile
    _check(prof, rows, classes, dtype, op)
    quantum = _tile_quantum(prof, dtype)
    out = []
    for buffers in (2, 1):
        largest = _largest_tile(prof, dtype, op, buffers)
        chunks = list(range(quantum, min(largest, classes - 1) + 1, quantum))
        if ub_bytes(prof, classes, dtype, op, buffers) <= prof.ub_bytes:
            chunks.append(classes)
        out += [tiled(prof, rows, classes, dtype, op, c, buffers) for c in chunks]
    return out


def search_plan(profile, rows: int, classes: int, dtype: str, op: str = "forward") -> Plan:
    """The plan of ``candidate_plans`` that the cost model (``cost``) finds fastest;
    ``plan``'s on a tie (it is one of the candidates, so never costlier)."""
    fixed = plan(profile, rows, classes, dtype, op)
    best = min(candidate_plans(profile, rows, classes, dtype, op),
               key=lambda p: cost(p)["ce_tvm"]["time_us"])
    return best if cost(best)["ce_tvm"]["time_us"] < cost(fixed)["ce_tvm"]["time_us"] else fixed


def cost(p: Plan) -> dict:
    """Estimated time of ``p`` and of the vendor's kernels for the same op
    (``OpModel.vendor``: the loss's forward is its 3-read + 1-write tiling).

    Time = launch + global-memory bytes / HBM bandwidth + vector repeats of
    the busiest core x ``repeat_ns``, the memory and vector terms added (no
    overlap assumed, for both kernels alike), plus, for ``p``, its tiles: the
    busiest core's tile steps (rows x tiles x passes) each cost ``tile_us``
    and, single-buffered, ``dma_us`` of exposed latency; double-buffered,
    the memory and vector work of one step overlap the next's, so the sum of
    the two terms shrinks to their maximum plus one step's share of the
    minimum (filling the pipeline) and ``dma_us`` is paid once.
    """
    prof = PROFILES[p.profile]
    esize = DTYPE_BYTES[p.dtype]
    row_bytes = p.classes * esize
    total = p.rows * row_bytes
    repeats_per_row = math.ceil(p.classes * 4 / prof.repeat_bytes)
    model = OP_MODELS[p.op]
    vector_us = (max(p.rows_per_core) * repeats_per_row * model.ops_per_element
                 * prof.repeat_ns / 1e3)

    def estimate(reads: int, writes: int) -> dict:
        moved = (reads + writes) * total
        mem_us = moved / (prof.hbm_gbs * 1e3)
        return {"reads": reads, "writes": writes, "bytes_per_pass": total, "bytes_moved": moved,
                "memory_us": mem_us, "vector_us": vector_us,
                "time_us": prof.launch_us + mem_us + vector_us}

    def tiled_estimate(reads: int, writes: int) -> dict:
        e = estimate(reads, writes)
        steps = max(max(p.rows_per_core), 1) * p.tiles * p.passes
        mem, vec = e["memory_us"], e["vector_us"]
        if p.buffers == 2:
            body, exposed = max(mem, vec) + min(mem, vec) / steps, prof.dma_us
        else:
            body, exposed = mem + vec, steps * prof.dma_us
        e.update(tile_steps=steps, tiles_us=steps * prof.tile_us + exposed,
                 time_us=prof.launch_us + body + steps * prof.tile_us + exposed)
        return e

    return {"ce_tvm": tiled_estimate(p.passes * model.inputs, model.writes),
            "vendor": estimate(*model.vendor)}

