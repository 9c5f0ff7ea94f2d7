"""Vocab-parallel cross entropy and LM heads over gloo, 2 to 4 processes on one machine.

The checks of one world size run in one group of rank processes
(``ranks_of``): a rank's start-up (torch, TVM) costs more than most checks.
Every check still reports on its own line, and each test asserts its own.
"""

import functools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support import Forked

WORKER = Path(__file__).with_name("dist_worker.py")
# ranks_of runs each world once per pytest worker: keep the module on one
# slow: processes: 2 to 4 ranks
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed")]
# The checks of dist_worker.CHECKS each world runs, in this order.
MODES = {2: ("cases", "odd_strides", "relayout", "linear_head", "linear_log_probs", "dtensor",
             "logit_scale"),
         3: ("cases", "relayout", "linear_head", "linear_log_probs"),
         4: ("linear_head",)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(world: int, modes: str, fresh_env: dict | None = None,
                 worker: Path = WORKER) -> list[tuple]:
    """Run ``worker modes`` (comma-separated; ``dist_worker.py`` by default) on ``world`` ranks:
    ``(returncode, stdout, stderr)`` per rank. The ranks are forked
    (``support.Forked``), or, with ``fresh_env``, new interpreters with it
    added to their environment (glibc reads ``MALLOC_*`` when a process starts)."""
    port = free_port()
    ranks = [{"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "TVM_NUM_THREADS": "1"} for rank in range(world)]
    if fresh_env is None:
        started = [Forked(str(worker), modes, **env) for env in ranks]
        return [(d.returncode, d.stdout, d.stderr) for d in (p.result(900) for p in started)]
    procs = [subprocess.Popen([sys.executable, str(worker), modes], text=True,
                              env={**os.environ, **fresh_env, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for env in ranks]
    outs = [p.communicate(timeout=900) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


@functools.cache
def ranks_of(world: int) -> list[tuple]:
    """Every check of ``MODES[world]``, run once in one group of ``world`` ranks."""
    return launch_ranks(world, ",".join(MODES[world]))


def assert_reported(ranks: list[tuple], mode: str, expect_checked: int) -> None:
    """Each rank reported ``expect_checked`` checks of ``mode`` passed."""
    world = len(ranks)
    for rank, (returncode, out, err) in enumerate(ranks):
        assert f"rank {rank}/{world}: {expect_checked} {mode} ok" in out, (
            f"rank {rank} (exit {returncode}):\n{out}\n{err[-3000:]}")


def check_world(world: int, mode: str, expect_checked: int) -> None:
    assert mode in MODES[world]
    assert_reported(ranks_of(world), mode, expect_checked)


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_matches_single_process(world):
    check_world(world, "cases", 27)


@pytest.mark.parametrize("world", [2, 3])
def test_layouts_that_agree_on_one_rank_only(world):
    """One process, shard widths that change on some ranks only (a cache of the
    layout per rank and width made the ranks' collectives pair up wrongly)."""
    check_world(world, "relayout", 3)


def test_vocab_parallel_empty_batches_and_odd_strides():
    """Empty shards with strides 0 in every dtype, size-1 dimensions with odd strides."""
    check_world(2, "odd_strides", 7)


VOCAB_PARALLEL_OUT_OF_RANGE = """
import sys, torch, torch.distributed as dist, ce_tvm
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0,
                        world_size=1)
try:
    ce_tvm.distributed.vocab_parallel_cross_entropy(torch.randn(4, 5), torch.tensor([0, 5, 1, 2]))
except ce_tvm.TargetOutOfRangeError as err:
    print(type(err).__name__, isinstance(err, IndexError), isinstance(err, ValueError), err)
dist.destroy_process_group()
"""


def test_vocab_parallel_out_of_range_target_is_an_index_error_and_a_value_error():
    done = subprocess.run([sys.executable, "-c", VOCAB_PARALLEL_OUT_OF_RANGE, str(free_port())],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TargetOutOfRangeError True True target[1] = 5 is out of range" in done.stdout


LAZY_DISTRIBUTED = """
import sys
import ce_tvm
assert "torch" not in sys.modules and "ce_tvm.distributed" not in sys.modules
module = ce_tvm.distributed  # imported on first use
import torch.distributed as dist
assert module.vocab_parallel_cross_entropy and not dist.is_initialized()
assert "distributed" in dir(ce_tvm)
print("lazy ok")
"""


def test_import_ce_tvm_reaches_distributed_lazily():
    """``import ce_tvm`` imports neither torch nor ``ce_tvm.distributed``; the
    attribute imports the module on first use and initialises no process group."""
    done = subprocess.run([sys.executable, "-c", LAZY_DISTRIBUTED], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "lazy ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_vocab_parallel_linear_head_matches_single_process(world):
    """The LM head sharded over the vocabulary (unequal shards over 3 and 4 ranks),
    with and without sequence parallelism, float32 and bfloat16, against the
    single-process fused loss."""
    check_world(world, "linear_head", 8)


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_linear_log_probs_match_single_process(world):
    """Log-probs (K = 1 and 2, masked rows, softcap, temperature) and entropy of the
    sharded head, with and without sequence parallelism; and the log-probs alone."""
    check_world(world, "linear_log_probs", 4)


def test_vocab_parallel_head_communicates_no_more_at_a_larger_vocabulary():
    """And its backward copies no gradient (RSS measured as the benchmarks do)."""
    from ce_tvm.tools.measure import CHILD_ENV

    assert_reported(launch_ranks(2, "bytes", CHILD_ENV), "bytes", 1)


def test_vocab_parallel_paths_take_the_logit_scale():
    check_world(2, "logit_scale", 3)


def test_dtensor_placements_take_the_vocabulary_parallel_paths():
    """torchtitan's setups (1-D mesh): logits Shard(-1); an lm_head weight Shard(0)
    with the input Replicate(), Shard(0) or sequence-sharded [B, T, H] Shard(1);
    a plain input beside it (ambiguous), other placements and meshes, and sharded heads
    given to the distillation losses refused;
    the same values under torch.compile."""
    check_world(2, "dtensor", 15)


# --- Data-parallel sharding (FSDP2, FSDP x TP): fsdp_worker.py --------------------------
FSDP_WORKER = Path(__file__).with_name("fsdp_worker.py")
FSDP_MODES = {2: ("fsdp2", "fsdp1", "transformers", "distill"), 4: ("fsdp2", "fsdp_tp")}


@functools.cache
def fsdp_ranks_of(world: int) -> list[tuple]:
    return launch_ranks(world, ",".join(FSDP_MODES[world]), worker=FSDP_WORKER)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_sharded_weight_refused_head_module_matches_stock_path(world):
    """FSDP2, each rank its own rows: the bare sharded weight with a plain input is a
    ValueError naming both readings (eager and under torch.compile); the head
    module gives each rank's loss (options: smoothing, z-loss, softcap,
    temperature) and log-probs (K = 1 and 3, with and without the entropy) and
    FSDP2's stock gradients, also through LinearCrossEntropyLoss under
    torch.compile."""
    assert_reported(fsdp_ranks_of(world), "fsdp2", 11)


def test_fsdp1_wrapped_head_module_matches_stock_path():
    assert_reported(fsdp_ranks_of(2), "fsdp1", 2)


def test_fsdp_x_tp_head_module_matches_single_process_model():
    """A 2 x 2 mesh: FSDP over dp, a column-wise parallel head over tp; the head
    module runs the vocabulary-parallel head inside its call; the distillation losses
    refuse that tensor-parallel student head."""
    assert_reported(fsdp_ranks_of(4), "fsdp_tp", 4)


def test_transformers_fused_loss_and_token_log_probs_under_fully_shard():
    assert_reported(fsdp_ranks_of(2), "transformers", 2)


def test_distillation_under_fully_shard():
    """The student and the teacher each under FSDP2, each rank its own rows: the bare
    sharded student weight refused (two readings); the head modules give the stock
    divergence (beta 0, 0.5, 1) and FSDP2's stock student gradients; the teacher's bare
    sharded weight is gathered (it takes no gradient)."""
    assert_reported(fsdp_ranks_of(2), "distill", 5)
