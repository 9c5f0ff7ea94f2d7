"""Static evidence for the CPU kernels, from their assembly (nothing runs).

For each shape (op, dtype, C) and CPU target it builds the kernel as the
runtime would, for that target's ``mcpu`` (cross-compiled: only assembly is
generated, so the host does not matter), and prints x86 instructions per
element of a row and their split: load and widening, max, exp, sum,
gradient/elementwise arithmetic, narrowing, store, other (the method:
``ce_tvm.testing.cpu_static``). ``--loops`` adds one line per loop.

Usage: ``python benchmarks/cpu_static.py --target "llvm -mcpu=znver5" --ops train forward
log_probs --dtypes float32 bfloat16 --classes 32000``
"""

from __future__ import annotations

import argparse
import sys

from ce_tvm.testing.cpu_static import DTYPE_BYTES, OPS, analyse, loop_table, table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", nargs="+", default=["llvm -mcpu=znver5"],
                        help='CPU targets, e.g. "llvm -mcpu=znver5" "llvm -mcpu=haswell"')
    parser.add_argument("--ops", choices=sorted(OPS), nargs="+",
                        default=["train", "forward", "log_probs"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=sorted(DTYPE_BYTES))
    parser.add_argument("--classes", type=int, nargs="+", default=[32000])
    parser.add_argument("--reduction", default="mean", choices=("none", "sum", "mean"))
    parser.add_argument("--weighted", action="store_true")
    parser.add_argument("--loops", action="store_true", help="one line per loop as well")
    args = parser.parse_args(argv)
    rows = []
    for target in args.target:
        for op in args.ops:
            for dtype in args.dtypes:
                for classes in args.classes:
                    try:
                        s = analyse(op, dtype, classes, target, args.weighted, args.reduction)
                    except Exception as err:  # report the shape, keep going
                        last = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
                        print(f"{op} {dtype} C={classes} {target}: BUILD FAILED: {last[:120]}",
                              file=sys.stderr)
                        continue
                    rows.append(s)
                    if args.loops:
                        print(s.label)
                        print(loop_table(s))
    print(table(rows))
    print("insn/el: x86 instructions per element of a row (static; each loop's own "
          "instructions over its elements per iteration, times the share of the row it runs); "
          "grad: elementwise arithmetic of a stored result; loops: element loops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
