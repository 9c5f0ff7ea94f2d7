"""The divergence kernel's build: the log bound once by a ``Let`` as built
(``kernels.divergence``, float32), against the plain tree (no ``Let``, as
half-precision inputs build) with and without TIR's common-subexpression pass
(``compiler.build.PASS_CONFIG_OF_OP`` turns it off): build time, kernel time
(interleaved rep by rep, best rep kept; ``ce_tvm.tools.measure``) and whether
the builds' outputs agree bit for bit.

The divergence names each logit's transcendentals inside one another
(softcap, exp, log), so without the ``Let`` its per-element trees hold tens
of thousands of loads; the capped JSD is the largest. On the CPU target:

    .venv/bin/python benchmarks/divergence_build_bench.py \\
        --out benchmarks/results/llvm-znver5-2c/divergence_build_bench.json
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
import tvm

from ce_tvm.compiler.build import pass_config, schedule_module, scheduled_func
from ce_tvm.kernels import fastmath
from ce_tvm.kernels.kinds import Variant
from ce_tvm.runtime.registry import configure_thread_pool
from ce_tvm.store.spec import KernelSpec
from ce_tvm.store.targets import host_cpu
from ce_tvm.tools.measure import interleaved_ms, write_report

CSE_OFF = "tirx.disable_cse_tir"
# name: (the log bound by a Let, TIR's CSE on)
BUILDS = {"let": (True, False), "tree": (False, False), "tree_with_cse": (False, True)}


def build(spec: KernelSpec, bind: bool, cse: bool):
    """``(Executable, seconds)``: ``spec`` built as ``build.lower_and_compile``
    does, its log bound or not, TIR's CSE on or off."""
    schedule = schedule_module(spec.target)
    config = {**pass_config(spec), CSE_OFF: not cse}
    log = fastmath.log
    fastmath.log = lambda x, _bind=False: log(x, bind and _bind)
    try:
        func = scheduled_func(spec)
    finally:
        fastmath.log = log
    start = time.perf_counter()
    with tvm.transform.PassContext(opt_level=3, config=config):
        ex = tvm.compile(func, target=spec.tvm_target(), tir_pipeline=schedule.TIR_PIPELINE)
    return ex, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2048x4000", help="N x C")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows, classes = (int(s) for s in args.shape.split("x"))
    configure_thread_pool()
    spec = KernelSpec("divergence", args.dtype, classes,
                      Variant("sum", divergence="jsd", softcap=True, teacher_softcap=True))
    built = {name: build(spec, *how) for name, how in BUILDS.items()}
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    student, teacher = ((torch.randn(rows, classes, generator=gen) * 20).to(dtype)
                        for _ in range(2))
    outputs = {name: (torch.empty(rows), torch.empty(rows), torch.empty(rows, classes, dtype=dtype))
               for name in built}
    scalars = (0.4, 1.0, 0.9, 30.0, 25.0)  # beta, both inverse temperatures, both caps

    def run(name):
        main_fn = built[name][0]["main"]
        return lambda: main_fn(student, teacher, torch.ones(rows), *scalars, *outputs[name])

    ms = interleaved_ms({name: run(name) for name in built}, reps=args.reps)
    result = {
        "what": f"divergence kernel (JSD, both softcaps, student gradient), {args.dtype}",
        "machine": f"{platform.node()}: {os.cpu_count()} cores, LLVM {host_cpu()}",
        "date": time.strftime("%Y-%m-%d"), "shape_NxC": args.shape,
        "build_s": {name: round(b[1], 1) for name, b in built.items()}, "kernel_ms": ms,
        "bitwise_equal_to_let": {name: all(torch.equal(a, b) for a, b in
                                           zip(outputs["let"], outputs[name]))
                                 for name in built if name != "let"},
    }
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
