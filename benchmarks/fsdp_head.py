"""The LM head under FSDP2 (``fully_shard``), per rank: ce_tvm's fused loss through
the head module against the stock path.

A body (``Linear(H, H)``) and an ``lm_head`` (``Linear(H, V)``, no bias), each
``fully_shard``-ed, and the root; each rank its own ``N`` rows. One training
step is ``loss.backward()`` for

- ``ce_tvm``: ``ce_tvm.linear_cross_entropy(hidden, model.lm_head, target)`` (the
  loss inside the head's call: FSDP gathers the weight, no logits);
- ``stock``: ``F.cross_entropy(model.lm_head(hidden), target)`` (``[N, V]`` logits);
- ``fsdp``: the floor, what FSDP itself holds for the head: inside the head's call
  a loss that touches the whole gathered weight but makes no logits (the weight
  gathered, its full gradient, the reduce-scatter).

Extra peak per rank: the RSS rise of one step (after a warm-up step), in a
fresh group per method, with ``tools.measure``'s child environment; the
figure that counts is a method's peak less the ``fsdp`` floor's. Time: the
three interleaved in one group, best of ``--reps``.
``python benchmarks/fsdp_head.py [--world 2] [--shape 2048x512x128256] [--reps 2] [--json F]``
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tp_head import run_ranks

from ce_tvm.tools.measure import write_report

METHODS = ("ce_tvm", "stock", "fsdp")


def _model(h: int, v: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.body = torch.nn.Linear(h, h, bias=False)
    model.lm_head = torch.nn.Linear(h, v, bias=False)
    model.forward = model.body.__call__
    fully_shard(model.body)
    fully_shard(model.lm_head)
    fully_shard(model)
    return model


def _loss_fn(method: str, model):
    import ce_tvm
    from ce_tvm.distributed.heads import inside

    head = model.lm_head
    if method == "ce_tvm":
        return lambda x, y: ce_tvm.linear_cross_entropy(model(x), head, y)
    if method == "stock":
        return lambda x, y: F.cross_entropy(head(model(x)), y)
    return lambda x, y: inside(head, lambda h: h.sum() + head.weight.sum(), model(x))


def worker(mode: str, n: int, h: int, v: int, reps: int, chunk_rows) -> None:
    """One rank: ``mode`` is ``time`` (every method) or a method (its memory)."""
    from ce_tvm.tools.measure import PeakRSS, interleaved_ms

    dist.init_process_group("gloo")
    model = _model(h, v)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(n, h, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)

    def step(fn):
        model.zero_grad(set_to_none=True)
        fn(x, y).backward()

    if mode == "time":
        fns = {m: _loss_fn(m, model) for m in METHODS}
        result = interleaved_ms({m: (lambda f=f: step(f)) for m, f in fns.items()}, reps=reps)
    else:
        fn = _loss_fn(mode, model)
        step(fn)  # warm-up: kernels loaded, FSDP's buffers made
        model.zero_grad(set_to_none=True)
        with PeakRSS() as peak:
            fn(x, y).backward()
        result = {mode: peak.mb}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()  # every rank done before any tears gloo down (its exit race)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--shape", default="2048x512x128256", help="N (per rank) x H x V")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--chunk-rows", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split("x"))
    if args.worker:
        worker(args.worker, *shape, args.reps, None)
        return 0
    from ce_tvm.tools.measure import CHILD_ENV

    times = run_ranks(args.world, "time", shape, args.reps, None, {}, script=__file__)
    peaks = {m: max(r[m] for r in run_ranks(args.world, m, shape, 1, None, CHILD_ENV,
                                            script=__file__)) for m in METHODS}
    extra = {m: peaks[m] - peaks["fsdp"] for m in ("ce_tvm", "stock")}
    report = {"shape": args.shape, "world": args.world,
              "ms": {m: max(t[m] for t in times) for m in METHODS},
              "peak_mb_per_rank": peaks, "extra_peak_mb_beyond_fsdp": extra,
              "ce_tvm_over_stock": extra["ce_tvm"] / extra["stock"],
              "command": " ".join(sys.argv)}
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
