"""Re-key tuning records to the current compute, for records of a CPU this
machine is not (whose searches cannot be rerun here).

A record's trace is replayed only on the function whose structural hash it
was tuned on (``ce_tvm.store.records.apply_record``), so any change to a kernel's
compute, even one that leaves its blocks and loops alone (a polynomial's
degree, a select), makes the record stale: the build warns and falls back to
the hand schedule. When the trace still replays on the new compute, this
swaps the record's workload (hash and function) for the new one and says so
in its summary (``rekeyed``); its measured times stay those of the old
compute. Where the machine is at hand, rerun the search instead
(``benchmarks/regenerate_tuning_logs.sh``).

    .venv/bin/python benchmarks/rekey_tuning_logs.py [tuning_logs/<key> ...]
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
from pathlib import Path

import tvm
import tvm_ffi
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

from ce_tvm.compiler import build
from ce_tvm.store import records
from ce_tvm.tools.cli import record_spec


def current_workload(summary: dict) -> tvm.IRModule:
    """The function the record's kernel is tuned on, from today's compute."""
    spec = record_spec(summary["kernel"])
    func = build.declared_func(spec, summary.get("knobs", {}).get("chunk"))
    return tvm.IRModule({"main": records.fixed_rows(func, summary["rows"])})


def rekey(directory: Path, note: str) -> bool:
    """Re-key one record if stale; whether it was. Raises if its trace no longer replays."""
    summary = json.loads((directory / "summary.json").read_text())
    mod = current_workload(summary)
    workloads = (directory / "database_workload.json").read_text().splitlines()
    if len(workloads) != 1:
        raise ValueError(f"{directory}: expected one workload, found {len(workloads)}")
    if json.loads(workloads[0])[0] == str(tvm_ffi.structural_hash(mod)):
        return False
    trace = json.loads((directory / "database_tuning_record.json").read_text().splitlines()[0])
    s_tir.Trace.apply_json_to_schedule(trace[1][0], s_tir.Schedule(mod["main"]))
    with tempfile.TemporaryDirectory() as tmp:
        ms.database.JSONDatabase(work_dir=tmp).commit_workload(mod)
        (directory / "database_workload.json").write_text(
            (Path(tmp) / "database_workload.json").read_text())
    summary["rekeyed"] = note
    (directory / "summary.json").write_text(json.dumps(summary, indent=1))
    return True


def main(roots: list[str]) -> int:
    note = (f"workload re-keyed on {datetime.date.today()} to the compute of that day; the "
            "trace replays unchanged; its times were measured on the compute it was tuned on")
    for root in roots or ["tuning_logs"]:
        for summary in sorted(Path(root).glob("**/summary.json")):
            print(f"{'re-keyed' if rekey(summary.parent, note) else 'current '}  {summary.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
