"""Peak memory of a piece of code, from the process's RSS high-water mark (Linux).

The benchmarks measure one training step per fresh process with it:
``with PeakRSS() as peak: step()``, then ``peak.mb`` is how far the RSS rose
above its value at entry, at its highest, in MB. Entering resets the
high-water mark (``/proc/self/clear_refs``).
"""

from __future__ import annotations


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
