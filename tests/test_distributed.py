"""Vocab-parallel cross entropy over gloo, 2 and 3 processes on one machine."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, mode: str, expect_checked: int) -> None:
    """Run ``dist_worker.py mode`` on ``world`` ranks; each must report its checks."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TVM_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), mode], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = [p.communicate(timeout=900) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}:\n{out}\n{err[-3000:]}"
        assert f"rank {rank}/{world}: {expect_checked} {mode} ok" in out


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_matches_single_process(world):
    run_ranks(world, "cases", 26)


def test_vocab_parallel_empty_batches_and_odd_strides():
    """Empty shards with strides 0 in every dtype, size-1 dimensions with odd strides."""
    run_ranks(2, "odd_strides", 7)
