"""Import time and peak RSS of ``import torch`` alone vs ``import ce_tvm`` plus a first
forward+backward served from the module cache, each in fresh processes, interleaved.

    python benchmarks/import_cost.py [--reps 5]
"""

import argparse
import subprocess
import sys

TORCH = """
import resource, sys, time
t = time.perf_counter()
import torch
mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{time.perf_counter() - t:.3f} {mb:.0f}")
"""
FIRST_CALL = """
import resource, sys, time
t = time.perf_counter()
import torch, ce_tvm
x = torch.randn(64, 32000, requires_grad=True); y = torch.randint(0, 32000, (64,))
ce_tvm.cross_entropy(x, y).backward()
mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
s = time.perf_counter() - t
print(f"{s:.3f} {mb:.0f}", "tvm" in sys.modules, "torch._dynamo" in sys.modules)
"""


def run(code: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    reps = parser.parse_args().reps
    run(FIRST_CALL)  # builds (or verifies) the kernels once
    torch_s, torch_mb, call_s, call_mb = [], [], [], []
    for _ in range(reps):
        s, mb = run(TORCH)
        torch_s.append(float(s))
        torch_mb.append(float(mb))
        s, mb, tvm, dynamo = run(FIRST_CALL)
        call_s.append(float(s))
        call_mb.append(float(mb))
    print(f"import torch:                      {min(torch_s):.2f} s  {min(torch_mb):.0f} MB")
    print(f"import torch, ce_tvm + first call: {min(call_s):.2f} s  {min(call_mb):.0f} MB  "
          f"(tvm imported: {tvm}, torch._dynamo imported: {dynamo})")
    print(f"over torch alone:                  {min(call_s) - min(torch_s):.2f} s  "
          f"{min(call_mb) - min(torch_mb):.0f} MB   (min of {reps} runs each)")


if __name__ == "__main__":
    main()
