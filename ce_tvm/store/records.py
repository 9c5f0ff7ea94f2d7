"""Tuning records, read side: where they live, which one a kernel uses, and
replaying one on a kernel. No search, no torch, no meta_schedule: records are
written by ``ce_tvm.tools.tuning`` (``ce-tvm tune``). Finding a record needs no TVM
(targets are their JSON descriptions, ``ce_tvm.store.targets.target_description``);
replaying one imports the compiler.

Layout: ``<logs>/<target key>/<kernel name>-N<rows>/`` holds ``summary.json``
(times, the winning ``knobs``, every candidate measured) and the winning
trace in meta_schedule's JSON database format: ``database_workload.json``
(one line per tuned function: its structural hash and the function) and
``database_tuning_record.json`` (one line per trace: the workload's line
number, then the trace and its run times). The trace draws every knob with a
sampling instruction; a knob of the compute (the CPU's ``chunk``) is also in
``knobs``, and the kernel is declared with it before the trace replays.
A trace replays only on the compute it was tuned on; on another (its
kernel's compute changed since) the build schedules the kernel by the
record's ``knobs`` (``compiler.build.scheduled_func``), and a shipped
record's summary says why (``by_knobs``).

Records are looked up, first match wins, in ``$CE_TVM_TUNING_LOGS``
(``os.pathsep``-separated), the per-user directory ``user_logs_dir()`` (where
``ce-tvm tune`` writes by default) and the package's read-only
``tuning_logs``. A record is used only when it beat the hand schedule by
``MIN_SPEEDUP`` when both were measured (tuning never makes anything
slower); for a call with N rows the record with the nearest N (in log2) is
used.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import math
import os
from pathlib import Path

from .paths import cache_dir

# A tie within timing noise keeps the hand schedule.
MIN_SPEEDUP = 1.02
PACKAGE_LOGS = Path(str(importlib.resources.files("ce_tvm.tuning_logs")))
# Scalar arguments bound while tuning (the search times a kernel on tensors
# only); non-zero, so no branch of the compute folds away.
TUNING_SCALARS = {"ignore_index": -100, "label_smoothing": 0.1, "zloss_scale": 1e-4,
                  "shard_offset": 0, "weight_sum": 1000.0, "global_classes": 1000.0,
                  "inv_temperature": 1.0 / 0.7}
# meta_schedule's run time of a candidate that failed to build or run.
_FAILED_RUN_S = 1e10


def target_key(target: dict) -> str:
    """e.g. ``llvm-znver5-2c``: kind, CPU or arch, cores (of a target description)."""
    cpu = str(target.get("mcpu", target.get("arch", "generic")))
    cores = f"-{int(target['num-cores'])}c" if "num-cores" in target else ""
    return f"{target['kind']}-{cpu}{cores}"


def user_logs_dir() -> Path:
    """This user's records: ``tuning_logs`` in the module cache directory
    (``ce_tvm.store.paths.cache_dir``; ``ce-tvm cache clear`` leaves it)."""
    return cache_dir() / "tuning_logs"


# The variables ``tuning_dirs`` follows: its own and ``cache_dir``'s.
_DIRS_ENV = ("CE_TVM_TUNING_LOGS", "CE_TVM_CACHE", "XDG_CACHE_HOME", "HOME")


def tuning_dirs() -> list[Path]:
    """Where records are looked up, first match wins: ``$CE_TVM_TUNING_LOGS``,
    ``user_logs_dir()``, the package's records."""
    return list(_tuning_dirs(tuple(os.environ.get(name) for name in _DIRS_ENV)))


@functools.lru_cache(maxsize=8)
def _tuning_dirs(env: tuple) -> tuple[Path, ...]:
    """``tuning_dirs`` for the values ``env`` of ``_DIRS_ENV`` (the same objects for
    the same values: every kernel call looks records up, and paths cost microseconds)."""
    logs = env[0] or ""
    return (*(Path(p) for p in logs.split(os.pathsep) if p), user_logs_dir(), PACKAGE_LOGS)


def default_log_dir() -> Path:
    """Where ``ce-tvm tune`` writes: the first ``$CE_TVM_TUNING_LOGS`` entry, else
    ``user_logs_dir()`` (never the installed package)."""
    return tuning_dirs()[0]


def record_id(target, kernel_name: str, rows: int) -> str:
    """The id (and relative path) of the record of ``kernel_name`` tuned at ``rows`` rows."""
    return f"{target_key(target)}/{kernel_name}-N{rows}"


def record_dir(rid: str) -> Path:
    for root in tuning_dirs():
        if (root / rid / "summary.json").exists():
            return root / rid
    raise FileNotFoundError(f"no tuning record {rid} in {[str(d) for d in tuning_dirs()]}")


def record_digest(rid: str) -> str:
    """Hash of a record's files (part of the module cache key)."""
    h = hashlib.sha256()
    for path in sorted(record_dir(rid).glob("*.json")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def fixed_rows(func, rows: int):
    """``func`` with N bound to ``rows`` and its scalar arguments to ``TUNING_SCALARS``:
    the function a record was tuned on."""
    import tvm

    from ..kernels.common import matrix_param

    x = matrix_param(func)
    shape = (tvm.tirx.IntImm("int64", rows), x.shape[1])
    binds = {x: tvm.tirx.decl_buffer(shape, x.dtype, x.name)}
    binds.update({p: tvm.tirx.const(TUNING_SCALARS[p.name], str(p.ty))
                  for p in func.params if not hasattr(p, "shape")})
    return func.specialize(binds).with_attr("global_symbol", "main")


def summaries(key: str, kernel_name: str = "", dirs=None) -> list[tuple[Path, dict]]:
    """``(record directory, summary)`` of every record of target key ``key``
    (of ``kernel_name`` only, if given) in ``dirs`` (``tuning_dirs()``); a
    record id found in several directories is the first one's."""
    seen, out = set(), []
    for root in tuning_dirs() if dirs is None else dirs:
        for summary in sorted((root / key).glob(f"{kernel_name or '*'}-N*/summary.json")):
            if summary.parent.name not in seen:
                seen.add(summary.parent.name)
                out.append((summary.parent, json.loads(summary.read_text())))
    return out


def applies(summary: dict) -> bool:
    """Whether a record is used: its best candidate (``best_ms``; ``tuned_ms`` in
    records written before the knob search) beat the hand schedule by
    ``MIN_SPEEDUP`` when both were measured."""
    best = summary.get("best_ms", summary["tuned_ms"])
    return bool(summary["applied"]) and summary["hand_ms"] >= MIN_SPEEDUP * best


@functools.cache
def _applicable(key: str, kernel_name: str, dirs: tuple) -> tuple:
    """``(rows, record id, digest)`` of the records in ``dirs`` that beat the hand schedule."""
    return tuple((int(data["rows"]), f"{key}/{path.name}", record_digest(f"{key}/{path.name}"))
                 for path, data in summaries(key, kernel_name, dirs) if applies(data))


def applicable(target: dict, kernel_name: str) -> tuple:
    """``(rows, record id, digest)`` of every record of ``kernel_name`` that applies."""
    return _applicable(target_key(target), kernel_name, tuple(tuning_dirs()))


def nearest_record(target: dict, kernel_name: str, rows: int) -> tuple[str, str] | None:
    """``(record id, digest)`` of the applicable record nearest to ``rows`` rows, or ``None``."""
    found = applicable(target, kernel_name)
    if not found:
        return None
    _, rid, digest = min(found, key=lambda r: abs(math.log2(r[0]) - math.log2(max(rows, 1))))
    return rid, digest


def record_knobs(rid: str) -> dict:
    """The winning knobs of record ``rid`` (``{}`` for a record without them)."""
    return json.loads((record_dir(rid) / "summary.json").read_text()).get("knobs", {})


def record_stage(rid: str) -> bool | None:
    """Whether record ``rid``'s compute staged its chunks (its summary's ``stage``;
    ``None``: the summary does not say, the schedule decides)."""
    return json.loads((record_dir(rid) / "summary.json").read_text()).get("stage")


def forget() -> None:
    """Drop what ``nearest_record`` has read (after a record was written)."""
    _applicable.cache_clear()


def apply_record(rid: str, func, target):
    """Replay the record's best trace on ``func`` (symbolic N); the scheduled PrimFunc.

    The trace is the fastest valid one measured on this kernel's fixed-N
    function, as meta_schedule's ``query_tuning_record`` picks it; the
    function is identified by its structural hash (a record directory holds
    the records of one kernel, so the hash alone tells it apart).
    """
    import tvm
    import tvm_ffi
    from tvm import s_tir

    directory = record_dir(rid)
    rows = json.loads((directory / "summary.json").read_text())["rows"]
    workload = str(tvm_ffi.structural_hash(tvm.IRModule({"main": fixed_rows(func, rows)})))
    workloads = [json.loads(line)[0] for line in _lines(directory / "database_workload.json")]
    best = None
    for line in _lines(directory / "database_tuning_record.json"):
        index, (trace, run_secs, *_) = json.loads(line)
        if workloads[index] != workload or not run_secs or min(run_secs) >= _FAILED_RUN_S:
            continue
        mean = sum(run_secs) / len(run_secs)
        if best is None or mean < best[0]:
            best = (mean, trace)
    if best is None:
        raise RuntimeError(f"tuning record {rid} has no entry for this kernel")
    sch = s_tir.Schedule(func)
    s_tir.Trace.apply_json_to_schedule(best[1], sch)
    return sch.mod["main"]


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]
