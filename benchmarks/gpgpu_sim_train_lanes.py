"""Simulated cycles of the CUDA training kernel in lanes, per knob choice, against
the recompute path (the forward, then the backward from the logits) and a copy
kernel moving the same bytes, in GPGPU-Sim's cycle model (``gpgpu_sim_cycles.py``'s
config: an RTX 3070, 46 SMs, 4 MB of L2).

The kernel reads each row twice, the second time for its gradient, which is
meant to find the row in L2. The default config at C = 32000 bf16 gives a row
per SM as large a share of L2 as C = 128256 bf16 on an H200 (64 KB of 89 KB,
256 KB of 379 KB). Each choice is ``THREADS`` with ``b`` appended for a
gradient swept backwards (``CUDAKnobs.gradient_backwards``). Usage::

    CE_TVM_GPGPU_SIM=~/gpgpu-sim python benchmarks/gpgpu_sim_train_lanes.py \\
        --classes 32000 --rows 184 --choices 256 256b 1024b --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from gpgpu_sim_cycles import bytes_moved, cycle_model

from ce_tvm.testing.cuda_cases import KERNELS, _case, problem

# (family, index in KERNELS[family]): the training kernel (sum), and the recompute pair
TRAIN, FORWARD, BACKWARD = ("train", 1), ("forward", 1), ("backward", 1)


def knobs_of(choice: str) -> tuple:
    """A choice as the training kernel's schedule options (``Case.knobs``)."""
    return (("gradient_backwards", str(choice.endswith("b"))), ("threads", choice.rstrip("b")))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=184)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--choices", nargs="+", default=["256", "256b", "1024b"])
    parser.add_argument("--arch", default="sm_80", help="the schedule's arch")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sim = cycle_model()
    if sim is None:
        return 2
    records = []

    def run(family_index, label, knobs=(), **fields):
        family, index = family_index
        case = replace(_case(family, KERNELS[family][index], args.dtype, args.classes, args.rows),
                       arch=args.arch, knobs=knobs)
        prob = problem(case)
        kernels = sim.kernels(case.spec())
        sim.run(kernels, case.rows, prob.arrays, prob.scalars, prob.aliases)
        cycles = sum(c for _, c in sim.last.cycles)
        reads, writes = bytes_moved(kernels, case, prob)
        records.append(dict(kernel=label, dtype=args.dtype, classes=args.classes, rows=args.rows,
                            arch=args.arch, cycles=cycles, read_bytes=reads,
                            write_bytes=writes, device=sim.name, **fields))
        print(f"{label:36} {cycles:>9}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(records, indent=1) + "\n")
        return cycles

    print(f"device: {sim.name}; C = {args.classes}, N = {args.rows}, {args.dtype}")
    for choice in args.choices:
        run(TRAIN, f"training kernel, {choice}", knobs_of(choice),
            threads=int(choice.rstrip("b")), backwards=choice.endswith("b"))
    total = run(FORWARD, "forward") + run(BACKWARD, "backward from the logits")
    records.append(dict(kernel="recompute path", cycles=total))
    floor = sim.copy_floor(records[0]["read_bytes"], records[0]["write_bytes"])
    records.append(dict(kernel="copy floor", cycles=floor))
    print(f"{'recompute path':36} {total:>9}\n{'copy floor':36} {floor:>9}")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
