"""ce-tvm bench runs end to end and writes its table, JSON and chart."""

import json

from processes import CLI, run


def test_bench_smoke(tmp_path):
    out = run([CLI, "bench", "--shapes", "64x300", "--dtypes", "float32", "--reps", "1",
               "--warmup", "1", "--no-compile", "--json", tmp_path / "b.json",
               "--png", tmp_path / "b.png"])
    assert "| 64x300 | float32 | forward |" in out
    assert "| 64x300 | float32 | fwd_bwd (one pass) |" in out
    assert "| 64x300 | float32 | fwd_bwd, recompute path (one pass " in out
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert {r["mode"]: r["floor"] for r in rows} == {"forward": "x.sum", "fwd_bwd": "copy"}
    assert all(r["ms"]["ce_tvm"] > 0 and r["ms"]["eager"] > 0 and r["ms"][r["floor"]] > 0
               for r in rows)
    assert next(r for r in rows if r["mode"] == "fwd_bwd")["ms"]["ce_tvm_recompute"] > 0
    assert (tmp_path / "b.png").stat().st_size > 1000
