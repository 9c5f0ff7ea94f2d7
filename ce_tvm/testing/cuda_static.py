"""Static evidence for the CUDA kernels, from their machine code (no GPU needed).

For one shape (op, dtype, C, arch) this builds the kernel exactly as the
runtime would (``build.lower_and_compile``), compiles TVM's
CUDA source with ``nvcc -cubin -Xptxas -v`` and the flags TVM's own CUDA build
passes (``nvcc_flags``: fast math among them) and disassembles the cubin with
``nvdisasm`` (pip ``nvidia-cuda-nvdisasm``; or ``cuobjdump -sass``). It prints,
per kernel: registers, shared memory per block, spill bytes (ptxas), and per
element loop: SASS instructions per element, shared loads per element, and
the broadcast shared loads per element (reads of a per-row or per-chunk
scalar that should live in a register).

Method (how element loops are found and counted):

1. A loop is a backward branch: a ``BRA`` whose target label lies at or
   before the branch. Its body is the instruction range [target, branch].
   A span holding an unconditional ``EXIT``/``RET`` is not a loop: it is
   out-of-line code (placed after the kernel's exit) jumping back into the
   body (a predicated ``@!P0 EXIT`` is a loop's exit and stays). Each loop is
   counted on its *own* instructions (its body less the loops nested in it):
   ptxas fully unrolls TVM's short per-thread loops, so a chunk loop's own
   body holds the staging copy, the max and the chunk's reductions, and an
   inner loop the exp-sum. Every element passes once through each element
   loop of its kernel that does not store to global memory, and through one
   of those that do (an element is stored once; ``loop_partition`` splits a
   store loop into parts): a kernel's instructions per element are the sum
   over the first and the costliest of the second.
2. A global access (``LDG``/``STG``) is *streaming* when
   a register in its address (``R``/``UR``) varies between iterations: it is
   written in the loop from a loaded or loop-carried value (a fixed point over
   the body's definitions); otherwise it is *loop-invariant* (e.g. a reduction
   slot at a shared base that ptxas rebuilds from constants every iteration).
   A shared access (``LDS``/``STS``) is streaming when its address holds a
   per-thread register (``R``): a staged chunk is re-read at the same
   addresses every chunk. A shared load whose address is uniform (only ``UR``
   registers and constants) reads one value for the whole block: a broadcast
   of a per-row or per-chunk scalar (``bcast_lds/el``), what a register
   should hold.
3. Elements per iteration: for each streaming kind (LDG, STG, LDS, STS) the
   bytes it moves per iteration divided by the storage dtype's size; the
   smallest of the global kinds and the staging stores when the loop has
   any (a per-chunk scalar read from shared memory at the chunk's index is
   not a stream); in a loop over a row staged before it (no staging stores
   and no global stores in the loop), also the distinct loop-varying
   addresses read off one base register:
   each pass (max, exp-sum, ...) reads the same staged elements, the
   reductions' scratch is read off others. Shared stores count only when they store a value loaded
   in the loop (staging a chunk), not a computed one (reduction scratch).
   Other traffic (float32 weights next to 16-bit logits, partial sums read
   back from shared memory) only adds bytes to a kind, so the minimum is at
   least the true count when one kind carries the elements alone, and the
   instructions per element below are then exact or low (never high: a
   budget failure is real). Loops with no streaming access are not element
   loops (division slow paths, spin loops) and are skipped.
4. Instructions per element = body instructions / elements per iteration
   (static count of one iteration; predicated-off instructions still issue).
   Shared loads per element likewise (``lds/el``: staged elements plus
   broadcasts).

``benchmarks/cuda_static.py`` prints the table for chosen shapes;
``tests/schedules/test_cuda_static.py`` holds the kernels to budgets with it.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import tvm_ffi

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MEMORY_KINDS = ("LDG", "STG", "LDS", "STS")
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_FUNC = re.compile(r"^\s*\.text\.(\S+):")
_REG = re.compile(r"\b(U?R\d+)\b")


@dataclass
class Loop:
    kernel: str
    instructions: int
    elements: float
    lds: int
    broadcast_lds: int
    moved: dict = field(default_factory=dict)  # streaming bytes per iteration by kind

    @property
    def per_element(self) -> float:
        return self.instructions / self.elements


@dataclass
class Kernel:
    name: str
    instructions: int = 0  # static SASS instructions of the whole kernel
    sweeps_rows: bool = False  # takes the [N, C] matrix (x or log_prob)
    registers: int = 0
    smem: int = 0  # static shared memory per block (ptxas)
    dyn_smem: int = 0  # dynamic shared memory per block (a row staged whole)
    spill_bytes: int = 0
    loops: list = field(default_factory=list)

    def _visited(self) -> list:
        """The loops one element passes through: every loop that does not store to
        global memory, and the costliest of those that do (each element is stored
        once, by one of them: ``loop_partition`` splits a row's store loop)."""
        stores = [loop for loop in self.loops if loop.moved.get("STG")]
        rest = [loop for loop in self.loops if not loop.moved.get("STG")]
        return rest + ([max(stores, key=lambda loop: loop.per_element)] if stores else [])

    def per_element(self) -> float:
        """SASS instructions per element over the element loops an element visits."""
        return sum(loop.per_element for loop in self._visited())

    def lds_per_element(self) -> float:
        return sum(loop.lds / loop.elements for loop in self._visited())

    def broadcast_per_element(self) -> float:
        return sum(loop.broadcast_lds / loop.elements for loop in self._visited())


def disassembler() -> list | None:
    """``nvdisasm`` (on PATH or in the nvidia pip wheel) or ``cuobjdump -sass``."""
    found = shutil.which("nvdisasm")
    if not found:
        try:
            import nvidia

            for base in nvidia.__path__:
                for cand in Path(base).glob("*/bin/nvdisasm"):
                    found = str(cand)
        except ImportError:
            pass
    if found:
        return [found, "-c"]
    return ["cuobjdump", "-sass"] if shutil.which("cuobjdump") else None


def _width(opcode: str) -> int:
    """Bytes moved by one memory instruction (``LDG.E.128`` -> 16, ``LDS.U16`` -> 2)."""
    for bits in (128, 64, 32, 16, 8):
        if re.search(rf"\.(U|S)?{bits}\b", opcode):
            return bits // 8
    return 4


def _writes(text: str) -> set:
    """Registers an instruction writes: its first operand, unless it is a store/branch."""
    op = text.split()[0] if not text.startswith("@") else text.split()[1]
    if op.split(".")[0] in ("STG", "STS", "ST", "BRA", "BAR", "EXIT", "BSYNC", "BSSY", "RED"):
        return set()
    operands = text[text.index(op) + len(op):].split(",")
    first = operands[0] if operands else ""
    regs = set(_REG.findall(first))
    if ".64" in first or "LDG.E.64" in op or ".128" in op:  # register pairs/quads
        for r in list(regs):
            kind, num = re.match(r"(U?R)(\d+)", r).groups()
            regs |= {f"{kind}{int(num) + i}" for i in range(1, 4)}
    return regs


def parse_sass(text: str, dtype_bytes: int) -> dict:
    """``{kernel: (instruction count, [Loop])}``: every element loop of every kernel."""
    functions: dict = {}
    current = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            current = m.group(1)
            functions[current] = []
            continue
        if current is None:
            continue
        m = _LABEL.match(line.strip())
        if m:
            functions[current].append(("label", m.group(1)))
            continue
        m = _INSN.search(line)
        if m:
            functions[current].append(("insn", m.group(2).strip()))
    loops: dict = {}
    for name, items in functions.items():
        insns, labels = [], {}
        for kind, value in items:
            if kind == "label":
                labels[value] = len(insns)
            else:
                insns.append(value)
        spans = []
        for i, text in enumerate(insns):
            m = re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", text)
            if m and labels.get(m.group(1), i + 1) <= i:
                start = labels[m.group(1)]
                if not any(re.match(r"(EXIT|RET)\b", t) for t in insns[start:i]):
                    spans.append((start, i))
        found = []
        for s in spans:
            nested = [o for o in spans if o != s and s[0] <= o[0] and o[1] <= s[1]]
            own = [insns[i] for i in range(s[0], s[1] + 1)
                   if not any(o[0] <= i <= o[1] for o in nested)]
            if loop := _loop(name, own, dtype_bytes):
                found.append(loop)
        loops[name] = (len(insns), found)
    return loops


def _opcode(text: str) -> str:
    return next(w for w in text.split() if not w.startswith("@"))


def _streaming(body: list) -> list:
    """For each instruction: does its memory address change between iterations?

    One pass in program order tracks whether each register holds an
    iteration-dependent value: a register read before it is written in the body
    (loop-carried) and written somewhere in it varies; a loaded value varies;
    anything computed from varying values varies. A register computed only from
    invariant values (a shared base rebuilt from constants) does not."""
    written = set().union(*(_writes(t) for t in body))
    state: dict = {}
    out = []
    for text in body:
        op = _opcode(text)
        dests = _writes(text)
        operands = text[text.index(op) + len(op):].split(",")
        sources = set(_REG.findall(",".join(operands[1:] if dests else operands)))
        address = text[text.rindex("["):] if "[" in text else ""
        out.append(any(state.get(r, r in written) for r in _REG.findall(address)))
        varies = op.split(".")[0] in MEMORY_KINDS + ("LD",) or any(
            state.get(r, r in written) for r in sources)
        for reg in dests:
            state[reg] = varies
    return out


def _loop(kernel: str, body: list, dtype_bytes: int) -> Loop | None:
    moved = dict.fromkeys(MEMORY_KINDS, 0)
    lds = broadcast = 0
    loaded: set = set()  # registers holding values loaded in this loop
    read_at: dict = {}  # per-thread shared reads: base register -> {address: bytes}
    for text, varying in zip(body, _streaming(body)):
        op = _opcode(text)
        kind = op.split(".")[0]
        if kind in ("LDG", "LDS"):
            loaded |= _writes(text)
        else:
            loaded -= _writes(text)
        if kind not in MEMORY_KINDS:
            continue
        if kind == "STS" and not set(_REG.findall(text.rsplit(",", 1)[-1])) & loaded:
            continue  # a computed value (reduction scratch), not a staged element
        address = text[text.rindex("["):] if "[" in text else ""
        per_thread = bool(re.search(r"\bR\d+", address))  # else uniform: a broadcast
        if kind == "LDS":
            lds += 1
            broadcast += not per_thread
        if kind == "LDS" and per_thread and varying:
            base = re.search(r"\bR\d+", address).group(0)
            read_at.setdefault(base, {})[address] = _width(op)
        if varying or (kind in ("LDS", "STS") and per_thread):
            moved[kind] += _width(op)
    # Elements per iteration from the global streams and the staging stores
    # when there are any: a per-chunk scalar read from shared memory at a
    # loop-varying address (the chunk index) would otherwise count as a
    # stream of its own.
    # A row staged in shared memory before the loop (no staging stores in it,
    # and no global stores: a loop that stores its elements is counted by them)
    # is a stream too: the distinct loop-varying addresses read off its base
    # register (every pass reads the same ones; the reductions' scratch is read
    # off others), as float32 weights read next to 16-bit logits would
    # otherwise count double.
    main = [moved[k] / dtype_bytes for k in ("LDG", "STG", "STS") if moved[k]]
    staged = max((sum(reads.values()) for reads in read_at.values()), default=0)
    row_pass = staged and not (moved["STS"] or moved["STG"])
    streams = main + ([staged / dtype_bytes] if row_pass else [])
    if not streams:
        return None
    return Loop(kernel, len(body), min(streams), lds, broadcast, moved)


def parse_ptxas(text: str) -> dict:
    """``{kernel: Kernel}`` from ``ptxas -v`` output."""
    kernels, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = kernels.setdefault(m.group(1), Kernel(m.group(1)))
        elif current and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                         line)):
            current.spill_bytes = int(m.group(1)) + int(m.group(2))
        elif current and (m := re.search(r"Used (\d+) registers", line)):
            current.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current.smem = int(s.group(1)) if s else 0
    return kernels


OPS = {  # tool op -> (KernelSpec op, variant keywords); -ns: without label smoothing (eps = 0)
    "forward": ("forward", {"log_prob": False}),
    "forward-ns": ("forward", {"log_prob": False, "smoothing": False}),
    "forward-lp": ("forward", {"log_prob": True}),
    "backward": ("backward", {"grad_source": "logits"}),
    "train": ("train", {"log_prob": False}),
    "train-ns": ("train", {"log_prob": False, "smoothing": False}),
    "log_probs": ("log_probs", {"columns": 1}),  # SPEC section 6: one index per row
    "log_probs_grad": ("log_probs_grad", {"columns": 1}),
    "log_probs-st": ("log_probs", {"columns": 1, "stats": True}),  # return_stats=True
    # the student-teacher divergence with its gradient (docs/spec.md, section 15)
    "divergence-jsd": ("divergence", {"divergence": "jsd"}),
    "divergence-fkl": ("divergence", {"divergence": "fkl"}),
}


def _spec(op: str, dtype: str, classes: int, arch: str, weighted: bool, reduction: str,
          knobs: tuple = ()):
    """The kernel's spec; ``knobs``: ``(name, value)`` pairs of the CUDA schedule's
    knobs, as ``ce_tvm.schedule("cuda", name=value)`` sets them."""
    from ..compiler.build import KernelSpec
    from ..kernels.kinds import Variant

    spec_op, extra = OPS[op]
    return KernelSpec(spec_op, dtype, classes, Variant(reduction, weighted, **extra), "cuda",
                      (("arch", arch), *sorted(knobs)))


def cuda_source(op: str, dtype: str, classes: int, arch: str = "sm_90",
                weighted: bool = False, reduction: str = "mean", knobs: tuple = ()) -> str:
    """TVM's CUDA source for one shape, built as the runtime builds it."""
    from ..compiler.build import lower_and_compile

    spec = _spec(op, dtype, classes, arch, weighted, reduction, knobs)
    return lower_and_compile(spec).mod.imports[0].inspect_source()


def dynamic_shared_bytes(op: str, dtype: str, classes: int, arch: str = "sm_90",
                         weighted: bool = False, reduction: str = "mean",
                         knobs: tuple = ()) -> int:
    """Bytes of dynamic shared memory (``shared.dyn``: a row staged whole) a block
    of the scheduled kernel allocates (ptxas reports static shared memory only)."""
    from tvm import s_tir, tirx

    from ..compiler.build import scheduled_func

    func = scheduled_func(_spec(op, dtype, classes, arch, weighted, reduction, knobs))
    blocks = []
    tvm_ffi.structural_map(func.body, [(s_tir.SBlock, lambda b: blocks.append(b) or b)])
    # Before lowering the staged buffer spans every row ([N, C]); a block holds one
    # row of it (the symbolic row dimension is compacted away): its constant dims.
    return sum(math.prod(int(d) for d in buf.shape if not isinstance(d, tirx.Var))
               * DTYPE_BYTES.get(str(buf.dtype), 4)
               for blk in blocks for buf in blk.alloc_buffers if buf.scope() == "shared.dyn")


def nvcc_flags() -> list:
    """The code-generation flags ``tvm.support.nvcc`` compiles a kernel with
    (``-O3``, ``--use_fast_math`` unless ``TVM_CUDA_NVCC_NO_FAST_MATH`` is set,
    its ptxas options, ``-v`` among them): the machine code counted is the
    machine code that runs."""
    from tvm.support import nvcc

    fast_math = [] if os.environ.get("TVM_CUDA_NVCC_NO_FAST_MATH") else ["--use_fast_math"]
    return ["-O3", *fast_math, f"--ptxas-options={','.join(nvcc._ptxas_option_flags())}"]


@functools.cache
def analyse(op: str, dtype: str, classes: int, arch: str = "sm_90", weighted: bool = False,
            reduction: str = "mean", knobs: tuple = ()) -> dict:
    """``{kernel: Kernel}`` with its element loops, for one shape (cached per process)."""
    source = cuda_source(op, dtype, classes, arch, weighted, reduction, knobs)
    disasm = disassembler()
    if disasm is None:
        raise RuntimeError("no nvdisasm or cuobjdump (pip install nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.cubin")
        Path(cu).write_text(source)
        ptxas = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", *nvcc_flags(), cu,
                                "-o", cubin], capture_output=True, text=True, check=True)
        sass = subprocess.run(disasm + [cubin], capture_output=True, text=True,
                              check=True).stdout
    kernels = parse_ptxas(ptxas.stderr + ptxas.stdout)
    for name, (count, loops) in parse_sass(sass, DTYPE_BYTES[dtype]).items():
        kernel = kernels.setdefault(name, Kernel(name))
        kernel.instructions, kernel.loops = count, loops
        kernel.sweeps_rows = name in _row_sweepers(source)
    if "extern __shared__" in source:  # TVM's CUDA codegen: dynamic shared memory
        row_kernel(kernels).dyn_smem = dynamic_shared_bytes(op, dtype, classes, arch, weighted,
                                                            reduction, knobs)
    return kernels


def _row_sweepers(source: str) -> set:
    """Kernels of TVM's CUDA source that take the ``[N, C]`` matrix (``x`` or
    ``log_prob``) as a parameter: the row kernels."""
    return {m.group(1) for m in re.finditer(r"__global__ void (?:__launch_bounds__\(\d+\) )?"
                                            r"(\w+)\(([^)]*)\)", source)
            if re.search(r"\b(x|log_prob)_ptr\b", m.group(2))}


def row_kernel(kernels: dict) -> Kernel:
    """The kernel that sweeps the ``[N, C]`` rows: the largest of those that take
    the matrix (the fused sums over rows can be as large, and have loops too)."""
    rows = [k for k in kernels.values() if k.sweeps_rows] or list(kernels.values())
    return max(rows, key=lambda k: k.instructions)


@dataclass
class Summary:
    """One shape's evidence: its row kernel's loops, and the worst spill of all kernels."""

    kernel: Kernel
    insn_per_element: float
    lds_per_element: float
    broadcast_per_element: float
    spill_bytes: int
    kernels: int


def summarise(kernels: dict, classes: int, threads: int = 256) -> Summary:
    """The row kernel's counts per element. A row kernel without loops (ptxas
    unrolled them all: short rows) runs each instruction at most once per row,
    so its whole instruction count over the ``ceil(C / threads)`` elements each
    thread owns is an upper bound per element."""
    k = row_kernel(kernels)
    spill = max(x.spill_bytes for x in kernels.values())
    if k.loops:
        return Summary(k, k.per_element(), k.lds_per_element(), k.broadcast_per_element(),
                       spill, len(kernels))
    per_thread = -(-classes // threads)
    return Summary(k, k.instructions / per_thread, float("nan"), float("nan"), spill,
                   len(kernels))


def table(rows: list) -> str:
    """Rows of ``(label, Summary)`` as a fixed-width table."""
    head = (f"{'shape':40} {'kernels':>7} {'regs':>4} {'smem':>6} {'dsmem':>6} {'spill':>5} "
            f"{'loops':>5} "
            f"{'insn/el':>8} {'lds/el':>7} {'bcast_lds/el':>12}")
    out = [head, "-" * len(head)]
    for label, s in rows:
        loops = len(s.kernel.loops) or "none"
        out.append(f"{label:40} {s.kernels:7d} {s.kernel.registers:4d} {s.kernel.smem:6d} "
                   f"{s.kernel.dyn_smem:6d} {s.spill_bytes:5d} {loops:>5} "
                   f"{s.insn_per_element:8.1f} "
                   f"{s.lds_per_element:7.2f} {s.broadcast_per_element:12.2f}")
    return "\n".join(out)
