"""The CUDA schedule's kernels executed without a GPU: each kernel of
``schedules/cuda.py``, built for OpenCL and run on PoCL's CPU device
(``ce_tvm.testing.pocl``), against the float64 reference (``ce_tvm.testing.reference``).

Every op family: the forward, the backward (from ``log_prob``, from the
logits, and in place), the one-pass training kernel, probability targets,
softcap, token accuracy, the vocabulary-shard statistics (and the combine and
shard backward), per-token log-probs and their gradient (also in place),
temperature, and the distillation kernel (the student-teacher divergence,
its entropy and gradient, also in place; its float64 reference is
``_distill_problem``'s); float32, float16 and bfloat16; C = 1000, 5003 (prime),
32000 and 128256; rows 1, 7, 64 and 1000 (1000 at C = 1000 and 5003 only, see
``MAX_ROWS``); ignored rows, every row ignored, class weights. The
stress pass runs the same kernels with the fewest and the most threads per
block ``schedules/cuda.py`` offers (and 4 rows per block where the
schedule allows it), three launches each: a race shows up as a result that
differs between launches or from the reference.

One JSON record per case (``--json FILE``): ``op`` (the kernel), ``family``,
``dtype``, ``classes``, ``rows``, ``variant``, ``max_abs_err`` (the largest
``|actual - reference|`` over every output), ``worst`` (the largest
``|actual - reference| / (|reference| + max(1, max |reference|))``, per
output), ``tol`` (``worst`` must not exceed it: the tolerances of
``tests/support.py``), ``passed`` (within ``tol``, NaN and infinities in the
same places, hit flags and repeated launches bit for bit equal),
``kernels`` (device kernels per launch of the host function), ``device``
(as PoCL names it) and ``seconds``.

The cases, the reference values and the comparison are
``ce_tvm.testing.cuda_cases``'s (``tests/schedules/test_pocl.py`` runs a part of
them); this script runs them all and writes the records.

Usage::

    python benchmarks/gpu_schedule_on_pocl.py --json pocl.json
    python benchmarks/gpu_schedule_on_pocl.py --families forward train --dtypes float32 \\
        --classes 5003 --rows 7
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from ce_tvm.testing import pocl
from ce_tvm.testing.cuda_cases import ARCH, case_arguments, matrix, run_cases, stress


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    case_arguments(parser)
    parser.add_argument("--no-stress", action="store_true", help="skip the stress pass")
    parser.add_argument("--arch", default=ARCH, help="the CUDA arch the kernels are "
                        "scheduled for (which rows the log_prob forward stages whole)")
    args = parser.parse_args(argv)
    reason = pocl.pocl_unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    device = pocl.PoCL.get()
    print(f"device: {device.name} ({', '.join(device.changes) or 'as PoCL set it up'})")
    cases = matrix(args.families, args.dtypes, args.classes, args.rows)
    if not args.no_stress:
        cases += [c for c in stress() if c.family in args.families]
    cases = [replace(c, arch=args.arch) for c in cases]
    results = run_cases(cases, device, args.json)
    return 0 if all(r.passed for r in results) else 1

if __name__ == "__main__":
    sys.exit(main())
