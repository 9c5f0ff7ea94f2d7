"""DeepSpeed ZeRO-3 on gloo, 2 ranks on the CPU (``DS_ACCELERATOR=cpu``): ce_tvm
against ZeRO-3's stock path (``zero3_worker.py``). Every mode runs in one group of
two fresh interpreters (a rank's start-up, torch, DeepSpeed and TVM, costs more
than the checks); each rank reports one JSON line per mode, and each test asserts
its own mode on both ranks."""

import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("zero3_worker.py")
MODES = ("error", "module", "transformers", "trl", "distill")
WORLD = 2
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed"),
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="DeepSpeed is not installed (the test extra pins it)")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def reports() -> dict:
    """``{(rank, mode): report}`` of one group of ``WORLD`` ranks running every mode,
    and the ranks' ``(returncode, stdout, stderr)``."""
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), ",".join(MODES)], text=True,
        env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
             "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
             "DS_ACCELERATOR": "cpu", "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(WORLD)]
    ranks = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        ranks.append((p.returncode, out, err))
    found = {}
    for out in (out for _, out, _ in ranks):
        for line in out.splitlines():
            if line.startswith("ZERO3 "):
                report = json.loads(line[len("ZERO3 "):])
                found[report["rank"], report["mode"]] = report
    return {"found": found, "ranks": ranks}


def check(mode: str, expect_checked: int) -> None:
    done = reports()
    for rank in range(WORLD):
        report = done["found"].get((rank, mode))
        returncode, out, err = done["ranks"][rank]
        assert report is not None, f"rank {rank} (exit {returncode}):\n{out}\n{err[-4000:]}"
        assert report["checked"] == expect_checked, report
        assert report["worst"] <= 1e-5, report


def test_the_bare_partitioned_weight_is_an_error_that_names_zero3():
    check("error", 1)


def test_the_head_module_equals_the_stock_path_loss_and_log_probs_with_entropy():
    """Losses of 2 SGD steps and every parameter after them, each rank its own rows
    (the log-probs with and without the entropy)."""
    check("module", 3)


def test_transformers_apply_untied_tied_and_under_zero_init():
    check("transformers", 4)


def test_trl_fused_head_is_computed_by_ce_tvm_and_equals_trls_own():
    check("trl", 2)


def test_trl_distillation_divergence_equals_trls_own():
    check("distill", 1)
