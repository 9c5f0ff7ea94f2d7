"""``ce-tvm demo`` (the README's main job) on a small batch: every section reported."""

import pytest

from ce_tvm.tools.demo import run_demo

pytestmark = pytest.mark.slow  # over 10 s: the demo's training steps and timings


def test_demo_reports_the_step_the_head_the_pair_and_the_kernels(capsys):
    run_demo(rows=64, classes=1000, hidden=32, dtype="float32", reps=1, with_compile=False)
    out = capsys.readouterr().out
    assert "drop-in training step, logits 64 x 1000: loss" in out
    assert "fused linear head, hidden 64 x 32, weight 1000 x 32: loss" in out
    assert "floor: one copy of x" in out and "floor: the GEMMs alone" in out
    assert "ce_tvm" in out and "eager" in out and "seed-compatible pair" in out
    assert "kernels:" in out and "train-float32-C1000" in out
    for line in out.splitlines():  # each check against PyTorch is within float32 rounding
        if "rel err" in line:
            assert float(line.split("rel err ")[1].split(")")[0]) < 1e-5, line
