"""The ``ce-tvm`` command line: ``compile`` kernels ahead of time, ``bundle``
them with the TVM runtime (to run without the compiler), inspect the module
``cache``, ``bench`` against PyTorch, ``tune`` kernels over their knobs, show an
Ascend tiling ``plan``, and ``demo`` the loss. The compiler (TVM) is imported by
the commands that build (``compile``, ``bundle``, ``tune``) only."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..kernels.kinds import DTYPES, Variant
from ..optional import MissingExtra, require
from ..runtime import cache
from ..schedules import ascend_plan
from ..store import records
from ..store.files import make_private_dir
from ..store.spec import KernelSpec
from ..store.targets import TARGETS, options_of, write_host_descriptor
from . import bench_args

TRAINING_DTYPES = tuple(d for d in DTYPES if d != "float64")


def cmd_compile(args) -> int:
    from ..compiler.build import ahead_of_time_specs

    options = {"ascend": (("profile", args.profile),),
               "cuda": (("arch", args.arch), *knob_options(args))}.get(args.target, ())
    specs = ahead_of_time_specs(args.target, args.dtype, args.classes, options, _extras(args))
    out = Path(args.out) if args.out else None
    t0 = time.perf_counter()
    built = 0
    for spec in specs:
        if out is not None:
            make_private_dir(out)
            path, new = cache.export_module(spec, out)
            built += new
        else:
            path = cache.ensure_cached(spec)
        print(f"  {path}")
    where = out if out is not None else cache.cache_dir()
    print(f"{len(specs)} kernels for {args.target}/{args.dtype}/C={args.classes} in "
          f"{time.perf_counter() - t0:.1f} s -> {where}")
    if out is not None:
        print(f"{built} built, {len(specs) - built} already there or copied from the cache "
              f"{cache.cache_dir()}")
        if args.target != "cuda":  # lets the runtime name this CPU without TVM
            write_host_descriptor(out)
        print(f"use them with: export CE_TVM_MODULE_DIR={out.resolve()}")
    return 0


def cmd_bench(args) -> int:
    # The optional dependencies first, not after minutes of measuring.
    if args.png and not args.policy:
        require("matplotlib", "bench", "--png (the chart)")
    if args.policy and not args.no_trl:
        require("trl", "trl", "--policy (it compares against TRL)", "pass --no-trl")
    from .bench import run  # torch

    return run(args)


def knob_options(args) -> tuple:
    """``--knob NAME=VALUE`` (``--target cuda``) as the options of the kernels CUDA
    calls ask for in ``ce_tvm.schedule("cuda", NAME=VALUE)``: checked against
    ``CUDAKnobs`` and written as Python writes the typed value (``False``, ``512``)."""
    if not args.knob:
        return ()
    if args.target != "cuda":
        raise SystemExit(f"--knob sets CUDA schedule knobs: it needs --target cuda, "
                         f"not {args.target}")
    bad = [k for k in args.knob if "=" not in k]
    if bad:
        raise SystemExit(f"--knob takes NAME=VALUE, got {bad}")
    from ..schedules.cuda import CUDAKnobs, with_options

    pairs = dict(k.split("=", 1) for k in args.knob)
    try:
        knobs = with_options(CUDAKnobs(), pairs)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    return options_of({k: getattr(knobs, k) for k in pairs})


def _add_knob_flag(parser) -> None:
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                        help="a CUDA schedule knob (--target cuda; repeatable): the kernels "
                             "CUDA calls load in ce_tvm.schedule('cuda', NAME=VALUE)")


def _extras(args):
    """The variants beyond the plain kernels that the flags ask for (``build.Extras``)."""
    from ..compiler.build import Extras

    return Extras(softcap=args.softcap, temperature=args.temperature, accuracy=args.accuracy,
                  log_probs=tuple(args.log_probs or ()), stats=args.stats, distill=args.distill)


def _add_variant_flags(p) -> None:
    p.add_argument("--softcap", action="store_true",
                   help="also the softcap variants (calls with softcap > 0)")
    p.add_argument("--temperature", action="store_true",
                   help="also the temperature variants (calls with temperature != 1)")
    p.add_argument("--accuracy", action="store_true",
                   help="also the kernels of return_token_accuracy=True")
    p.add_argument("--log-probs", type=int, action="append", metavar="K",
                   help="also log_probs / linear_log_probs with K indices per row "
                        "(repeat for several K)")
    p.add_argument("--stats", action="store_true",
                   help="with --log-probs: also their return_stats=True variants "
                        "(TRL's trainers ask for the statistics)")
    p.add_argument("--distill", action="store_true",
                   help="also the divergence kernels of linear_distillation_loss / "
                        "distillation_loss: every direction (beta), with and without the "
                        "gradient (with --softcap also either side capped)")


def cmd_bundle(args) -> int:
    from .bundle import make_bundle

    out = Path(args.out)
    t0 = time.perf_counter()
    manifest = make_bundle(out, target=args.target, dtype=args.dtype, classes=args.classes,
                           arch=args.arch if args.target == "cuda" else None,
                           knobs=knob_options(args), extras=_extras(args))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{len(manifest['kernels'])} kernels for {args.target}/{args.dtype}/C={args.classes} "
          f"and the TVM runtime ({', '.join(manifest['runtime_libs'])}), {size / 1e6:.1f} MB, "
          f"in {time.perf_counter() - t0:.1f} s -> {out}")
    print(f"use it with: export CE_TVM_MODULE_DIR={out.resolve()}")
    return 0


def cmd_cache(args) -> int:
    directory = Path(args.dir) if args.dir else cache.cache_dir()
    if args.action == "clear":
        print(f"removed {cache.clear(directory)} files from {directory}")
        return 0
    libs = cache.entries(directory)
    bad = 0
    for lib in libs:
        size = f"{lib.stat().st_size / 1024:8.1f} KiB"
        if args.action == "list":
            print(f"{size}  {lib.name}")
        else:
            problem = cache.verify_entry(lib)
            bad += problem is not None
            print(f"{'ok ' if problem is None else 'BAD'}  {lib.name}" +
                  (f": {problem}" if problem else ""))
    verdict = f", {bad} bad" if args.action == "verify" else ""
    print(f"{len(libs)} modules in {directory}{verdict}")
    return 1 if bad else 0


TUNED_VARIANTS = {"forward": lambda r: Variant(r, False, False),
                  "backward": lambda r: Variant(r, False, grad_source="logits"),
                  "train": lambda r: Variant(r, False, False),
                  # one index per row (the reduction does not apply)
                  "log_probs": lambda r: Variant(columns=1),
                  "log_probs_grad": lambda r: Variant(columns=1),
                  # the training kernel (it writes the student's gradient); the
                  # Ascend plan, the only one tuned, is the same for every divergence
                  "divergence": lambda r: Variant("sum", divergence="jsd")}


def record_spec(kernel_name: str) -> KernelSpec:
    """The spec ``ce-tvm tune`` tunes under ``kernel_name`` (a record's
    ``summary["kernel"]``, e.g. ``llvm-forward-float32-C32000-mean-nw-nolp``)."""
    target, op, dtype, classes, reduction = kernel_name.split("-")[:5]
    spec = KernelSpec(op, dtype, int(classes[1:]), TUNED_VARIANTS[op](reduction), target)
    if spec.name() != kernel_name:
        raise ValueError(f"{kernel_name!r} is not the name of a kernel ce-tvm tune tunes")
    return spec


def record_cross_spec(directory: Path) -> KernelSpec:
    """The kernel of the tuning record in ``directory`` (``<key>/<record>``, e.g.
    ``llvm-znver5-2c/llvm-forward-...``), with the record as its own, built for
    the record's CPU (its key's name) instead of this host's: the compute its
    trace replays on."""
    from ..testing.cpu_static import cross_spec

    rid = f"{directory.parent.name}/{directory.name}"
    tuned = record_spec(json.loads((directory / "summary.json").read_text())["kernel"])
    cpu = directory.parent.name.split("-")[1]
    return replace(cross_spec("forward", "float32", 1, f"llvm -mcpu={cpu}"), op=tuned.op,
                   dtype=tuned.dtype, classes=tuned.classes, variant=tuned.variant,
                   tuned=rid, tuned_digest=records.record_digest(rid))


def _tuned_specs(args) -> list[KernelSpec]:
    unknown = set(args.ops.split(",")) - set(TUNED_VARIANTS)
    if unknown:
        raise SystemExit(f"ce-tvm tune: unknown --ops {sorted(unknown)} "
                         f"(choose from {', '.join(TUNED_VARIANTS)})")
    return [KernelSpec(op, args.dtype, args.classes, TUNED_VARIANTS[op](args.reduction),
                       args.target) for op in args.ops.split(",")]


def cmd_tune(args) -> int:
    if args.list:
        return _list_records(args)
    if args.classes is None or (args.rows is None and args.target != "cuda"):
        raise SystemExit("ce-tvm tune: --classes and --rows are required (or --list)")
    from . import tuning

    if args.target == "cuda":
        return _check_cuda_grid(args, tuning)
    log_root = Path(args.log_dir) if args.log_dir else records.default_log_dir()
    if args.target == "ascend":
        rows = [tuning.tune_ascend_plan(replace(spec, options=(("profile", args.profile),)),
                                        args.rows, log_root) for spec in _tuned_specs(args)]
    else:
        from ..compiler.build import schedule_module

        specs = _tuned_specs(args)
        for spec in specs:  # each op's schedule on this target must have knobs
            try:
                schedule_module(spec.target).knob_space(spec.op, spec.classes, spec.dtype,
                                                        spec.tvm_target())
            except ValueError as e:
                raise SystemExit(f"ce-tvm tune: {e} on {args.target}") from e
        rows = [tuning.tune(spec, args.rows, args.trials, log_root, args.retune,
                            args.exhaustive) for spec in specs]
    print(f"\n{'kernel':<46} {'kind':<16} {'N':>6} {'space':>5} {'hand ms':>9} "
          f"{'tuned ms':>9} {'grid ms':>9} {'speedup':>8}  knobs (applied?)")
    for r in rows:
        grid = f"{r['exhaustive_best_ms']:>9.3f}" if "exhaustive_best_ms" in r else f"{'-':>9}"
        applied = "yes" if r["applied"] else "no: hand schedule"
        knobs = " ".join(f"{k}={v}" for k, v in r["knobs"].items())
        print(f"{r['kernel']:<46} {r['kind']:<16} {r['rows']:>6} {r['space_size']:>5} "
              f"{r['hand_ms']:>9.3f} {r['tuned_ms']:>9.3f} {grid} {r['speedup']:>7.2f}x  "
              f"{knobs} ({applied})")
    print(f"records in {log_root}")
    if args.json:
        fields = ("name", "kind", "rows", "hand_ms", "tuned_ms", "exhaustive_best_ms",
                  "best_ms", "space_size", "knobs", "tuned_knobs", "exhaustive_best_knobs",
                  "applied")
        kernels = [{k: v for k, v in {**r, "name": r["kernel"]}.items() if k in fields}
                   for r in rows]
        Path(args.json).write_text(json.dumps({"kernels": kernels}, indent=1))
        print(f"wrote {args.json}")
    return 0


def _check_cuda_grid(args, tuning) -> int:
    """Without a GPU: build every candidate of the CUDA knob grid and compile it with nvcc."""
    from ..compiler.build import cuda_binary

    for spec in _tuned_specs(args):
        if spec.op == "train":  # no CUDA training kernel
            continue
        spec = replace(spec, options=(("arch", args.arch),))
        t0 = time.perf_counter()
        points, executable = tuning.compile_grid(spec)
        built = cuda_binary(executable, spec)
        verdict = ("compiled with nvcc" if built else
                   "built by TVM (no nvcc on PATH, or a GPU here: measuring needs one)")
        print(f"  {spec.name()} {args.arch}: {len(points)} candidates ({', '.join(points[0])})"
              f" {verdict} in {time.perf_counter() - t0:.1f} s")
    print("CUDA candidates are measured only on a GPU; nothing was recorded")
    return 0


def _list_records(args) -> int:
    """Every record for ``--target`` (this machine's kind) and where it lies; with
    ``--classes`` and ``--rows``, which record each kernel of that shape would use."""
    key = records.target_key(KernelSpec("forward", "float32", 1, target=args.target)
                             .target_description())
    print(f"tuning records for {key}, looked up in this order:")
    for d in records.tuning_dirs():
        print(f"  {d}")
    found = records.summaries(key)
    for path, s in found:
        used = "applies" if records.applies(s) else "not used (hand schedule kept)"
        knobs = " ".join(f"{k}={v}" for k, v in s.get("knobs", {}).items())
        print(f"  {path.name:<56} hand {s['hand_ms']:8.3f} ms  best "
              f"{s.get('best_ms', s['tuned_ms']):8.3f} ms  {used}  {knobs}\n    in {path.parent}")
    print(f"{len(found)} records")
    if args.classes is not None and args.rows is not None:
        print(f"a call with N={args.rows}, C={args.classes}, {args.dtype} would use:")
        for spec in _tuned_specs(args):
            hit = records.nearest_record(spec.target_description(), spec.name(), args.rows)
            print(f"  {spec.op:<9} {hit[0] if hit else 'the hand schedule (no record applies)'}")
    return 0


def cmd_plan(args) -> int:
    p = ascend_plan.plan(args.profile, args.rows, args.classes, args.dtype, args.op)
    est = ascend_plan.cost(p)
    if args.json:
        print(json.dumps({"plan": p.as_dict(), "cost": est}, indent=1))
        return 0
    front = p.rows_per_core
    print(f"Ascend {p.profile} plan: {args.op}, N={p.rows} C={p.classes} {p.dtype}")
    print(f"  block_dim {p.block_dim}; rows per core {front[0]} x {front.count(front[0])}"
          + (f", {front[-1]} x {front.count(front[-1])}" if front[-1] != front[0] else ""))
    print(f"  chunk {p.chunk} elements x {p.tiles} tiles; UB {p.ub_bytes} of "
          f"{ascend_plan.PROFILES[p.profile].ub_bytes} bytes; buffers {p.buffers}; "
          f"passes over the logits {p.passes}")
    print("  cost model          reads  writes    MB moved   memory us   vector us    total us")
    for name, e in est.items():
        print(f"  {name:<18}{e['reads']:>6}{e['writes']:>8}{e['bytes_moved'] / 1e6:>12.1f}"
              f"{e['memory_us']:>12.1f}{e['vector_us']:>12.1f}{e['time_us']:>12.1f}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(args.rows, args.classes, args.hidden, args.dtype, args.reps,
             with_compile=not args.no_compile)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ce-tvm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile every kernel variant for one (target, dtype, C)")
    c.add_argument("--target", choices=TARGETS, default="llvm")
    c.add_argument("--dtype", choices=DTYPES, default="float32")
    c.add_argument("--classes", type=int, required=True)
    c.add_argument("--out", help="write a precompiled directory here instead of the cache")
    c.add_argument("--profile", default="910b", help="Ascend profile (--target ascend)")
    c.add_argument("--arch", default="sm_90", help="CUDA architecture (--target cuda)")
    _add_knob_flag(c)
    _add_variant_flags(c)
    c.set_defaults(func=cmd_compile)

    b = sub.add_parser("bundle", help="kernels for some shapes + the TVM runtime, to run "
                       "without the compiler")
    b.add_argument("--target", choices=["llvm", "cuda"], default="llvm")
    b.add_argument("--arch", default="sm_90", help="CUDA architecture (--target cuda)")
    b.add_argument("--dtype", choices=DTYPES, default="float32")
    b.add_argument("--classes", type=int, action="append", required=True,
                   help="C (repeat for several)")
    b.add_argument("--out", required=True, help="the bundle directory")
    _add_knob_flag(b)
    _add_variant_flags(b)
    b.set_defaults(func=cmd_bundle)

    k = sub.add_parser("cache", help="list, verify or clear compiled modules")
    k.add_argument("action", choices=["list", "verify", "clear"])
    k.add_argument("--dir", help="a precompiled directory instead of the cache")
    k.set_defaults(func=cmd_cache)

    bench_args.add_parser(sub).set_defaults(func=cmd_bench)

    t = sub.add_parser("tune", help="autotune the forward, training and backward kernels at "
                       "one shape over their schedules' knobs; or --list the records")
    t.add_argument("--target", choices=["llvm", "cuda", "ascend"], default="llvm",
                   help="cuda: build-check the knob grid with nvcc (no GPU needed); ascend: "
                   "search the tiling plan against the cost model")
    t.add_argument("--arch", default="sm_90", help="CUDA architecture (--target cuda)")
    t.add_argument("--profile", default="910b", help="Ascend profile (--target ascend)")
    t.add_argument("--dtype", choices=TRAINING_DTYPES, default="float32")
    t.add_argument("--classes", type=int)
    t.add_argument("--rows", type=int)
    t.add_argument("--trials", type=int, default=16, help="candidates the search measures "
                   "per kernel")
    t.add_argument("--ops", default="forward,train,backward")
    t.add_argument("--reduction", choices=["sum", "mean"], default="mean")
    t.add_argument("--exhaustive", action="store_true",
                   help="also measure every candidate of the knob grid")
    t.add_argument("--json", metavar="FILE", help="write the results as JSON")
    t.add_argument("--log-dir", help="where records go (default: $CE_TVM_TUNING_LOGS, else "
                   "tuning_logs in the module cache directory)")
    t.add_argument("--retune", action="store_true", help="search again where a record exists")
    t.add_argument("--list", action="store_true", help="list the records and, with --classes "
                   "and --rows, which one each kernel of that shape would use")
    t.set_defaults(func=cmd_tune)

    pl = sub.add_parser("plan", help="Ascend tiling plan and cost model")
    pl.add_argument("--profile", default="910b")
    pl.add_argument("--classes", type=int, required=True)
    pl.add_argument("--rows", type=int, required=True)
    pl.add_argument("--dtype", choices=TRAINING_DTYPES, default="bfloat16")
    pl.add_argument("--op", choices=ascend_plan.OPS, default="forward",
                    help="the loss's kernels, or the per-token log-probs and their gradient")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    d = sub.add_parser("demo", help="the training step and the fused linear head on this CPU, "
                       "checked against PyTorch and timed beside eager and torch.compile")
    d.add_argument("--rows", type=int, default=4096)
    d.add_argument("--classes", type=int, default=32000)
    d.add_argument("--hidden", type=int, default=256, help="the linear head's input width")
    d.add_argument("--dtype", choices=TRAINING_DTYPES, default="float32")
    d.add_argument("--reps", type=int, default=3)
    d.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to warm)")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MissingExtra as e:  # an optional dependency: what to install, not a traceback
        print(f"ce-tvm {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
