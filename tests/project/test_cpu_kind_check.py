"""benchmarks/cpu_kind_check.sh, its first step (the bf16 rounding against torch's:
run on an AVX-512 BF16 host, skipped elsewhere) into a scratch folder: the
script's plumbing, so that a session on a new kind of CPU can trust it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_kind_check.sh"


@pytest.mark.slow  # a pytest process
def test_first_step_runs_and_logs(tmp_path):
    env = {**os.environ, "STEPS": "1", "CE_TVM_RESULTS": str(tmp_path),
           "CE_TVM_PYTHON": os.environ.get("CE_TVM_PYTHON", sys.executable)}
    done = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== 1. rounding" in done.stdout and "== 2." not in done.stdout
    log = (tmp_path / "rounding.log").read_text()
    assert "1 passed" in log or "1 skipped" in log, log


def test_a_failing_step_is_reported_and_the_script_fails(tmp_path):
    env = {**os.environ, "STEPS": "1", "CE_TVM_RESULTS": str(tmp_path),
           "CE_TVM_PYTHON": "false"}
    done = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1
    assert "!! rounding failed" in done.stdout
