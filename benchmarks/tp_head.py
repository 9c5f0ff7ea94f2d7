"""The vocabulary-sharded LM head per rank, against the unfused tensor-parallel path.

Each rank holds ``V / world`` rows of the head's weight and the replicated
hidden states ``[N, H]``; one training step is ``loss.backward()`` for

- ``ce_tvm``: ``vocab_parallel_linear_cross_entropy`` (the shard's logits one
  chunk of rows at a time);
- ``unfused``: ``vocab_parallel_cross_entropy(F.linear(x, W_r), y)`` (the
  rank's ``[N, V_r]`` logits whole).

Time: both methods in one process group, interleaved rep by rep, best of
``--reps``. Memory: each method in a fresh group, the extra peak RSS of one
step (after a warm-up step) beyond the inputs and the gradients, per rank,
with ``tools.measure``'s child environment. ``python benchmarks/tp_head.py
[--world 2] [--shape 2048x512x128256] [--reps 3] [--chunk-rows R] [--json F]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

METHODS = ("ce_tvm", "unfused")


def _step_fn(method: str, chunk_rows: int | None):
    from ce_tvm import distributed

    if method == "ce_tvm":
        return lambda x, W, y: distributed.vocab_parallel_linear_cross_entropy(
            x, W, y, chunk_rows=chunk_rows)
    return lambda x, W, y: distributed.vocab_parallel_cross_entropy(F.linear(x, W), y)


def _inputs(n: int, h: int, v: int, world: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=gen).requires_grad_()
    W = (torch.randn(v // world, h, generator=gen) * h ** -0.5).requires_grad_()
    return x, W, torch.randint(0, v // world * world, (n,), generator=gen)


def _step(fn, x, W, y) -> None:
    x.grad = W.grad = None
    fn(x, W, y).backward()


def worker(mode: str, n: int, h: int, v: int, reps: int, chunk_rows: int | None) -> None:
    """One rank: ``mode`` is ``time`` (both methods) or a method (its memory)."""
    from ce_tvm.tools.measure import PeakRSS, interleaved_ms

    dist.init_process_group("gloo")
    x, W, y = _inputs(n, h, v, dist.get_world_size())
    if mode == "time":
        fns = {m: _step_fn(m, chunk_rows) for m in METHODS}
        result = interleaved_ms({m: (lambda f=f: _step(f, x, W, y)) for m, f in fns.items()},
                                reps=reps, warmup=1)
    else:
        fn = _step_fn(mode, chunk_rows)
        _step(fn, x, W, y)  # warm-up: kernels loaded
        x.grad = W.grad = None
        with PeakRSS() as peak:
            fn(x, W, y).backward()
        grads = sum(t.grad.numel() * t.grad.element_size() for t in (x, W)) / 2**20
        result = {mode: peak.mb - grads}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()  # every rank done before any tears gloo down (its exit race)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, mode: str, shape: tuple, reps: int, chunk_rows: int | None,
              env: dict, script: str = __file__) -> list[dict]:
    """``script --worker mode ...`` on ``world`` local ranks (gloo); each rank's
    ``RESULT`` dictionary."""
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, script, "--worker", mode, "--shape", "x".join(map(str, shape)),
         "--reps", str(reps), "--chunk-rows", str(chunk_rows or 0)],
        env={**os.environ, **env, "RANK": str(r), "WORLD_SIZE": str(world),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "TVM_NUM_THREADS": str(max(1, os.cpu_count() // world)),
             "OMP_NUM_THREADS": str(max(1, os.cpu_count() // world))},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(err[-3000:])
        results.append(json.loads(out.split("RESULT ")[-1]))
    return results


def main() -> int:
    from ce_tvm.tools.measure import write_report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--shape", default="2048x512x128256", help="N x H x V")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-rows", type=int, default=0,
                        help="ce_tvm's rows per chunk (default: its own choice)")
    parser.add_argument("--json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split("x"))
    if args.worker:
        worker(args.worker, *shape, args.reps, args.chunk_rows or None)
        return 0
    from ce_tvm.tools.measure import CHILD_ENV

    rows = args.chunk_rows or None
    times = run_ranks(args.world, "time", shape, args.reps, rows, {})
    peaks = {m: [r[m] for r in run_ranks(args.world, m, shape, 1, rows, CHILD_ENV)]
             for m in METHODS}
    report = {"shape": args.shape, "world": args.world,
              "ms": {m: max(t[m] for t in times) for m in METHODS},
              "extra_peak_mb_per_rank": {m: max(v) for m, v in peaks.items()},
              "command": " ".join(sys.argv)}
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
