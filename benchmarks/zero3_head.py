"""The LM head under DeepSpeed ZeRO-3 (CPU, gloo), per rank: ce_tvm's fused loss
through the head module against the stock path.

A body (``Linear(H, H)``) and an ``lm_head`` (``Linear(H, V)``, no bias) under
ZeRO-3 with every parameter partitioned (``stage3_param_persistence_threshold``
0) and SGD; each rank its own ``N`` rows; the loss is computed inside the model's
forward. One training step is the engine's forward and ``engine.backward`` for

- ``ce_tvm``: ``ce_tvm.linear_cross_entropy(hidden, self.lm_head, target)`` (inside
  the head's call: ZeRO-3 gathers the weight there, no logits);
- ``stock``: ``F.cross_entropy(self.lm_head(hidden), target)`` (``[N, V]`` logits);
- ``zero3``: the floor, what ZeRO-3 itself holds for the head: inside the head's
  call a loss that touches the whole gathered weight but makes no logits.

Extra peak per rank: the RSS rise of one step (after a warm-up step with the
optimizer's step), in a fresh group per method, with ``tools.measure``'s child
environment; the figure that counts is a method's peak less the ``zero3`` floor's.
``DS_ACCELERATOR=cpu python benchmarks/zero3_head.py [--world 2] [--shape 2048x512x32000]``
``[--json F]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tp_head import run_ranks  # noqa: E402

from ce_tvm.tools.measure import write_report  # noqa: E402

METHODS = ("ce_tvm", "stock", "zero3")
CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class Model(torch.nn.Module):
    def __init__(self, h: int, v: int, method: str):
        super().__init__()
        self.body = torch.nn.Linear(h, h, bias=False)
        self.lm_head = torch.nn.Linear(h, v, bias=False)
        self.method = method

    def forward(self, x, y):
        import ce_tvm
        from ce_tvm.distributed.heads import inside

        hidden = self.body(x)
        if self.method == "ce_tvm":
            return ce_tvm.linear_cross_entropy(hidden, self.lm_head, y)
        if self.method == "stock":
            return F.cross_entropy(self.lm_head(hidden), y)
        head = self.lm_head
        return inside(head, lambda t: t.sum() + head.weight.sum(), hidden)


def worker(method: str, n: int, h: int, v: int) -> None:
    """One rank: the extra peak of one step of ``method``."""
    import deepspeed

    from ce_tvm.tools.measure import PeakRSS

    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Model(h, v, method)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=CONFIG)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(n, h, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    engine.backward(engine(x, y))  # warm-up: kernels loaded, ZeRO-3's buffers made
    engine.step()
    with PeakRSS() as peak:
        engine.backward(engine(x, y))
    engine.step()
    print("RESULT " + json.dumps({method: peak.mb}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--shape", default="2048x512x32000", help="N (per rank) x H x V")
    parser.add_argument("--json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--chunk-rows", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split("x"))
    if args.worker:
        worker(args.worker, *shape)
        return 0
    from ce_tvm.tools.measure import CHILD_ENV

    peaks = {m: max(r[m] for r in run_ranks(args.world, m, shape, 1, None, CHILD_ENV,
                                            script=__file__)) for m in METHODS}
    extra = {m: peaks[m] - peaks["zero3"] for m in ("ce_tvm", "stock")}
    report = {"shape": args.shape, "world": args.world, "peak_mb_per_rank": peaks,
              "extra_peak_mb_beyond_zero3": extra,
              "ce_tvm_over_stock": extra["ce_tvm"] / extra["stock"],
              "command": " ".join(sys.argv)}
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
