"""Re-key tuning records to the current compute, for records of a CPU this
machine is not (whose searches cannot be rerun here).

A record's trace is replayed only on the function whose structural hash it
was tuned on (``ce_tvm.store.records.apply_record``), so any change to a kernel's
compute, even one that leaves its blocks and loops alone (a polynomial's
degree, a select), makes the record stale: the build then schedules the
kernel by the record's knobs (``build.scheduled_func``). When the trace still
replays on the new compute, this swaps the record's workload (hash and
function) for the new one and says so in its summary (``rekeyed``); its
measured times stay those of the old compute. ``--by-knobs NOTE`` instead
leaves the workload as it is and writes ``NOTE`` into the summary
(``by_knobs``): for a compute whose new blocks the trace would leave
unscheduled, the record's knobs schedule it. Where the machine is at hand,
rerun the search instead (``benchmarks/regenerate_tuning_logs.sh``).

    .venv/bin/python benchmarks/rekey_tuning_logs.py [--by-knobs NOTE] [tuning_logs/<key> ...]
"""

from __future__ import annotations

import argparse
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
from ce_tvm.store.files import copy_file, write_file
from ce_tvm.tools.cli import record_cross_spec


def current_workload(directory: Path) -> tvm.IRModule:
    """The function the record's kernel is tuned on, from today's compute for
    the record's CPU."""
    spec = record_cross_spec(directory)
    summary = json.loads((directory / "summary.json").read_text())
    func = build.declared_func(spec, summary.get("knobs", {}).get("chunk"))
    return tvm.IRModule({"main": records.fixed_rows(func, summary["rows"])})


def rekey(directory: Path, note: str, by_knobs: bool = False) -> bool:
    """Re-key one record if stale (``by_knobs``: mark it instead); whether it was.
    Raises if its trace no longer replays (``by_knobs``: if it has no knobs)."""
    summary = json.loads((directory / "summary.json").read_text())
    mod = current_workload(directory)
    workloads = (directory / "database_workload.json").read_text().splitlines()
    if len(workloads) != 1:
        raise ValueError(f"{directory}: expected one workload, found {len(workloads)}")
    if json.loads(workloads[0])[0] == str(tvm_ffi.structural_hash(mod)):
        return False
    if by_knobs:
        if not summary.get("knobs"):
            raise ValueError(f"{directory}: a record without knobs cannot schedule by them")
        summary["by_knobs"] = note
    else:
        trace = json.loads(
            (directory / "database_tuning_record.json").read_text().splitlines()[0])
        s_tir.Trace.apply_json_to_schedule(trace[1][0], s_tir.Schedule(mod["main"]))
        with tempfile.TemporaryDirectory() as tmp:
            ms.database.JSONDatabase(work_dir=tmp).commit_workload(mod)
            copy_file(Path(tmp) / "database_workload.json",
                      directory / "database_workload.json", mode=0o644)
        summary["rekeyed"] = note
    write_file(directory / "summary.json", json.dumps(summary, indent=1).encode(), mode=0o644)
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--by-knobs", metavar="NOTE",
                        help="mark stale records to be scheduled by their knobs, saying why")
    parser.add_argument("roots", nargs="*", default=["tuning_logs"])
    args = parser.parse_args(argv)
    note = args.by_knobs or (
        f"workload re-keyed on {datetime.date.today()} to the compute of that day; the "
        "trace replays unchanged; its times were measured on the compute it was tuned on")
    done = "by knobs" if args.by_knobs else "re-keyed"
    for root in args.roots:
        for summary in sorted(Path(root).glob("**/summary.json")):
            stale = rekey(summary.parent, note, by_knobs=bool(args.by_knobs))
            print(f"{done if stale else 'current '}  {summary.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
