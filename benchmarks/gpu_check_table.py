"""The timings of a GPU check (``benchmarks/gpu_check.py --json``) as Markdown
tables: per row, each method's milliseconds, its bandwidth counted at the
floor's bytes, the floor's time over its time, the peers' times over
ce-tvm's (above 1: ce-tvm is faster) and, from runs that measured it, its
extra peak memory (``gpu_check.extra_peak_mib``: beyond its inputs).

    python benchmarks/gpu_check_table.py gpu_check.jsonl [...]

Floors: ``copy`` (one read and one write of the logits: the training step and
the log-probs' step), ``gemm3`` / ``gemm`` (the fused heads' GEMMs alone);
``read`` (one read of the logits, a forward's floor) is listed beside them.
Several files: one table each, in order, then what the run decides: the
one-pass training kernel against the recompute path, and each of ce-tvm's
methods against its runs with other knobs of the CUDA schedule
(``"one_pass threads=512"``: ``gpu_check.py``'s ``KNOB_VARIANTS``).
"""

from __future__ import annotations

import argparse
import json

BYTES = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4}
OURS = ("ce_tvm", "ce_tvm_async_check", "ce_tvm_sync_check", "one_pass", "one_pass_scaled",
        "recompute", "forward", "backward", "both")
OTHER_FLOORS = ("read",)  # shown beside the row's own floor
PEERS = ("liger", "trl", "eager", "compile")


def _ours(method: str) -> bool:
    """A method of ce-tvm's, also with knobs of the CUDA schedule (``"one_pass threads=512"``)."""
    return method.split(" ")[0] in OURS


def timing_rows(path: str) -> list[dict]:
    """The timed rows of one check's JSON lines (those with ``ms`` and a floor)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "ms" in r and r.get("over") in ("copy", "gemm3", "gemm")]


def _floor_gbps(row: dict, ms: float) -> str:
    """The copy floor's bytes (read + write of the logits) over ``ms``, GB/s."""
    if row["over"] != "copy":
        return ""
    return f"{2 * row['n'] * row['c'] * BYTES[row['dtype']] / ms / 1e6:.0f}"


def _mib(peaks: dict, method: str) -> str:
    """``method``'s extra peak MiB, or nothing where the run did not measure it."""
    return f"{peaks[method]:.0f}" if method in peaks else ""


def table(rows: list[dict]) -> str:
    """One Markdown table of ``timing_rows``."""
    out = ["| case | method | ms | GB/s at the floor's bytes | floor / method "
           "| liger / method | trl / method | eager / method | compile / method "
           "| extra peak MiB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ms, peaks = row["ms"], row.get("peak_mib", {})
        floor = ms[row["over"]]
        for name in [m for m in ms if _ours(m) or m in OTHER_FLOORS] + [row["over"]]:
            t = ms[name]
            peers = [f"{ms[p] / t:.2f}" if p in ms and _ours(name) else "" for p in PEERS]
            case = row["case"].replace("torch.", "")
            out.append(f"| {case} | {name} | {t:.3f} | {_floor_gbps(row, t)} | "
                       f"{floor / t:.2f} | " + " | ".join(peers) + f" | {_mib(peaks, name)} |")
        for peer in [p for p in PEERS if p in ms]:
            out.append(f"| | {peer} | {ms[peer]:.3f} | {_floor_gbps(row, ms[peer])} | "
                       f"{floor / ms[peer]:.2f} | | | | | {_mib(peaks, peer)} |")
    return "\n".join(out)


def decisions(rows: list[dict]) -> str:
    """What a check's ``timing_rows`` settle, one line each: per row with both, the
    one-pass training kernel against the recompute path; per method of ce-tvm's
    timed with other knobs, each knob variant's time over the method's and the
    fastest of them all."""
    out = []
    for row in rows:
        ms, case = row["ms"], row["case"].replace("torch.", "")
        if "one_pass" in ms and "recompute" in ms:
            speedup = ms["recompute"] / ms["one_pass"]
            out.append(f"- {case}: one_pass {ms['one_pass']:.3f} ms, recompute "
                       f"{ms['recompute']:.3f} ms: "
                       + (f"the one-pass kernel {speedup:.2f}x faster" if speedup > 1
                          else f"the recompute path {1 / speedup:.2f}x faster" if speedup < 1
                          else "the same time"))
        for method in [m for m in ms if _ours(m) and " " not in m]:
            knobbed = {m.split(" ", 1)[1]: t for m, t in ms.items() if m.startswith(method + " ")}
            if knobbed:
                fastest = min(knobbed, key=knobbed.get)
                out.append(f"- {case}: {method} {ms[method]:.3f} ms; " + ", ".join(
                    f"{k} {t:.3f} ms ({ms[method] / t:.2f}x)" for k, t in knobbed.items())
                    + "; fastest: " + (fastest if knobbed[fastest] < ms[method]
                                       else "the schedule's own knobs"))
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="gpu_check.py --json files")
    args = p.parse_args(argv)
    for path in args.files:
        rows = timing_rows(path)
        print(f"{path}:\n\n{table(rows)}\n\nWhat it decides:\n\n{decisions(rows)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
