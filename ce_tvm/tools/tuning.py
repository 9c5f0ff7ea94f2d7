"""Autotuning: the search behind ``ce-tvm tune``.

A kernel's space is its schedule's knob family (``schedules.<target>
.knob_space``: ``{knob: choices}``, declared next to the schedule). A
candidate is one value per knob: the compute is declared with its ``chunk``
(when the space has one), and ``schedule_knobs`` draws every knob with
``sample_categorical`` fixed to the candidate's value, so the schedule's
trace records each knob and replays without the search.

The search runs at a fixed row count N (the record's): a candidate's trace
is recorded on the compute with N and the scalars bound (the record's
workload), and the candidate is timed as the runtime would run it: the trace
replayed on the symbolic-N compute, loaded from disk, on torch's OpenMP
threads (``Candidates.build``, ``compile_scheduled``). It measures
``trials`` candidates: coordinate descent from the hand schedule's knobs
(each knob's other values in turn, moving to any faster candidate), and once
no single change helps, a random unmeasured candidate, from which the
descent goes on if it is faster. ``exhaustive`` then measures every
candidate of the grid too. The search's pick and the grid's best are
measured against the hand schedule once more, interleaved; the record keeps
the faster and applies only when it beat the hand schedule
(``records.MIN_SPEEDUP``). meta_schedule provides the sampling instructions,
traces and the record format; its search is not used (its mutators do not
change categorical decisions, so on this space it would sample at random).

CUDA candidates are compiled (``compile_grid``), not measured, without a
GPU; the Ascend plan is searched against its cost model (``tune_ascend_plan``).
Reading and replaying records is ``ce_tvm.store.records``; only the CLI imports
this module.
"""

from __future__ import annotations

import itertools
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import tvm
import tvm_ffi
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

from ..compiler.build import (
    SCHEDULE_OF_OP,
    KernelSpec,
    chunk_staged,
    declared_func,
    schedule_module,
)
from ..compiler.build import compile_scheduled as compile_executable
from ..runtime.omp_pool import use_torch_pool
from ..runtime.registry import configure_thread_pool
from ..runtime.tensors import TORCH_DTYPES
from ..store import records
from ..store.files import copy_file, write_file


def _random_args(func, spec: KernelSpec):
    """Random inputs for timing a ``fixed_rows`` function."""
    gen = torch.Generator().manual_seed(0)
    args = []
    for p in func.params:
        shape = [int(d) for d in p.shape]
        if p.name in ("target", "index"):
            args.append(torch.randint(0, spec.classes, shape, generator=gen))
        else:
            args.append(torch.randn(shape, generator=gen).to(TORCH_DTYPES[str(p.dtype)]))
    return args


def compile_scheduled(scheduled, spec: KernelSpec, entry: str | None = "main"):
    """Function ``entry`` of a scheduled PrimFunc (or IRModule) of ``spec``, built
    as ``build`` builds (``compiler.build.compile_scheduled``) and,
    on the CPU, loaded as the runtime loads it (``loaded_as_the_runtime_runs_it``);
    the Executable when ``entry`` is ``None``."""
    ex = compile_executable(scheduled, spec)
    if entry is None:
        return ex
    return loaded_as_the_runtime_runs_it(ex, entry) if spec.target == "llvm" else ex[entry]


_exports: dict = {}


def loaded_as_the_runtime_runs_it(ex, entry: str):
    """``ex[entry]`` exported, loaded from disk and pointed at torch's OpenMP
    threads (``omp_pool.use_torch_pool``), as ``runtime.kernel`` runs a CPU
    kernel. In memory it would run its parallel loop on TVM's thread pool,
    where rows per task and prefetch distance rank differently: records tuned
    that way lost to the hand schedule once run through the runtime."""
    if "dir" not in _exports:
        _exports["dir"] = tempfile.TemporaryDirectory(prefix="ce_tvm_tune_")
        _exports["count"] = itertools.count()
    path = Path(_exports["dir"].name) / f"candidate{next(_exports['count'])}.so"
    ex.export_library(str(path))
    fn = tvm_ffi.load_module(str(path))[entry]
    use_torch_pool(path)
    return fn


def time_ms(fns: list, args, runs: int = 5) -> list[float]:
    """Best time of each compiled function in ``fns`` over ``runs`` runs after a warm-up,
    interleaved run by run (so a noisy moment hits them alike)."""
    for fn in fns:
        fn(*args)
    best = [float("inf")] * len(fns)
    for _ in range(runs):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn(*args)
            best[i] = min(best[i], time.perf_counter() - t0)
    return [b * 1e3 for b in best]


def grid(space: dict) -> list[dict]:
    """Every candidate of ``space`` (``{knob: choices}``), as ``{knob: value}``."""
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


def _key(knobs: dict) -> tuple:
    return tuple(sorted(knobs.items()))


@dataclass
class Candidates:
    """Builds and measures the candidates of one kernel at one row count."""

    spec: KernelSpec
    rows: int | None  # None: the symbolic-N kernel (built, not measured)
    space: dict
    echo: object = print
    measured: dict = field(default_factory=dict)  # _key(knobs) -> ms
    traces: dict = field(default_factory=dict)  # _key(knobs) -> (fixed func, trace)
    _declared: dict = field(default_factory=dict)  # chunk -> the symbolic-N compute
    _fixed: dict = field(default_factory=dict)  # chunk -> the fixed-N compute
    args: list = None

    def declared(self, chunk: int | None):
        """The compute declared with ``chunk`` (``None``: the schedule's), N symbolic."""
        if chunk not in self._declared:
            self._declared[chunk] = declared_func(self.spec, chunk)
        return self._declared[chunk]

    def fixed(self, chunk: int | None):
        """``declared(chunk)`` with N bound to ``rows`` (unless ``None``)."""
        if chunk not in self._fixed:
            func = self.declared(chunk)
            self._fixed[chunk] = func if self.rows is None else records.fixed_rows(func, self.rows)
        return self._fixed[chunk]

    def hand(self):
        """The hand schedule, compiled as the runtime runs it (N symbolic)."""
        schedule = getattr(schedule_module(self.spec.target), SCHEDULE_OF_OP[self.spec.op])
        return compile_scheduled(schedule(self.declared(None), self.spec.tvm_target()), self.spec)

    def chunk(self, knobs: dict) -> int | None:
        spec = self.spec
        return schedule_module(spec.target).knob_chunk(
            spec.op, spec.classes, spec.dtype, spec.tvm_target(), knobs)

    def schedule(self, knobs: dict):
        """The candidate ``knobs``, scheduled (its trace is kept for the record) and
        finished as the target's schedules finish a kernel (``finish``, if any)."""
        func = self.fixed(self.chunk(knobs))
        sch = s_tir.Schedule(func)
        module = schedule_module(self.spec.target)
        module.schedule_knobs(sch, self.spec.op, self.spec.tvm_target(), self.space, knobs)
        self.traces[_key(knobs)] = (func, sch.trace)
        return getattr(module, "finish", lambda f: f)(sch.mod["main"])

    def build(self, knobs: dict):
        """The candidate ``knobs``, compiled. At a row count, as the build compiles
        its record: the trace replayed on the symbolic-N compute, whose scalars
        are arguments. The fixed-N function the trace was recorded on binds N
        and the scalars (``records.fixed_rows``), so LLVM optimises it otherwise:
        rows per task ranked differently on it than in the runtime's kernel."""
        scheduled = self.schedule(knobs)  # records the trace
        if self.rows is None:
            return compile_scheduled(scheduled, self.spec)
        sch = s_tir.Schedule(self.declared(self.chunk(knobs)))
        self.traces[_key(knobs)][1].apply_to_schedule(sch, remove_postproc=False)
        return compile_scheduled(sch.mod["main"], self.spec)

    def arguments(self, knobs: dict) -> list:
        """Random tensors of ``rows`` rows and ``records.TUNING_SCALARS``, in the
        order of the symbolic-N kernel's arguments (those the runtime passes)."""
        if self.args is None:
            tensors = iter(_random_args(self.fixed(self.chunk(knobs)), self.spec))
            self.args = [next(tensors) if hasattr(p, "shape") else records.TUNING_SCALARS[p.name]
                         for p in self.declared(self.chunk(knobs)).params]
        return self.args

    def measure(self, knobs: dict, label: str) -> float:
        key = _key(knobs)
        if key not in self.measured:
            self.measured[key] = time_ms([self.build(knobs)], self.arguments(knobs),
                                         runs=CANDIDATE_RUNS)[0]
            best = min(self.measured.values())
            self.echo(f"    {label} {_show(knobs)}: {self.measured[key]:.3f} ms"
                      f"{'  (best so far)' if self.measured[key] == best else ''}")
        return self.measured[key]


def _show(knobs: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in knobs.items())


def search(cands: Candidates, start: dict, trials: int, seed: int = 0) -> dict:
    """Coordinate descent from ``start`` over ``cands.space``, with random restarts,
    measuring at most ``trials`` candidates; returns the fastest one's knobs."""
    rng = random.Random(seed)
    points = grid(cands.space)
    budget = min(trials, len(points))
    done = 0

    def try_(knobs: dict) -> bool:
        """Measure ``knobs`` (if new and within budget); True when it is the best so far."""
        nonlocal done
        if _key(knobs) not in cands.measured:
            if done >= budget:
                return False
            done += 1
            cands.measure(knobs, f"[search {done}/{budget}]")
        return cands.measured[_key(knobs)] <= cands.measured[_key(best)]

    best = dict(start)
    try_(best)
    while done < budget:
        improved = False
        for name, choices in cands.space.items():
            for value in choices:
                cand = {**best, name: value}
                if cand != best and try_(cand):
                    best, improved = cand, True
        if not improved:
            fresh = [p for p in points if _key(p) not in cands.measured]
            if not fresh:
                break
            cand = rng.choice(fresh)
            if try_(cand):
                best = cand
    return best


def save(out: Path, cands: Candidates, summary: dict) -> None:
    """Write the record: ``summary`` and the trace of its ``knobs`` (built by
    ``cands``) in meta_schedule's JSON database format (``records``)."""
    func, trace = cands.traces[_key(summary["knobs"])]
    with tempfile.TemporaryDirectory() as tmp:
        db = ms.database.JSONDatabase(work_dir=tmp)
        workload = db.commit_workload(tvm.IRModule({"main": func}))
        db.commit_tuning_record(ms.database.TuningRecord(
            trace, workload, [summary["best_ms"] / 1e3], cands.spec.tvm_target()))
        out.mkdir(parents=True, exist_ok=True)
        for name in ("database_workload.json", "database_tuning_record.json"):
            copy_file(Path(tmp) / name, out / name, mode=0o644)
    write_file(out / "summary.json", json.dumps(summary, indent=1).encode(), mode=0o644)
    records.forget()


def compile_grid(spec: KernelSpec, rows: int | None = None) -> tuple[list[dict], object]:
    """Every candidate of ``spec``'s knob grid (symbolic N, or at ``rows``), scheduled and
    compiled into one module (function ``<op>_<i>`` for candidate ``i``);
    returns ``(candidates, Executable)``. For CUDA without a GPU the module
    keeps its source (``build.cuda_binary`` compiles it with nvcc)."""
    space = schedule_module(spec.target).knob_space(
        spec.op, spec.classes, spec.dtype, spec.tvm_target())
    cands = Candidates(spec, rows, space)
    points = grid(space)
    funcs = {f"{spec.op}_{i}": cands.schedule(knobs).with_attr("global_symbol", f"{spec.op}_{i}")
             for i, knobs in enumerate(points)}
    return points, compile_scheduled(tvm.IRModule(funcs), spec, entry=None)


# Runs of one candidate's measurement (its best time counts).
CANDIDATE_RUNS = 8
# Runs of the final, interleaved measurement of the hand schedule and the winners.
FINAL_RUNS = 15
# What a kernel computes, for reports: the backward is a gradient kernel.
KIND_OF_OP = {"forward": "forward", "backward": "gradient", "train": "forward+gradient",
              "log_probs": "log-probs", "log_probs_grad": "log-probs gradient",
              "divergence": "divergence"}


def tune(spec: KernelSpec, rows: int, trials: int, log_root: Path, retune: bool = False,
         exhaustive: bool = False, echo=print) -> dict:
    """Tune ``spec`` at ``rows`` rows and store the record; returns its summary:
    ``hand_ms``, ``tuned_ms`` (the search's pick), ``exhaustive_best_ms`` (the
    grid's best, with ``exhaustive``), measured again together, interleaved;
    ``best_ms`` and ``knobs`` (the record's: the faster of the two), ``space_size``,
    ``applied`` (``best_ms`` beat the hand schedule) and every candidate's first
    measurement (``measured``)."""
    rid = spec.record_id(rows)
    out = log_root / rid
    if (out / "summary.json").exists() and not retune:
        echo(f"  {rid}: already tuned (use --retune to search again)")
        return json.loads((out / "summary.json").read_text())
    configure_thread_pool()  # measure with the threads the runtime will use
    sched = schedule_module(spec.target)
    target = spec.tvm_target()
    space = sched.knob_space(spec.op, spec.classes, spec.dtype, target)
    cands = Candidates(spec, rows, space, echo)
    size = len(grid(space))
    echo(f"  {spec.name()} at N={rows}: {size} candidates "
         f"({' x '.join(f'{k} {list(v)}' for k, v in space.items())})")
    hand = {k: v[0] for k, v in space.items()}  # the hand schedule's knobs come first
    picked = search(cands, hand, trials)
    contenders = {"tuned": picked}
    if exhaustive:
        for i, knobs in enumerate(grid(space)):
            cands.measure(knobs, f"[grid {i + 1}/{size}]")
        contenders["exhaustive_best"] = dict(min(cands.measured, key=cands.measured.get))
    # The verdict: the hand schedule, the search's pick and the grid's best,
    # measured again in one run, interleaved (one noisy moment hits all alike).
    # Equal knobs are one candidate, measured once; the hand schedule's knobs are
    # the hand schedule (the same code: a record of them is not applied).
    unique = [k for k in {_key(k): k for k in contenders.values()}.values() if k != hand]
    final = time_ms([cands.hand()] + [cands.build(k) for k in unique], cands.arguments(hand),
                    runs=FINAL_RUNS)
    by_key = {_key(hand): final[0], **{_key(k): t for k, t in zip(unique, final[1:])}}
    times = {name: by_key[_key(k)] for name, k in contenders.items()}
    winner = min(times, key=times.get)
    knobs = {k: contenders[winner][k] for k in space}
    hand_ms, best_ms = final[0], times[winner]
    summary = {"kernel": spec.name(), "kind": KIND_OF_OP[spec.op], "rows": rows,
               "trials": trials, "space": {k: list(v) for k, v in space.items()},
               "space_size": size, "hand_ms": hand_ms,
               **{f"{name}_ms": t for name, t in times.items()},
               **{f"{name}_knobs": contenders[name] for name in contenders},
               "knobs": knobs, "best_ms": best_ms, "speedup": hand_ms / best_ms,
               "applied": knobs != hand and hand_ms >= records.MIN_SPEEDUP * best_ms,
               "measured": [{"knobs": dict(k), "ms": v} for k, v in cands.measured.items()]}
    stage = chunk_staged(spec)
    if stage is not None:  # the compute the record replays on stages its chunks or not
        summary["stage"] = stage
    echo(f"  {spec.name()}: hand {hand_ms:.3f} ms, best {best_ms:.3f} ms ({_show(knobs)}): "
         f"{'applied' if summary['applied'] else 'not applied (hand schedule kept)'}")
    save(out, cands, summary)
    return summary


def tune_ascend_plan(spec: KernelSpec, rows: int, log_root: Path, echo=print) -> dict:
    """Search the Ascend tiling plan of ``spec`` (tile size x buffer count) against
    the cost model (``ascend_plan.search_plan``: no hardware, the model is the
    measure) and record the best plan; the summary has ``tune``'s fields, times
    being the model's (``hand_ms``: ``ascend_plan.plan``'s fixed plan)."""
    from ..schedules import ascend_plan

    profile = dict(spec.options)["profile"]
    args = (profile, rows, spec.classes, spec.dtype, spec.op)
    fixed, best = ascend_plan.plan(*args), ascend_plan.search_plan(*args)
    hand_ms, best_ms = (ascend_plan.cost(p)["ce_tvm"]["time_us"] / 1e3 for p in (fixed, best))
    summary = {"kernel": spec.name(), "kind": KIND_OF_OP[spec.op], "rows": rows,
               "measure": "ascend_plan.cost (model)",
               "space_size": len(ascend_plan.candidate_plans(*args)), "hand_ms": hand_ms,
               "tuned_ms": best_ms, "exhaustive_best_ms": best_ms, "best_ms": best_ms,
               "knobs": {"chunk": best.chunk, "buffers": best.buffers},
               "hand_knobs": {"chunk": fixed.chunk, "buffers": fixed.buffers},
               "speedup": hand_ms / best_ms, "applied": best != fixed, "plan": best.as_dict()}
    out = log_root / f"ascend-{profile}" / f"{spec.name()}-N{rows}"
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / "summary.json", json.dumps(summary, indent=1).encode(), mode=0o644)
    echo(f"  {spec.name()} N={rows}: {summary['space_size']} plans; fixed plan "
         f"{fixed.chunk} x {fixed.buffers} buffers {hand_ms * 1e3:.1f} us, best {best.chunk} x "
         f"{best.buffers} buffers {best_ms * 1e3:.1f} us")
    return summary
