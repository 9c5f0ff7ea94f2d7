"""The CUDA schedule's kernels as nvcc compiles them, executed in GPGPU-Sim
(``ce_tvm.testing.gpgpu_sim``), against the float64 reference: the cases of
``ce_tvm.testing.cuda_cases`` (every op family, float32, float16 and bfloat16,
C = 1000, 5003, 32000 and 128256), at rows 1, 7 and 64, on the sm_80 and sm_90
schedules (sm_90 stages the log_prob forward's row whole in dynamic shared
memory), in the simulator's functional mode.

One JSON record per case (``--json FILE``): ``op``, ``family``, ``dtype``,
``classes``, ``rows``, ``arch`` (the schedule's), ``variant``, ``max_abs_err``,
``worst``, ``tol``, ``passed`` (as ``benchmarks/gpu_schedule_on_pocl.py``'s),
``instructions`` (thread instructions the simulator executed) and ``device``
(the simulator, its config and mode, nvcc's arch).

Needs the simulator built (``benchmarks/gpgpu_sim/build.sh``) and
``CE_TVM_GPGPU_SIM`` (or ``GSIM``) naming its folder. Usage::

    CE_TVM_GPGPU_SIM=~/gpgpu-sim python benchmarks/gpu_schedule_on_gpgpu_sim.py --json sim.json
    ... --json sim.json --resume      # a stopped run goes on; failed cases run again
    ... --families forward log_probs --dtypes bfloat16 --classes 32000 --rows 7 --archs sm_90
    ... --classes 32000 128256 --rows 64 --sample   # one kernel per family x dtype
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ce_tvm.testing import gpgpu_sim
from ce_tvm.testing.cuda_cases import case_arguments, matrix, run_cases

ROWS = (1, 7, 64)
ARCHS = ("sm_80", "sm_90")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    case_arguments(parser, ROWS)
    parser.add_argument("--archs", nargs="+", default=list(ARCHS),
                        help="the CUDA archs the kernels are scheduled for")
    parser.add_argument("--resume", action="store_true",
                        help="keep the passed records already in --json; run the rest")
    parser.add_argument("--sample", action="store_true",
                        help="each family's first kernel only (per dtype, C, rows and arch): "
                             "the long grids of the largest shapes at a few minutes a case")
    args = parser.parse_args(argv)
    reason = gpgpu_sim.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    sim = gpgpu_sim.Simulator.find()
    print(f"device: {sim.name}")
    # smallest first (rows x classes): a run stopped early has covered every family
    cases = sorted((replace(case, arch=arch) for arch in args.archs
                    for case in matrix(args.families, args.dtypes, args.classes, args.rows)),
                   key=lambda case: case.rows * case.classes)
    if args.sample:
        firsts = {}
        for case in cases:
            firsts.setdefault((case.family, case.dtype, case.classes, case.rows, case.arch), case)
        cases = list(firsts.values())
    kept = []
    if args.resume and args.json and args.json.exists():
        kept = [r for r in json.loads(args.json.read_text()) if r["passed"]]
        done = {_key(r) for r in kept}
        cases = [c for c in cases if _key(vars(c) | {"variant": c.label}) not in done]
        print(f"resuming: {len(kept)} passed records kept, {len(cases)} cases to run")
    results = run_cases(cases, sim, args.json, kept)
    return 0 if all(r.passed for r in results) else 1


def _key(record: dict) -> tuple:
    return tuple(record[k] for k in ("family", "op", "variant", "dtype", "classes", "rows",
                                     "arch"))


if __name__ == "__main__":
    sys.exit(main())
