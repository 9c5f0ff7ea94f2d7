"""torchtitan's llama3 debugmodel trained on CPU for a few steps, its stock loss
(``ChunkedLossWrapper`` around ``CrossEntropyLoss``) against ce_tvm's
(``ce_tvm.integrations.torchtitan.apply``): the logged losses side by side and the
largest difference of the parameters after the last step.

    python benchmarks/torchtitan_run.py --ranks 1 --steps 4
    python benchmarks/torchtitan_run.py --ranks 2 --steps 4 --dtype bfloat16

``--ranks 2`` runs torchrun (gloo) with FSDP2 over the two ranks (torchtitan's
``data_parallel_shard_degree=-1``). Each loss is trained in its own run of the same
seed and data; ``--dtype bfloat16`` is torchtitan's mixed precision (FSDP2
parameters in bfloat16 on 2 ranks, ``torch.autocast`` on 1), float32 otherwise.

torchtitan 0.3.0 does not train on a CPU as shipped; these workarounds, applied
here before torchtitan is imported or built, change nothing of the loss:

- device: torchtitan falls back to ``"cuda"`` when no accelerator is found
  (``torchtitan.tools.utils``); ``torch._utils._get_available_device_type`` is made
  to answer ``"cpu"``, and the CUDA-only calls on ``torch.cpu`` (device name, memory
  statistics, ``set_device``) get stand-ins;
- triton: ``torchtitan.trainer`` imports triton kernels (expert parallelism,
  ``torchtitan.distributed.minimal_async_ep.kernels``) at import; a CPU torch has
  no triton, so an empty module stands in for that one (nothing here calls them);
- attention: the llama3 configs use FlexAttention, which has no CPU backward
  here; every layer's inner attention becomes torchtitan's
  ``ScaledDotProductAttention`` (causal). The data has one document per row, so
  causal equals FlexAttention's block-causal mask;
- ``ReduceOp.PREMUL_SUM``: torchtitan sets FSDP2's gradient divide factor to 1
  (it divides by the global token count itself), which makes FSDP2 reduce-scatter
  with ``PREMUL_SUM(1.0)``, which gloo lacks; ``set_force_sum_reduction_for_comms``
  makes it ``SUM``, the same sum;
- ``torch.distributed.set_timeout``, which torchtitan calls after the first step
  (``set_pg_timeouts``), is not in torch 2.13; that call is skipped;
- ``parallelism.spmd_backend="partial_dtensor"``: under the default
  ``"spmd_types"``, FSDP2 refused the plain parameters of the llama3 model
  ("all parameters must be DTensors on the full SPMD mesh");
- data: a synthetic tokenizer and loader (seeded random tokens, one document per
  row, the last 8 labels of each row -100 so the ignore index and the global
  token count matter); no dataset or tokenizer files are needed.

Also: no checkpoints, no validation, no compile, ``seq_len`` 256, ``local_batch_size``
2 per rank (8 and 2048 in the stock config).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

import torch


def cpu_workarounds() -> None:
    """The workarounds of the module docstring that must precede torchtitan's import."""
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    for name, value in (("get_device_name", lambda *a: "cpu"),
                        ("current_device", lambda: 0),
                        ("get_device_properties", lambda *a: types.SimpleNamespace(
                            total_memory=1, name="cpu")),
                        ("reset_peak_memory_stats", lambda *a: None),
                        ("empty_cache", lambda: None),
                        ("memory_stats", lambda *a: {}),
                        ("set_device", lambda *a: None)):
        if not hasattr(torch.cpu, name) or name in ("set_device", "current_device"):
            setattr(torch.cpu, name, value)
    kernels = "torchtitan.distributed.minimal_async_ep.kernels"  # triton kernels, for EP
    if kernels not in sys.modules:
        stub = types.ModuleType(kernels)
        for name in ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel",
                     "expand_topk_grad_kernel", "fill_combine_metadata_kernel",
                     "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                     "reduce_topk_slots_kernel", "topk_scores_grad_kernel"):
            setattr(stub, name, None)
        sys.modules[kernels] = stub
    from torch.distributed.fsdp import FSDPModule

    own = FSDPModule.set_gradient_divide_factor

    def divide_then_sum(self, factor):
        own(self, factor)
        self.set_force_sum_reduction_for_comms(True)  # SUM, not PREMUL_SUM(1 / factor)

    FSDPModule.set_gradient_divide_factor = divide_then_sum


def synthetic_data():
    """A tokenizer and a loader of seeded random tokens (torchtitan Configurables)."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class Tokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config, **_):
            super().__init__()
            self.eos_id, self.bos_id = 1, 0

        def encode(self, *a, **k):
            return []

        def decode(self, *a, **k):
            return ""

        def get_vocab_size(self):
            return 2048

    class Loader(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len,
                     local_batch_size, **_):
            self.rank, self.seq_len, self.batch = dp_rank, seq_len, local_batch_size

        def __iter__(self):
            gen = torch.Generator().manual_seed(1000 + self.rank)
            while True:
                tokens = torch.randint(2, 2048, (self.batch, self.seq_len + 1), generator=gen)
                labels = tokens[:, 1:].clone()
                labels[:, -8:] = -100
                positions = torch.arange(self.seq_len).expand(self.batch, -1).contiguous()
                yield {"input": tokens[:, :-1], "positions": positions}, labels

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    return Tokenizer.Config(), Loader.Config()


def worker(loss: str, steps: int, dtype: str, out: Path) -> None:
    """One training run (one torchrun rank): the logged losses and, on rank 0, the
    final parameters, to ``out``."""
    cpu_workarounds()
    import torch.distributed as dist
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    dist_utils.set_pg_timeouts = lambda *a, **k: None  # torch.distributed.set_timeout: none
    config = llama3_debugmodel()
    for _, _, parent, attr in config.model_spec.model.traverse(FlexAttention.Config):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.tokenizer, config.dataloader = synthetic_data()
    config.training.seq_len, config.training.local_batch_size = 256, 2
    config.training.steps = steps
    config.training.mixed_precision_param = dtype
    config.checkpoint.enable = False
    # FSDP2 under the default "spmd_types" wants every parameter a DTensor on the full
    # SPMD mesh (dp_mesh_dims), which its llama3 CPU path does not give: DTensors for
    # the model-parallel axes only (none here), plain FSDP2 over the data-parallel ranks
    config.parallelism.spmd_backend = "partial_dtensor"
    config.validator.enable = False
    config.dump_folder = str(out.parent / "dump")
    if loss == "ce_tvm":
        from ce_tvm.integrations import torchtitan as cetitan

        cetitan.apply(config)
    torch.manual_seed(0)

    logged = []
    own_log = MetricsProcessor.log

    def log(self, step, global_avg_loss, global_max_loss, *args, **kwargs):
        logged.append(float(global_avg_loss))
        return own_log(self, step, global_avg_loss, global_max_loss, *args, **kwargs)

    MetricsProcessor.log = log
    trainer = config.build()
    trainer.train()
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
              for name, p in trainer.model_parts[0].named_parameters()}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save({"losses": logged, "params": params,
                    "loss_type": type(trainer.loss_fn).__name__}, out)
    trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(loss: str, ranks: int, steps: int, dtype: str, out: Path) -> None:
    me = [str(Path(__file__).resolve()), "--worker", loss, "--steps", str(steps),
          "--dtype", dtype, "--out", str(out)]
    if ranks == 1:
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
        command = [sys.executable, *me]
    else:
        env = dict(os.environ)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={ranks}", *me]
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    subprocess.run(command, env=env, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--worker", choices=["stock", "ce_tvm"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.dtype, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for loss in ("stock", "ce_tvm"):
            out = Path(tmp) / f"{loss}.pt"
            launch(loss, args.ranks, args.steps, args.dtype, out)
            runs[loss] = torch.load(out)
    stock, ours = runs["stock"], runs["ce_tvm"]
    print(f"\nllama3 debugmodel, {args.ranks} rank(s), {args.dtype}, {args.steps} steps; "
          f"losses: {stock['loss_type']} vs {ours['loss_type']}")
    print(f"{'step':>4}  {'stock':>12}  {'ce_tvm':>12}  {'|diff|':>9}")
    for step, (a, b) in enumerate(zip(stock["losses"], ours["losses"]), 1):
        print(f"{step:>4}  {a:12.7f}  {b:12.7f}  {abs(a - b):9.2e}")
    diff = max(float((stock["params"][n] - ours["params"][n]).abs().max())
               for n in stock["params"])
    print(f"max |parameter difference| after step {args.steps}: {diff:.2e}")
    print(json.dumps({"ranks": args.ranks, "dtype": args.dtype, "stock": stock["losses"],
                      "ce_tvm": ours["losses"], "max_param_diff": diff}))


if __name__ == "__main__":
    main()
