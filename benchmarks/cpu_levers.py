"""What each lever of the CPU schedule is worth on this machine: the hand schedule
against the same kernel built without that one lever, in one process.

A lever is one thing ``schedules/cpu.py`` (or its lowering passes and knobs)
does beyond the plain schedule. For each lever, op, dtype and shape both
kernels are built as the runtime builds them (hand schedule, no tuning
record, loaded from disk, on torch's OpenMP threads), run once each on the
same inputs to compare every output bit for bit, then called alternately,
best of ``--reps`` (``ce_tvm.tools.tuning.time_ms``): a neighbour's load lands
on both. ``without / hand`` above 1 means the lever pays. A lever whose
variant compiles to the same assembly as the hand kernel has no effect there
(say, the AVX-512 BF16 rounding on a CPU without it) and is not timed.
Each record also has both kernels' x86 instructions per element of a row
(``ce_tvm.testing.cpu_static``). ``--target`` builds for another CPU
(``"llvm -mcpu=znver5"`` on any x86 host): then only the assembly is
compared and counted, nothing runs.

    python benchmarks/cpu_levers.py --json benchmarks/results/<CPU key>/levers.json
    python benchmarks/cpu_levers.py --levers sum_with_max --dtypes bfloat16 --shapes 4096x32000
    python benchmarks/cpu_levers.py --target "llvm -mcpu=znver5" --shapes 4096x32000

The kernels are the ones ``ce-tvm tune`` tunes (mean, unweighted; the
backward from the logits) at the bench's shapes by default.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, replace

import torch

from ce_tvm.compiler.build import SCHEDULE_OF_OP, KernelSpec, declared_func
from ce_tvm.runtime.registry import configure_thread_pool
from ce_tvm.schedules import (
    cpu,
    cpu_lagged_rows,
    cpu_narrowing,
    cpu_reductions,
    cpu_stores,
    cpu_widening,
)
from ce_tvm.schedules.cpu_knobs import CPUKnobs, forward_chunk, hand_knobs
from ce_tvm.store import records, targets
from ce_tvm.testing.cpu_static import (
    DTYPE_BYTES,
    analyse_asm,
    cross_spec,
    kernel_per_element,
    row_loops,
)
from ce_tvm.tools import tuning
from ce_tvm.tools.cli import TUNED_VARIANTS


def _patched(module, name: str, value):
    """A context in which ``module.name`` is ``value``."""
    @contextlib.contextmanager
    def context():
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, saved)
    return context


def _both(*contexts):
    @contextlib.contextmanager
    def context():
        with contextlib.ExitStack() as stack:
            for c in contexts:
                stack.enter_context(c())
            yield
    return context


def _everywhere(spec, target) -> bool:
    return True


def _overlapping_chunks(spec, target) -> bool:
    return spec.classes % forward_chunk(spec.classes, spec.dtype, target) != 0


def _has_bf16_instruction(spec, target) -> bool:
    return cpu_narrowing.has_bf16_rounding(target)


def _sums_ride(spec, target) -> bool:
    return cpu.sums_ride_the_exp(target)


def _has_word_permutes(spec, target) -> bool:
    return cpu_widening.has_word_permutes(target)


def _hand_knobs_differ(spec, target) -> bool:
    return hand_knobs(spec.op, target, spec.dtype) != CPUKnobs()


_PREFETCH_IN = cpu._prefetch_in
_BY_INSTRUCTION = cpu_narrowing._by_instruction


@dataclass(frozen=True)
class Lever:
    """One lever: ``without`` is the context the variant is declared, scheduled and
    compiled in; ``knobs`` its knobs given the hand schedule's (default: the same).
    ``declared``: ``Variant`` fields (name, value) the hand kernel is declared with
    for this lever, the variant being the kernel without them (``both``: with them
    too); ``scalars``:
    scalar arguments (name, value) both are called with instead of
    ``TUNING_SCALARS``'."""

    name: str
    ops: tuple
    what: str
    without: object = contextlib.nullcontext
    knobs: object = None
    dtypes: tuple = ("float32", "bfloat16")
    applies: object = _everywhere
    declared: tuple = ()
    scalars: tuple = ()
    both: bool = False


LEVERS = (
    Lever("chunk_in_place", ("forward", "log_probs"),
          "the forward (and on AVX-512 BW the log-probs) reads a 16-bit chunk in place "
          "(no float32 copy)",
          without=_patched(cpu, "stages_chunk",
                           lambda op, classes, dtype, target, variant=None: True),
          dtypes=("bfloat16", "float16")),
    Lever("logits_sum_in_max_loop", ("forward",),
          "label smoothing's logits sum in the chunk max's loop",
          without=_patched(cpu, "logits_sum_in_max_loop", lambda sch, stages, outer: stages)),
    Lever("sum_with_max", ("train",),
          "the training sweep's logits sum in the chunk max's loop",
          without=_patched(cpu, "sum_with_max", lambda sch, stages: None)),
    Lever("one_hot_by_chunk", ("train",),
          "the gradient's one-hot test decided per chunk",
          without=_patched(cpu, "ONE_HOT_BY_CHUNK", False)),
    Lever("last_chunk_peeled", ("forward", "train"),
          "the overlapping last chunk peeled off the chunk loop",
          without=_patched(cpu, "PEELS_LAST_CHUNK", False), applies=_overlapping_chunks),
    Lever("prefetch_next_chunk", ("forward", "train"),
          "the exp loop prefetches the next chunk",
          knobs=lambda hand: replace(hand, prefetch=0)),
    Lever("prefetchw_gradient", ("train",),
          "the exp loop prefetches the gradient's lines for writing",
          without=_patched(cpu, "_prefetch_in",
                           lambda seq, grad=None, streamed=(): _PREFETCH_IN(seq))),
    Lever("streamed_gradient", ("train", "backward", "log_probs_grad"),
          "the gradient's stores non-temporal (cpu_stores: aligned rows, and on AVX-512 "
          "unaligned ones by blocks), its prefetchw dropped, where it is at least "
          "STREAM_MIN_BYTES",
          without=_both(_patched(cpu_stores, "_streamable", lambda store, values: False),
                        _patched(cpu_stores, "_stageable", lambda loop, values: None)),
          dtypes=("float32",)),
    Lever("staged_gradient", ("train", "backward", "log_probs_grad"),
          "a gradient whose rows are not 64-byte multiples staged in L1 by blocks and "
          "copied out non-temporally from each block's first line boundary (cpu_stores)",
          without=_patched(cpu_stores, "_stageable", lambda loop, values: None),
          dtypes=("float32",),
          applies=lambda spec, target: cpu_stores.stages_unaligned_rows(target)),
    Lever("tree_lane_reductions", ("forward", "train", "log_probs"),
          "a reduction's vector accumulators merged by halves, not lane by lane "
          "(cpu_reductions)",
          without=_patched(cpu_reductions, "_as_tree", lambda loop: loop)),
    Lever("tree_lane_reductions_eps0", ("forward", "train"),
          "the same in the kernels a call with eps = 0 runs",
          without=_patched(cpu_reductions, "_as_tree", lambda loop: loop),
          declared=(("smoothing", False),), scalars=(("label_smoothing", 0.0),), both=True),
    Lever("next_row_prefetch", ("train",),
          "the streamed gradient's loops prefetch the next row's logits into L2, in the "
          "kernels a call with eps = 0 runs (cpu.prefetch_next_row)",
          without=_patched(cpu, "_next_row_in", lambda loop, *args: loop),
          declared=(("smoothing", False),), scalars=(("label_smoothing", 0.0),), both=True,
          applies=lambda spec, target: cpu.shifts_rows(target), dtypes=("float32",)),
    Lever("next_row_prefetch_smoothing", ("train",),
          "the streamed gradient's loops prefetch the next row's logits into L2, in the "
          "kernels with label smoothing's terms (cpu.prefetch_next_row)",
          without=_patched(cpu, "_next_row_in", lambda loop, *args: loop), both=True,
          applies=lambda spec, target: cpu.shifts_rows(target), dtypes=("float32",)),
    Lever("compared_ramps_as_offsets", ("train",),
          "column ramps compared as a base plus constant offsets",
          without=_both(_patched(cpu, "_compare_offsets", lambda cmp: cmp),
                        _patched(cpu, "_selected_offsets", lambda sel: sel))),
    Lever("bf16_rounding_once", ("train", "backward"),
          "the bfloat16 rounding's value evaluated once",
          without=_patched(cpu_narrowing, "_rewrite", lambda store, instruction: store),
          dtypes=("bfloat16",)),
    Lever("vcvtneps2bf16", ("train", "backward"),
          "bfloat16 rounded by AVX-512 BF16's instruction",
          without=_patched(cpu_narrowing, "has_bf16_rounding", lambda target: False),
          dtypes=("bfloat16",), applies=_has_bf16_instruction),
    Lever("vcvtne2ps2bf16", ("train", "backward"),
          "32 lanes rounded to bfloat16 by one two-register instruction, not two and a merge",
          without=_patched(cpu_narrowing, "_by_instruction",
                           lambda value, lanes, pairs=True: _BY_INSTRUCTION(value, lanes, False)),
          dtypes=("bfloat16",), applies=_has_bf16_instruction),
    Lever("vpermt2w", ("log_probs",),
          "bfloat16 widened by one word permutation per 16 lanes where an accumulator "
          "takes them not by pairs (a buffer reused for another stage's), "
          "not a zero-extension and a shift",
          without=_patched(cpu_widening, "has_word_permutes", lambda target: False),
          dtypes=("bfloat16",), applies=_has_word_permutes),
    Lever("pairs_widening", ("forward", "train", "log_probs"),
          "bfloat16 that a loop only accumulates widened by 32-bit pairs (a shift and a "
          "mask per 16 lanes, the lanes reordered), not a zero-extension and a shift",
          without=_patched(cpu_widening, "_pairs_in_loop", lambda loop, *_: loop),
          dtypes=("bfloat16",)),
    Lever("sums_ride_the_exp", ("log_probs",),
          "the plain log-probs' two sums in the kept exp's loop",
          without=_patched(cpu, "sums_ride_the_exp", lambda target: False),
          applies=_sums_ride),
    Lever("smoothing_left_out", ("forward", "train"),
          "a call with eps = 0 runs the kernel without label smoothing's terms "
          "(Variant.smoothing off), not the one with them",
          declared=(("smoothing", False),), scalars=(("label_smoothing", 0.0),)),
    Lever("row_shift", ("forward", "train"),
          "a call with eps = 0 takes each row against its first chunk's max, a chunk's "
          "max and exp-sum (and kept exp) in one loop (cpu.shifts_rows), not after its max",
          without=_patched(cpu, "shifts_rows", lambda target: False),
          declared=(("smoothing", False),), scalars=(("label_smoothing", 0.0),), both=True,
          applies=lambda spec, target: cpu.shifts_rows(target)),
    Lever("row_shift_smoothing", ("forward", "train"),
          "with label smoothing's terms too (eps = 0.1), each row against its first "
          "chunk's max: the chunk's max, logits' sum and exp-sum (and kept exp) in one loop",
          without=_patched(cpu, "shifts_rows", lambda target: False), both=True,
          applies=lambda spec, target: cpu.shifts_rows(target)),
    Lever("train_chunk_in_l1", ("train",),
          "the training kernel's chunk fits half the L1d with its kept exp (train_chunk), "
          "not the forward's chunk",
          without=_patched(cpu, "train_chunk", lambda classes, dtype, target:
                           cpu.forward_chunk(classes, dtype, target))),
    Lever("lagged_rows", ("train",),
          "a 16-bit training kernel's gradient written a row late, during the next row's "
          "sweep, its stores non-temporal where its rows are whole lines and it is at "
          "least STREAM_MIN_BYTES (cpu_lagged_rows)",
          without=_patched(cpu_lagged_rows, "lags_rows", lambda target: False),
          dtypes=("bfloat16", "float16"),
          applies=lambda spec, target: cpu_lagged_rows.lags_rows(target)),
    Lever("hand_knobs", ("forward", "backward"),
          "the hand knobs (cpu_knobs.hand_knobs) against the defaults",
          knobs=lambda hand: CPUKnobs(), applies=_hand_knobs_differ),
)


def _spec(op: str, dtype: str, classes: int, target: str | None) -> KernelSpec:
    """The kernel ``ce-tvm tune`` tunes, for this host or for ``target``."""
    if target is None:
        return KernelSpec(op, dtype, classes, TUNED_VARIANTS[op]("mean"), "llvm")
    spec = cross_spec(op, dtype, classes, target)
    assert spec.variant == TUNED_VARIANTS[op]("mean"), spec.variant
    return spec


def per_element(asm: str, spec: KernelSpec) -> float:
    """Static x86 instructions per element of a row of ``spec``'s kernel."""
    return kernel_per_element(row_loops(analyse_asm(asm, DTYPE_BYTES[spec.dtype], spec.classes)))


def build(spec: KernelSpec, knobs: CPUKnobs, without=contextlib.nullcontext, load=True):
    """``(kernel, assembly, counted)``: ``spec`` declared, scheduled by hand with
    ``knobs`` and compiled inside ``without``, loaded as the runtime runs it (``None``
    unless ``load``); the assembly as a launch larger than the caches runs it
    (``cpu_stores.always_streaming``: built again only where the kernel streams its
    stores); ``counted``: that assembly, or where the kernel's gradient is written a
    row late, the kernel's unlagged (``cpu_lagged_rows.unlagged``), whose loops
    the counter attributes to a row (``per_element``)."""
    with without():
        func = declared_func(spec)
        scheduled = getattr(cpu, SCHEDULE_OF_OP[spec.op])(func, spec.tvm_target(), knobs)
        ex = tuning.compile_scheduled(scheduled, spec, entry=None) if load else None
        asm = ex.mod.inspect_source("asm") if load else None
        if asm is None or "vmovnt" in asm:
            with cpu_stores.always_streaming():
                asm = tuning.compile_scheduled(scheduled, spec,
                                               entry=None).mod.inspect_source("asm")
        counted = asm
        if (spec.op == "train" and DTYPE_BYTES[spec.dtype] == 2
                and cpu_lagged_rows.lags_rows(spec.tvm_target())):
            with cpu_stores.always_streaming(), cpu_lagged_rows.unlagged():
                counted = tuning.compile_scheduled(scheduled, spec,
                                                   entry=None).mod.inspect_source("asm")
    return (tuning.loaded_as_the_runtime_runs_it(ex, "main") if load else None), asm, counted


def _outputs(kernel, args) -> list:
    """Every tensor argument after one call of ``kernel`` on a copy of ``args``."""
    fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    kernel(*fresh)
    return [a for a in fresh if isinstance(a, torch.Tensor)]


def _difference(a: list, b: list) -> str:
    if all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b)):
        return "identical"
    worst = max(float((x.double() - y.double()).abs().nan_to_num(float("inf")).max())
                for x, y in zip(a, b))
    return f"max |difference| {worst:.3g}"


def compare(lever: Lever, spec: KernelSpec, rows: int, reps: int, hand: tuple, args,
            plain: KernelSpec | None = None) -> dict:
    """One lever on one kernel at ``rows``: its record (``without_over_hand``:
    the variant's best time over the hand kernel's; ``insn_per_element``: the
    hand kernel's and the variant's). ``args`` ``None``: counted, not run.
    ``plain``: the spec the variant is declared as (``spec`` unless the lever
    has ``declared`` fields)."""
    target = spec.tvm_target()
    record = {"lever": lever.name, "op": spec.op, "dtype": spec.dtype,
              "shape": f"{rows}x{spec.classes}"}
    if not lever.applies(spec, target):
        return {**record, "effect": "does not apply here"}
    knobs = hand_knobs(spec.op, target, spec.dtype)
    variant = build(plain or spec, lever.knobs(knobs) if lever.knobs else knobs, lever.without,
                    load=args is not None)
    if variant[1] == hand[1]:
        return {**record, "effect": "same assembly"}
    record["insn_per_element"] = [per_element(hand[2], spec), per_element(variant[2], spec)]
    if args is None:
        return {**record, "effect": "counted"}
    outputs = _difference(_outputs(hand[0], args), _outputs(variant[0], args))
    hand_ms, without_ms = tuning.time_ms([hand[0], variant[0]], args, runs=reps)
    return {**record, "effect": "timed", "outputs": outputs, "hand_ms": hand_ms,
            "without_ms": without_ms, "without_over_hand": without_ms / hand_ms}


def run(levers, ops, dtypes, shapes, reps: int, target: str | None = None, echo=print) -> list:
    """Every lever of ``levers`` on every kernel it applies to; a record each
    (``target``: built for that CPU, counted, not run)."""
    configure_thread_pool()
    results = []
    for rows, classes in shapes:
        for op in ops:
            for dtype in dtypes:
                chosen = [lv for lv in levers if op in lv.ops and dtype in lv.dtypes]
                if not chosen:
                    continue
                spec = _spec(op, dtype, classes, target)
                knobs = hand_knobs(op, spec.tvm_target(), dtype)
                candidates = None if target else tuning.Candidates(spec, rows, {})
                args = candidates and candidates.arguments({})
                hands = {spec: build(spec, knobs, load=target is None)}
                for lever in chosen:
                    declared = replace(spec, variant=replace(spec.variant, **dict(lever.declared)))
                    if declared not in hands:
                        hands[declared] = build(declared, knobs, load=target is None)
                    record = compare(lever, declared, rows, reps, hands[declared],
                                     _called_with(args, candidates, lever.scalars),
                                     declared if lever.both else spec)
                    echo(line(record))
                    results.append(record)
                del args, hands
    return results


def _called_with(args, candidates, scalars: tuple):
    """``args`` with the scalar arguments ``scalars`` names set to their values."""
    if args is None or not scalars:
        return args
    names = [p.name for p in candidates.declared(candidates.chunk({})).params]
    values = dict(scalars)
    return [values.get(name, arg) for name, arg in zip(names, args)]


def line(r: dict) -> str:
    head = f"{r['lever']:<26} {r['op']:<8} {r['dtype']:<8} {r['shape']:>11}"
    if "insn_per_element" not in r:
        return f"{head}  {r['effect']}"
    counts = "insn/el {:.2f} -> {:.2f} without".format(*r["insn_per_element"])
    if r["effect"] != "timed":
        return f"{head}  {counts}"
    return (f"{head}  hand {r['hand_ms']:8.2f} ms  without {r['without_ms']:8.2f} ms  "
            f"without/hand {r['without_over_hand']:.3f}  {counts}  outputs {r['outputs']}")


def _shape(text: str) -> tuple:
    rows, classes = text.split("x")
    return int(rows), int(classes)


def main(argv=None) -> int:
    names = [lv.name for lv in LEVERS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levers", nargs="+", choices=names, default=names)
    parser.add_argument("--ops", nargs="+", choices=("forward", "train", "backward", "log_probs",
                                                     "log_probs_grad"),
                        default=["forward", "train", "backward", "log_probs"])
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16", "float16"),
                        default=["float32", "bfloat16"])
    parser.add_argument("--shapes", nargs="+", type=_shape,
                        default=[(4096, 32000), (8192, 50257), (2048, 128256)], metavar="NxC")
    parser.add_argument("--reps", type=int, default=9, help="alternate calls; the best counts")
    parser.add_argument("--target", help='build for this CPU instead, e.g. "llvm -mcpu=znver5" '
                        "(assembly compared and counted, nothing runs)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    levers = [lv for lv in LEVERS if lv.name in args.levers]
    for lever in levers:
        print(f"{lever.name}: {lever.what}")
    start = time.time()
    results = run(levers, args.ops, args.dtypes, args.shapes, args.reps, args.target)
    if args.json:
        meta = {"cpu_key": records.target_key(targets.target_description("llvm")),
                "target": args.target or "this host",
                "torch": torch.__version__, "threads": torch.get_num_threads(),
                "load": os.getloadavg(), "reps": args.reps, "seconds": time.time() - start,
                "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "records": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
