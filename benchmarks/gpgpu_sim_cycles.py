"""Simulated cycles of ce-tvm's CUDA kernels against a copy kernel moving the
same bytes, side by side in one run, in GPGPU-Sim's cycle model (an SM86
config: RTX 3070, 46 SMs).

For each kernel (a ``ce_tvm.testing.cuda_cases`` case), the floor is one
kernel that reads the bytes the case's inputs hold and writes the bytes its
outputs hold (``Simulator.copy_floor``: 16-byte loads and stores, grid-stride,
8 blocks of 256 threads per SM): a plain read for a forward, a copy for a
training step or a gradient. The table gives ce-tvm's cycles (every launch of the op, the
config's 5000-cycle launch latency set to 0 for both) over the floor's.

Simulated cycles rank designs where no GPU can; they are not a GPU's timing
(the cycle model's DRAM and caches are an RTX 3070's as GPGPU-Sim models them,
at sizes far below a real batch). Usage::

    CE_TVM_GPGPU_SIM=~/gpgpu-sim python benchmarks/gpgpu_sim_cycles.py --classes 32000 --rows 8
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from ce_tvm.testing import gpgpu_sim
from ce_tvm.testing.cuda_cases import KERNELS, _case, problem

# (family, index in KERNELS[family]): one kernel of each kind the table compares
TABLE = [("forward", 1), ("train", 1), ("backward", 1), ("log_probs", 0), ("log_probs", 2),
         ("distillation", 0)]

def bytes_moved(kernels, case, prob) -> tuple[int, int]:
    """(bytes the case's inputs hold, bytes its outputs hold; scratch excluded)."""
    reads = sum(np.asarray(a).nbytes for a in prob.arrays.values())
    values = {"N": case.rows, **prob.scalars}
    writes = 0
    for p in kernels.buffers():
        if p.name in prob.arrays or p.name.startswith("scratch_"):
            continue
        size = int(np.prod([int(kernels.evaluate(d, values)) for d in p.shape]))
        writes += size * np.dtype(gpgpu_sim.pocl.NUMPY_DTYPES[p.dtype]).itemsize
    return reads, writes


def cycle_model() -> gpgpu_sim.Simulator | None:
    """The simulator in its cycle model, launch latency 0; ``None`` (the reason
    printed) where it is not installed."""
    reason = gpgpu_sim.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return None
    return gpgpu_sim.Simulator.find(perf=True, launch_latency=0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--arch", default="sm_80", help="the schedule's arch")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--families", nargs="+", default=sorted({f for f, _ in TABLE}),
                        help="only these families' rows of the table")
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                        help="a CUDA schedule knob over each kernel's own (repeatable)")
    args = parser.parse_args(argv)
    knobs = tuple(tuple(k.split("=", 1)) for k in args.knob)
    sim = cycle_model()
    if sim is None:
        return 2
    print(f"device: {sim.name}; C = {args.classes}, N = {args.rows}, schedule {args.arch}"
          + "".join(f", {k}={v}" for k, v in knobs))
    print(f"{'kernel':42} {'dtype':8} {'launches':>8} {'ce-tvm':>9} {'floor':>9} {'ratio':>6}")
    records = []
    for (family, index), dtype in [(k, d) for k in TABLE for d in args.dtypes
                                   if k[0] in args.families]:
        kernel = KERNELS[family][index]
        case = _case(family, kernel, dtype, args.classes, args.rows)
        case = replace(case, arch=args.arch, knobs=knobs)
        prob = problem(case)
        kernels = sim.kernels(case.spec())
        sim.run(kernels, case.rows, prob.arrays, prob.scalars, prob.aliases)
        cycles = sum(c for _, c in sim.last.cycles)
        reads, writes = bytes_moved(kernels, case, prob)
        floor = sim.copy_floor(reads, writes)
        name = f"{family}: {kernel[0]} {kernel[2]}"
        print(f"{name:42} {dtype:8} {len(kernels.launches):>8} {cycles:>9} {floor:>9} "
              f"{cycles / floor:>6.2f}", flush=True)
        records.append(dict(family=family, op=kernel[0], variant=kernel[2], dtype=dtype,
                            classes=args.classes, rows=args.rows, arch=args.arch,
                            knobs=dict(knobs),
                            launches=len(kernels.launches), cycles=cycles,
                            floor_cycles=floor, read_bytes=reads, write_bytes=writes,
                            ratio=round(cycles / floor, 3), device=sim.name))
        if args.json:
            args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
