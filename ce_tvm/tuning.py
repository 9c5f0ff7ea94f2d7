"""Autotuning with meta_schedule: the search behind ``ce-tvm tune``.

``tune`` searches two spaces at a fixed row count N (meta_schedule rejects a
symbolic N): the hand schedule's own family (``schedules.<target>
.sample_knobs``: its knobs drawn by sampling instructions, so every trace
records them) and meta_schedule's generic space. The best candidate is
measured against the hand schedule in the same process; the record stores
both times. Reading records and replaying them on the symbolic-N kernel is
``ce_tvm.records`` (layout, lookup, ``MIN_SPEEDUP``); only the CLI imports
this module.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

from . import records
from .build import KernelSpec, declared_func, schedule_module
from .runtime import configure_thread_pool
from .tensors import TORCH_DTYPES


def _random_args(func, spec: KernelSpec):
    """Random inputs for timing a ``fixed_rows`` function."""
    gen = torch.Generator().manual_seed(0)
    args = []
    for p in func.params:
        shape = [int(d) for d in p.shape]
        if p.name == "target":
            args.append(torch.randint(0, spec.classes, shape, generator=gen))
        else:
            args.append(torch.randn(shape, generator=gen).to(TORCH_DTYPES[str(p.dtype)]))
    return args


def measure_ms(scheduled, target, args, budget_s: float = 0.5) -> float:
    """Best time of a scheduled fixed-N PrimFunc over at least 5 runs and ``budget_s``."""
    fn = tvm.compile(scheduled, target=target)["main"]
    fn(*args)
    best, runs, start = float("inf"), 0, time.perf_counter()
    while runs < 5 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best * 1e3


def _search(fixed, target, work_dir: Path, trials: int, space) -> tuple:
    """Tune one space; ``(scheduled PrimFunc or None, work_dir)``."""
    db = ms.tune_tir(
        tvm.IRModule({"main": fixed}), target, str(work_dir), max_trials_global=trials,
        num_trials_per_iter=min(trials, 8), space=space, cost_model="random",
        # Generous timeouts: on a loaded 2-core machine a candidate's build took
        # over meta_schedule's default 30 s, and the search then found nothing.
        builder=ms.builder.LocalBuilder(timeout_sec=300),
        runner=ms.runner.LocalRunner(timeout_sec=60), num_tuning_cores=1, seed=0)
    sch = ms.tir_integration.compile_tir(db, tvm.IRModule({"main": fixed}), target)
    return (sch.mod["main"] if sch is not None else None), work_dir


SPACES = ("ce_tvm", "generic")


def tune(spec: KernelSpec, rows: int, trials: int, log_root: Path, retune: bool = False,
         spaces=SPACES, echo=print) -> dict:
    """Tune ``spec`` at ``rows`` rows and store the record; returns its summary."""
    rid = spec.record_id(rows)
    out = log_root / rid
    if (out / "summary.json").exists() and not retune:
        echo(f"  {rid}: already tuned (use --retune to search again)")
        return json.loads((out / "summary.json").read_text())
    configure_thread_pool()  # measure with the threads the runtime will use
    target = spec.tvm_target()
    sched = schedule_module(spec.target)
    op_schedule = {"forward": sched.schedule_forward, "backward": sched.schedule_backward}[spec.op]
    fixed = records.fixed_rows(declared_func(spec), rows)
    args = _random_args(fixed, spec)
    hand_ms = measure_ms(op_schedule(s_tir.Schedule(fixed), target).mod["main"], target, args)
    echo(f"  {rid}: hand schedule {hand_ms:.3f} ms; searching {trials} trials per space ...")

    def family(sch):
        op_schedule(sch, target, sched.sample_knobs(sch))

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        generators = {"ce_tvm": lambda: ms.space_generator.ScheduleFn(
                          family, sch_rules=[], postprocs=[], mutator_probs={}),
                      "generic": lambda: "post-order-apply"}
        for name in spaces:
            space = generators[name]()
            try:
                scheduled, work_dir = _search(fixed, target, Path(tmp) / name, trials, space)
            except Exception as err:  # noqa: BLE001 - a space that fails is reported, not fatal
                echo(f"    {name} space failed: {str(err).splitlines()[-1][:160]}")
                continue
            if scheduled is None:
                echo(f"    {name} space: no valid candidate")
                continue
            ms_time = measure_ms(scheduled, target, args)
            echo(f"    {name} space: best {ms_time:.3f} ms")
            results.append((ms_time, name, work_dir))
        if not results:
            raise RuntimeError(f"tuning {rid} found no valid schedule")
        tuned_ms, space, work_dir = min(results)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for name in ("database_workload.json", "database_tuning_record.json"):
            shutil.copy(work_dir / name, out / name)
    summary = {"kernel": spec.name(), "rows": rows, "hand_ms": hand_ms,
               "tuned_ms": tuned_ms, "space": space, "trials": trials,
               "applied": hand_ms >= records.MIN_SPEEDUP * tuned_ms,
               "speedup": hand_ms / tuned_ms}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if summary["applied"]:
        try:  # a trace that does not replay on the symbolic-N kernel is never applied
            records.apply_record(rid, declared_func(spec), target)
        except Exception as err:  # noqa: BLE001 - recorded in the summary instead
            summary.update(applied=False, replay_error=str(err).splitlines()[-1][:300])
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
    records.forget()
    return summary
