"""Autotuning with meta_schedule, and the tuning records the build applies.

``tune`` searches two spaces at a fixed row count N (meta_schedule rejects a
symbolic N): the hand schedule's own family (``schedules.<target>
.sample_knobs``: its knobs drawn by sampling instructions, so every trace
records them) and meta_schedule's generic space. The best candidate is
measured against the hand schedule in the same process; the record stores
both times. The build applies a record only when it beat the hand schedule
by ``MIN_SPEEDUP`` (tuning never makes anything slower), replaying its trace
on the symbolic-N function.

Layout: ``<logs>/<target key>/<kernel stem>-N<rows>/`` holds the JSON
database of the winning space and ``summary.json``. Records are looked up in
``$CE_TVM_TUNING_LOGS`` (``os.pathsep``-separated) and the package's
``tuning_logs``; for a call with N rows the record with the nearest N (in
log2) is used.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

from .build import KernelSpec, declared_func, schedule_module
from .runtime import configure_thread_pool

log = logging.getLogger("ce_tvm")
# A record is applied only when it beat the hand schedule by this factor when
# both were measured: a tie within timing noise keeps the hand schedule.
MIN_SPEEDUP = 1.02
PACKAGE_LOGS = Path(str(importlib.resources.files("ce_tvm.tuning_logs")))


@functools.lru_cache(maxsize=None)
def target_key(target) -> str:
    """e.g. ``llvm-znver5-2c``: kind, CPU or arch, cores."""
    attrs = target.attrs
    cpu = str(attrs.get("mcpu", attrs.get("arch", "generic")))
    cores = f"-{int(attrs['num-cores'])}c" if "num-cores" in attrs else ""
    return f"{target.kind.name}-{cpu}{cores}"


def tuning_dirs() -> list[Path]:
    env = os.environ.get("CE_TVM_TUNING_LOGS", "")
    return [Path(p) for p in env.split(os.pathsep) if p] + [PACKAGE_LOGS]


def record_id(spec: KernelSpec, rows: int) -> str:
    return f"{target_key(spec.tvm_target())}/{replace(spec, tuned='').stem()}-N{rows}"


def _record_dir(rid: str) -> Path:
    for root in tuning_dirs():
        if (root / rid / "summary.json").exists():
            return root / rid
    raise FileNotFoundError(f"no tuning record {rid} in {[str(d) for d in tuning_dirs()]}")


def record_digest(rid: str) -> str:
    """Hash of a record's files (part of the module cache key)."""
    h = hashlib.sha256()
    for path in sorted(_record_dir(rid).glob("*.json")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


# Scalar arguments bound for tuning (meta_schedule's runner passes tensors
# only); non-zero, so no branch of the compute folds away.
TUNING_SCALARS = {"ignore_index": -100, "label_smoothing": 0.1, "zloss_scale": 1e-4,
                  "shard_offset": 0, "weight_sum": 1000.0, "global_classes": 1000.0}


def fixed_rows(func, rows: int):
    """``func`` with N bound to ``rows`` and its scalar arguments to ``TUNING_SCALARS``."""
    x = next(p for p in func.params if len(getattr(p, "shape", ())) == 2)
    shape = (tvm.tirx.IntImm("int64", rows), x.shape[1])
    binds = {x: tvm.tirx.decl_buffer(shape, x.dtype, x.name)}
    binds.update({p: tvm.tirx.const(TUNING_SCALARS[p.name], str(p.ty))
                  for p in func.params if not hasattr(p, "shape")})
    return func.specialize(binds).with_attr("global_symbol", "main")


@functools.lru_cache(maxsize=None)
def _records(key: str, stem: str, dirs: tuple) -> tuple:
    """``(rows, record id)`` of the records in ``dirs`` that beat the hand schedule."""
    found = []
    for root in dirs:
        for summary in sorted((root / key).glob(f"{stem}-N*/summary.json")):
            data = json.loads(summary.read_text())
            if data["applied"] and data["hand_ms"] >= MIN_SPEEDUP * data["tuned_ms"]:
                found.append((int(data["rows"]), f"{key}/{summary.parent.name}"))
    return tuple(found)


_told: set = set()


def tuned_spec(spec: KernelSpec, rows: int) -> KernelSpec:
    """``spec`` with the record nearest to ``rows`` rows applied, if there is one."""
    if spec.op not in ("forward", "backward"):
        return spec
    records = _records(target_key(spec.tvm_target()), spec.stem(), tuple(tuning_dirs()))
    if not records:
        if spec not in _told:
            _told.add(spec)
            log.debug("ce_tvm: no tuning record for %s; tune it with: ce-tvm tune --target %s "
                      "--dtype %s --classes %d --rows %d", spec.stem(), spec.target, spec.dtype,
                      spec.classes, max(rows, 1))
        return spec
    nearest = min(records, key=lambda r: abs(math.log2(r[0]) - math.log2(max(rows, 1))))
    return replace(spec, tuned=nearest[1])


def apply_record(rid: str, func, target):
    """Replay the record's trace on ``func`` (symbolic N); the scheduled PrimFunc."""
    directory = _record_dir(rid)
    rows = json.loads((directory / "summary.json").read_text())["rows"]
    db = ms.database.JSONDatabase(work_dir=str(directory))
    mod = tvm.IRModule({"main": fixed_rows(func, rows)})
    record = db.query_tuning_record(mod, target, "main")
    if record is None:
        raise RuntimeError(f"tuning record {rid} has no entry for this kernel")
    sch = s_tir.Schedule(func)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch.mod["main"]


def _random_args(func, spec: KernelSpec):
    """Random inputs for timing a ``fixed_rows`` function."""
    gen = torch.Generator().manual_seed(0)
    args = []
    for p in func.params:
        shape = [int(d) for d in p.shape]
        dtype = getattr(torch, str(p.dtype))
        if p.name == "target":
            args.append(torch.randint(0, spec.classes, shape, generator=gen))
        elif dtype.is_floating_point:
            args.append(torch.randn(shape, generator=gen).to(dtype))
        else:
            args.append(torch.zeros(shape, dtype=dtype))
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
        runner=ms.runner.LocalRunner(timeout_sec=30), num_tuning_cores=1, seed=0)
    sch = ms.tir_integration.compile_tir(db, tvm.IRModule({"main": fixed}), target)
    return (sch.mod["main"] if sch is not None else None), work_dir


SPACES = ("ce_tvm", "generic")


def tune(spec: KernelSpec, rows: int, trials: int, log_root: Path, retune: bool = False,
         spaces=SPACES, echo=print) -> dict:
    """Tune ``spec`` at ``rows`` rows and store the record; returns its summary."""
    rid = record_id(spec, rows)
    out = log_root / rid
    if (out / "summary.json").exists() and not retune:
        echo(f"  {rid}: already tuned (use --retune to search again)")
        return json.loads((out / "summary.json").read_text())
    configure_thread_pool()  # measure with the threads the runtime will use
    target = spec.tvm_target()
    sched = schedule_module(spec.target)
    op_schedule = {"forward": sched.schedule_forward, "backward": sched.schedule_backward}[spec.op]
    fixed = fixed_rows(declared_func(spec), rows)
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
    summary = {"kernel": replace(spec, tuned="").stem(), "rows": rows, "hand_ms": hand_ms,
               "tuned_ms": tuned_ms, "space": space, "trials": trials,
               "applied": hand_ms >= MIN_SPEEDUP * tuned_ms, "speedup": hand_ms / tuned_ms}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if summary["applied"]:
        try:  # a trace that does not replay on the symbolic-N kernel is never applied
            apply_record(rid, declared_func(spec), target)
        except Exception as err:  # noqa: BLE001 - recorded in the summary instead
            summary.update(applied=False, replay_error=str(err).splitlines()[-1][:300])
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
    _records.cache_clear()
    return summary
