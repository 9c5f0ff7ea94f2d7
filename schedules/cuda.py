"""CUDA schedule for the fused cross-entropy forward and backward.

Expects the blocks that ``ce_tvm.kernels`` names; the math is never touched.

Forward (and the vocabulary-shard statistics, and the log-prob kernels):

1. One thread block of ``threads`` threads per row (``blockIdx.x``).
2. A row longer than ``max_chunk`` (the forward and log-prob kernels') is
   merged in lanes (``forward_lanes``, ``schedule_forward_lanes``): each
   thread loads one 16-byte vector of the row into registers, reduces it and
   merges it into its own online-softmax lane, then the vector ``threads``
   further on (coalesced); the lanes meet once per row in cross-thread max,
   sum and min reductions. On an H200 the bf16 forward at 8192 x 128256 ran
   at 89% of one read of the logits (0.574 ms against 0.509).
3. Otherwise the row is reduced in chunks of ``forward_chunk`` classes (the
   whole row when it fits): each chunk is staged once into shared memory with
   coalesced, 128-bit vectorised loads (``cache_read`` to ``shared`` at the
   chunk loop), so the logits are read from global memory exactly once; the
   chunk's max, exp-sum and weighted sums are cross-thread reductions
   (``threadIdx.x`` on the reduction loop: TVM lowers them to warp shuffles
   plus shared memory), merged over chunks by the compute's online-softmax
   reducer. Accumulation is float32.
4. ``log_prob`` (seed API) is written from a second, coalesced pass, which
   reads the staged row when the row is one chunk, or when the whole row
   fits shared memory (``stages_whole_row``: then it is staged whole and its
   chunks reduced from there); else the logits again (the chunk staged last
   is not the row, and ``lse`` is known only after the last chunk).
5. Sums over rows run in one block with a cross-thread reduction: a fixed
   order, so results are deterministic (no atomics). Consecutive
   single-block stages (the sums, the loss finalisers) are one kernel, so a
   ``mean`` forward is 2 launches.

Backward: one block per row; per-row coefficients once per thread, then the
gradient with coalesced (128-bit where the row is 16-byte aligned) loads and
stores, ``CUDAKnobs.unroll`` block sweeps per iteration. Indices are int64
throughout (``N`` is an int64 variable).

Training (``train_func``, loss and gradient in one sweep): see ``train``.

Every kernel: ``exp`` is ``exp2f`` (``exp_scaling``); intermediate buffers
passed between launches are parameters filled by the caller's torch
allocation (``scratch_as_params``), never TVM's workspace pool.

``dlight.gpu.GeneralReduction`` schedules the same compute too (it is the
baseline ``benchmarks/gpu_check.py`` compares with): it re-reads the row from
global memory for every reduction.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import tvm_ffi
from tvm import s_tir, tirx
from tvm.target import Target

from ..kernels.common import matrix_param
from ..kernels.kinds import CUDA_SCRATCH_ROWS, CUDA_SCRATCH_SINGLES, DTYPE_BYTES
from ..kernels.stages import (
    CHUNK_EXP,
    CHUNK_EXPSUM,
    CHUNK_LOGITS,
    CHUNK_MAX,
    CHUNK_PSCALE,
    CHUNK_WSUM,
    LANE_STATS,
    LANES_EXPSUM,
    LANES_MAX,
    LANES_VALUES,
    LOG_PROB,
    LOGITS,
    LSE,
    MEAN_NORMS,
    ROW_CE,
    ROW_LOG_EXPSUM,
    ROW_MAX,
    ROW_TARGET_LOGIT,
    ROW_Z,
    ROWSTATS,
    WSUM,
    X_GRAD,
)
from ._common import (
    COMBINE_ROWS,
    ROW_GRAD_COEFS,
    ROW_INDEPENDENT,
    ROW_PRODUCERS,
    ROW_TOTALS,
    SHARD_GATHERS,
    all_blocks,
    classes_of,
    divergence_row,
    has_stage,
    inline_capped_chunk,
    inline_row_helpers,
    is_per_row,
    join_row,
    place_chunk_stages,
    place_grad_coefficients,
    place_row_rest,
    place_row_stages,
    present_blocks,
    row_sweep,
    sample_knobs,
)

VECTOR_BYTES = 16  # one 128-bit load or store per thread
# Shared memory per SM by compute capability (KB; CUDA programming guide): a row
# the log_prob forward stages whole (``stages_whole_row``) takes at most half,
# less 2 KB (the reductions' scratch, the 1 KB the driver reserves per block), so
# that 2 blocks share an SM. Above ``STATIC_STAGE_BYTES`` it is dynamic shared
# memory (``shared.dyn``; TVM's runtime raises the kernel's dynamic shared
# memory limit at launch), static below (48 KB at most).
SMEM_PER_SM_KB = {"sm_80": 164, "sm_87": 164, "sm_86": 100, "sm_89": 100, "sm_90": 228,
                  "sm_100": 228, "sm_120": 100}
STATIC_STAGE_BYTES = 40 * 1024
# Threads of the one block that sums the class weights (``ce_wsum``) before the
# row kernel: latency-bound (one SM), so as many loads in flight as a block
# holds (nvcc unrolls each thread's loop ~20 loads deep: ~80 KB in flight).
WIDE_BLOCK = 1024
# TVM's StorageRewrite folds each chunk reduction's one-element ``local`` result
# into a buffer that LowerThreadAllreduce then maps to its ``volatile`` shared
# slot: every use of the chunk max became a shared load the compiler may not
# merge (10 per element in the exp-sum loop). Without it the result is copied
# into a register once per reduction (``benchmarks/cuda_static.py``: bcast_lds/el).
PASS_CONFIG = {"tirx.disable_storage_rewrite": True}
# The log-prob kernels evaluate a chunk's exp in each of its two sums
# (``kernels.choices.chunk_exp_kept``): exp2f is 5 instructions, a kept chunk a scratch
# the launch would have to provide.
KEEPS_CHUNK_EXP = False


def exp_scaling(target: Target) -> str:
    """``fastmath.exp`` as ``exp2f`` (special-function unit): 5 instructions per
    element where the polynomial took about 19 (``benchmarks/cuda_static.py``)."""
    return "exp2"


@dataclass(frozen=True)
class CUDAKnobs:
    """``threads`` per row block (a multiple of the 32-thread warp); ``max_chunk``:
    classes staged in shared memory at once (16 KiB of float32 at 4096);
    ``unroll``: sweeps of the block per iteration of a streaming element loop
    (gradient, ``log_prob``): 4 keeps 4 loads per thread in flight (32 bytes
    of 16-bit logits, one 8-byte vector each), where one left the bf16 backward
    short of bytes in flight (review item 8). ``rows_per_block``: rows sharing
    a block, ``threads / rows_per_block`` threads each (a warp per row at
    128 / 4: for short rows); ``vector_bytes``: the widest load or store per
    thread; ``lane_vectors``: the vectors a thread reduces at a time before it
    merges them into its lane (``forward_lanes``). Two take 17-29% fewer
    instructions per element than one (the merge's two ``exp`` and selects
    amortised over twice the elements; sm_90 machine code, C = 128256:
    the forward bf16 12.3 -> 10.2, fp32 15.2 -> 10.9, the log-probs 23.5 -> 19.1
    and 29.0 -> 20.6, before their branch-free entropy term: 13.9 and 16.8) and
    keep as many bytes in flight per SM, the bf16 log-probs at 39 registers (6
    blocks of 256 threads per SM) instead of 32 (8 blocks); four took 80
    registers there (1.34x the cycles of two in GPGPU-Sim: fewer blocks per
    SM). A short row keeps one vector
    (``LANE_PADDING``). ``lane_rounds``: rounds of the lane loop per
    iteration, unrolled (``LOG_PROBS_KNOBS``). ``gradient_backwards``: the
    training kernel in lanes sweeps its gradient from the row's end
    (``TRAIN_LANES_KNOBS``)."""

    threads: int = 256
    max_chunk: int = 4096
    unroll: int = 4
    rows_per_block: int = 1
    vector_bytes: int = VECTOR_BYTES
    lane_vectors: int = 2
    lane_rounds: int = 1
    gradient_backwards: bool = False

    @property
    def row_threads(self) -> int:
        return self.threads // self.rows_per_block


def with_options(knobs: CUDAKnobs, options: dict) -> CUDAKnobs:
    """``knobs`` with a call scope's schedule options over them
    (``ce_tvm.schedule("cuda", threads=512)``: the options name ``CUDAKnobs``
    fields, their values strings, as a kernel's spec keeps them)."""
    names = [f.name for f in fields(CUDAKnobs)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"unknown CUDA schedule options {unknown}; the knobs are {names}")
    return replace(knobs, **{k: _knob_value(k, v, type(getattr(knobs, k)))
                             for k, v in options.items()})


def _knob_value(name: str, text: str, kind: type):
    words = {"true": True, "1": True, "false": False, "0": False} if kind is bool else {}
    try:
        return words[str(text).lower()] if kind is bool else kind(text)
    except (KeyError, ValueError):
        expected = "true or false" if kind is bool else "an integer"
        raise ValueError(f"CUDA schedule option {name}={text!r}: expected {expected}") from None


def knob_space(op: str, classes: int, dtype: str, target: Target) -> dict:
    """The knobs of ``op``'s schedule and their choices, the hand schedule's first.
    ``max_chunk`` (the forward's only) sizes the chunk the compute is declared
    with (``forward_chunk``). Candidates are built, never measured, without a GPU.

    The forward keeps a block per row: with rows on ``threadIdx.y`` its
    per-row local buffers lose their constant size and TVM 0.27's CUDA
    codegen refuses them ("constant size stack allocation").
    """
    threads, vector, unroll = (256, 128, 512), (16, 8), (4, 1)
    if op == "forward":
        return {"max_chunk": (4096, 2048, 8192), "threads": threads, "vector_bytes": vector,
                "unroll": unroll}
    if op == "backward":
        return {"threads": threads, "rows_per_block": (1, 4), "vector_bytes": vector,
                "unroll": unroll}
    raise ValueError(f"no tunable CUDA schedule for {op!r}")


def knob_chunk(op: str, classes: int, dtype: str, target: Target, knobs: dict) -> int | None:
    """The chunk the compute of ``op`` is declared with for ``knobs`` (``None``: no chunk)."""
    return forward_chunk(classes, dtype, target, CUDAKnobs(**knobs)) if op == "forward" else None


def schedule_knobs(sch, op: str, target: Target, space: dict, decisions: dict | None = None):
    """Schedule ``op`` with knobs drawn from ``space`` by sampling instructions
    (``decisions`` fixes them); the compute must be declared with the chunk
    ``forward_chunk`` gives for them. ``finish`` completes the function."""
    knobs = CUDAKnobs(**sample_knobs(sch, space, decisions))
    schedule = {"forward": schedule_forward, "backward": schedule_backward}[op]
    func = sch.mod["main"]
    if op == "forward":
        chunk = forward_chunk(classes_of(func), str(matrix_param(func).dtype), target, knobs)
        if chunk != _chunk(sch):
            raise ValueError(f"knobs {knobs} need chunk {chunk}, the compute has {_chunk(sch)}")
    return schedule(sch, target, knobs)


def forward_chunk(classes: int, dtype: str, target: Target, knobs: CUDAKnobs = CUDAKnobs(),
                  **options) -> int:
    """The whole row when it fits ``max_chunk``; else the smallest number of
    equal chunks, each a multiple of one vectorised sweep of the block."""
    knobs = with_options(knobs, options)
    if classes <= knobs.max_chunk:
        return classes
    sweep = knobs.row_threads * knobs.vector_bytes // DTYPE_BYTES[dtype]
    chunks = -(-classes // knobs.max_chunk)
    per_chunk = -(-classes // chunks)
    return -(-per_chunk // sweep) * sweep


def forward_lanes(classes: int, dtype: str, variant, target: Target,
                  knobs: CUDAKnobs = CUDAKnobs(), **options) -> tuple[int | None, int]:
    """``(chunk, lanes)`` of a forward row longer than ``max_chunk``: chunks of
    ``lane_vectors`` vectors (``vector_bytes``) merged in a lane per thread of the row's block
    (``schedule_forward_lanes``); ``(None, 0)`` (``forward_chunk``'s chunks) for
    a row staged whole: a shorter one, or the ``log_prob`` variant's where it
    fits (``stages_whole_row``: read once for both passes)."""
    knobs = with_options(knobs, options)
    if stages_whole_row(classes, forward_chunk(classes, dtype, target, knobs), dtype,
                        variant.log_prob, staged_row_bytes(target)):
        return None, 0
    return log_probs_lanes(classes, dtype, variant, target, knobs)


def log_probs_lanes(classes: int, dtype: str, variant, target: Target,
                    knobs: CUDAKnobs = CUDAKnobs(), **options) -> tuple[int | None, int]:
    """``forward_lanes`` of the log-prob kernels, which write no ``log_prob``:
    a row longer than ``max_chunk`` in lanes."""
    knobs = with_options(knobs, options)
    if classes <= knobs.max_chunk:
        return None, 0
    vector, lanes = knobs.vector_bytes // DTYPE_BYTES[dtype], knobs.row_threads

    def padded(chunk):  # the elements the lanes' rounds span
        return -(-classes // (chunk * lanes)) * chunk * lanes

    chunk = knobs.lane_vectors * vector
    if padded(chunk) > LANE_PADDING * padded(vector):
        chunk = vector
    return chunk, lanes


# Several vectors per lane step unless their rounds span this much more of the row
# than one vector's: at C = 5003 (bf16) two vectors' rounds span 8192 elements
# against one's 6144, and one vector ran 13-15% faster in GPGPU-Sim (forward and
# log-probs, 92 rows); at C = 32000 both span 32768, and two ran 11-13% faster.
LANE_PADDING = 1.10


def _vector_width(classes: int, extent: int, dtype: str, computes: bool = False,
                  vector_bytes: int = VECTOR_BYTES) -> int:
    """128-bit vectors when every row starts 16-byte aligned and ``extent`` divides evenly.

    A loop that computes in float32 (not a plain copy) is held to 4 lanes: TVM
    0.27's CUDA codegen emits an invalid ``make_ulonglong4`` for an 8-lane
    float32 broadcast, so half types load 64 bits there.
    """
    lanes = vector_bytes // DTYPE_BYTES[dtype]
    if computes:
        lanes = min(lanes, VECTOR_BYTES // 4)
    aligned = (classes * DTYPE_BYTES[dtype]) % vector_bytes == 0
    return lanes if aligned and extent % lanes == 0 else 1


def _thread_loop(sch, loop, threads: int, lanes: int = 1, unroll: int = 1):
    """Spread ``loop`` over ``threadIdx.x`` (coalesced), vectorising ``lanes`` per
    thread; ``unroll`` consecutive sweeps of the block per iteration (their
    loads independent, so in flight together). Returns the loop over the
    iterations."""
    factors = [None] + ([unroll] if unroll > 1 else []) + [threads] + ([lanes] if lanes > 1 else [])
    loops = sch.split(loop, factors)
    if lanes > 1:
        sch.vectorize(loops[-1])
    if unroll > 1:
        sch.unroll(loops[1])
    sch.bind(loops[-2] if lanes > 1 else loops[-1], "threadIdx.x")
    return loops[0]


def _bind_rows(sch, loop, threads: int) -> None:
    """A loop over rows as a grid of ``threads``-thread blocks, one row per thread."""
    bx, tx = sch.split(loop, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def _bind_single_block_reductions(sch, threads: int) -> None:
    """The stages that are not per row (sums over rows, ``ce_wsum`` over classes,
    the loss finalisers, the mean's norms) run in one block, each reduction
    cross-thread; consecutive ones (in program order) are fused into one kernel
    (``merge``), and a sum read only inside its kernel stays in registers. A
    kernel of row-independent sums alone (``ce_wsum`` before the row kernel)
    gets ``WIDE_BLOCK`` threads: one block streams all of ``w``."""
    groups, run = [], []
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if is_per_row(sch, block) and sch.get(block).name_hint != MEAN_NORMS:
            if run:
                groups.append(run)
            run = []
        else:
            run.append(block)
    if run:
        groups.append(run)
    for group in groups:
        names = [sch.get(b).name_hint for b in group]
        width = WIDE_BLOCK if set(names) <= set(ROW_INDEPENDENT) else threads
        loops = []
        for block in group:
            loop = sch.get_loops(block)[0]
            if int(sch.get(loop).extent) != 1:  # the mean's norms: both in one thread
                loop, _ = sch.split(loop, [1, None])
            loops.append(loop)
        outer = sch.merge(*loops) if len(loops) > 1 else loops[0]
        sch.bind(outer, "blockIdx.x")
        for block in group:
            if sch.get(block).name_hint in ROW_TOTALS + (WSUM,):
                _, tx = sch.split(sch.get_loops(block)[-1], [None, width])
                sch.bind(tx, "threadIdx.x")
        if not any(sch.get(block).name_hint in ROW_TOTALS + (WSUM,) for block in group):
            _, tx = sch.split(outer, [None, 1])
            sch.bind(tx, "threadIdx.x")
        for block in group:
            consumers = [sch.get(c).name_hint for c in sch.get_consumers(block)]
            if sch.get(block).name_hint in ROW_TOTALS + (WSUM,) and consumers and all(
                    c in names for c in consumers):
                sch.set_scope(block, 0, "local")


def forward(func, target: Target, knobs: CUDAKnobs = CUDAKnobs(), **options):
    """Schedule ``forward_func`` / ``shard_stats_func`` (built with ``forward_chunk``,
    or ``forward_lanes``)."""
    knobs = with_options(knobs, options)
    sch = s_tir.Schedule(func)
    lanes = has_stage(sch, LANE_STATS)
    return finish((schedule_forward_lanes if lanes else schedule_forward)(
        sch, target, knobs).mod["main"])


def schedule_forward_lanes(sch, target: Target, knobs: CUDAKnobs = CUDAKnobs()):
    """The forward of a row merged in lanes (``forward_lanes``), before ``finish``:
    a block per row, a lane per thread. Each thread loads its chunk
    (``lane_vectors`` vectors) into registers, reduces it (max, exp-sum, sums),
    merges it into its lane and goes on to the chunk ``threads`` further
    (coalesced: the block's threads read consecutive chunks; ``lane_rounds``
    such rounds an iteration, unrolled, where they divide the row's rounds:
    no tail to guard); the lanes then
    meet once per row, in one cross-thread max and one cross-thread sum per
    merged value. No shared-memory staging and no block-wide reduction per
    chunk, which the chunked schedule pays for.

    The training kernel in lanes (``train_lanes``) is the same sweep, then its
    per-row gradient coefficients (in registers, every thread) and the
    gradient, streamed over the row as ``log_prob`` is."""
    func = sch.mod["main"]
    inline_row_helpers(sch)
    dtype, classes = str(matrix_param(func).dtype), classes_of(func)
    row, lane, chunk_loop = sch.get_loops(sch.get_sblock(LANE_STATS))
    names = list(place_chunk_stages(sch, chunk_loop, lanes=1))
    names += [CHUNK_EXP] if has_stage(sch, CHUNK_EXP) else []
    capped = present_blocks(sch, [CHUNK_LOGITS])
    readers = [b for b in [sch.get_sblock(n) for n in names] + capped
               if LOGITS in [r.source.name for r in sch.get(b).reads]]
    loaded = sch.cache_read(readers[0], _read_index(sch, readers[0], LOGITS), "local",
                            consumer_blocks=readers)
    sch.compute_at(loaded, chunk_loop)
    across = present_blocks(sch, (LANES_MAX, LANES_EXPSUM, *LANES_VALUES))
    for blk in across:
        sch.reverse_compute_at(blk, row)
    if has_stage(sch, X_GRAD):  # the training kernel
        place_grad_coefficients(sch)
    row = place_row_rest(sch, row, then=(X_GRAD,))
    _shared_row_outputs(sch, row)
    per_row_only = [] if present_blocks(sch, ROW_TOTALS) else [ROW_CE, ROW_Z]
    _keep_on_chip(sch, func, names + [CHUNK_LOGITS, LANE_STATS, LANES_MAX, LANES_EXPSUM,
                                      *LANES_VALUES, ROW_TARGET_LOGIT, *ROW_GRAD_COEFS]
                  + per_row_only)
    sch.bind(row, "blockIdx.x")
    sch.bind(lane, "threadIdx.x")
    copy = sch.get_loops(loaded)[-1]
    vector = knobs.vector_bytes // DTYPE_BYTES[dtype]
    if int(sch.get(copy).extent) > vector:  # a chunk of several vectors
        vectors, copy = sch.split(copy, [None, vector])
        sch.unroll(vectors)
    if _vector_width(classes, int(sch.get(copy).extent), dtype,
                     vector_bytes=knobs.vector_bytes) > 1:
        sch.vectorize(copy)
    else:
        sch.unroll(copy)
    for blk in [sch.get_sblock(n) for n in names] + capped:
        for loop in sch.get_loops(blk)[3:]:
            sch.unroll(loop)
    for blk in across:
        sch.bind(sch.get_loops(blk)[-1], "threadIdx.x")
    rounds = int(sch.get(chunk_loop).extent)
    if knobs.lane_rounds > 1 and rounds % knobs.lane_rounds == 0:
        sch.unroll(sch.split(chunk_loop, [None, knobs.lane_rounds])[1])
    for blk in present_blocks(sch, [LOG_PROB, X_GRAD]):
        sweep = _thread_loop(sch, _own_loop(sch, blk, row), knobs.row_threads,
                             _vector_width(classes, classes, dtype, True, knobs.vector_bytes),
                             knobs.unroll)
        if sch.get(blk).name_hint == X_GRAD and knobs.gradient_backwards:
            sch.annotate(sweep, BACKWARDS, 1)
    _bind_single_block_reductions(sch, knobs.threads)
    return sch


# Per-row outputs that other per-row stages of the same kernel read.
ROW_OUTPUTS_READ = (LSE, ROW_MAX, ROW_LOG_EXPSUM)


def _shared_row_outputs(sch, row) -> None:
    """After the lanes meet, TVM writes a value computed from a cross-thread
    reduction's result from thread 0 alone: a row's ``lse`` (``row_max``,
    ``log_expsum``) reaches global memory from thread 0, and the other threads
    of a stage that reads it there (the z-loss, ``log_prob``, the token
    log-probs) would race it (an H200 read garbage). Each such output is
    written through shared memory, where its readers take it after a barrier
    (TVM's thread sync), and copied out from there, under the row loop ``row``."""
    for blk in present_blocks(sch, ROW_OUTPUTS_READ):
        readers = sch.get_consumers(blk)
        if readers:
            sch.reverse_compute_at(sch.cache_write(blk, 0, "shared", consumer_blocks=readers),
                                   row)


def _bind_row_blocks(sch, row, rows_per_block: int) -> None:
    """Rows on ``blockIdx.x``, ``rows_per_block`` of them per block on ``threadIdx.y``."""
    if rows_per_block == 1:
        sch.bind(row, "blockIdx.x")
        return
    bx, ty = sch.split(row, [None, rows_per_block])
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")


def staged_row_bytes(target: Target) -> int:
    """The largest row the log_prob forward stages whole on ``target``'s arch
    (``SMEM_PER_SM_KB``; an unknown arch: the smallest listed)."""
    per_sm = SMEM_PER_SM_KB.get(str(target.attrs.get("arch", "")), min(SMEM_PER_SM_KB.values()))
    return (per_sm // 2 - 2) * 1024


def stages_whole_row(classes: int, chunk: int, dtype: str, log_prob: bool,
                     limit: int) -> bool:
    """Whether the forward stages the whole row in shared memory, not chunk by
    chunk: when the row is one chunk; and for the ``log_prob`` forward when
    the row fits ``limit`` bytes (``staged_row_bytes``) and every row starts
    16-byte aligned, so that ``log_prob`` is written from the staged row: the
    logits read once, 2 passes over HBM instead of 3 (C = 32000 bf16 on
    sm_90: 64 KB per block, 3 blocks per SM).

    Not for rows that are not 16-byte aligned (C = 50257 bf16, 98 KB): staged
    with 2-byte loads at 2 blocks per SM, ~4 KB are in flight per SM where
    ~23 KB are needed (4.3 TB/s over 132 SMs, ~0.7 us latency); the chunked
    forward keeps 5 blocks per SM loading. Rows over ``limit`` (C = 128256
    bf16: 250 KB, more than a block may hold; C = 50257 fp32: 196 KB, one
    block per SM) are chunked."""
    if chunk == classes:
        return True
    row_bytes = classes * DTYPE_BYTES[dtype]
    return log_prob and row_bytes <= limit and row_bytes % VECTOR_BYTES == 0


def schedule_forward(sch, target: Target, knobs: CUDAKnobs = CUDAKnobs()):
    """``forward`` on a given schedule (before ``finish``)."""
    func = sch.mod["main"]
    inline_row_helpers(sch)
    inline_capped_chunk(sch)  # the chunk is in shared memory already: tanh per read
    dtype, classes = str(matrix_param(func).dtype), classes_of(func)
    # log_prob reads the staged row too: one read
    whole_row = stages_whole_row(classes, _chunk(sch), dtype, has_stage(sch, LOG_PROB),
                                 staged_row_bytes(target))
    row, chunk_loop, stages = place_row_stages(sch, lanes=1)
    names = list(stages)
    readers = [sch.get_sblock(n) for n in names if n != CHUNK_WSUM]
    if whole_row:
        readers += present_blocks(sch, (LOG_PROB,))
    dynamic = whole_row and classes * DTYPE_BYTES[dtype] > STATIC_STAGE_BYTES
    staged = sch.cache_read(readers[0], _read_index(sch, readers[0], "x"),
                            "shared.dyn" if dynamic else "shared", consumer_blocks=readers)
    sch.compute_at(staged, row if whole_row else chunk_loop)
    per_row_only = [] if present_blocks(sch, ROW_TOTALS) else [ROW_CE, ROW_Z]
    _keep_on_chip(sch, func, names + [ROWSTATS, ROW_TARGET_LOGIT, *ROW_PRODUCERS] + per_row_only)
    _bind_row_blocks(sch, row, knobs.rows_per_block)
    copy = _own_loop(sch, staged, row, chunk_loop)
    if copy is not None:
        _thread_loop(sch, copy, knobs.row_threads, _vector_width(
            classes, int(sch.get(copy).extent), dtype, vector_bytes=knobs.vector_bytes))
    for name in names:
        if (loop := _own_loop(sch, sch.get_sblock(name), row, chunk_loop)) is not None:
            _thread_loop(sch, loop, knobs.row_threads)
    if has_stage(sch, LOG_PROB):
        inner = _own_loop(sch, sch.get_sblock(LOG_PROB), row)
        if inner is not None:
            _thread_loop(sch, inner, knobs.row_threads, _vector_width(
                classes, classes, dtype, True, knobs.vector_bytes), knobs.unroll)
    for blk in present_blocks(sch, SHARD_GATHERS):
        _bind_rows(sch, sch.get_loops(blk)[0], knobs.threads)
    _bind_single_block_reductions(sch, knobs.threads)
    return sch


def _own_loop(sch, block, *outer):
    """``block``'s innermost loop, or ``None`` where it has none below the
    ``outer`` loops: with C = 1 a staged row, a chunk's reductions and
    ``log_prob`` are one element, which TVM gives no loop. Such a block is left
    to every thread of the row's block (each computes the same value: no
    cross-thread reduction to feed); binding its last loop bound the row loop
    itself, and the build failed."""
    loop = sch.get_loops(block)[-1]
    return None if any(sch.get(loop).same_as(sch.get(o)) for o in outer) else loop


def _under(sch, block, loop) -> bool:
    return any(sch.get(outer).same_as(sch.get(loop)) for outer in sch.get_loops(block))


def _chunk(sch) -> int:
    """The chunk the compute reduces a row in (the extent of the chunk max's reduction)."""
    return int(sch.get(sch.get_loops(sch.get_sblock(CHUNK_MAX))[-1]).extent)


def _keep_on_chip(sch, func, names) -> None:
    """Per-row intermediates live in registers (``local``), not global memory."""
    params = {p.name for p in func.params if hasattr(p, "shape")}
    for block in present_blocks(sch, names):
        for i, region in enumerate(sch.get(block).writes):
            if region.source.name not in params:
                sch.set_scope(block, i, "local")


def _read_index(sch, block, buffer: str) -> int:
    return [r.source.name for r in sch.get(block).reads].index(buffer)


def backward(func, target: Target, knobs: CUDAKnobs = CUDAKnobs(), **options):
    """Schedule ``backward_func``: a block per row, coalesced element loop."""
    return finish(schedule_backward(s_tir.Schedule(func), target,
                                    with_options(knobs, options)).mod["main"])


def schedule_backward(sch, target: Target, knobs: CUDAKnobs = CUDAKnobs()):
    """``backward`` on a given schedule (before ``finish``)."""
    func = sch.mod["main"]
    inline_row_helpers(sch)
    grad, row = place_grad_coefficients(sch)
    _row_values_in_registers(sch, grad)
    col = sch.get_loops(grad)[-1]
    _keep_on_chip(sch, func, ROW_GRAD_COEFS)
    _bind_row_blocks(sch, row, knobs.rows_per_block)
    written = sch.get(grad).writes[0].source
    dtype, classes = str(written.dtype), int(written.shape[1])
    _thread_loop(sch, col, knobs.row_threads, _vector_width(
        classes, classes, dtype, True, knobs.vector_bytes), knobs.unroll)
    _bind_single_block_reductions(sch, knobs.threads)
    return sch


def _row_values_in_registers(sch, grad) -> None:
    """The per-row inputs the gradient reads for every element (the log-prob
    gradient's ``row_max``, ``log_expsum``, ``entropy``, upstream gradients and
    indices: ``[N]`` or ``[N, K]`` parameters), copied into registers once per
    row: nvcc re-read them from global memory per element (it cannot tell them
    from the gradient's stores)."""
    rows = sch.get(grad).writes[0].source.shape[0]
    params = {p.name for p in sch.mod["main"].params if hasattr(p, "shape")}
    for i, region in reversed(list(enumerate(sch.get(grad).reads))):
        buf = region.source
        if buf.name in params and buf.shape[0].same_as(rows) and (len(buf.shape) == 1 or (
                len(buf.shape) == 2 and int(buf.shape[1]) <= MAX_ROW_VALUES)):
            copy = sch.cache_read(grad, i, "local", consumer_blocks=[grad])
            sch.compute_at(copy, sch.get_loops(grad)[0])


# The widest ``[N, K]`` input held in registers per row (``_row_values_in_registers``).
MAX_ROW_VALUES = 8


def per_row(func, target: Target, knobs: CUDAKnobs = CUDAKnobs(), **options):
    """Schedule ``shard_combine_func``: one row per thread."""
    knobs = with_options(knobs, options)
    sch = s_tir.Schedule(func)
    inline_row_helpers(sch)
    for blk in [sch.get_sblock(name) for name in COMBINE_ROWS]:
        if is_per_row(sch, blk):
            _bind_rows(sch, sch.get_loops(blk)[0], knobs.threads)
    _bind_single_block_reductions(sch, knobs.threads)
    return scratch_as_params(sch.mod["main"])


# The log-prob forward in lanes takes two rounds of its lane loop per iteration,
# unrolled, where they divide its rounds: nvcc issues the second round's loads while
# the first round reduces, and the loop's own instructions are paid once for both.
# sm_90, bf16, C = 32000, 128256 and 151936: 13.9 -> 13.2 SASS instructions per
# element, 40 registers (6 blocks of 256 threads per SM, as at 39); fp32 C = 32000
# 16.8 -> 15.4 (C = 128256: 63 rounds, unchanged). GPGPU-Sim, C = 32000 bf16: one row
# per SM 22976 -> 21921 cycles, a full wave 76829 -> 77256 (+0.6%). The loss's
# forward keeps one round: 10.2 -> 9.4 instructions, but 32 -> 38 registers (8 -> 6
# blocks per SM) for a kernel already under an H200's 14 instructions per element.
LOG_PROBS_KNOBS = CUDAKnobs(lane_rounds=2)


def log_probs(func, target: Target, knobs: CUDAKnobs | None = None, **options):
    """Schedule ``log_probs_func``: ``forward``, with ``LOG_PROBS_KNOBS`` by default."""
    return forward(func, target, knobs or LOG_PROBS_KNOBS, **options)


train_chunk = forward_chunk


# The training kernel in lanes reads its row twice: for its statistics, then for
# its gradient, which should find the row still in L2. A block of 1024 threads
# per row holds 2 rows per SM on an H200 (264 rows, 67 MB of bf16 at C = 128256,
# against its 50 MB of L2) where 256 threads held 8 (270 MB); and the gradient
# sweeps the row from its end, so its first reads are of the lines the
# statistics read last (the lines L2 evicts last). In GPGPU-Sim's sm_86 model
# (46 SMs, 4 MB of L2, C = 32000 bf16: a row per SM takes as large a share
# of L2 as on the H200), 184 rows: 256 threads forwards 114071 cycles, 1024
# threads backwards 97761.
TRAIN_LANES_KNOBS = CUDAKnobs(threads=1024, gradient_backwards=True)


def train_lanes(classes: int, dtype: str, variant, target: Target,
                knobs: CUDAKnobs | None = None, **options) -> tuple[int | None, int]:
    """``forward_lanes`` of the training kernel (``TRAIN_LANES_KNOBS`` by default):
    a row longer than ``max_chunk`` is merged in lanes
    (``schedule_forward_lanes``), and its gradient reads the row again; a
    shorter one is staged whole (``train``: read once)."""
    return log_probs_lanes(classes, dtype, variant, target, knobs or TRAIN_LANES_KNOBS, **options)


def train(func, target: Target, knobs: CUDAKnobs | None = None, **options):
    """Schedule ``train_func``.

    A row longer than ``max_chunk`` (built with ``train_lanes``'s lanes) is the
    forward's lane sweep (``schedule_forward_lanes``) followed, in the same
    block, by its gradient coefficients and its gradient, which recomputes
    ``exp(z - lse)`` from the logits read again: a row of an LM vocabulary
    (256 KB of bfloat16 at C = 128256) fits neither registers nor shared
    memory, so the second read is meant to come from L2
    (``TRAIN_LANES_KNOBS``), where the recompute path (forward, then backward)
    reads the row from memory twice.

    Otherwise (built with ``train_chunk``) a block per row, one sweep
    (``row_sweep``): the chunk loop is the forward's (chunk staged in shared
    memory once, its reductions cross-thread, results in registers), and
    ``ce_chunk_exp`` is inlined: the gradient, after the row's ``lse``,
    recomputes ``exp(x - chunk_max)`` chunk by chunk (``_gradient_by_chunk``)
    from the staged row when the row is one chunk (``C <= max_chunk``: 1 read
    + 1 write), else (a tuning record's chunk) from the logits read again. The
    chunk maxima and per-chunk scales live in shared memory (``C / chunk``
    floats), the other per-row values in registers.
    """
    sch = s_tir.Schedule(func)
    if has_stage(sch, LANE_STATS):
        knobs = with_options(knobs or TRAIN_LANES_KNOBS, options)
        return finish(schedule_forward_lanes(sch, target, knobs).mod["main"])
    knobs = with_options(knobs or CUDAKnobs(), options)
    inline_row_helpers(sch)
    inline_capped_chunk(sch)  # softcap: tanh per read, as the exp is recomputed
    dtype, classes = str(matrix_param(func).dtype), classes_of(func)
    chunk = _chunk(sch)
    sch.compute_inline(sch.get_sblock(CHUNK_EXP))
    sweep = row_sweep(sch, lanes=1)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    after = [sch.get(b).name_hint for b in blocks].index(X_GRAD) + 1
    for blk in blocks[after:]:  # the per-row terms after the gradient (loss, z-loss, hits)
        if is_per_row(sch, blk) and not _under(sch, blk, sweep.row):
            sweep.row = join_row(sch, blk, sweep.row)
    sweep.chunk = sch.get_loops(sch.get_sblock(ROWSTATS))[1]
    names = list(sweep.stages)
    readers = [sch.get_sblock(n) for n in names if n != CHUNK_WSUM]
    whole_row = classes == chunk  # the gradient reads the staged row too: one read
    if whole_row:
        readers.append(sch.get_sblock(X_GRAD))
    staged = sch.cache_read(readers[0], _read_index(sch, readers[0], "x"), "shared",
                            consumer_blocks=readers)
    sch.compute_at(staged, sweep.row if whole_row else sweep.chunk)
    _keep_on_chip(sch, func, [n for n in names if n != CHUNK_MAX]
                  + [ROWSTATS, LSE] + list(ROW_GRAD_COEFS))
    for name in (CHUNK_MAX, CHUNK_PSCALE):
        sch.set_scope(sch.get_sblock(name), 0, "shared")
    in_chunk = [sch.get_sblock(n) for n in (CHUNK_EXPSUM, ROWSTATS)]
    sch.cache_read(in_chunk[0], _read_index(sch, in_chunk[0], CHUNK_MAX + "_shared"),
                              "local", consumer_blocks=in_chunk)
    sch.bind(sweep.row, "blockIdx.x")
    copy = _own_loop(sch, staged, sweep.row, sweep.chunk)
    if copy is not None:
        _thread_loop(sch, copy, knobs.threads,
                     _vector_width(classes, int(sch.get(copy).extent), dtype))
    for name in names + [CHUNK_PSCALE]:
        if (loop := _own_loop(sch, sch.get_sblock(name), sweep.row, sweep.chunk)) is not None:
            _thread_loop(sch, loop, knobs.threads)
    if _own_loop(sch, sch.get_sblock(X_GRAD), sweep.row, sweep.chunk) is not None:
        _gradient_by_chunk(sch, classes, chunk, dtype, knobs.threads, knobs.unroll)
    _bind_single_block_reductions(sch, knobs.threads)
    return scratch_as_params(sch.mod["main"])


def _gradient_by_chunk(sch, classes: int, chunk: int, dtype: str, threads: int,
                       unroll: int) -> None:
    """``x_grad``'s columns chunk by chunk, the last chunk (which overlaps the one
    before when ``chunk`` does not divide C) in a loop of its own, so that the
    logits' index is plain in the loop; each chunk's max and scale are read
    from shared memory into registers once per chunk."""
    grad = sch.get_sblock(X_GRAD)
    n_chunks = -(-classes // chunk)
    lanes = _vector_width(classes, chunk, dtype, True)
    outer, _ = sch.split(sch.get_loops(grad)[-1], [n_chunks, chunk])
    if classes % chunk:
        sch.loop_partition(outer, [n_chunks - 1])
    for blk in _blocks_writing(sch, X_GRAD):
        _thread_loop(sch, sch.get_loops(blk)[-1], threads, lanes, unroll)


def _blocks_writing(sch, buffer: str) -> list:
    """Every block that writes ``buffer`` (``loop_partition`` copies a block per part)."""
    return [b for b in all_blocks(sch) if [w.source.name for w in sch.get(b).writes] == [buffer]]


def finish(func):
    """What every CUDA kernel gets after scheduling (function transforms, not
    schedule steps, so also after a tuning trace): ``run_backwards`` and
    ``scratch_as_params``."""
    return scratch_as_params(run_backwards(func))


# A loop annotated so runs its iterations last to first (``run_backwards``).
BACKWARDS = "ce_tvm.backwards"


def run_backwards(func):
    """Every loop annotated ``BACKWARDS`` (independent iterations) runs from its
    last iteration to its first: its variable ``i`` reads ``extent - 1 - i`` in
    its body. TVM has no schedule primitive that reverses a loop."""
    def flip(loop):
        if BACKWARDS not in loop.annotations:
            return loop
        last = loop.min + loop.extent - 1
        body = tvm_ffi.structural_map(loop.body, [(tirx.Var, lambda v: (
            last - (loop.loop_var - loop.min) if v.same_as(loop.loop_var) else v))])
        annotations = {k: v for k, v in loop.annotations.items() if k != BACKWARDS}
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body,
                        loop.thread_binding, annotations)

    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.For, flip)], order="post"))


def scratch_as_params(func):
    """``func`` with its global intermediate buffers (what TVM would take from its
    workspace pool) turned into trailing parameters: ``CUDA_SCRATCH_ROWS``
    ``[N]`` slots, then ``CUDA_SCRATCH_SINGLES`` ``[1]`` slots (``ce_tvm.kernels.kinds``),
    the unused ones left unused, all in the accumulation dtype."""
    realize = func.body
    root = realize.block
    lifted = [b for b in root.alloc_buffers if b.scope() == "global"]
    rows = [b for b in lifted if len(b.shape) == 1 and not isinstance(b.shape[0], tirx.IntImm)]
    singles = [b for b in lifted if [int(d) for d in b.shape if isinstance(d, tirx.IntImm)] == [1]
               and len(b.shape) == 1]
    acc = "float64" if any(str(p.dtype) == "float64" for p in _buffer_params(func)) else "float32"
    odd = [b.name for b in lifted if str(b.dtype) != acc
           or not any(b.same_as(s) for s in rows + singles)]
    if odd or len(rows) > CUDA_SCRATCH_ROWS or len(singles) > CUDA_SCRATCH_SINGLES:
        raise ValueError(f"scratch does not fit the CUDA scratch slots: {[b.name for b in lifted]}")
    n_rows = next(p.shape[0] for p in _buffer_params(func)
                  if not isinstance(p.shape[0], tirx.IntImm))
    slots = {b: tirx.decl_buffer(b.shape, b.dtype, name=b.name) for b in lifted}
    params = ([slots[b] for b in rows]
              + [tirx.decl_buffer((n_rows,), acc, name=f"scratch_row{i}")
                 for i in range(len(rows), CUDA_SCRATCH_ROWS)]
              + [slots[b] for b in singles]
              + [tirx.decl_buffer((1,), acc, name=f"scratch_single{i}")
                 for i in range(len(singles), CUDA_SCRATCH_SINGLES)])
    body = tvm_ffi.structural_map(realize, [(tirx.Buffer, lambda b: slots.get(b, b))])
    block = body.block
    kept = [b for b in block.alloc_buffers if not any(b.same_as(s) for s in slots.values())]
    block = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, block.body,
                         block.init, kept, block.match_buffers, block.annotations)
    body = s_tir.SBlockRealize(body.iter_values, body.predicate, block)
    return tirx.PrimFunc(list(func.params) + params, body, func.ret_type, func.attrs)


def _buffer_params(func) -> list:
    return [p for p in func.params if hasattr(p, "shape")]


def divergence(func, target: Target, knobs: CUDAKnobs = CUDAKnobs(), **options):
    """Schedule ``ce_tvm.kernels.divergence_func``: one thread block per row
    (``divergence_row`` puts every stage under the row loop); each row
    reduction spread over the block's threads (a cross-thread reduction: warp
    shuffles, then shared memory), its per-row result in shared memory (no
    global scratch); the gradient's columns spread over the threads, coalesced;
    the two per-row outputs written by every thread (the same value). Every
    row reduction reads its rows from global memory again (up to seven passes
    over the student row, five over the teacher's): the simple nest, built
    with nvcc here and not yet run or timed on a GPU."""
    knobs = with_options(knobs, options)
    sch = s_tir.Schedule(func)
    order = list(sch.get_child_blocks(sch.get_sblock("root")))
    outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(sch.get_sblock("root"))}
    row, _ = divergence_row(sch, order)
    sch.bind(row, "blockIdx.x")
    # C = 1: no block has a column loop, so every thread computes every per-row
    # value itself; in shared memory those writes needed a barrier inside the
    # gradient's thread predicate, which TVM refuses ("Cannot insert syncs
    # inside condition"): the build failed. Registers need none.
    scope = "local" if classes_of(func) == 1 else "shared"
    for blk in order:
        loops = sch.get_loops(blk)
        if len(loops) == 2:  # a row reduction, or the gradient's columns
            _thread_loop(sch, loops[1], knobs.threads)
        if sch.get(blk).name_hint not in outputs:
            sch.set_scope(blk, 0, scope)
    return finish(sch.mod["main"])
