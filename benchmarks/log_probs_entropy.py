"""``ce_tvm.log_probs`` without the entropy (``return_entropy=False``: the kernel
without its sum, on AVX-512 taking each row against its first chunk's max) and
with it, against the read floor ``x.sum()``, interleaved in one run
(``tools.measure.interleaved_ms``: in turn within each rep, a pause after each
call, the best rep kept). Temperature 0.7, one index per row, logits
``3 N(0, 1)``. JSON with ``--json``.

    python benchmarks/log_probs_entropy.py --shapes 4096x32000,8192x50257,2048x128256
"""

from __future__ import annotations

import argparse
import json

import torch

import ce_tvm
from ce_tvm.runtime.registry import configure_thread_pool
from ce_tvm.tools.measure import interleaved_ms


def measure(rows: int, classes: int, dtype: torch.dtype, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, classes, generator=gen) * 3).to(dtype)
    index = torch.randint(0, classes, (rows,), generator=gen)
    ms = interleaved_ms({
        "without": lambda: ce_tvm.log_probs(x, index, temperature=0.7),
        "with": lambda: ce_tvm.log_probs(x, index, temperature=0.7, return_entropy=True),
        "read": lambda: x.sum(),
    }, reps=reps, warmup=2)
    return {"shape": f"{rows}x{classes}", "dtype": str(dtype).removeprefix("torch."), **ms,
            "with/without": ms["with"] / ms["without"], "without/read": ms["without"] / ms["read"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x32000,8192x50257,2048x128256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    configure_thread_pool()
    records = []
    for shape in args.shapes.split(","):
        rows, classes = (int(v) for v in shape.split("x"))
        for dtype in args.dtypes.split(","):
            record = measure(rows, classes, getattr(torch, dtype), args.reps)
            print(f"{record['shape']:>12} {record['dtype']:<9} without {record['without']:7.1f} ms"
                  f"  with {record['with']:7.1f} ms  read {record['read']:7.1f} ms"
                  f"  with/without {record['with/without']:.2f}x"
                  f"  without/read {record['without/read']:.2f}x", flush=True)
            records.append(record)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
