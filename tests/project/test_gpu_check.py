"""benchmarks/gpu_check.py rehearsed on the CPU (``--device cpu``): its sections'
code, float64 references and records run here, so a mistake in them costs no
device time."""

import json
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SECTIONS = ["correctness", "training_kernel", "log_probs", "sharded_direct", "sharded_group",
            "distill", "time_ce", "time_linear", "time_log_probs", "time_distill",
            "time_training", "time_edge"]


@pytest.mark.slow  # a process: every section, compiled and timed (a 600 s limit)
def test_cpu_rehearsal_runs_every_section_and_records_each_row(tmp_path):
    out = tmp_path / "check.jsonl"
    done = subprocess.run(
        [sys.executable, BENCHMARKS / "gpu_check.py", "--device", "cpu", "--classes", "64",
         "--dtypes", "bfloat16", "--sections", ",".join(SECTIONS), "--json", out],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    verdicts = [r for r in records if r.get("done")]
    assert [v["section"] for v in verdicts] == SECTIONS
    assert all(v["ok"] and "error" not in v for v in verdicts)
    rows = [r for r in records if not r.get("done")]
    checks = [r for r in rows if not r["section"].startswith("time_")]
    assert {r["section"] for r in checks} == set(SECTIONS[:6])
    assert all(r["ok"] and r["errors"] for r in checks)
    timings = [r for r in rows if r["section"].startswith("time_")]
    assert {r["section"] for r in timings} == set(SECTIONS[6:])
    for row in timings:  # each timed against its floor in the same reps
        assert row["ms"] and row["ratio"][row["over"]] == 1.0
    training = next(r for r in timings if r["section"] == "time_training")
    assert {"one_pass threads=512", "forward lane_rounds=2", "backward unroll=8"} <= set(
        training["ms"])
    kernels = next(r for r in timings if r["case"].startswith("log-prob kernels"))
    assert {"forward lane_vectors=1", "backward unroll=8"} <= set(kernels["ms"])
    for head in ("time_linear", "time_distill"):  # rows per chunk beside the default
        row = next(r for r in timings if r["section"] == head)
        assert sum(name.startswith("ce_tvm chunk_rows=") for name in row["ms"]) >= 2
    ce = next(r for r in timings if r["section"] == "time_ce")
    assert {"ce_tvm", "eager", "copy"} <= set(ce["ms"])
    assert ce["left_out"]["compile"] == "CUDA only in this check"


@pytest.fixture(scope="module")
def gpu_check():
    """The script's functions, as ``python benchmarks/gpu_check.py`` would define them
    (run from its path, not imported: benchmarks/ is no package)."""
    return types.SimpleNamespace(**runpy.run_path(str(BENCHMARKS / "gpu_check.py"),
                                                  run_name="gpu_check"))


def test_a_failing_section_is_recorded_and_the_next_runs(gpu_check, tmp_path, monkeypatch):
    def broken(plan):
        yield {"ok": True, "case": "first"}
        raise RuntimeError("boom")

    monkeypatch.setitem(gpu_check.SECTIONS, "broken", broken)
    path = tmp_path / "check.jsonl"
    plan = gpu_check.Plan(torch.device("cpu"), classes=64, dtypes=(torch.float32,))
    assert not gpu_check.run_section(plan, "broken", str(path))
    assert gpu_check.run_section(plan, "correctness", str(path))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["section"], r.get("done", False), r["ok"]) for r in records] == [
        ("broken", False, True), ("broken", True, False),
        *[("correctness", False, True)] * 10, ("correctness", True, True)]  # 5 cases, 2 eps
    assert records[1]["error"] == "RuntimeError: boom"


def test_a_failing_case_is_recorded_and_the_next_runs(gpu_check):
    def rows(plan, n, c, dtype):
        if dtype == torch.float16:
            raise RuntimeError("no kernel")
        yield {"ok": True, "case": str(dtype)}

    plan = gpu_check.Plan(torch.device("cpu"))
    got = list(gpu_check._each(plan, [(4, 8, torch.float16), (4, 8, torch.float32)], rows))
    assert [(r["ok"], r.get("error")) for r in got] == [(False, "RuntimeError: no kernel"),
                                                       (True, None)]


def test_knob_variants_are_the_kernels_a_gpu_asks_for(gpu_check, monkeypatch):
    """``knob_specs`` (what a rehearsal builds for the knobs timed) are the very
    kernels CUDA calls ask for in ``ce_tvm.schedule("cuda", ...)``, at the timed
    shapes only."""
    from dataclasses import replace

    import ce_tvm
    from ce_tvm.kernels.kinds import Variant
    from ce_tvm.runtime.tensors import kernel_target
    from ce_tvm.store.spec import KernelSpec

    timed = KernelSpec("train", "bfloat16", 128256, Variant("mean", True, False), "cuda",
                       (("arch", "sm_90"),))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    on_gpu = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    asked = []
    for knobs in gpu_check.KNOB_VARIANTS["train"]:
        with ce_tvm.schedule("cuda", **knobs):
            asked.append(replace(timed, options=kernel_target(on_gpu)[1]))
    assert gpu_check.knob_specs([timed, replace(timed, classes=32000)]) == asked


def test_the_table_says_what_a_run_decides(tmp_path):
    """``gpu_check_table.py``: the knob variants sit in the table beside their
    method, and the decisions name the faster training path and the fastest knobs."""
    table = runpy.run_path(str(BENCHMARKS / "gpu_check_table.py"), run_name="gpu_check_table")
    row = {"section": "time_training", "case": "training step 8192x128256 torch.bfloat16",
           "n": 8192, "c": 128256, "dtype": "torch.bfloat16", "over": "copy",
           "ms": {"one_pass": 2.0, "one_pass threads=512": 1.6,
                  "one_pass gradient_backwards=False": 2.5, "recompute": 3.0,
                  "forward": 1.0, "forward lane_rounds=2": 1.25, "copy": 1.5},
           "peak_mib": {"one_pass": 2004.0, "copy": 0.0}}
    path = tmp_path / "check.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({"section": "x", "done": True}) + "\n")
    rows = table["timing_rows"](str(path))
    lines = table["table"](rows).splitlines()
    assert "| one_pass threads=512 | 1.600 | 2627 | 0.94 |" in lines[3]
    assert lines[2].endswith("| one_pass | 2.000 | 2101 | 0.75 |  |  |  |  | 2004 |")
    assert lines[3].endswith("|  |")  # not measured
    assert lines[-1].endswith("| copy | 1.500 | 2802 | 1.00 |  |  |  |  | 0 |")
    said = table["decisions"](rows).splitlines()
    assert said == [
        "- training step 8192x128256 bfloat16: one_pass 2.000 ms, recompute 3.000 ms: "
        "the one-pass kernel 1.50x faster",
        "- training step 8192x128256 bfloat16: one_pass 2.000 ms; threads=512 1.600 ms "
        "(1.25x), gradient_backwards=False 2.500 ms (0.80x); fastest: threads=512",
        "- training step 8192x128256 bfloat16: forward 1.000 ms; lane_rounds=2 1.250 ms "
        "(0.80x); fastest: the schedule's own knobs"]



class _Allocator:
    """A stand-in for torch.cuda's allocator counters, with 100 MiB of inputs live."""

    def __init__(self):
        self.live = self.high = 100 * 2**20

    def take(self, mib: int, keep: int = 0):
        """Allocate ``mib`` MiB at once, then free all but ``keep``."""
        self.live += mib * 2**20
        self.high = max(self.high, self.live)
        self.live -= (mib - keep) * 2**20

    def synchronize(self):
        pass

    def allocated(self) -> int:
        return self.live

    def reset_peak(self):
        self.high = self.live

    def peak(self) -> int:
        return self.high


def test_extra_peak_memory_is_each_call_beyond_what_was_allocated_before_it(gpu_check):
    memory = _Allocator()
    fns = {"big": lambda: memory.take(300), "kept": lambda: memory.take(50, keep=20),
           "none": lambda: None, "small": lambda: memory.take(5)}
    assert gpu_check.extra_peak_mib(fns, memory) == {"big": 300.0, "kept": 50.0, "none": 0.0,
                                                     "small": 5.0}
