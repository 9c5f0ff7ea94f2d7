"""A change to the compute, timed: each kernel built twice in one process, once
with a function of ``ce_tvm/kernels/`` as it was at a git revision and once as it
is now, both on the hand schedule (``cpu_levers.build``), called alternately,
best of ``--reps``; outputs compared, static instructions per element counted.

The old function is the revision's module source executed in a copy of the
current module's namespace; every ``ce_tvm.kernels`` module that imported the
function by name sees the old one while the old kernel is declared.

Usage::

    python benchmarks/compute_ab.py --rev HEAD~1 --function row_stats \\
        --ops log_probs --shapes 4096x32000 8192x50257 2048x128256 --json ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import subprocess
import sys
from pathlib import Path

import cpu_levers

from ce_tvm.schedules.cpu_knobs import hand_knobs
from ce_tvm.tools import tuning


def old_function(rev: str, module: str, name: str):
    """``module.name`` as the source at ``rev`` defines it (the current module's
    imports and helpers around it)."""
    current = importlib.import_module(module)
    path = Path(current.__file__).relative_to(Path(__file__).resolve().parents[1])
    source = subprocess.run(["git", "show", f"{rev}:{path.as_posix()}"], capture_output=True,
                            text=True, check=True).stdout
    namespace = dict(vars(current))
    exec(compile(source, current.__file__, "exec"), namespace)  # noqa: S102
    return getattr(current, name), namespace[name]


def swapped(new, old):
    """A context in which every loaded ``ce_tvm.kernels`` module holding ``new``
    under its name holds ``old``."""
    @contextlib.contextmanager
    def context():
        holders = [m for key, m in sys.modules.items() if key.startswith("ce_tvm.kernels")
                   and getattr(m, new.__name__, None) is new]
        for m in holders:
            setattr(m, new.__name__, old)
        try:
            yield
        finally:
            for m in holders:
                setattr(m, new.__name__, new)
    return context


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the git revision of the old function")
    parser.add_argument("--module", default="ce_tvm.kernels.common")
    parser.add_argument("--function", required=True)
    parser.add_argument("--ops", nargs="+", default=["log_probs"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--shapes", nargs="+", type=cpu_levers._shape, default=[(4096, 32000)])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rev = subprocess.run(["git", "rev-parse", "--short", args.rev], capture_output=True,
                         text=True, check=True).stdout.strip()
    new, old = old_function(rev, args.module, args.function)
    cpu_levers.configure_thread_pool()
    records = []
    for rows, classes in args.shapes:
        for op in args.ops:
            for dtype in args.dtypes:
                spec = cpu_levers._spec(op, dtype, classes, None)
                knobs = hand_knobs(op, spec.tvm_target(), dtype)
                now = cpu_levers.build(spec, knobs)
                before = cpu_levers.build(spec, knobs, swapped(new, old))
                record = {"op": op, "dtype": dtype, "shape": f"{rows}x{classes}",
                          "rev": rev, "function": args.function}
                if now[1] == before[1]:
                    record["effect"] = "same assembly"
                else:
                    kernel_args = tuning.Candidates(spec, rows, {}).arguments({})
                    outputs = cpu_levers._difference(cpu_levers._outputs(before[0], kernel_args),
                                                     cpu_levers._outputs(now[0], kernel_args))
                    old_ms, new_ms = tuning.time_ms([before[0], now[0]], kernel_args,
                                                    runs=args.reps)
                    record.update(effect="timed", outputs=outputs, old_ms=old_ms, new_ms=new_ms,
                                  old_over_new=old_ms / new_ms,
                                  insn_per_element=[cpu_levers.per_element(before[2], spec),
                                                    cpu_levers.per_element(now[2], spec)])
                    del kernel_args
                print(json.dumps(record), flush=True)
                records.append(record)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
