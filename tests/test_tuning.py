"""Autotuning: a tiny tuning run, the record round trip, and never-slower builds."""

import json
import logging
import shutil

import pytest
import torch

import ce_tvm
from ce_tvm import runtime
from ce_tvm.compute import Variant
from ce_tvm.launch import _spec
from ce_tvm.spec import KernelSpec, tuned_spec
from processes import CLI, run

C, TUNED_ROWS = 300, 64
FORWARD = KernelSpec("forward", "float32", C, Variant("mean", False, False))


@pytest.fixture(scope="module")
def tuned_logs(tmp_path_factory):
    """One real tuning run of the autograd forward (our search space, 3 trials)."""
    logs = tmp_path_factory.mktemp("tuning_logs")
    out = run([CLI, "tune", "--classes", str(C), "--rows", str(TUNED_ROWS), "--trials", "3",
               "--spaces", "ce_tvm", "--ops", "forward", "--log-dir", logs])
    assert "hand ms" in out and "speedup" in out
    return logs


def _summary_path(logs):
    return logs / FORWARD.record_id(TUNED_ROWS) / "summary.json"


def _force(logs, applied: bool):
    path = _summary_path(logs)
    data = json.loads(path.read_text())
    data["tuned_ms"] = data["hand_ms"] * (0.5 if applied else 2.0)
    data["applied"] = applied
    path.write_text(json.dumps(data))


def test_record_round_trips_and_applies_at_other_row_counts(tuned_logs, monkeypatch):
    summary = json.loads(_summary_path(tuned_logs).read_text())
    assert summary["rows"] == TUNED_ROWS and summary["space"] == "ce_tvm"
    assert (_summary_path(tuned_logs).parent / "database_tuning_record.json").exists()
    _force(tuned_logs, applied=True)  # whatever the timing noise said: test the apply path
    monkeypatch.setenv("CE_TVM_TUNING_LOGS", str(tuned_logs))
    # The training step below runs the forward kernel (the tuned one) on the recompute
    # path; the one-pass training kernel has no tuning records yet.
    monkeypatch.setattr(ce_tvm.nn, "ONE_PASS_TRAINING", False)
    x = torch.randn(5, C)
    spec = _spec("forward", x, FORWARD.variant)
    assert spec.tuned == FORWARD.record_id(TUNED_ROWS) and spec.stem().endswith("-tuned")
    for rows in (1, 7, TUNED_ROWS, 1000):
        xs = torch.randn(rows, C, requires_grad=True)
        ys = torch.randint(0, C, (rows,))
        loss = ce_tvm.cross_entropy(xs, ys, label_smoothing=0.1)
        xr = xs.detach().clone().requires_grad_()
        ref = torch.nn.functional.cross_entropy(xr, ys, label_smoothing=0.1)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref.backward()
        torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-8)
    assert spec in runtime.loaded_specs()  # the losses above ran the tuned kernel


def test_record_slower_than_hand_is_not_applied(tuned_logs, tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    shutil.copytree(tuned_logs, logs)
    _force(logs, applied=False)
    monkeypatch.setenv("CE_TVM_TUNING_LOGS", str(logs))
    assert _spec("forward", torch.randn(5, C), FORWARD.variant).tuned == ""


def test_nearest_row_bucket_is_chosen(tuned_logs, tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    shutil.copytree(tuned_logs, logs)
    _force(logs, applied=True)
    big = logs / FORWARD.record_id(4096)
    shutil.copytree(_summary_path(logs).parent, big)
    data = json.loads((big / "summary.json").read_text())
    (big / "summary.json").write_text(json.dumps({**data, "rows": 4096}))
    monkeypatch.setenv("CE_TVM_TUNING_LOGS", str(logs))
    assert _spec("forward", torch.randn(100, C), FORWARD.variant).tuned.endswith(f"-N{TUNED_ROWS}")
    assert _spec("forward", torch.randn(3000, C), FORWARD.variant).tuned.endswith("-N4096")


def test_untuned_shape_says_how_to_tune_once(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("CE_TVM_TUNING_LOGS", str(tmp_path))
    spec = KernelSpec("forward", "float32", 77, Variant("sum", False, False))
    with caplog.at_level(logging.DEBUG, logger="ce_tvm"):
        assert tuned_spec(spec, 10) == spec
        tuned_spec(spec, 10)
    hints = [r for r in caplog.records if "ce-tvm tune" in r.getMessage()]
    assert len(hints) == 1 and "--classes 77" in hints[0].getMessage()
