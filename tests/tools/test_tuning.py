"""Autotuning: the knob spaces, the search, a tiny tuning run, the record round
trip (every knob value replayed and checked against torch), record lookup
order, ``tune --list``, and never-slower builds."""

import ctypes
import json
import logging
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import tvm_ffi
from tvm import tirx
from tvm.target import Target

import ce_tvm
import support
from ce_tvm.compiler import build
from ce_tvm.compiler.build import declared_func, schedule_module
from ce_tvm.kernels.kinds import Variant
from ce_tvm.losses import cross_entropy as ce_nn
from ce_tvm.runtime import omp_pool
from ce_tvm.runtime import registry as runtime
from ce_tvm.runtime.launch import _spec
from ce_tvm.store import records
from ce_tvm.store.spec import KernelSpec, tuned_spec
from ce_tvm.tools import cli, tuning
from support import CLI, run

# its module fixtures are built once: every test of the module on one worker
# slow: the tuner's searches and builds; the command line
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tuning")]

C, TUNED_ROWS = 300, 64
FORWARD = KernelSpec("forward", "float32", C, Variant("mean", False, False))
TRAIN = KernelSpec("train", "float32", C, Variant("mean", False, False))
BACKWARD = KernelSpec("backward", "float32", C, Variant("mean", False, grad_source="logits"))
CPU = schedule_module("llvm")


@pytest.fixture(scope="module")
def tuned_logs(tmp_path_factory):
    """One real tuning run of the three kernels (3 trials each), JSON report included."""
    logs = tmp_path_factory.mktemp("tuning_logs")
    report = logs / "report.json"
    out = run([CLI, "tune", "--classes", str(C), "--rows", str(TUNED_ROWS), "--trials", "3",
               "--log-dir", logs, "--json", report])
    assert "hand ms" in out and "[search 3/3]" in out
    return logs


def _summary_path(logs, spec=FORWARD):
    return logs / spec.record_id(TUNED_ROWS) / "summary.json"


def _force(logs, applied: bool, spec=FORWARD):
    path = _summary_path(logs, spec)
    data = json.loads(path.read_text())
    data["best_ms"] = data["hand_ms"] * (0.5 if applied else 2.0)
    data["applied"] = applied
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("op", ["forward", "train", "backward"])
def test_every_space_has_at_least_12_candidates_and_starts_at_the_hand_schedule(op):
    target = FORWARD.tvm_target()
    space = CPU.knob_space(op, 50257, "bfloat16", target)
    assert len(tuning.grid(space)) >= 12
    if op != "backward":
        chunk_of = CPU.train_chunk if op == "train" else CPU.forward_chunk
        assert space["chunk"][0] == chunk_of(50257, "bfloat16", target)
        assert len(set(space["chunk"])) == len(space["chunk"]) >= 3
    assert space["accumulators"][0] == CPU.hand_knobs(op, target, "bfloat16").accumulators
    assert len(set(space["accumulators"])) == len(space["accumulators"])


@pytest.mark.parametrize("mcpu, forward_accumulators", [("znver1", 1), ("haswell", 1),
                                                        ("znver5", 2), ("skylake-avx512", 2)])
def test_hand_schedule_keeps_one_forward_accumulator_on_avx2(mcpu, forward_accumulators):
    """AVX2 (16 registers of 8 float32 lanes): fewer chains, no spills; AVX-512: two.
    The search starts from the hand schedule's knobs."""
    target = Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    hand = CPU.hand_knobs("forward", target, "float32")
    assert hand.accumulators == forward_accumulators
    assert CPU.hand_knobs("forward", target, "bfloat16") == hand
    assert (CPU.hand_knobs("train", target, "float32")
            == CPU.hand_knobs("backward", target, "float32") == CPU.CPUKnobs())
    space = CPU.knob_space("forward", 32000, "float32", target)
    assert (space["accumulators"][0], space["unroll"][0]) == (hand.accumulators, hand.unroll)
    assert sorted(space["unroll"]) == [1, 2, 4] and sorted(space["accumulators"]) == [1, 2, 4]


def test_knobs_are_recorded_by_sampling_instructions():
    target = TRAIN.tvm_target()
    space = CPU.knob_space("train", 4099, "float32", target)
    knobs = {"chunk": space["chunk"][1], "accumulators": 4, "prefetch": 2, "row_grain": 8}
    cands = tuning.Candidates(KernelSpec("train", "float32", 4099, TRAIN.variant), 16, space)
    cands.build(knobs)
    _, trace = cands.traces[tuning._key(knobs)]
    drawn = [trace.decisions[inst] for inst in trace.insts if inst.kind.name == "SampleCategorical"]
    assert drawn == [list(space[k]).index(knobs[k]) for k in space]
    other = tuning.s_tir.Schedule(cands.fixed(space["chunk"][0]))
    with pytest.raises(ValueError, match="chunk"):  # the drawn chunk must be the declared one
        CPU.schedule_knobs(other, "train", target, space, knobs)


def test_cpu_candidates_run_as_the_runtime_runs_them():
    """A CPU candidate is timed as ``runtime.kernel`` runs its record: the trace
    replayed on the symbolic-N compute (runtime scalars as arguments), loaded
    from disk, its parallel loop on torch's OpenMP threads (``omp_pool``), not
    on TVM's pool, where knobs rank differently; and it computes the same."""
    launcher = omp_pool.launcher_address()
    if launcher is None:
        pytest.skip("no OpenMP launcher here: the runtime uses TVM's pool too")
    space = CPU.knob_space("train", 4099, "float32", TRAIN.tvm_target())
    spec = KernelSpec("train", "float32", 4099, TRAIN.variant)
    cands = tuning.Candidates(spec, 16, space)
    knobs = {"chunk": space["chunk"][1], "accumulators": 4, "prefetch": 2, "row_grain": 8}
    fn = cands.build(knobs)
    built = max(Path(tuning._exports["dir"].name).glob("candidate*.so"),
                key=lambda p: p.stat().st_mtime_ns)
    pointer = ctypes.c_void_p.in_dll(ctypes.CDLL(str(built)), omp_pool.LAUNCH_POINTER)
    assert pointer.value == launcher
    symbolic = declared_func(spec, space["chunk"][1])
    sch = tuning.s_tir.Schedule(symbolic)
    CPU.schedule_knobs(sch, "train", TRAIN.tvm_target(), space, knobs)
    in_memory = tuning.compile_scheduled(sch.mod["main"], spec, entry=None)["main"]
    args = cands.arguments(knobs)
    assert len(args) == len(symbolic.params)  # N and the scalars are arguments
    before, expected = [_copy(a) for a in args], [_copy(a) for a in args]
    fn(*args)
    in_memory(*expected)
    grad = [p.name for p in symbolic.params].index("x_grad")
    for got, want in zip(args, expected):
        if isinstance(got, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(args[grad], before[grad])  # the kernel ran


def _copy(arg):
    return arg.clone() if isinstance(arg, torch.Tensor) else arg


@pytest.mark.parametrize("mcpu", ["znver1", "znver5"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_bf16_backward_steps_four_vectors_over_16_row_tasks(mcpu, dtype):
    """The bfloat16 element-wise gradient (its rounding is integer arithmetic)
    runs four vectors a step, 16 rows a task; float32 and float16 the default.
    The log-prob gradient runs the backward's schedule, so its knobs too."""
    target = Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    expected = (CPU.CPUKnobs(accumulators=4, row_grain=16) if dtype == "bfloat16"
                else CPU.CPUKnobs())
    for op in ("backward", "log_probs_grad"):
        assert CPU.hand_knobs(op, target, dtype) == expected
        space = CPU.knob_space(op, 32000, dtype, target)
        assert (space["accumulators"][0], space["row_grain"][0]) == (
            expected.accumulators, expected.row_grain)
    assert CPU.hand_knobs("train", target, dtype).accumulators == 2


@pytest.mark.parametrize("op, dtype", [("forward", "float32"), ("train", "float32"),
                                       ("backward", "float32"), ("backward", "bfloat16")])
def test_hand_knobs_build_the_hand_schedule(op, dtype):
    """The first choice of every knob is the hand schedule: the same machine code."""
    spec = {"forward": FORWARD, "train": TRAIN, "backward": BACKWARD}[op]
    spec = KernelSpec(op, dtype, 4099, spec.variant)
    space = CPU.knob_space(op, 4099, dtype, spec.tvm_target())
    cands = tuning.Candidates(spec, None, space)
    knobs = {k: v[0] for k, v in space.items()}
    hand = getattr(CPU, tuning.SCHEDULE_OF_OP[op])(cands.fixed(None), spec.tvm_target())

    def llvm_ir(func):  # type-based alias metadata is named by addresses
        ir = tuning.compile_scheduled(func, spec, entry=None).mod.inspect_source("ll")
        return re.sub(r"0x[0-9a-f]+", "", ir)

    assert llvm_ir(cands.schedule(knobs)) == llvm_ir(hand)


class Synthetic(tuning.Candidates):
    """Candidates timed by a known function of the knobs (tests the search alone)."""

    def measure(self, knobs, label):
        key = tuning._key(knobs)
        if key not in self.measured:
            self.measured[key] = (1 + abs(knobs["a"] - 3)) * (1 + abs(knobs["b"] - 1)) * (
                2 if knobs["c"] else 1)
        return self.measured[key]


def test_search_starts_from_the_hand_knobs_stays_in_budget_and_finds_the_best():
    space = {"a": (0, 1, 2, 3, 4), "b": (0, 1, 2), "c": (1, 0)}
    cands = Synthetic(FORWARD, 1, space)
    best = tuning.search(cands, {"a": 0, "b": 0, "c": 1}, trials=12)
    assert best == {"a": 3, "b": 1, "c": 0}
    assert len(cands.measured) <= 12
    assert next(iter(cands.measured)) == tuning._key({"a": 0, "b": 0, "c": 1})
    small = Synthetic(FORWARD, 1, {"a": (0, 3), "b": (1,), "c": (0,)})
    assert tuning.search(small, {"a": 0, "b": 1, "c": 0}, trials=16) == {"a": 3, "b": 1, "c": 0}
    assert len(small.measured) == 2  # a space smaller than the budget is measured once


def _record(logs, spec, knobs, rows=TUNED_ROWS):
    """A record of ``spec`` with ``knobs`` that applies (times made up: the numerics are tested)."""
    target = spec.tvm_target()
    space = CPU.knob_space(spec.op, spec.classes, spec.dtype, target)
    cands = tuning.Candidates(spec, rows, space)
    cands.build(knobs)
    summary = {"kernel": spec.name(), "rows": rows, "hand_ms": 2.0, "tuned_ms": 1.0,
               "best_ms": 1.0, "knobs": knobs, "applied": True}
    tuning.save(logs / spec.record_id(rows), cands, summary)


def _one_factor_points(space):
    """The hand knobs, each other value of each knob on its own, and the last corner."""
    hand = {k: v[0] for k, v in space.items()}
    points = [hand] + [{**hand, k: v} for k, vs in space.items() for v in vs[1:]]
    return points + [{k: v[-1] for k, v in space.items()}]


def _points(op, classes):
    return _one_factor_points(CPU.knob_space(op, classes, "float32", FORWARD.tvm_target()))


@pytest.mark.parametrize("ops", [("forward", "backward"), ("train",)], ids=["fwd+bwd", "train"])
def test_every_knob_value_replays_and_matches_torch(ops, tmp_path, monkeypatch):
    """Records of each knob value: the compute re-declared with the record's chunk, the
    trace replayed on the symbolic-N kernel; loss and gradient against torch at row
    counts other than the tuned one. C = 4099 has two chunk choices, both overlapping."""
    c = 4099
    monkeypatch.setattr(ce_nn, "ONE_PASS_TRAINING", ops == ("train",))
    specs = {op: KernelSpec(op, "float32", c, {"forward": FORWARD, "train": TRAIN,
                                               "backward": BACKWARD}[op].variant) for op in ops}
    points = {op: _points(op, c) for op in ops}
    for i in range(max(len(p) for p in points.values())):
        logs = tmp_path / str(i)
        for op in ops:
            _record(logs, specs[op], points[op][min(i, len(points[op]) - 1)])
        monkeypatch.setenv("CE_TVM_TUNING_LOGS", str(logs))
        records.forget()
        gen = torch.Generator().manual_seed(i)
        for rows in (1, 13):
            x = (torch.randn(rows, c, generator=gen) * 4).requires_grad_()
            y = torch.randint(0, c, (rows,), generator=gen)
            loss = ce_tvm.cross_entropy(x, y, label_smoothing=0.1)
            # torch in float64: the reference's own float32 rounding is not in the tolerance
            xr = x.detach().double().requires_grad_()
            ref = F.cross_entropy(xr, y, label_smoothing=0.1)
            loss.backward()
            ref.backward()
            support.assert_close(loss, ref.detach().numpy(), support.TOL[torch.float32], "loss")
            support.assert_close(x.grad, xr.grad.numpy(), support.TOL[torch.float32], "grad")
        loaded = runtime.loaded_specs()
        for op, spec in specs.items():
            tuned = tuned_spec(spec, 13)
            assert tuned.tuned and tuned in loaded, f"{op} did not run its record"


def test_train_record_keeps_the_prefetch_marker():
    """The prefetch distance is a loop annotation in the trace: replayed on the
    symbolic-N kernel it marks the ``exp`` loop, and the build emits its
    prefetches (to L1: locality 3; the next row's, into L2, come with a streamed
    gradient whatever the marker)."""
    spec = KernelSpec("train", "float32", 4099, TRAIN.variant)
    space = CPU.knob_space("train", 4099, "float32", spec.tvm_target())
    for prefetch in (0, 2):
        knobs = {"chunk": space["chunk"][1], "accumulators": 2, "prefetch": prefetch,
                 "row_grain": 1}
        sch = tuning.s_tir.Schedule(tuning.declared_func(spec, knobs["chunk"]))
        cands = tuning.Candidates(spec, 16, space)
        cands.build(knobs)
        cands.traces[tuning._key(knobs)][1].apply_to_schedule(sch, remove_postproc=False)
        marks = [int(loop.annotations[CPU.PREFETCH_ATTR])
                 for loop in CPU.collect_nodes(sch.mod["main"].body, tirx.For)
                 if CPU.PREFETCH_ATTR in loop.annotations]
        assert marks == ([knobs["chunk"] * prefetch] if prefetch else [])
        llvm_ir = tuning.compile_scheduled(sch.mod["main"], spec, entry=None).mod.inspect_source(
            "ll")
        to_l1 = re.findall(r"@llvm\.prefetch\.p0\(ptr [^,]+, i32 [01], i32 3, i32 1\)", llvm_ir)
        assert bool(to_l1) == bool(prefetch)


def test_tuning_run_reports_every_kernel_and_its_json(tuned_logs):
    report = json.loads((tuned_logs / "report.json").read_text())["kernels"]
    assert [k["kind"] for k in report] == ["forward", "forward+gradient", "gradient"]
    for k, spec in zip(report, (FORWARD, TRAIN, BACKWARD)):
        assert k["name"] == spec.name() and k["space_size"] == len(tuning.grid(
            CPU.knob_space(spec.op, C, "float32", spec.tvm_target())))
        assert k["hand_ms"] > 0 and k["tuned_ms"] > 0 and "exhaustive_best_ms" not in k
        assert set(k["knobs"]) == set(CPU.knob_space(spec.op, C, "float32", spec.tvm_target()))
        summary = json.loads(_summary_path(tuned_logs, spec).read_text())
        assert len(summary["measured"]) == 3 and summary["applied"] == k["applied"]
        assert summary["applied"] == records.applies(summary)
        # the forward's compute could stage its chunks: the record says whether it did
        assert summary.get("stage") == (False if spec.op == "forward" else None)


def test_exhaustive_measures_the_whole_grid(tmp_path):
    spec = KernelSpec("backward", "float32", 64, BACKWARD.variant)
    summary = tuning.tune(spec, 8, trials=2, log_root=tmp_path, exhaustive=True, echo=lambda s: 0)
    assert len(summary["measured"]) == summary["space_size"] == 12
    fastest = min(summary["measured"], key=lambda m: m["ms"])
    assert summary["exhaustive_best_knobs"] == fastest["knobs"]
    assert summary["best_ms"] == min(summary["exhaustive_best_ms"], summary["tuned_ms"])
    assert summary["knobs"] in (summary["exhaustive_best_knobs"], summary["tuned_knobs"])


def test_record_round_trips_and_applies_at_other_row_counts(tuned_logs, monkeypatch):
    summary = json.loads(_summary_path(tuned_logs).read_text())
    assert summary["rows"] == TUNED_ROWS
    assert (_summary_path(tuned_logs).parent / "database_tuning_record.json").exists()
    _force(tuned_logs, applied=True)  # whatever the timing noise said: test the apply path
    monkeypatch.setenv("CE_TVM_TUNING_LOGS", str(tuned_logs))
    monkeypatch.setattr(ce_nn, "ONE_PASS_TRAINING", False)  # runs the forward kernel
    x = torch.randn(5, C)
    spec = _spec("forward", x, FORWARD.variant)
    assert spec.tuned == FORWARD.record_id(TUNED_ROWS) and spec.stem().endswith("-tuned")
    for rows in (1, 7, TUNED_ROWS, 1000):
        xs = torch.randn(rows, C, requires_grad=True)
        ys = torch.randint(0, C, (rows,))
        loss = ce_tvm.cross_entropy(xs, ys, label_smoothing=0.1)
        xr = xs.detach().clone().requires_grad_()
        ref = F.cross_entropy(xr, ys, label_smoothing=0.1)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref.backward()
        torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-8)
    assert spec in runtime.loaded_specs()  # the losses above ran the tuned kernel


def test_a_record_of_another_compute_schedules_by_its_knobs(tuned_logs, tmp_path, monkeypatch,
                                                          caplog):
    """A record whose trace was tuned on another version of its kernel's compute
    (its workload's hash no longer today's) schedules the kernel by its knobs,
    not by the hand schedule, and says so; the loss through it matches torch."""
    logs = tmp_path / "logs"
    shutil.copytree(tuned_logs, logs)
    _force(logs, applied=True)
    workload = logs / FORWARD.record_id(TUNED_ROWS) / "database_workload.json"
    line = json.loads(workload.read_text().splitlines()[0])
    line[0] = str(int(line[0]) + 1)  # the hash of another compute
    workload.write_text(json.dumps(line) + "\n")
    monkeypatch.setenv("CE_TVM_TUNING_LOGS", str(logs))
    records.forget()
    spec = _spec("forward", torch.randn(5, C), FORWARD.variant)
    assert spec.tuned == FORWARD.record_id(TUNED_ROWS)
    func, target = declared_func(spec), spec.tvm_target()
    with pytest.raises(RuntimeError, match="no entry for this kernel"):
        records.apply_record(spec.tuned, func, target)
    knobs = records.record_knobs(spec.tuned)
    assert knobs
    with caplog.at_level(logging.INFO, logger="ce_tvm"):
        scheduled = build.scheduled_func(spec)
    assert tvm_ffi.structural_equal(scheduled, CPU.schedule_with_knobs(func, "forward", target,
                                                                        knobs))
    assert any("its knobs schedule it" in r.getMessage() for r in caplog.records)
    xs, ys = torch.randn(7, C), torch.randint(0, C, (7,))
    torch.testing.assert_close(ce_tvm.cross_entropy(xs, ys, label_smoothing=0.1),
                               F.cross_entropy(xs, ys, label_smoothing=0.1),
                               rtol=1e-5, atol=1e-6)


def test_kernels_without_label_smoothing_take_their_siblings_records_by_knobs(
        tuned_logs, tmp_path, monkeypatch):
    """A call with ``eps = 0`` runs the forward and training kernels without label
    smoothing's terms, which are never tuned: each uses its sibling's record,
    scheduled by the record's knobs (its trace is of a compute with one sum more,
    and does not replay), and the losses through them match torch."""
    logs = tmp_path / "logs"
    shutil.copytree(tuned_logs, logs)
    for spec in (FORWARD, TRAIN):
        _force(logs, applied=True, spec=spec)
    monkeypatch.setenv("CE_TVM_TUNING_LOGS", str(logs))
    records.forget()
    specs = []
    for sibling in (FORWARD, TRAIN):
        spec = _spec(sibling.op, torch.randn(5, C), replace(sibling.variant, smoothing=False))
        assert spec.name() == sibling.name() + "-ns"
        assert spec.tuned == sibling.record_id(TUNED_ROWS) and spec.record_name() == sibling.name()
        func, target = declared_func(spec), spec.tvm_target()
        with pytest.raises(RuntimeError, match="no entry for this kernel"):
            records.apply_record(spec.tuned, func, target)
        by_knobs = CPU.schedule_with_knobs(func, spec.op, target, records.record_knobs(spec.tuned))
        assert tvm_ffi.structural_equal(build.scheduled_func(spec), by_knobs)
        specs.append(spec)
    for one_pass in (False, True):
        monkeypatch.setattr(ce_nn, "ONE_PASS_TRAINING", one_pass)
        xs = torch.randn(7, C, requires_grad=True)
        ys = torch.randint(0, C, (7,))
        xr = xs.detach().clone().requires_grad_()
        loss, ref = ce_tvm.cross_entropy(xs, ys), F.cross_entropy(xr, ys)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref.backward()
        torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-8)
    assert set(specs) <= set(runtime.loaded_specs())


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


def test_user_records_come_before_the_shipped_ones_and_env_before_both(
        tuned_logs, tmp_path, monkeypatch):
    monkeypatch.setenv("CE_TVM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CE_TVM_TUNING_LOGS", raising=False)
    assert records.default_log_dir() == records.user_logs_dir() == tmp_path / "cache/tuning_logs"
    assert records.tuning_dirs() == [records.user_logs_dir(), records.PACKAGE_LOGS]
    env = tmp_path / "env"
    shutil.copytree(tuned_logs, env)
    _force(env, applied=False)
    shutil.copytree(tuned_logs, records.user_logs_dir())
    _force(records.user_logs_dir(), applied=True)
    records.forget()
    assert _spec("forward", torch.randn(5, C), FORWARD.variant).tuned  # the user's record
    monkeypatch.setenv("CE_TVM_TUNING_LOGS", str(env))
    assert records.default_log_dir() == env
    records.forget()
    assert _spec("forward", torch.randn(5, C), FORWARD.variant).tuned == ""  # env's wins


def test_tune_list_shows_records_and_the_one_a_shape_uses(tuned_logs, tmp_path):
    logs = tmp_path / "logs"
    shutil.copytree(tuned_logs, logs)
    _force(logs, applied=True)
    _force(logs, applied=False, spec=BACKWARD)
    out = run([CLI, "tune", "--list", "--classes", str(C), "--rows", "100"],
              CE_TVM_TUNING_LOGS=str(logs))
    assert str(logs) in out and FORWARD.name() in out and BACKWARD.name() in out
    uses = {line.split()[0]: line.split()[1] for line in out.split("would use:")[1].splitlines()
            if line.strip()}
    assert uses["forward"] == FORWARD.record_id(TUNED_ROWS)
    assert uses["backward"] == "the"  # "the hand schedule (no record applies)"


def test_untuned_shape_says_how_to_tune_once(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("CE_TVM_TUNING_LOGS", str(tmp_path))
    spec = KernelSpec("forward", "float32", 77, Variant("sum", False, False))
    with caplog.at_level(logging.DEBUG, logger="ce_tvm"):
        assert tuned_spec(spec, 10) == spec
        tuned_spec(spec, 10)
    hints = [r for r in caplog.records if "ce-tvm tune" in r.getMessage()]
    assert len(hints) == 1 and "--classes 77" in hints[0].getMessage()


SHIPPED_RECORDS = sorted(p.parent for p in records.PACKAGE_LOGS.glob("*/*/summary.json"))


@pytest.mark.parametrize("directory", SHIPPED_RECORDS, ids=lambda d: f"{d.parent.name}/{d.name}")
def test_shipped_record_schedules_the_current_compute(directory, tmp_path, monkeypatch):
    """Every record in the package is keyed to today's compute of its kernel and
    its trace replays there, or its summary says why its knobs schedule the
    kernel instead (``by_knobs``: tuned on a CPU not at hand, before its
    kernel's compute changed), and they do, as the build schedules it. A
    compute change that leaves a record stale unsaid fails here: re-tune it
    on its machine, or re-key or mark it (``benchmarks/rekey_tuning_logs.py``)."""
    from ce_tvm.tools.cli import record_cross_spec

    monkeypatch.setenv("CE_TVM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CE_TVM_TUNING_LOGS", raising=False)
    summary = json.loads((directory / "summary.json").read_text())
    spec = record_cross_spec(directory)
    rid = spec.tuned
    func = declared_func(spec)  # as the build declares it there: the record's chunk and stage
    if "by_knobs" not in summary:
        records.apply_record(rid, func, spec.tvm_target())  # raises on a stale record
        return
    with pytest.raises(RuntimeError, match="no entry for this kernel"):
        records.apply_record(rid, func, spec.tvm_target())  # a mark left on a current record
    by_knobs = CPU.schedule_with_knobs(func, spec.op, spec.tvm_target(), summary["knobs"])
    assert tvm_ffi.structural_equal(build.scheduled_func(spec), by_knobs)


def test_log_prob_records_replay_and_match_the_reference(tmp_path, monkeypatch):
    """The log-prob kernels are tuned like the others: records of the hand
    knobs' corner and of each chunk (C = 4099: one overlapping) replay on the
    symbolic-N kernels, which give the reference's values and gradient."""
    import numpy as np

    from ce_tvm.testing import reference

    c = 4099
    specs = {op: KernelSpec(op, "float32", c, Variant(columns=2)) for op in
             ("log_probs", "log_probs_grad")}
    points = {op: _points(op, c) for op in specs}
    chunks = [p for p in points["log_probs"] if p != points["log_probs"][0]
              and set(p.items()) - set(points["log_probs"][0].items()) <= {("chunk", p["chunk"])}]
    picks = [points["log_probs"][-1], *chunks]
    for i, knobs in enumerate(picks):
        logs = tmp_path / str(i)
        _record(logs, specs["log_probs"], knobs)
        _record(logs, specs["log_probs_grad"], points["log_probs_grad"][-1])
        monkeypatch.setenv("CE_TVM_TUNING_LOGS", str(logs))
        records.forget()
        gen = torch.Generator().manual_seed(i)
        for rows in (1, 13):
            x = (torch.randn(rows, c, generator=gen) * 4).requires_grad_()
            index = torch.randint(0, c, (rows, 2), generator=gen)
            a, b = torch.randn(rows, 2, generator=gen), torch.randn(rows, generator=gen)
            logp, entropy = ce_tvm.log_probs(x, index, temperature=0.7, return_entropy=True)
            ((logp * a).sum() + (entropy * b).sum()).backward()
            live = np.ones(index.shape, bool)
            xn = x.detach().double().numpy()
            ref_logp, ref_entropy = reference.policy_outputs(xn, index.numpy(), live, 0.7)
            ref_grad = reference.policy_grad(xn, index.numpy(), live, a.double().numpy(),
                                             b.double().numpy(), 0.7)
            tol = support.TOL[torch.float32]
            support.assert_close(logp, ref_logp, tol, f"logp {knobs}")
            support.assert_close(entropy, ref_entropy, tol, f"entropy {knobs}")
            support.assert_close(x.grad, ref_grad, tol, f"x_grad {knobs}")
        loaded = runtime.loaded_specs()
        for op, spec in specs.items():
            tuned = tuned_spec(spec, 13)
            assert tuned.tuned and tuned in loaded, f"{op} did not run its record"


@pytest.mark.parametrize("ops, message", [
    ("forward,divergence", "ce-tvm tune: no tunable schedule for 'divergence' on llvm"),
    ("forwards", r"ce-tvm tune: unknown --ops \['forwards'\]")])
def test_tune_refuses_an_op_it_cannot_search_before_tuning(tmp_path, ops, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["tune", "--classes", "1000", "--rows", "64", "--ops", ops,
                  "--log-dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # nothing tuned: the forward was not searched
