"""The numbers the CPU schedule (``cpu``) runs with, decided from the target
and the shape alone (no schedule here): the vector width (``vector_lanes``),
the chunk a row is reduced in and whether the chunk is staged in float32
(``forward_chunk``, ``stages_chunk``: what the compute is declared with),
and the tunable knobs (``CPUKnobs``): the hand schedule's values
(``hand_knobs``) and the tuning search's choices (``knob_space``,
``knob_chunk``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tvm import DataType
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width, target_has_features

from ..kernels.kinds import Variant
from .cpu_widening import has_word_permutes

# Chunk of a row kept in L1 between its max and its exp-sum: at most 24 KB of
# float32 (half the 48 KB L1d of Zen 5), at least 8 vectors of accumulators.
# The forward's kernels keep it on CPUs with 32 KB of L1d too: on a Zen 4 the
# bf16 forward and log-probs lost 3-25% with chunks of half its L1d (C = 128256:
# 768 classes, not 5344); the fp32 forward gained 0-9%. The training
# kernel's chunk also keeps its exp beside it (``train_chunk``).
MAX_CHUNK = 6144
# CPUs (LLVM names) with 48 KB of L1d per core; every other one is taken to have
# 32 KB (Zen 1-4, Intel's cores before Sunny Cove).
L1D_48KB = frozenset({"znver5", "icelake-client", "icelake-server", "tigerlake", "rocketlake",
                      "alderlake", "raptorlake", "meteorlake", "arrowlake", "lunarlake",
                      "sapphirerapids", "emeraldrapids", "graniterapids"})
MIN_CHUNK_VECTORS = 8
# Chunks are multiples of this many native vectors (whatever the accumulators).
CHUNK_VECTORS = 2


@dataclass(frozen=True)
class CPUKnobs:
    """Tunable constants of the CPU schedule (the defaults are the hand schedule but
    where ``hand_knobs`` says otherwise).

    ``accumulators``: vector accumulators per row reduction, and native
    vectors per step of the element-wise loops; 2 hides the 4-cycle FP add
    latency behind a second chain (measured on znver4/5). ``unroll``: vector
    steps per iteration of the forward's chunk reductions. ``row_grain``: rows
    per parallel task. ``prefetch``: how many chunks ahead the ``exp`` loop
    prefetches the logits (0: none; a knob of the training and log-prob
    kernels, the forward keeps one). The chunk itself is a knob of the
    compute (``forward_chunk``'s ``max_chunk``; ``knob_space``).
    """

    accumulators: int = 2
    unroll: int = 1
    row_grain: int = 1
    prefetch: int = 1


# Bounds on the chunk that ``knob_space`` offers: 8 to 48 KB of float32.
MAX_CHUNK_CHOICES = (2048, 4096, MAX_CHUNK, 12288)


# The knobs' choices per op (``chunk`` aside); ``knob_space`` puts the hand value first.
_KNOB_CHOICES = {
    "forward": {"accumulators": (2, 1, 4), "unroll": (1, 2, 4), "row_grain": (1, 8)},
    "train": {"accumulators": (2, 1, 4), "prefetch": (1, 0, 2), "row_grain": (1, 8)},
    "backward": {"accumulators": (2, 1, 4, 8), "row_grain": (1, 4, 16)},
}
# The log-prob kernels are a forward (its row sweep, the chunk's exp kept) and
# a backward (one element-wise pass) for their schedules, and tuned as such:
# ``SCHEDULE_OF`` names the schedule of ``cpu`` each tunable op runs.
_KNOB_CHOICES["log_probs"] = {**_KNOB_CHOICES["forward"], "prefetch": (1, 0, 2)}
_KNOB_CHOICES["log_probs_grad"] = _KNOB_CHOICES["backward"]
SCHEDULE_OF = {"forward": "forward", "train": "train", "backward": "backward",
               "log_probs": "forward", "log_probs_grad": "backward"}


def knob_space(op: str, classes: int, dtype: str, target: Target) -> dict:
    """The knobs of ``op``'s schedule at this shape and their choices (``{name: choices}``),
    the hand schedule's value first (``hand_knobs``). ``chunk`` is the chunk the
    compute is declared with (a tuned kernel re-declares it); the backward has none."""
    if op not in _KNOB_CHOICES:
        raise ValueError(f"no tunable schedule for {op!r}")
    space = {}
    if SCHEDULE_OF[op] != "backward":
        hand_chunk = (train_chunk if op == "train" else forward_chunk)(classes, dtype, target)
        space["chunk"] = (hand_chunk,) + tuple(sorted(
            {forward_chunk(classes, dtype, target, m) for m in MAX_CHUNK_CHOICES} - {hand_chunk}))
    hand = asdict(hand_knobs(op, target, dtype))
    for name, choices in _KNOB_CHOICES[op].items():
        space[name] = (hand[name],) + tuple(c for c in choices if c != hand[name])
    return space


def hand_knobs(op: str, target: Target, dtype: str) -> CPUKnobs:
    """The hand schedule's knobs of ``op`` on ``target`` for ``dtype`` rows:
    ``CPUKnobs()``, but where measurement said otherwise:

    - the forward on x86 without AVX-512: one accumulator, unrolled twice.
      There a ``vector_lanes`` step of 16 float32 lanes is two ymm registers
      (LLVM reports a 512-bit width for AVX2 CPUs too), so two accumulators
      make four chains, and the 16 registers cannot hold their temporaries
      beside the ``exp``'s constants: LLVM spills. Measured by the tuner on a
      2-core AVX2 EPYC (LLVM: znver1; ``tuning_logs/llvm-znver1-2c``): at all
      six bench shapes this beat the default by 5-7% (bf16) and 11-16% (fp32);
      the training kernel's searches kept the default.
    - the bfloat16 backward (the logits' and the log-probs' gradient, one
      element-wise pass whose bf16 rounding is integer arithmetic where the CPU
      lacks AVX-512 BF16): four vectors a step and 16 rows a parallel task.
      At the three bench shapes it beat the default by 12-16% on a 2-core
      Zen 3 EPYC (znver3, interleaved) and by 2-6% on a Zen 5 one (znver5, the
      tuner's grid). float16 (one ``vcvtps2ph``) and float32 keep the default:
      there it measured up to 9% slower.
    """
    if (SCHEDULE_OF.get(op) == "forward" and target_has_features("avx2", target)
            and not target_has_features("avx512f", target)):
        return CPUKnobs(accumulators=1, unroll=2)
    if SCHEDULE_OF.get(op) == "backward" and dtype == "bfloat16":
        return CPUKnobs(accumulators=4, row_grain=16)
    return CPUKnobs()


def knob_chunk(op: str, classes: int, dtype: str, target: Target, knobs: dict) -> int | None:
    """The chunk the compute of ``op`` is declared with for ``knobs`` (``None``: no chunk)."""
    return knobs.get("chunk")


def vector_lanes(target: Target, elem_bytes: int = 4) -> int:
    """float32 lanes of one native vector register of ``target``."""
    return max(1, llvm_get_vector_width(target) // (8 * elem_bytes))


def forward_chunk(classes: int, dtype: str, target: Target, max_chunk: int = MAX_CHUNK,
                  min_fit: int = 0) -> int:
    """Chunk of the compute's row reduction, a multiple of ``CHUNK_VECTORS``
    native vectors: the largest one dividing ``C``, at most ``max_chunk`` and at
    least ``min_fit``; else (``C`` like 50257) equal chunks of at most ``max_chunk``, the last one
    overlapping the one before (``kernels.common.ChunkLayout``). A row no longer than
    ``max_chunk`` is one chunk when ``C`` is a multiple of that step or too
    short for two chunks of ``MIN_CHUNK_VECTORS`` steps; else it is two
    overlapping chunks: one chunk of ``C = 4099`` (prime) reduced with one
    scalar lane, 3.7x slower for the log-probs at 64 x 4099 (the tuner's
    pick), and less accurate (thousands of terms summed into the row max's
    ``exp(0) = 1`` lost up to 2e-4 of the lse). ``dtype`` does not matter
    here: the float32 accumulators size the chunk."""
    lanes = vector_lanes(target) * CHUNK_VECTORS
    if classes <= max_chunk and (classes % lanes == 0
                                 or classes < 2 * lanes * MIN_CHUNK_VECTORS):
        return classes
    fits = [b for b in range(lanes * MIN_CHUNK_VECTORS, max_chunk + 1, lanes)
            if classes % b == 0 and b >= min_fit]
    if fits:
        return max(fits)
    most = max(lanes, max_chunk // lanes * lanes)  # so that rounding up to steps stays within
    per_chunk = -(-classes // max(2, -(-classes // most)))
    return -(-per_chunk // lanes) * lanes


def l1_data_bytes(target: Target) -> int:
    """Per-core L1 data cache of ``target``'s CPU: 48 KB where ``L1D_48KB`` names
    its ``mcpu``, else 32 KB."""
    return (48 if str(target.attrs.get("mcpu", "")) in L1D_48KB else 32) << 10


def train_chunk(classes: int, dtype: str, target: Target) -> int:
    """The training kernel's chunk: ``forward_chunk``'s, of at most as many classes
    as fit half the L1d with their kept ``exp`` (float32, in the row's scratch)
    beside the logits (2048 float32 or 2730 bf16 classes on 32 KB, 3072 and 4096
    on 48 KB), and equal overlapping chunks where the largest that divides ``C``
    is under half that (C = 128256: 768 classes, where bf16 lost 1-6%).
    Measured on a 2-core Zen 4 (32 KB; the two built in one process, called
    alternately): against the forward's chunk, fp32 at 8192 x 50257 and
    2048 x 128256 1-12% faster, bf16 at 4096 x 32000 and 8192 x 50257 4-9%,
    the others -1-5% (``benchmarks/cpu_levers.py``, ``train_chunk_in_l1``)."""
    most = min(MAX_CHUNK, l1_data_bytes(target) // 2 // (DataType(dtype).bits // 8 + 4))
    return forward_chunk(classes, dtype, target, most, min_fit=most // 2)


# The ops whose bfloat16 chunks are copied to float32 before their reductions.
STAGES_BF16 = ("shard_stats", "log_probs")


def shifts_rows(target: Target) -> bool:
    """Whether the kernels that may (``Variant.shifts_rows``: the forward and
    training kernels a training step runs, the log-probs without the entropy)
    take each row against the max of its first chunk
    (``kernels.choices.row_shift``), so that a chunk's max and exp-sum (and
    kept ``exp``) are one loop that streams it in (``logits_sum_in_max_loop``,
    ``exp_with_max``, ``ride_along``): on AVX-512. In-process A/B on a 2-core
    Zen 4 EPYC, hand schedule, at 4096 x 32000, 8192 x 50257 and 2048 x
    128256: the forward 1.10-1.13x faster in bf16 and 1.01-1.11x in float32,
    the training kernel 1.01-1.10x (two runs, ``benchmarks/cpu_levers.py``,
    ``row_shift``, without label smoothing); with it (``row_shift_smoothing``)
    the forward 1.03-1.14x in float32, in bf16 1.06-1.09x but 0.94x at C =
    50257 with the hand knobs (the overlapping last chunk's loop spills a
    register; its tuned record takes one accumulator), the training kernel
    1.02-1.15x; the log-probs without the entropy 1.08-1.12x in float32
    and 1.32-1.43x in bf16 (against the bf16 chunk copied to float32, as it
    was). On AVX2 the merged loop needs more than its 16 registers: the
    forward 2.4-2.5 -> 3.1-3.2 instructions per element (``znver3``,
    ``haswell``, C = 32000)."""
    return bool(target_has_features("avx512f", target))


def stages_chunk(op: str, classes: int, dtype: str, target: Target,
                 variant: Variant | None = None) -> bool:
    """Whether ``op``'s compute copies each chunk to float32 before its reductions
    (``kernels.forward.forward_func``'s ``stage``; a softcap always stages):
    bfloat16 rows of a vocabulary shard's statistics and of the log-probs (one
    conversion, a load and a shift, instead of one per pass over the chunk;
    unstaged, 0-4% and 1-6% slower on a 2-core Zen 3 EPYC, in-process A/B at
    4096 x 32000 and 2048 x 128256; float16's one ``vcvtph2ps`` per pass is
    cheaper than the copy there: 3-7% faster in place). The loss forward
    reads its 16-bit chunk in place: since the logits' sum rides
    the max's loop it passes over a chunk twice, and widening twice (bf16: a
    load and a shift; fp16: one ``vcvtph2ps``) beats the copy's store and
    reload: 7-9% faster for bf16 at the three bench shapes and 13.5% for fp16
    on that machine (4% with the seed API's ``log_prob``, 2% weighted), the
    outputs bit for bit the same; 5% fewer instructions on Zen 5
    (``benchmarks/cpu_static.py``). float32 rows are reduced in place, aligned
    or not: staging cost aligned ones ~10%, and since the overlap test left
    all but the last chunk (``cpu.PASS_CONFIG``) it costs C = 50257 more than
    the straddled loads do (in cache, 2 cores: 0.182 vs 0.157 ns per element
    per core). So are the probability targets' rows, which stream the targets
    beside the logits (staging cost them 14-20%). A log-prob kernel whose rows
    are taken against their shift (``shifts_rows``, ``variant``'s
    ``shifts_rows``) sweeps a chunk once: nothing to stage.

    Where AVX-512 BW widens a bf16 vector by one word permutation
    (``cpu_widening``), only the log-probs' statistics variant stages (its
    three more sums read the chunk again). In-process A/B on a 2-core Zen 4
    EPYC, hand schedule, best of 9, at 4096 x 32000, 8192 x 50257 and
    2048 x 128256, staged over in place: the shard's statistics 1.12-1.20x
    (with label smoothing's sum 1.16-1.20x), the log-probs with the entropy
    1.06-1.11x (two runs), the statistics variant 0.98-0.99x."""
    if dtype != "bfloat16" or op not in STAGES_BF16:
        return False
    if op == "log_probs" and variant is not None and variant.shifts_rows() \
            and shifts_rows(target):
        return False
    return not has_word_permutes(target) or (variant is not None and variant.stats)
