"""How the benchmarks measure: time, interleaved rep by rep, and peak memory.

``interleaved_ms``: the best of several reps of each method, timed in turn
within every rep (this machine's bandwidth swings between runs, so only
ratios within one run mean much), with a pause after each call
(``SETTLE_S``) so that what one call leaves to the machine is not timed in the
next one.

Peak memory of a piece of code, from the process's RSS high-water mark
(Linux): ``with PeakRSS() as peak: step()``, then ``peak.mb`` is how far the
RSS rose above its value at entry, at its highest, in MB. Entering resets the
high-water mark (``/proc/self/clear_refs``). ``in_fresh_processes`` runs a
benchmark's ``peak_child`` once per method, each in a new process.
``write_report``: the result, printed and kept as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

# A call that frees gigabytes (eager's gradient and log-softmax) leaves the
# machine busy after it returns: on these 2-core VMs the call after it ran up to
# twice as long (a 1.6 GB copy: 104 -> 208 ms after eager's step at 8192 x 50257,
# with no page fault of its own), and the copy floor, timed after eager, came
# out slow. A pause after every call, as long as the call but at most this,
# keeps one method's aftermath out of the next one's time.
SETTLE_S = 0.25


def interleaved_ms(fns: dict, reps: int = 5, warmup: int = 1,
                   settle_s: float = SETTLE_S) -> dict:
    """Best milliseconds of each callable, timed in turn within every rep, each
    call followed by a pause of its own duration, at most ``settle_s``."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            best[name] = min(best[name], elapsed)
            time.sleep(min(settle_s, elapsed))
    return {name: t * 1e3 for name, t in best.items()}


def _vm_kb(field_name: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return float(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


class PeakRSS:
    """RSS high-water mark inside a ``with`` block, in MB above the RSS at entry."""

    mb: float = float("nan")

    def __enter__(self) -> PeakRSS:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self._before_kb = _vm_kb("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.mb = (_vm_kb("VmHWM") - self._before_kb) / 1024


# A child's allocator returns freed blocks at once (so the RSS follows the
# live memory) and ce_tvm's buffer pool keeps nothing (its buffers count).
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "CE_TVM_POOL_BYTES": "0"}


def in_fresh_processes(module: str, methods, *args) -> dict:
    """``{method: MB}``: ``module.peak_child(method, *args)`` (which returns the
    extra peak in MB) run in a fresh Python process per method; NaN for a
    method whose process failed."""
    peaks = {}
    for method in methods:
        code = (f"import warnings; warnings.simplefilter('ignore'); "
                f"from {module} import peak_child; "
                f"print(peak_child({', '.join(map(repr, (method, *args)))}))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, **CHILD_ENV})
        peaks[method] = float(done.stdout.split()[-1]) if done.returncode == 0 else float("nan")
    return peaks


def write_report(report: dict, path: str | None) -> None:
    """Print ``report`` as JSON, and write it to ``path`` when given."""
    print(json.dumps(report, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
