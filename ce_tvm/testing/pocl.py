"""The CUDA schedule's kernels run without a GPU: built for OpenCL, run on PoCL.

``build(spec)`` takes the scheduled TIR of a CUDA ``KernelSpec`` (the
function ``ce_tvm.compiler.build.scheduled_func`` gives the CUDA build: the
same ``schedules/cuda.py`` knobs, chunks and launches) and compiles it for an
OpenCL target with CUDA's limits (``opencl_target``). From the lowered module
(caught right after TVM's ``SplitHostDevice``) it reads what a GPU runtime
reads: the host function's buffer and scalar parameters, and its device
kernel calls in order, each with its arguments and its grid and block as
expressions of ``N``. ``PoCL.run`` launches them with pyopencl on PoCL's CPU
device, one work-group per thread block, ``N`` bound.

Where the OpenCL lowering differs from the CUDA one (what is not exercised):

- warp size 1: TVM lowers every cross-thread reduction to a tree through
  shared (``__local``) memory with a barrier per level, not to CUDA's warp
  shuffles, and so PoCL runs the shared-memory half of CUDA's reductions, not
  the shuffles;
- ``exp2f`` is OpenCL's ``exp2`` (same role, PoCL's library, not the SFU);
- bfloat16 is 16-bit integers with TVM's bit arithmetic (``BF16*Legalize``)
  and its staged chunks float32, where CUDA has ``__nv_bfloat16``;
- ``shared.dyn`` (the ``log_prob`` forward's whole staged row) is made
  static ``shared`` before lowering (``_static_local``): TVM 0.27's OpenCL
  code generator declares a dynamic shared buffer as a private array;
- float16: PoCL 3.0's CPU device does not declare ``cl_khr_fp16`` and its
  kernel library has no ``half`` loads, stores or conversions; the device is
  told it has the extension and ``HALF_PRELUDE`` supplies those few
  functions (conversions round to nearest even, as CUDA's ``__float2half``).

PoCL 3.0 (``pocl-binary-distribution``, LLVM 14) names the host CPU with
LLVM 14, which calls a CPU it does not know (AMD family 26) ``generic``, a
name its clang then refuses ("unknown target CPU"). ``PoCL`` then gives the
device the x86-64 level the CPU's flags support (``x86-64-v4`` with AVX-512),
the name PoCL 5 would take from ``POCL_LLVM_CPU_NAME``. Both device changes
write the device's own strings in PoCL's device record, found by content;
this module never runs in the runtime (which never loads OpenCL).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.target import Target
from tvm.tirx.buffer import BufferType

from ..compiler.build import pass_config, scheduled_func
from ..store.spec import KernelSpec

# CUDA's limits for a block: the static shared memory one block may declare
# (dynamic staging goes beyond, see ``_static_local``); threads per block.
CUDA_SHARED_PER_BLOCK = 48 * 1024
AXES = ("x", "y", "z")


def opencl_target(cuda: Target) -> Target:
    """An OpenCL target with ``cuda``'s thread limits and CUDA's shared memory per
    block; warp size 1 (OpenCL has no warp shuffles: reductions go through
    ``__local`` memory)."""
    threads = int(cuda.attrs["max_num_threads"])
    return Target({"kind": "opencl", "max_num_threads": threads,
                   "max_threads_per_block": threads,
                   "max_shared_memory_per_block": CUDA_SHARED_PER_BLOCK,
                   "thread_warp_size": 1})


@dataclass(frozen=True)
class Param:
    """A parameter of the host function: a buffer (``shape``: PrimExprs of N) or a
    scalar (``shape`` None)."""

    name: str
    dtype: str
    shape: tuple | None


@dataclass(frozen=True)
class Launch:
    """One device kernel call of the host function."""

    kernel: str
    args: tuple  # per kernel parameter: ("buffer", name) or ("scalar", PrimExpr, dtype)
    grid: tuple  # PrimExprs (x, y, z): work-groups
    block: tuple  # PrimExprs (x, y, z): work-items per work-group
    shared: object = 0  # bytes of dynamic shared memory (a PrimExpr; CUDA builds only)


@dataclass
class Kernels:
    """What ``build`` gives: the OpenCL source and the host function's launch plan."""

    spec: KernelSpec
    source: str
    params: list  # Param, in the host function's order
    launches: list  # Launch, in the host function's order
    binds: dict = field(default_factory=dict)  # the host's let-variables: name -> PrimExpr

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)

    def buffers(self) -> list:
        return [p for p in self.params if p.shape is not None]

    def evaluate(self, expr, values: dict):
        """``expr`` of the host function with its variables bound: ``values``
        (``N`` and the scalar parameters, by name), then the let-variables."""
        return _evaluate(expr, {**values}, self.binds)


class AfterSplit:
    """A pass instrument keeping the module ``SplitHostDevice`` leaves: the host
    function with its kernel calls, the device functions with their parameters."""

    def __init__(self):
        self.mod = None

    def run_after_pass(self, mod, info):
        if info.name == "tirx.SplitHostDevice":
            self.mod = mod


def build(spec: KernelSpec) -> Kernels:
    """The CUDA schedule of ``spec`` (a ``cuda`` spec) built for OpenCL."""
    if spec.target != "cuda":
        raise ValueError(f"the PoCL harness runs the CUDA schedule, not {spec.target!r}")
    func = _static_local(scheduled_func(spec))
    grab = tvm.ir.instrument.pass_instrument(AfterSplit)()
    with tvm.transform.PassContext(opt_level=3, config=pass_config(spec), instruments=[grab]):
        executable = tvm.compile(func, target=opencl_target(spec.tvm_target()))
    return launch_plan(spec, hoist_local(executable.mod.imports[0].inspect_source()), grab.mod)


_LOCAL = re.compile(r"^ {4,}__local [\w ]+ \w+\[\d+\];$")


def hoist_local(source: str) -> str:
    """``source`` with every ``__local`` array declared inside a loop or block
    moved to the top of its kernel: OpenCL C allows them at kernel scope only,
    CUDA anywhere (a ``__shared__`` array is one per block wherever it is
    declared, so the move changes nothing; TVM names each one uniquely)."""
    out, header, hoisted = [], None, []
    for line in source.splitlines():
        if line.startswith("__kernel") and line.endswith("{"):
            header, hoisted = len(out), []
        elif line == "}" and header is not None:
            out[header + 1:header + 1] = ["  " + h.strip() for h in hoisted]
            header = None
        elif header is not None and _LOCAL.match(line):
            hoisted.append(line)
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def _static_local(func):
    """``func`` with its ``shared.dyn`` buffers (a row staged whole) made ``shared``:
    TVM 0.27's OpenCL code generator prints a dynamic shared allocation as a
    private array (one copy per work-item), where CUDA has one per block."""
    dynamic = []

    def visit(block):
        dynamic.extend(b for b in block.alloc_buffers if b.scope() == "shared.dyn")
        return block

    tvm_ffi.structural_map(func.body, [(s_tir.SBlock, visit)])
    if not dynamic:
        return func
    static = {b: tirx.decl_buffer(b.shape, b.dtype, name=b.name, scope="shared")
              for b in dynamic}
    body = tvm_ffi.structural_map(func.body, [(tirx.Buffer, lambda b: static.get(b, b))])
    return tirx.PrimFunc(func.params, body, func.ret_type, func.attrs)


def launch_plan(spec: KernelSpec, source: str, mod) -> Kernels:
    """The host function's parameters and kernel calls, in order."""
    host = mod["main"]
    devices = {gv.name_hint: f for gv, f in mod.functions.items() if gv.name_hint != "main"}
    params = [Param(p.name, str(p.dtype), tuple(p.shape))
              if isinstance(p.ty, BufferType) else Param(p.name, str(p.ty.dtype), None)
              for p in host.params]
    kernels = Kernels(spec, source, params, [])
    declared = []  # (buffer declared in the host body, its data: buffer_data(parameter))

    def param_of(var) -> str:
        for p in host.params:
            if p.same_as(var):
                return p.name
        for buf, data in declared:
            if buf.same_as(var):
                return param_of(data.args[0])
        raise ValueError(f"kernel argument {var} is no buffer parameter")

    statements = host.body.seq if isinstance(host.body, tirx.SeqStmt) else [host.body]
    for stmt in statements:
        if isinstance(stmt, tirx.Bind):
            kernels.binds[stmt.var.name] = stmt.value
        elif isinstance(stmt, tirx.DeclBuffer):
            declared.append((stmt.buffer, stmt.data))
        elif isinstance(stmt, tirx.Evaluate) and _is_launch(stmt.value):
            kernels.launches.append(_launch(stmt.value, devices, param_of))
        else:  # a branch or a loop would change which kernels run: not seen so far
            raise NotImplementedError(f"host statement {type(stmt).__name__}: {stmt}")
    return kernels


def _is_launch(expr) -> bool:
    return isinstance(expr, tvm.ir.expr.Call) and expr.op.name == "tirx.call_ffi_kernel"


def _launch(call, devices: dict, param_of) -> Launch:
    name = call.args[0].value
    n_args = len(devices[name].params)
    args = []
    for arg, dparam in zip(call.args[1:1 + n_args], devices[name].params):
        if isinstance(arg, tvm.ir.expr.Call) and arg.op.name == "tirx.buffer_data":
            args.append(("buffer", param_of(arg.args[0])))
        else:
            args.append(("scalar", arg, _dtype(dparam)))
    values = dict(zip(call.attrs.launch_params, call.args[1 + n_args:]))
    known = {f"{kind}.{a}" for kind in ("blockIdx", "threadIdx") for a in AXES}
    if set(values) - known - {DYNAMIC_SHARED}:
        raise NotImplementedError(f"{name}: launch parameters {sorted(set(values) - known)}")
    one = tirx.const(1, "int64")
    return Launch(name, tuple(args), tuple(values.get(f"blockIdx.{a}", one) for a in AXES),
                  tuple(values.get(f"threadIdx.{a}", one) for a in AXES),
                  values.get(DYNAMIC_SHARED, 0))


# The launch parameter that carries a kernel's dynamic shared memory (bytes).
DYNAMIC_SHARED = "tirx.use_dyn_shared_memory"


_BINARY = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
           "Div": lambda a, b: a / b, "FloorDiv": lambda a, b: a // b,
           "FloorMod": lambda a, b: a % b, "Min": min, "Max": max}


def _evaluate(expr, values: dict, binds: dict):
    """A host expression (launch extents, scalar arguments) as a Python number."""
    if isinstance(expr, (int, float)):
        return expr
    kind = type(expr).__name__
    if kind in ("IntImm", "FloatImm"):
        return expr.value
    if kind == "Var":
        if expr.name in values:
            return values[expr.name]
        if expr.name in binds:
            return _evaluate(binds[expr.name], values, binds)
        raise KeyError(f"no value for {expr.name}")
    if kind in _BINARY:
        return _BINARY[kind](_evaluate(expr.a, values, binds), _evaluate(expr.b, values, binds))
    if kind == "Cast":
        value = _evaluate(expr.value, values, binds)
        return int(value) if "int" in str(expr.dtype) else float(value)
    raise NotImplementedError(f"host expression {kind}: {expr}")


# --- PoCL ---------------------------------------------------------------------

# float16 loads, stores and conversions PoCL 3.0's CPU kernel library lacks,
# in plain OpenCL C (a conversion to half is a cast: round to nearest even).
_SPACES = ("__global", "__local", "__private")


def _half_prelude() -> str:
    lines = ["#pragma OPENCL EXTENSION cl_khr_fp16 : enable",
             "#define CE_OVL __attribute__((overloadable))"]
    for n in (2, 4, 8):
        for space in _SPACES:
            lines.append(
                f"CE_OVL half{n} vload{n}(size_t i, const {space} half *p) {{ half{n} v; "
                f"for (int k = 0; k < {n}; ++k) ((half *)&v)[k] = p[i * {n} + k]; return v; }}")
            lines.append(
                f"CE_OVL void vstore{n}(half{n} v, size_t i, {space} half *p) {{ "
                f"for (int k = 0; k < {n}; ++k) p[i * {n} + k] = ((half *)&v)[k]; }}")
        lines.append(f"CE_OVL half{n} convert_half{n}(float{n} v) "
                     f"{{ return __builtin_convertvector(v, half{n}); }}")
        lines.append(f"CE_OVL float{n} convert_float{n}(half{n} v) "
                     f"{{ return __builtin_convertvector(v, float{n}); }}")
    lines += ["CE_OVL half convert_half(float v) { return (half)v; }",
              "CE_OVL float convert_float(half v) { return (float)v; }", ""]
    return "\n".join(lines)


HALF_PRELUDE = _half_prelude()


def _x86_level() -> str:
    """The x86-64 microarchitecture level this CPU's flags reach (LLVM names)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return "x86-64"
    levels = [("x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
              ("x86-64-v3", {"avx2", "bmi1", "bmi2", "f16c", "fma", "movbe"}),
              ("x86-64-v2", {"sse4_2", "popcnt", "ssse3"})]
    return next((name for name, need in levels if need <= flags), "x86-64")


def _readable_ranges() -> list:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            if perms.startswith("r"):
                lo, hi = (int(v, 16) for v in span.split("-"))
                ranges.append((lo, hi))
    return ranges


_KEEP: list = []  # the strings the device record points to from now on


def _fix_device(device) -> list:
    """Give PoCL's CPU device a CPU name its clang knows, and float16, when it
    lacks them (see the module's docstring); returns what was changed. The
    device record's string pointers are found by their contents: the LLVM CPU
    name follows the target triple; the extension list starts with
    ``cl_khr_byte_addressable_store``."""
    changes = []
    ranges = _readable_ranges()

    def text(address: int, size: int) -> bytes | None:
        if any(lo <= address and address + size <= hi for lo, hi in ranges):
            return ctypes.string_at(address, size)
        return None

    words = (ctypes.c_uint64 * 160).from_address(device.int_ptr)
    for i in range(1, len(words)):
        if text(words[i], 8) == b"generic\0" and text(words[i - 1], 7) == b"x86_64-":
            name = ctypes.create_string_buffer(_x86_level().encode())
            _KEEP.append(name)
            words[i] = ctypes.addressof(name)
            changes.append(f"cpu {name.value.decode()}")
        head = text(words[i], 29)
        if head == b"cl_khr_byte_addressable_store" and b"cl_khr_fp16" not in ctypes.string_at(
                words[i]):
            extensions = ctypes.create_string_buffer(ctypes.string_at(words[i]) + b" cl_khr_fp16")
            _KEEP.append(extensions)
            words[i] = ctypes.addressof(extensions)
            changes.append("cl_khr_fp16")
    return changes


def pocl_unavailable() -> str | None:
    """Why PoCL cannot run kernels here (``None`` when it can)."""
    try:
        PoCL.get()
    except Exception as err:  # noqa: BLE001 - the reason is the message
        return f"PoCL cannot be loaded: {type(err).__name__}: {str(err).strip()[:300]}"
    return None


class PoCL:
    """PoCL's CPU device with a context and an in-order queue (one per process)."""

    _instance = None
    instructions = None  # PoCL counts none

    @classmethod
    def get(cls) -> PoCL:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        import pyopencl as cl

        self.cl = cl
        platforms = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name]
        if not platforms:
            raise RuntimeError("no PoCL platform (pip install pocl-binary-distribution)")
        self.device = platforms[0].get_devices()[0]
        self.changes = _fix_device(self.device)
        self.name = self.device.name
        self.context = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.context)
        self._programs: dict = {}
        self._built: dict = {}
        self.program("__kernel void ce_probe(__global float *a) { a[0] = exp2(a[0]); }")

    def kernels(self, spec: KernelSpec) -> Kernels:
        """``build(spec)``, once per spec."""
        if spec not in self._built:
            self._built[spec] = build(spec)
        return self._built[spec]

    def program(self, source: str):
        """The kernels of ``source``, built, by name (float16 sources get ``HALF_PRELUDE``)."""
        if "half" in source and "cl_khr_fp16" in self.changes:
            source = HALF_PRELUDE + source
        key = hashlib.sha256(source.encode()).hexdigest()
        if key not in self._programs:
            program = self.cl.Program(self.context, source).build()
            self._programs[key] = {k.function_name: k for k in program.all_kernels()}
        return self._programs[key]

    def run(self, kernels: Kernels, rows: int, arrays: dict, scalars: dict,
            aliases: dict | None = None) -> dict:
        """Run ``kernels`` at ``N = rows``, in the host's order. ``arrays``: input
        buffers by parameter name (numpy; bfloat16 as its 16-bit patterns);
        ``scalars``: scalar parameters by name; ``aliases``: buffers that are
        another's memory (``{"x_grad": "x"}``: the gradient written in place).
        Every buffer not given (outputs, scratch) starts as NaN (all bits set
        for integers), as memory a GPU kernel may not rely on. Returns every
        buffer after the run, by name."""
        cl = self.cl
        aliases = aliases or {}
        values = {"N": rows, **scalars}
        host = {}
        for p in kernels.buffers():
            if p.name in aliases:
                continue
            shape = tuple(int(kernels.evaluate(d, values)) for d in p.shape)
            if p.name in arrays:
                data = np.ascontiguousarray(arrays[p.name], dtype=NUMPY_DTYPES[p.dtype])
                if data.shape != shape:
                    raise ValueError(f"{p.name}: shape {data.shape}, the kernel takes {shape}")
            else:
                data = poison(shape, p.dtype)
            host[p.name] = data.copy()
        flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
        device = {name: cl.Buffer(self.context, flags, hostbuf=data if data.size else
                                  np.zeros(1, data.dtype)) for name, data in host.items()}
        for alias, target in aliases.items():
            device[alias] = device[target]
        program = self.program(kernels.source)
        for launch in kernels.launches:
            kernel = program[launch.kernel]
            args = []
            for arg in launch.args:
                if arg[0] == "buffer":
                    args.append(device[arg[1]])
                else:
                    args.append(np.dtype(NUMPY_DTYPES[arg[2]]).type(
                        kernels.evaluate(arg[1], values)))
            kernel.set_args(*args)
            grid = [int(kernels.evaluate(e, values)) for e in launch.grid]
            block = [int(kernels.evaluate(e, values)) for e in launch.block]
            cl.enqueue_nd_range_kernel(self.queue, kernel,
                                       [g * b for g, b in zip(grid, block)], block)
        for name, data in host.items():
            if data.size:
                cl.enqueue_copy(self.queue, data, device[name])
        self.queue.finish()
        return {**host, **{alias: host[target] for alias, target in aliases.items()}}


NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
                "float64": np.float64, "int64": np.int64, "int32": np.int32}


def poison(shape: tuple, dtype: str) -> np.ndarray:
    if dtype in ("float32", "float16", "float64"):
        return np.full(shape, np.nan, NUMPY_DTYPES[dtype])
    return np.full(shape, -1, np.int64 if dtype == "int64" else np.int32) if "int" in dtype \
        else np.full(shape, 0xFFFF, np.uint16)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns, rounded to nearest even."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    nan = np.isnan(values)
    return np.where(nan, 0x7FC0, rounded >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns as float32 values."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _dtype(var) -> str:
    """A parameter's dtype: a buffer's element type, a scalar's type, or a
    device pointer's element type."""
    ty = var.ty
    if isinstance(ty, BufferType):
        return str(var.dtype)
    if hasattr(ty, "element_type"):
        return str(ty.element_type.dtype)
    return str(ty.dtype)
