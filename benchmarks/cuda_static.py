"""Static evidence for the CUDA kernels, from their machine code (no GPU needed).

For each shape (op, dtype, C, arch) it builds the kernel as the runtime would,
compiles TVM's CUDA source with ``nvcc -cubin -Xptxas -v``, disassembles the
cubin and prints, for the row kernel: registers, shared memory per block,
spill bytes, and per element: SASS instructions, shared loads and broadcast
shared loads (the method: ``ce_tvm.testing.cuda_static``).

Usage: ``python benchmarks/cuda_static.py --op forward --dtype bfloat16 --classes 128256``
(``--op`` forward | forward-lp | backward | train; ``--weighted``; ``--arch sm_90``).
"""

from __future__ import annotations

import argparse
import sys

from ce_tvm.testing.cuda_static import DTYPE_BYTES, OPS, analyse, summarise, table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=sorted(OPS), nargs="+", default=["forward"])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=sorted(DTYPE_BYTES))
    parser.add_argument("--classes", type=int, nargs="+", default=[128256])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--reduction", default="mean", choices=("none", "sum", "mean"))
    parser.add_argument("--weighted", action="store_true")
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                        help="a CUDA schedule knob over the kernel's own (repeatable)")
    args = parser.parse_args(argv)
    knobs = tuple(tuple(k.split("=", 1)) for k in args.knob)
    rows = []
    for op in args.op:
        for dtype in args.dtype:
            for classes in args.classes:
                label = (f"{op} {args.reduction}{' w' if args.weighted else ''} {dtype} C={classes}"
                         + "".join(f" {k}={v}" for k, v in knobs))
                try:
                    kernels = analyse(op, dtype, classes, args.arch, args.weighted,
                                      args.reduction, knobs)
                    rows.append((label, summarise(kernels, classes)))
                except Exception as err:  # report the shape, keep going
                    last = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
                    print(f"{label}: BUILD FAILED: {last[:120]}", file=sys.stderr)
    print(table(rows))
    print("regs/smem (static)/dsmem (dynamic: a row staged whole)/loops/per-element counts: "
          "the row kernel (the one sweeping [N, C]); "
          "spill: the worst kernel; loops 'none': whole kernel / ceil(C/256) (upper bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
