"""ce-tvm bench runs end to end and writes its table, JSON and chart (in this process:
the command line's ``main``, as the ``ce-tvm`` script calls it)."""

import json

import pytest

from ce_tvm.tools.cli import main


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
