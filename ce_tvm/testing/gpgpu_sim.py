"""The CUDA schedule's kernels as nvcc compiles them, run in GPGPU-Sim on the CPU.

PoCL (``ce_tvm.testing.pocl``) runs the CUDA schedule's TIR re-lowered to
OpenCL. This runs what a GPU would run: TVM's CUDA C from the same build as
the runtime's (``scheduled_func``, the spec's CUDA target and pass config),
compiled by CUDA 13's nvcc for ``sm_86`` and executed as PTX by GPGPU-Sim
(accel-sim's fork with ce-tvm's patch, built by ``benchmarks/gpgpu_sim/build.sh``):
warp shuffles, ``ex2.approx``, bf16 and half conversions, dynamic shared
memory placed after the kernel's static shared memory.

TVM's CUDA runtime cannot load modules under the simulator (its driver calls
are stubs there), so ``Simulator.kernels`` reads the launch plan right after
``SplitHostDevice`` (``pocl.launch_plan``, as the PoCL harness does) and
compiles a host program for it (``host_program``): the program reads its
buffers, launch extents and scalar arguments from files, launches each kernel
with ``<<<>>>`` and writes every buffer back. One program per kernel spec
serves every row count, input and alias.

Two modes: functional (``perf=False``: results, about 10M thread instructions
a second on one core) and the cycle model (``perf=True``: an SM86 config,
about 0.7M a second). Simulated cycles rank designs; they are not a GPU's
timing. What the simulator cannot show (timing, the SFU's real approximation
error: ``ex2.approx`` is computed exactly here, races its scheduling hides) is
in docs/targets.md.

``Simulator.find()`` takes the build from ``$CE_TVM_GPGPU_SIM`` (or
``$GSIM``); ``unavailable()`` says why none can run. ``selfcheck`` (``python
-m ce_tvm.testing.gpgpu_sim selfcheck``) runs ``gpgpu_sim_checks``' micro-programs,
which pin down the semantics the patch fixes.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm

from ..compiler.build import pass_config, scheduled_func
from ..store.spec import KernelSpec
from . import pocl

COMMIT = "667834cfe5214523edd7769aeab77f91b7137686"  # accel-sim/gpgpu-sim_distribution, dev
CONFIG = "SM86_RTX3070"  # the simulated GPU (configs/tested-cfgs)
COMPILE_ARCH = "sm_86"  # nvcc -arch: the simulated GPU's, whatever arch a schedule targets
# Shared memory a block may opt in to: sm_90's 227 KB, so that every schedule's
# staging fits (the log_prob forward stages up to 112 KB on sm_90).
SHARED_PER_BLOCK = 227 * 1024
STATIC_SHARED_LIMIT = 48 * 1024  # above it a kernel opts in (cudaFuncSetAttribute)

CTYPES = {"float32": "float", "float16": "half", "bfloat16": "nv_bfloat16",
          "float64": "double", "int32": "int", "int64": "int64_t"}


class SimulatorError(RuntimeError):
    """The simulator or the program it ran failed (the log's tail in the message)."""


@dataclass
class SimRun:
    """What one simulated program run reports: thread instructions executed, and
    per kernel launch ``(kernel, cycles)`` (the cycle model's; 0 in functional mode)."""

    log: str
    instructions: int
    cycles: list
    seconds: float


def build(spec: KernelSpec) -> pocl.Kernels:
    """The CUDA build of ``spec``: TVM's CUDA C and the host's launch plan."""
    if spec.target != "cuda":
        raise ValueError(f"the simulator runs the CUDA schedule, not {spec.target!r}")
    grab = tvm.ir.instrument.pass_instrument(pocl.AfterSplit)()
    with tvm.transform.PassContext(opt_level=3, config=pass_config(spec), instruments=[grab]):
        executable = tvm.compile(scheduled_func(spec), target=spec.tvm_target())
    return pocl.launch_plan(spec, executable.mod.imports[0].inspect_source(), grab.mod)


_PRELUDE = r"""
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#define CE_CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(3); } } while (0)
static FILE *ce_plan;
static long long ce_int() {
  long long v; if (fscanf(ce_plan, "%lld", &v) != 1) { fprintf(stderr, "plan: short\n"); exit(2); }
  return v; }
static double ce_float() {
  char s[64]; if (fscanf(ce_plan, "%63s", s) != 1) { fprintf(stderr, "plan: short\n"); exit(2); }
  return strtod(s, 0); }
static void *ce_dev[64], *ce_host[64];
static long long ce_bytes[64], ce_alias[64];
// "alias bytes" per buffer (alias: another buffer's index, or -1 for its own memory,
// read from in<i>.bin); aliases resolved after every owner is allocated.
static void ce_buffers(int n) {
  for (int i = 0; i < n; ++i) { ce_alias[i] = ce_int(); ce_bytes[i] = ce_int(); }
  for (int i = 0; i < n; ++i) {
    if (ce_alias[i] >= 0) continue;
    ce_host[i] = malloc(ce_bytes[i] ? ce_bytes[i] : 1);
    char f[32]; snprintf(f, sizeof f, "in%d.bin", i); FILE *F = fopen(f, "rb");
    if (!F || (long long)fread(ce_host[i], 1, ce_bytes[i], F) != ce_bytes[i]) {
      fprintf(stderr, "short %s\n", f); exit(2); }
    fclose(F);
    CE_CHECK(cudaMalloc(&ce_dev[i], ce_bytes[i] ? ce_bytes[i] : 4));
    CE_CHECK(cudaMemcpy(ce_dev[i], ce_host[i], ce_bytes[i], cudaMemcpyHostToDevice));
  }
  for (int i = 0; i < n; ++i) if (ce_alias[i] >= 0) ce_dev[i] = ce_dev[ce_alias[i]];
}
struct ce_launch { dim3 grid, block; size_t shared; };
static ce_launch ce_next() {
  ce_launch l; l.grid.x = ce_int(); l.grid.y = ce_int(); l.grid.z = ce_int();
  l.block.x = ce_int(); l.block.y = ce_int(); l.block.z = ce_int(); l.shared = ce_int();
  return l; }
static void ce_finish(const char *kernel) {
  CE_CHECK(cudaGetLastError()); CE_CHECK(cudaDeviceSynchronize());
  fprintf(stderr, "ran %s\n", kernel); }
static void ce_write_back(int n) {
  for (int i = 0; i < n; ++i) {
    if (ce_alias[i] >= 0) continue;
    CE_CHECK(cudaMemcpy(ce_host[i], ce_dev[i], ce_bytes[i], cudaMemcpyDeviceToHost));
    char f[32]; snprintf(f, sizeof f, "out%d.bin", i); FILE *F = fopen(f, "wb");
    fwrite(ce_host[i], 1, ce_bytes[i], F); fclose(F);
  }
}
"""


def host_program(kernels: pocl.Kernels) -> str:
    """``kernels``' CUDA source with a ``main`` that runs its launch plan, reading
    ``plan.txt`` (``Simulator.run`` writes it): per buffer ``alias bytes``, then per
    launch its grid, block, dynamic shared bytes and scalar arguments."""
    buffers = [p.name for p in kernels.buffers()]
    index = {name: i for i, name in enumerate(buffers)}
    lines = [kernels.source, _PRELUDE, "int main() {",
             '  ce_plan = fopen("plan.txt", "r"); if (!ce_plan) return 2;',
             f"  ce_buffers({len(buffers)});"]
    for launch in kernels.launches:
        reads, args = [], []
        for arg in launch.args:
            if arg[0] == "buffer":
                args.append(f"({CTYPES[kernels.param(arg[1]).dtype]} *)ce_dev[{index[arg[1]]}]")
                continue
            dtype = arg[2]
            if dtype not in CTYPES:
                raise NotImplementedError(f"{launch.kernel}: a {dtype} scalar argument")
            read = "ce_float()" if dtype.startswith("float") else "ce_int()"
            reads.append(f"{CTYPES[dtype]} s{len(reads)} = ({CTYPES[dtype]}){read};")
            args.append(f"s{len(reads) - 1}")
        kernel = launch.kernel
        lines += [
            f"  {{ ce_launch l = ce_next(); {' '.join(reads)}",
            f"    if (l.shared > {STATIC_SHARED_LIMIT}) CE_CHECK(cudaFuncSetAttribute("
            f"(const void *){kernel},",
            "      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)l.shared));",
            f"    {kernel}<<<l.grid, l.block, l.shared>>>({', '.join(args)});",
            f'    ce_finish("{kernel}"); }}']
    lines += [f"  ce_write_back({len(buffers)});", '  printf("CE_HOST_DONE\\n");',
              "  return 0;", "}"]
    return "\n".join(lines) + "\n"


def _plan_text(kernels: pocl.Kernels, values: dict, sizes: list, aliases: dict) -> str:
    buffers = [p.name for p in kernels.buffers()]
    words = []
    for name, size in zip(buffers, sizes):
        words.append(f"{buffers.index(aliases[name]) if name in aliases else -1} {size}")
    for launch in kernels.launches:
        extents = [int(kernels.evaluate(e, values)) for e in (*launch.grid, *launch.block)]
        extents.append(int(kernels.evaluate(launch.shared, values)))
        for arg in launch.args:
            if arg[0] == "scalar":
                v = kernels.evaluate(arg[1], values)
                extents.append(float(v).hex() if arg[2].startswith("float") else int(v))
        words.append(" ".join(str(e) for e in extents))
    return "\n".join(words) + "\n"


# The simulated floor: one kernel that reads ``reads`` bytes and writes ``writes`` bytes
# (16-byte loads and stores, grid-stride, 8 blocks of 256 threads per SM of the
# 46-SM config): a read for a forward, a copy for a gradient.
_COPY_FLOOR = r"""
#include <cstdio>
#include <cstdlib>
__global__ void move(const uint4 *src, long long reads, uint4 *dst, long long writes,
                     unsigned *sink) {
  long long n = reads > writes ? reads : writes, step = (long long)gridDim.x * blockDim.x;
  unsigned acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step) {
    uint4 v = make_uint4(i, i, i, i);
    if (i < reads) { v = src[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (i < writes) dst[i] = v;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads
}
int main(int argc, char **argv) {
  long long reads = atoll(argv[1]) / 16, writes = atoll(argv[2]) / 16;
  uint4 *src, *dst; unsigned *sink;
  cudaMalloc(&src, reads * 16 + 16); cudaMalloc(&dst, writes * 16 + 16); cudaMalloc(&sink, 4);
  move<<<46 * 8, 256>>>(src, reads, dst, writes, sink);
  if (cudaDeviceSynchronize() != cudaSuccess) return 3;
  printf("CE_CHECK_DONE\n"); return 0; }
"""


# running totals of thread instructions: functional mode's, the cycle model's
_INSTRUCTIONS = re.compile(r"Done functional simulation \((\d+) instructions|"
                           r"^gpu_tot_sim_insn = (\d+)$", re.M)
_KERNEL = re.compile(r"^kernel_name = (\S+)\s*$", re.M)
_CYCLES = re.compile(r"^gpu_sim_cycle = (\d+)$", re.M)


class Simulator:
    """A GPGPU-Sim build (``root``: ``build.sh``'s ``$GSIM``) running CUDA programs
    in ``config``, functional or (``perf``) in the cycle model."""

    def __init__(self, root: Path, perf: bool = False, config: str = CONFIG,
                 launch_latency: int | None = None):
        self.root, self.perf, self.config = Path(root), perf, config
        self.launch_latency = launch_latency  # cycles; None: the config's
        self.cuda13 = Path((self.root / "cuda13").read_text().strip())
        libs = sorted(self.root.glob("gpgpu-sim/lib/*/*/release/libcudart.so"))
        if not libs:
            raise FileNotFoundError(f"no simulator library under {self.root}/gpgpu-sim/lib")
        self.lib = libs[0].parent
        self.instructions: int | None = None  # of the last run
        self.last: SimRun | None = None
        self._built: dict = {}

    @classmethod
    def find(cls, root: str | Path | None = None, **kwargs) -> Simulator:
        """The build at ``root``, ``$CE_TVM_GPGPU_SIM`` or ``$GSIM``."""
        root = root or os.environ.get("CE_TVM_GPGPU_SIM") or os.environ.get("GSIM")
        if not root:
            raise FileNotFoundError("no simulator: set CE_TVM_GPGPU_SIM to the folder "
                                    "benchmarks/gpgpu_sim/build.sh built it in")
        return cls(Path(root), **kwargs)

    @property
    def name(self) -> str:
        mode = "cycle model" if self.perf else "functional"
        return f"GPGPU-Sim {COMMIT[:8]}+ce-tvm, {self.config}, {mode}, nvcc -arch={COMPILE_ARCH}"

    # --- programs ---------------------------------------------------------------

    def compile(self, source: str, name: str = "program") -> Path:
        """``source`` (CUDA C++ with a ``main``) built for the simulator, once per source."""
        key = hashlib.sha256(f"{COMPILE_ARCH}\n{source}".encode()).hexdigest()[:20]
        folder = self.root / "programs" / key
        exe = folder / name
        if exe.exists():
            return exe
        folder.mkdir(parents=True, exist_ok=True)
        # every name this process writes is its own: runs in parallel may build the same
        # program at once, and one may be running it when another's build finishes
        cu = folder / f".{name}.{os.getpid()}.cu"
        cu.write_text(source)
        tmp = folder / f".{name}.{os.getpid()}.tmp"
        cuda11 = self.root / "cuda11" / "lib64"
        # CUDA 13's launch stubs mapped onto cudaLaunchKernel; the cu11 runtime's soname,
        # which the simulator's libcudart replaces (LD_LIBRARY_PATH) and accepts.
        command = [str(self.cuda13 / "bin" / "nvcc"), "-cudart", "none", f"-arch={COMPILE_ARCH}",
                   "-O3", "-w", str(cu), str(self.root / "cuda13_launch_shim.cpp"),
                   f"-L{cuda11}", "-l:libcudart.so.11.0", "-Xlinker", f"-rpath={cuda11}",
                   "-o", str(tmp)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SimulatorError(f"nvcc failed for {cu}:\n{done.stderr[-3000:]}")
        try:  # the first build stays: the simulator reads (md5sum) the program it runs
            os.link(tmp, exe)
        except FileExistsError:
            pass
        tmp.unlink()
        cu.unlink()
        (folder / f"{name}.cu").write_text(source)
        return exe

    def _config(self, folder: Path) -> None:
        source = self.root / "gpgpu-sim" / "configs" / "tested-cfgs" / self.config
        for f in source.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        text = (folder / "gpgpusim.config").read_text()
        # The SM86 config lists 5 integer latencies; the simulator reads a 6th (shuffles).
        text = re.sub(r"^(-ptx_opcode_(?:latency|initiation)_int \d+(?:,\d+){4})$",
                      lambda m: m.group(1) + (",4" if "latency" in m.group(1) else ",2"),
                      text, flags=re.M)
        text = re.sub(r"^-gpgpu_shmem_per_block \d+$",
                      f"-gpgpu_shmem_per_block {SHARED_PER_BLOCK}", text, flags=re.M)
        if not self.perf:  # functional: one block's staging may exceed the SM86 carve-out
            for key in ("gpgpu_shmem_size", "gpgpu_shmem_sizeDefault"):
                text = re.sub(rf"^-{key} \d+$", f"-{key} {SHARED_PER_BLOCK + 1024}",
                              text, flags=re.M)
        if self.launch_latency is not None:
            text = re.sub(r"^-gpgpu_kernel_launch_latency \d+$",
                          f"-gpgpu_kernel_launch_latency {self.launch_latency}", text, flags=re.M)
        text = re.sub(r"^-gpgpu_ptx_sim_mode \d+$", "", text, flags=re.M)
        text += f"\n-gpgpu_ptx_sim_mode {0 if self.perf else 1}\n"
        (folder / "gpgpusim.config").write_text(text)

    def execute(self, exe: Path, folder: Path, args: tuple = (),
                timeout: float | None = None, ptx: str | None = None) -> SimRun:
        """Run ``exe args`` in ``folder`` (its inputs there) under the simulator.
        ``ptx``: PTX text that replaces the program's own device code (a peer's
        kernel, Triton's say, launched through a program declaring its signature)."""
        self._config(folder)
        cuda11 = self.root / "cuda11"
        env = {**os.environ, "CUDA_INSTALL_PATH": str(cuda11),
               "PTXAS_CUDA_INSTALL_PATH": str(cuda11),  # the ptxas whose report it parses
               "LD_LIBRARY_PATH": str(self.lib),
               # as setup_environment sets them: PTX taken from cuobjdump -xptx files
               "PTX_SIM_USE_PTX_FILE": "1.ptx", "PTX_SIM_KERNELFILE": "_1.ptx",
               "CUOBJDUMP_SIM_FILE": "jj"}
        if ptx is not None:  # the cuobjdump wrapper puts it in place of what it extracts
            (folder / "peer.ptx").write_text(ptx)
            env["CE_GSIM_PTX"] = str(folder / "peer.ptx")
        start = time.perf_counter()
        done = subprocess.run([str(exe), *args], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=timeout)
        seconds = time.perf_counter() - start
        log = done.stdout + "\n--- stderr ---\n" + done.stderr
        if done.returncode or "CE_HOST_DONE" not in done.stdout and "CE_CHECK_DONE" not in \
                done.stdout:
            kept = self.root / "failed" / f"{exe.parent.name}-{os.getpid()}-{time.time_ns()}.log"
            kept.parent.mkdir(exist_ok=True)
            kept.write_text(log)
            tail = "\n".join(line for line in log.splitlines()[-40:])
            raise SimulatorError(f"{exe.name} failed under the simulator (rc "
                                 f"{done.returncode}; log {kept}):\n{tail}")
        names = _KERNEL.findall(done.stdout)
        cycles = [int(c) for c in _CYCLES.findall(done.stdout)] if self.perf else []
        totals = [int(a or b) for a, b in _INSTRUCTIONS.findall(done.stdout)]
        run = SimRun(log, totals[-1] if totals else 0, list(zip(names, cycles)), seconds)
        self.instructions, self.last = run.instructions, run
        return run

    def copy_floor(self, reads: int, writes: int) -> int:
        """Cycles of the floor kernel moving ``reads`` and ``writes`` bytes (``_COPY_FLOOR``;
        the cycle model's, summed over its launch)."""
        exe = self.compile(_COPY_FLOOR, "floor")
        work = self.root / "run"
        work.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            run = self.execute(exe, Path(tmp), args=(str(reads), str(writes)))
        return sum(cycles for _, cycles in run.cycles)

    # --- the launch plan of a kernel spec, as cuda_cases runs it ------------------

    def kernels(self, spec: KernelSpec) -> pocl.Kernels:
        """``build(spec)`` and its host program, once per spec."""
        if spec not in self._built:
            kernels = build(spec)
            self._built[spec] = (kernels, self.compile(host_program(kernels), "host"))
        return self._built[spec][0]

    def run(self, kernels: pocl.Kernels, rows: int, arrays: dict, scalars: dict,
            aliases: dict | None = None) -> dict:
        """``pocl.PoCL.run``'s contract, in the simulator: buffers not given start
        as NaN (all bits set for integers); returns every buffer by name."""
        aliases = aliases or {}
        exe = self._built[kernels.spec][1]
        values = {"N": rows, **scalars}
        work = self.root / "run"
        work.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            folder = Path(tmp)
            host, sizes = {}, []
            for i, p in enumerate(kernels.buffers()):
                shape = tuple(int(kernels.evaluate(d, values)) for d in p.shape)
                if p.name in aliases:
                    sizes.append(0)
                    continue
                if p.name in arrays:
                    data = np.ascontiguousarray(arrays[p.name], dtype=pocl.NUMPY_DTYPES[p.dtype])
                    if data.shape != shape:
                        raise ValueError(f"{p.name}: shape {data.shape}, the kernel takes {shape}")
                else:
                    data = pocl.poison(shape, p.dtype)
                host[p.name] = (i, data)
                sizes.append(data.nbytes)
                (folder / f"in{i}.bin").write_bytes(data.tobytes())
            (folder / "plan.txt").write_text(_plan_text(kernels, values, sizes, aliases))
            self.execute(exe, folder)
            out = {name: np.frombuffer((folder / f"out{i}.bin").read_bytes(), data.dtype)
                   .reshape(data.shape).copy() for name, (i, data) in host.items()}
        return {**out, **{alias: out[target] for alias, target in aliases.items()}}


def unavailable(root: str | Path | None = None) -> str | None:
    """Why no simulator can run here (``None`` when one can)."""
    try:
        sim = Simulator.find(root)
    except (OSError, ValueError) as err:
        return f"GPGPU-Sim is not built: {err} (benchmarks/gpgpu_sim/build.sh builds it)"
    if not (sim.cuda13 / "bin" / "nvcc").exists():
        return f"no nvcc at {sim.cuda13}/bin"
    return None


def main(argv: list | None = None) -> int:
    """``selfcheck``: the micro-programs of ``gpgpu_sim_checks`` against their answers."""
    from . import gpgpu_sim_checks

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["selfcheck"]:
        print("usage: python -m ce_tvm.testing.gpgpu_sim selfcheck", file=sys.stderr)
        return 2
    reason = unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    failed = 0
    for check in gpgpu_sim_checks.run_all(Simulator.find()):
        print(f"{'ok  ' if check.passed else 'FAIL'} {check.name}: {check.detail}")
        failed += not check.passed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
