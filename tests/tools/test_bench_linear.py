"""ce-tvm bench --linear runs end to end and writes its table, goals, JSON and chart."""

import json
import math

import pytest

from support import CLI, run

pytestmark = pytest.mark.slow  # a process: the command line


def test_bench_linear_smoke(tmp_path):
    out = run([CLI, "bench", "--linear", "--shapes", "48x8x300", "--dtypes", "float32",
               "--reps", "1", "--warmup", "1", "--no-compile", "--memory",
               "--json", tmp_path / "b.json", "--png", tmp_path / "b.png"])
    assert "| 48x8x300 | float32 |" in out and "GEMM probe ms" in out
    assert "48x8x300 float32: time <= eager:" in out
    data = json.loads((tmp_path / "b.json").read_text())
    (row,) = data["rows"]
    assert set(row["ms"]) == {"ce_tvm", "eager", "torch_chunked", "gemm"}
    assert all(ms > 0 for ms in row["ms"].values())
    assert set(row["extra_peak_mb"]) == set(row["ms"])
    assert all(math.isfinite(mb) for mb in row["extra_peak_mb"].values())
    assert set(row["goals"]) == {"time <= eager", "time <= 1.05 x GEMM", "memory"}
    assert data["meta"]["label_smoothing"] == 0.0
    assert (tmp_path / "b.png").stat().st_size > 1000
