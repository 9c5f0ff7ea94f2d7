"""The fused log-prob + entropy heads against their four GEMMs, directly and through
TRL's head, interleaved in one run.

One step is ``ce-tvm bench --policy``'s (temperature 0.7, one index per row,
``(a * logp).sum() + (b * entropy).sum()`` then ``backward()``) for

- ``ce_tvm``: ``ce_tvm.linear_log_probs``;
- ``via_trl``: the call TRL's fused head makes
  (``trl.trainer.utils._ChunkedLogProbFunction.apply``) after
  ``ce_tvm.integrations.trl.apply()``;
- ``by_rows`` (``--by-rows``): ``ce_tvm`` as the row sweep ran it before the
  vocabulary blocks, chunks of 384 rows against the whole vocabulary
  (``CE_TVM_LINEAR_CHUNK_ROWS=384``, ``CE_TVM_LINEAR_BLOCK_COLUMNS=V``);
- ``trl`` (``--trl-own``): TRL's own ``ChunkedLogProbFunction`` (its CPU path);
- the floor ``gemm``: the four products a head that recomputes its logits runs
  (``bench_policy.gemm_floor``), into buffers made once; with ``--fresh-grads``
  also ``gemm_fresh``: the same with the two gradients in new tensors each
  step, as a head returns them (on these VMs a fresh 2 GB tensor's first touch
  costs from 0.6 s to 15 s, depending on what the process touched before).

Methods run in turn within each rep, the best rep kept (``--reps``, after
``--warmup``), so a neighbour's load lands on all of them. JSON with ``--json``.

    python benchmarks/fused_heads.py --shapes 2048x256x32000,1024x1024x128256,2048x4096x128256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from ce_tvm.integrations import trl as ce_trl
from ce_tvm.tools import bench_policy as policy
from ce_tvm.tools.measure import interleaved_ms


def via_trl(x, W, index, temperature=policy.TEMPERATURE):
    """TRL's head call, computed by ce_tvm (``apply()``) and TRL's own again after it."""
    from trl.trainer import utils as trl_utils

    ce_trl.apply()
    try:
        return trl_utils._ChunkedLogProbFunction.apply(
            x, W, None, index, temperature, 32768, None, 1.0, ("log_probs", "entropy"))[:2]
    finally:
        ce_trl.remove()


def by_rows(step):
    """``step`` with ``ce_tvm`` in row chunks of 384 against the whole vocabulary,
    forward and backward."""
    def run():
        names = ("CE_TVM_LINEAR_CHUNK_ROWS", "CE_TVM_LINEAR_BLOCK_COLUMNS")
        saved = {k: os.environ.get(k) for k in names}
        os.environ.update(dict(zip(names, ("384", str(1 << 30)))))
        try:
            step()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
    return run


def measure(shape, reps, warmup, trl_own, rows, fresh=False) -> dict:
    """Best milliseconds per method at ``shape`` (N, H, V), float32."""
    (x, W), index, a, b = policy.inputs(shape, "float32")
    leaves = [x.clone().requires_grad_(), W.clone().requires_grad_()]
    heads = {"ce_tvm": policy.methods(shape, with_compile=False, with_trl=False)["ce_tvm"],
             "via_trl": via_trl}
    if trl_own:
        heads["trl"] = policy._trl_head
    timed = {name: (lambda fn=fn: policy.step(fn, leaves, index, a, b))
             for name, fn in heads.items()}
    if rows:
        timed["by_rows"] = by_rows(timed["ce_tvm"])
    timed["gemm"] = policy.gemm_floor(x, W)
    if fresh:
        timed["gemm_fresh"] = policy.gemm_floor(x, W, fresh_grads=True)
    return interleaved_ms(timed, reps, warmup)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2048x256x32000,1024x1024x128256,2048x4096x128256")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--trl-own", action="store_true", help="time TRL's own head too")
    parser.add_argument("--by-rows", action="store_true",
                        help="time the row sweep (chunks of 384 rows) too")
    parser.add_argument("--fresh-grads", action="store_true",
                        help="time the GEMMs with the gradients in new tensors too")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    records = []
    print("| N x H x V | ce_tvm ms | via TRL ms | 4 GEMMs ms | ce_tvm / GEMMs | via TRL / GEMMs "
          "| others / GEMMs |")
    print("|---|---|---|---|---|---|---|")
    for text in args.shapes.split(","):
        shape = tuple(int(s) for s in text.split("x"))
        ms = measure(shape, args.reps, args.warmup, args.trl_own, args.by_rows, args.fresh_grads)
        records.append({"shape": text, "dtype": "float32", "ms": ms,
                        "ratio": {k: ms[k] / ms["gemm"] for k in ms if k != "gemm"}})
        print(f"| {' x '.join(map(str, shape))} | {ms['ce_tvm']:.0f} | {ms['via_trl']:.0f} | "
              f"{ms['gemm']:.0f} | {ms['ce_tvm'] / ms['gemm']:.3f}x | "
              f"{ms['via_trl'] / ms['gemm']:.3f}x | "
              + ", ".join(f"{k} {ms[k] / ms['gemm']:.3f}x"
                          for k in ("by_rows", "trl", "gemm_fresh") if k in ms)
              + " |", flush=True)
    if args.json:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
                "load": os.getloadavg(), "reps": args.reps, "warmup": args.warmup}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
