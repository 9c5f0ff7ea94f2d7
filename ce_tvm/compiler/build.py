"""Lower, schedule and compile one kernel (a ``ce_tvm.store.spec.KernelSpec``) into a
shared library: the compiler side, imported only when a module must be built."""

from __future__ import annotations

import importlib
import itertools
import logging
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import tvm

from ..kernels import (
    backward,
    choices,
    divergence,
    fastmath,
    forward,
    log_probs,
    prob_targets,
    shards,
    training,
)
from ..kernels.kinds import DIVERGENCES, REDUCTIONS, SMOOTHING_OPS, Variant, accum_dtype
from ..store import records
from ..store.files import copy_file
from ..store.spec import LOG_PROB_OPS, KernelSpec, schedule_name, tuned_variants

log = logging.getLogger("ce_tvm")


def schedule_module(target: str):
    """The ``schedules/<target>.py`` module (installed as ``ce_tvm.schedules.<target>``)."""
    return importlib.import_module(f"ce_tvm.schedules.{schedule_name(target)}")


PROB_OPS = ("prob_forward", "prob_backward", "prob_target_grad")  # probability targets


@dataclass(frozen=True)
class Extras:
    """Kernel variants beyond the plain ones that ``ce-tvm compile`` and
    ``ce-tvm bundle`` build when asked (``--softcap``, ``--temperature``,
    ``--accuracy``, ``--log-probs K``, ``--stats``, ``--distill``): what calls with
    those options load.

    ``softcap``/``temperature``: the capped / tempered variants (and both
    together) of every loss kernel a drop-in call runs (not the seed pair's);
    ``accuracy``: the forward and training kernels that also write the token
    hits; ``log_probs``: the log-prob kernels for each ``K`` (capped too with
    ``softcap``; the forward with and without the entropy); ``stats``: their
    forward's variant that also writes the statistics (``return_stats=True``,
    what TRL's trainers ask for); ``distill``: the divergence kernels of the
    distillation losses, each direction with and without the gradient (with
    ``softcap`` also each side capped, and both)."""

    softcap: bool = False
    temperature: bool = False
    accuracy: bool = False
    log_probs: tuple = ()
    stats: bool = False
    distill: bool = False


def all_specs(target: str, dtype: str, classes: int, options: tuple = (),
              extras: Extras = Extras()) -> list[KernelSpec]:
    """Every forward, training and backward variant for one (target, dtype, C)
    (training kernels where the target's schedule has them), for class-index
    and probability targets; and the ``extras`` asked for; each forward and
    training kernel also without label smoothing (what calls with ``eps = 0``
    load), with the kernels of its exact path (``exact_path_specs``)."""
    fwd = [KernelSpec("forward", dtype, classes, Variant(r, w, lp), target, options)
           for r, w, lp in itertools.product(REDUCTIONS, (False, True), (True, False))]
    bwd = [KernelSpec("backward", dtype, classes, Variant(r, w, grad_source=src), target, options)
           for r, w, src in itertools.product(REDUCTIONS, (False, True), ("log_prob", "logits"))]
    train = [KernelSpec("train", dtype, classes, Variant(r, w, False), target, options)
             for r, w in itertools.product(("sum", "mean"), (False, True))
             if hasattr(schedule_module(target), "train")]
    probs = [KernelSpec(op, dtype, classes, Variant(r, w, False), target, options)
             for op, r, w in itertools.product(PROB_OPS, REDUCTIONS, (False, True))]
    plain = fwd + train + bwd + probs
    specs = plain + _extra_specs(plain, extras)
    specs += [replace(s, variant=replace(s.variant, smoothing=False)) for s in specs
              if s.op in SMOOTHING_OPS]
    return list(dict.fromkeys(specs + [e for s in specs for e in exact_path_specs(s)]))


def exact_path_specs(spec: KernelSpec) -> list[KernelSpec]:
    """The kernels the runtime computes a call of the CPU forward or training
    kernel ``spec`` again with when a row's ``lse`` is not finite, which a
    kernel that may take its rows against a shift (``Variant.shifts_rows``)
    also gives a row too far above its shift: a vocabulary shard's statistics
    and their combine (``launch._exact_forward``; the training kernel's
    gradient then comes from the backward, a plain kernel). A log-prob
    kernel's exact path is the one with the entropy, a plain kernel."""
    v = spec.variant
    if spec.op not in ("forward", "train") or spec.target != "llvm" or not v.shifts_rows():
        return []
    loss_dtype = accum_dtype(spec.dtype) if v.wide_loss else spec.dtype
    return [KernelSpec("shard_stats", spec.dtype, spec.classes,
                       Variant("mean", v.weighted, softcap=v.softcap, tempered=v.tempered,
                               smoothing=v.smoothing), spec.target, spec.options),
            KernelSpec("shard_combine", loss_dtype, spec.classes, Variant(v.reduction),
                       spec.target, spec.options)]


def _extra_specs(plain: list[KernelSpec], extras: Extras) -> list[KernelSpec]:
    """The variants of ``Extras`` derived from the plain kernels."""
    def seed_pair(spec):  # the seed-compatible ops have neither softcap nor temperature
        return spec.variant.log_prob and spec.op == "forward" or (
            spec.op == "backward" and spec.variant.grad_source == "log_prob")

    flags = [f for f, on in (("softcap", extras.softcap), ("tempered", extras.temperature)) if on]
    combos = [c for n in range(1, len(flags) + 1) for c in itertools.combinations(flags, n)]
    options = [s for s in plain if not seed_pair(s)]
    varied = [replace(s, variant=replace(s.variant, **dict.fromkeys(combo, True)))
              for combo in combos for s in options]
    hits = [replace(s, variant=replace(s.variant, accuracy=True)) for s in options + varied
            if extras.accuracy and s.op in ("forward", "train")]
    base = plain[0]
    policy = [KernelSpec(op, base.dtype, base.classes, Variant(columns=k, softcap=cap),
                         base.target, base.options)
              for k in extras.log_probs for cap in (False, True)[:1 + extras.softcap]
              for op in LOG_PROB_OPS]
    # without the entropy: what a call that returns none loads
    policy += [replace(s, variant=replace(s.variant, entropy=False)) for s in policy
               if s.op == "log_probs"]
    stats = [replace(s, variant=replace(s.variant, stats=True)) for s in policy
             if extras.stats and s.op == "log_probs" and s.variant.entropy]
    # the divergence kernels write the student's gradient for "sum", none for "none"
    caps = (False, True)[:1 + extras.softcap]
    divergence = [KernelSpec("divergence", base.dtype, base.classes,
                             Variant(r, divergence=kind, softcap=student, teacher_softcap=teacher),
                             base.target, base.options)
                  for kind in DIVERGENCES for r in ("none", "sum") for student in caps
                  for teacher in caps if extras.distill]
    return varied + hits + policy + stats + divergence


def ahead_of_time_specs(target: str, dtype: str, classes: int, options: tuple = (),
                        extras: Extras = Extras()) -> list[KernelSpec]:
    """The kernels a call of one shape may load (``ce-tvm compile``, bundles):
    ``all_specs`` and, where tuning records apply (CPU), each tuned variant."""
    specs = all_specs(target, dtype, classes, options, extras)
    if target == "llvm":
        specs += [t for spec in specs for t in tuned_variants(spec)]
    return specs


def declared_func(spec: KernelSpec, chunk: int | None = None) -> tvm.tirx.PrimFunc:
    """The compute of ``spec``, unscheduled (forward rows chunked, and merged in
    lanes, the forward's chunk staged, ``exp`` scaled and NaN-tested, the overlap and
    one-hot tests written, a chunk's exponentials kept or not, as the schedule asks:
    ``forward_chunk``, ``<op>_lanes``, ``stages_chunk``, ``exp_scaling``,
    ``EXP_NAN_TEST``, ``PEELS_LAST_CHUNK``, ``ONE_HOT_BY_CHUNK``, ``KEEPS_CHUNK_EXP``,
    ``shifts_rows``).
    The row chunk is ``chunk`` if given, else the tuning record's, else the schedule's;
    the chunk staged as the tuning record's compute was, else as the schedule asks."""
    schedule = schedule_module(spec.target)
    scaling = getattr(schedule, "exp_scaling", lambda target: "bits")(spec.tvm_target())
    if chunk is None and spec.tuned:
        chunk = records.record_knobs(spec.tuned).get("chunk")
    with fastmath.scaling(scaling, nan_test=getattr(schedule, "EXP_NAN_TEST", False)), \
            choices.last_chunk_peeled(getattr(schedule, "PEELS_LAST_CHUNK", False)), \
            choices.one_hot_by_chunk(getattr(schedule, "ONE_HOT_BY_CHUNK", False)), \
            choices.chunk_exp_kept(getattr(schedule, "KEEPS_CHUNK_EXP", True)), \
            choices.row_shift(getattr(schedule, "shifts_rows", lambda target: False)(
                spec.tvm_target())):
        return _declare(spec, schedule, chunk)


# The ops whose compute may stage its chunk (``stages_chunk`` of the schedule decides).
STAGED_OPS = ("forward", "shard_stats", "log_probs")


def chunk_staged(spec: KernelSpec) -> bool | None:
    """Whether ``spec``'s compute copies each chunk to float32 first: as its tuning
    record's compute did (``records.record_stage``), else as its schedule asks
    (``stages_chunk``); ``None`` for an op or schedule without the choice."""
    stage_of = getattr(schedule_module(spec.target), "stages_chunk", None)
    if spec.op not in STAGED_OPS or stage_of is None:
        return None
    recorded = records.record_stage(spec.tuned) if spec.tuned else None
    if recorded is not None:
        return recorded
    return stage_of(spec.op, spec.classes, spec.dtype, spec.tvm_target(), spec.variant,
                    **spec.schedule_options())


def _declare(spec: KernelSpec, schedule, chunk: int | None) -> tvm.tirx.PrimFunc:
    args = (spec.classes, spec.dtype, spec.variant)
    chunked = {"forward": forward.forward_func, "train": training.train_func,
               "shard_stats": shards.shard_stats_func,
               "prob_forward": prob_targets.prob_forward_func,
               "log_probs": log_probs.log_probs_func}
    if spec.op in chunked:
        extra = {}
        lanes_of = getattr(schedule, f"{spec.op}_lanes", None)
        if chunk is None and lanes_of is not None:
            chunk, lanes = lanes_of(spec.classes, spec.dtype, spec.variant, spec.tvm_target(),
                                    **spec.schedule_options())
            extra = {"lanes": lanes} if lanes else {}
        chunk_of = getattr(schedule, f"{spec.op}_chunk", schedule.forward_chunk)
        if chunk is None:
            chunk = chunk_of(spec.classes, spec.dtype, spec.tvm_target(),
                             **spec.schedule_options())
        stage = chunk_staged(spec)
        if stage is not None:
            extra["stage"] = stage
        return chunked[spec.op](*args, chunk, **extra)
    whole = {"shard_combine": shards.shard_combine_func, "backward": backward.backward_func,
             "prob_backward": prob_targets.prob_backward_func,
             "prob_target_grad": prob_targets.prob_target_grad_func,
             "log_probs_grad": log_probs.log_probs_grad_func,
             "divergence": divergence.divergence_func}
    return whole[spec.op](*args)


# The schedule function of each op, where the schedule module has none named after the op.
SCHEDULE_OF_OP = {"forward": "forward", "train": "train", "shard_stats": "forward",
                  "backward": "backward", "shard_combine": "per_row",
                  "prob_forward": "forward", "prob_backward": "backward",
                  "prob_target_grad": "backward", "log_probs": "forward",
                  "log_probs_grad": "backward", "divergence": "divergence"}


def scheduled_func(spec: KernelSpec) -> tvm.tirx.PrimFunc:
    """The compute of ``spec`` with its tuning record, or its target's hand schedule
    (the schedule module's function named after the op, else ``SCHEDULE_OF_OP``'s).
    A record replays its trace on the compute it was tuned on. On another
    compute (a sibling kernel's record, ``KernelSpec.record_name``; a record
    tuned before its kernel's compute changed) the record's knobs schedule the
    kernel, where the schedule module can (``schedule_with_knobs``: the CPU's),
    else the hand schedule does."""
    func = declared_func(spec)
    module = schedule_module(spec.target)
    if spec.tuned:
        stale = None
        if spec.record_name() == spec.name():
            try:
                return records.apply_record(spec.tuned, func, spec.tvm_target())
            except RuntimeError as err:  # a record of an older compute: never fail the build
                stale = err
        by_knobs, knobs = getattr(module, "schedule_with_knobs", None), \
            records.record_knobs(spec.tuned)
        if by_knobs is not None and knobs:
            if stale:
                log.info("ce_tvm: %s (it was tuned on another version of the compute); "
                         "its knobs schedule it. Retune it with ce-tvm tune.", stale)
            return by_knobs(func, spec.op, spec.tvm_target(), knobs)
        if stale:
            log.warning("ce_tvm: %s (it was tuned on another version of the compute); "
                        "using the hand schedule. Retune it with ce-tvm tune.", stale)
    schedule = getattr(module, spec.op, None) or getattr(module, SCHEDULE_OF_OP[spec.op])
    return schedule(func, spec.tvm_target(), **spec.schedule_options())


# Pass options by op, on every target. The divergence names each logit's
# transcendentals (softcap, exp, log) inside one another, so its per-element
# trees are large where the log's argument is not bound once (half inputs:
# kernels.divergence), and TIR's common-subexpression pass took half of such a
# build (fp32 capped JSD as a plain tree, znver5: 133 s, 61 s without it);
# LLVM and nvcc fold the repeats themselves: the same kernel time, bitwise
# the same results (benchmarks/divergence_build_bench.py;
# results/llvm-znver5-2c/divergence_build_bench.json).
PASS_CONFIG_OF_OP = {"divergence": {"tirx.disable_cse_tir": True}}


def pass_config(spec: KernelSpec) -> dict:
    """The pass options ``spec`` builds with: its schedule module's
    (``PASS_CONFIG``) and its op's (``PASS_CONFIG_OF_OP``)."""
    return {**getattr(schedule_module(spec.target), "PASS_CONFIG", {}),
            **PASS_CONFIG_OF_OP.get(spec.op, {})}


def compile_scheduled(scheduled, spec: KernelSpec):
    """``tvm.compile`` a scheduled PrimFunc (or IRModule) of ``spec``; returns the
    Executable. A schedule module may name its own lowering pipeline
    (``TIR_PIPELINE``: the CPU's adds prefetches); the pass options are
    ``pass_config``'s."""
    pipeline = getattr(schedule_module(spec.target), "TIR_PIPELINE", None)
    with tvm.transform.PassContext(opt_level=3, config=pass_config(spec)):
        return tvm.compile(scheduled, target=spec.tvm_target(),
                           **({"tir_pipeline": pipeline} if pipeline else {}))


def lower_and_compile(spec: KernelSpec):
    """``compile_scheduled`` of ``spec``'s scheduled kernel; returns the Executable."""
    return compile_scheduled(scheduled_func(spec), spec)


def compile_spec(spec: KernelSpec):
    """``lower_and_compile``; returns the Executable.

    For CUDA on a machine without a GPU, TVM keeps the CUDA source in the
    module (``cuda_binary`` compiles it with ``nvcc``).
    """
    return lower_and_compile(spec)


def cuda_binary(executable, spec: KernelSpec) -> tuple[str, bytes] | None:
    """``(CUDA source, cubin)`` of a CUDA kernel whose module kept its source (no
    GPU here), compiled with ``nvcc`` (raises on any error); ``None`` when the
    module has no source to compile or ``nvcc`` is not on ``PATH``."""
    if spec.target != "cuda" or tvm.cuda().exist or not shutil.which("nvcc"):
        return None
    from tvm.support import nvcc

    source = executable.mod.imports[0].inspect_source()
    target = spec.tvm_target()
    with target:
        return source, nvcc.compile_cuda(source, target_format="cubin",
                                         arch=str(target.attrs["arch"]), compiler="nvcc")


def export(executable, path: Path) -> None:
    """Write the shared library to ``path``: linked in the system temp directory,
    then moved in by ``files.copy_file`` (readers never see a partial file)."""
    with tempfile.TemporaryDirectory(prefix="ce_tvm-export-") as scratch:
        linked = Path(scratch) / path.name
        executable.export_library(str(linked))
        copy_file(linked, path)
