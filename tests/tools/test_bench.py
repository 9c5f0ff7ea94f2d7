"""ce-tvm bench runs end to end and writes its table, JSON and chart (in this process:
the command line's ``main``, as the ``ce-tvm`` script calls it)."""

import json
import time

import pytest

from ce_tvm.tools.cli import main
from ce_tvm.tools.measure import interleaved_ms


@pytest.mark.slow  # timing reps and a chart, not a check of the kernels
def test_bench_smoke(tmp_path, capsys):
    assert main(["bench", "--shapes", "64x300", "--dtypes", "float32", "--reps", "1",
                 "--warmup", "1", "--no-compile", "--json", str(tmp_path / "b.json"),
                 "--png", str(tmp_path / "b.png")]) == 0
    out = capsys.readouterr().out
    assert "| 64x300 | float32 | forward |" in out
    assert "| 64x300 | float32 | fwd_bwd (one pass) |" in out
    assert "| 64x300 | float32 | fwd_bwd, recompute path (one pass " in out
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert {r["mode"]: r["floor"] for r in rows} == {"forward": "x.sum", "fwd_bwd": "copy"}
    assert all(r["ms"]["ce_tvm"] > 0 and r["ms"]["eager"] > 0 and r["ms"][r["floor"]] > 0
               for r in rows)
    assert next(r for r in rows if r["mode"] == "fwd_bwd")["ms"]["ce_tvm_recompute"] > 0
    assert (tmp_path / "b.png").stat().st_size > 1000


@pytest.mark.parametrize("settle_s, pause", [(0.25, 0.04), (0.02, 0.02), (0.0, 0.0)])
def test_interleaved_calls_pause_after_each(settle_s, pause):
    """Each timed call is followed by a pause of its own length, at most
    ``settle_s``, before the next method starts; the pause is not timed."""
    starts, ends = [], []

    def slow():
        starts.append(time.perf_counter())
        time.sleep(0.04)
        ends.append(time.perf_counter())

    def fast():
        starts.append(time.perf_counter())
        ends.append(time.perf_counter())

    ms = interleaved_ms({"slow": slow, "fast": fast}, reps=2, warmup=0, settle_s=settle_s)
    assert 40 <= ms["slow"] < 40 + 30 and ms["fast"] < 5
    gaps = [start - end for end, start in zip(ends[::2], starts[1::2])]  # slow -> fast
    assert all(pause * 0.9 <= gap < pause + 0.03 for gap in gaps), gaps


@pytest.mark.slow  # timing reps, not a check of the kernels
def test_log_probs_entropy_benchmark_smoke(tmp_path, capsys):
    """``benchmarks/log_probs_entropy.py`` times both log-prob kernels and the read."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "log_probs_entropy.py"
    bench = runpy.run_path(str(script), run_name="log_probs_entropy")
    assert bench["main"](["--shapes", "9x5003", "--reps", "1", "--json",
                          str(tmp_path / "lp.json")]) == 0
    records = json.loads((tmp_path / "lp.json").read_text())["records"]
    assert [(r["shape"], r["dtype"]) for r in records] == [("9x5003", "float32"),
                                                           ("9x5003", "bfloat16")]
    assert all(r[k] > 0 for r in records for k in ("without", "with", "read"))
    assert "with/without" in capsys.readouterr().out
