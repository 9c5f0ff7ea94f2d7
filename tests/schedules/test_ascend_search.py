"""The Ascend plan search: tile size x buffer count against the cost model, never
costlier than the fixed plan, for C from 1 to 1M; and its record (``ce-tvm tune
--target ascend``)."""

import json

import numpy as np
import pytest

from ce_tvm.schedules import ascend_plan
from support import CLI, run

pytestmark = pytest.mark.slow  # plans searched for C up to 1M; the command line

# C from 1 to 1M: 60 log-spaced values and the vocabularies in use.
CLASSES = sorted(set(np.logspace(0, 6, 60).astype(int).tolist())
                 | {1_000_000, 32000, 50257, 128256, 151936})


@pytest.mark.parametrize("profile", sorted(ascend_plan.PROFILES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ascend_plan.OPS)
def test_searched_plan_never_costs_more_than_the_fixed_plan(profile, dtype, op):
    prof = ascend_plan.PROFILES[profile]
    for classes in CLASSES:
        for rows in (1, 8192):
            fixed = ascend_plan.plan(profile, rows, classes, dtype, op)
            best = ascend_plan.search_plan(profile, rows, classes, dtype, op)
            where = f"{profile} {dtype} {op} C={classes} N={rows}"
            fixed_us = ascend_plan.cost(fixed)["ce_tvm"]["time_us"]
            best_us = ascend_plan.cost(best)["ce_tvm"]["time_us"]
            assert best_us <= fixed_us, where
            assert best.ub_bytes <= prof.ub_bytes and best.buffers in (1, 2), where
            assert (best.tiles - 1) * best.chunk < classes <= best.tiles * best.chunk, where
            candidates = ascend_plan.candidate_plans(profile, rows, classes, dtype, op)
            assert (fixed.chunk, fixed.buffers) in {(p.chunk, p.buffers) for p in candidates}
            assert best_us == min(ascend_plan.cost(p)["ce_tvm"]["time_us"] for p in candidates) \
                or best == fixed, where


def test_search_beats_the_fixed_plan_where_double_buffered_tiles_pay():
    """910B, float32, C = 8565: the whole row fits single-buffered only; two
    double-buffered tiles overlap memory and compute and cost less."""
    fixed = ascend_plan.plan("910b", 8192, 8565, "float32", "backward")
    best = ascend_plan.search_plan("910b", 8192, 8565, "float32", "backward")
    assert (fixed.tiles, fixed.buffers) == (1, 1) and best.buffers == 2 and best.tiles == 2
    costs = [ascend_plan.cost(p)["ce_tvm"] for p in (fixed, best)]
    assert costs[1]["time_us"] < costs[0]["time_us"]
    assert costs[1]["bytes_moved"] == costs[0]["bytes_moved"]  # same traffic, overlapped


def test_tune_records_the_best_plan(tmp_path):
    report = tmp_path / "r.json"
    run([CLI, "tune", "--target", "ascend", "--profile", "910b", "--dtype", "float32",
         "--classes", "8565", "--rows", "8192", "--log-dir", tmp_path, "--json", report,
         "--ops", ",".join(ascend_plan.OPS)])
    kernels = json.loads(report.read_text())["kernels"]
    assert [k["kind"] for k in kernels] == ["forward", "gradient", "forward+gradient",
                                            "log-probs", "log-probs gradient", "divergence"]
    for k in kernels:
        assert k["tuned_ms"] <= k["hand_ms"] and k["space_size"] > 12
        summary = json.loads((tmp_path / "ascend-910b" / f"{k['name']}-N8192" / "summary.json")
                             .read_text())
        assert summary["knobs"] == {"chunk": summary["plan"]["chunk"],
                                    "buffers": summary["plan"]["buffers"]}
