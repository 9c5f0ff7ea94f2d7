"""Simulated cycles of Triton peers' kernels beside the copy floor, in GPGPU-Sim's
cycle model, as ``benchmarks/gpgpu_sim_cycles.py`` gives ce-tvm's.

The peers: Liger Kernel's cross entropy (``liger_cross_entropy_kernel``: loss per
row, the logits overwritten with their gradient, mean reduction, one program per
row, 32 warps) and TRL's log-prob + entropy pair (``trl.kernels.logprob_entropy``:
``_forward_kernel`` writes the target's log-prob, the entropy, log Z and the
expected logit per row; ``_backward_kernel`` the logits' gradient of both, grid
rows x vocabulary blocks of 1024).

Triton is not a dependency of ce-tvm: it runs from its own virtual environment
(``--triton-python``, ``$CE_TVM_TRITON_PYTHON``, or ``$GSIM/triton-venv``), with
``liger-kernel`` and ``trl`` installed there without their dependencies (torch is
not needed). There, each kernel's ``@triton.jit`` source is taken from the
installed package, specialized as Triton's launcher specializes its launch
arguments (ints equal to 1 and ``None`` become constants, 16-divisible ints and
pointers get divisibility hints), and compiled ahead of time for
``GPUTarget("cuda", 86, 32)`` without a driver: the PTX, the kernel's name, its
parameters (Triton appends two hidden ones, the global and the profile scratch
pointers, passed null as Triton does when the kernel needs no scratch), warps and
dynamic shared bytes. Line info is off (``TRITON_DISABLE_LINE_INFO``); two edits
that leave the instructions as they are make the PTX GPGPU-Sim's
(``for_simulator``): launch-bound hints (``.reqntid``) dropped, Triton's
one-register vectors (``{ %r1 }`` in its inline-asm loads and stores) written as
the register.

A generated host program declares the kernel with the same parameter list (an
empty body: ``Simulator.execute(ptx=...)`` runs Triton's PTX instead), reads the
buffers from files, launches the kernel as the peer's Python wrapper does and
writes the buffers back. Each kernel runs in functional mode first and is checked
against float64 NumPy (``ce_tvm.testing.cuda_cases``' tolerances), then in the
cycle model (``launch_latency=0``, as the cycles script) beside the floor: one
copy kernel moving the bytes the peer's launch reads and writes
(``Simulator.copy_floor``). Usage::

    GSIM=/work/gsim .venv/bin/python benchmarks/gpgpu_sim_triton_peer.py \\
        --classes 5003 --rows 92 --json peer.json

Setting up the Triton environment (once, outside the repository)::

    python3 -m venv $GSIM/triton-venv
    $GSIM/triton-venv/bin/pip install triton==3.9.0
    $GSIM/triton-venv/bin/pip install --no-deps liger-kernel==0.8.5 trl==1.16.0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ce_tvm.testing import gpgpu_sim
from ce_tvm.testing.cuda_cases import IGNORE, SCALE, TOL, compare, store, value

# Runs in Triton's environment: reads a request (JSON) on stdin, writes the compiled
# kernel (JSON) on stdout. The kernel's module is rebuilt from the installed source
# with what Triton needs of it (its triton imports, tl.constexpr and literal
# constants, its @triton.jit functions), so torch and the package's other imports
# are not needed.
_AOT = r'''
import ast, importlib.metadata, importlib.util, json, sys, tempfile, warnings
from pathlib import Path
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

warnings.simplefilter("ignore")
req = json.load(sys.stdin)
spec = importlib.util.find_spec(req["package"])
path = Path(spec.submodule_search_locations[0]) / req["file"]
text = path.read_text()
keep = ["import triton", "import triton.language as tl", *req.get("preamble", [])]

def wanted(node):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        return all(n.split(".")[0] == "triton" for n in names)
    if isinstance(node, ast.Assign):
        v = node.value
        return isinstance(v, ast.Constant) or (isinstance(v, ast.Call)
                                                and ast.unparse(v.func) in ("tl.constexpr",))
    if isinstance(node, ast.FunctionDef):
        return any(ast.unparse(d) in ("triton.jit", "jit") for d in node.decorator_list)
    return False

lines = text.splitlines()
for node in ast.parse(text).body:
    if wanted(node):
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        keep.append("\n".join(lines[first - 1:node.end_lineno]))
folder = Path(tempfile.mkdtemp(prefix="triton-peer-"))
module_path = folder / (req["package"] + "_" + Path(req["file"]).stem + ".py")
module_path.write_text("\n\n\n".join(keep) + "\n")
mspec = importlib.util.spec_from_file_location(module_path.stem, module_path)
module = importlib.util.module_from_spec(mspec)
mspec.loader.exec_module(module)
kernel = getattr(module, req["kernel"])

class Tensor:  # what the launcher's specialization reads of a tensor: dtype, address
    def __init__(self, dtype):
        self.dtype = getattr(tl, dtype)
    def data_ptr(self):
        return 0  # a 16-byte aligned allocation, as the caching allocator's

target = GPUTarget("cuda", 86, 32)
backend = make_backend(target)
binder = create_function_from_signature(kernel.signature, kernel.params, backend)
args = {k: Tensor(v["tensor"]) if isinstance(v, dict) else v for k, v in req["args"].items()}
bound, specialization, options = binder(**args, **req["options"])
options, signature, constexprs, attrs = kernel._pack_args(backend, options, bound,
                                                          specialization, options)
compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)
md = compiled.metadata
versions = {"triton": triton.__version__}
try:
    versions[req["distribution"]] = importlib.metadata.version(req["distribution"])
except importlib.metadata.PackageNotFoundError:
    pass
json.dump({
    "name": md.name, "ptx": compiled.asm["ptx"], "num_warps": md.num_warps,
    "shared": md.shared, "global_scratch_size": getattr(md, "global_scratch_size", 0),
    "profile_scratch_size": getattr(md, "profile_scratch_size", 0),
    "params": [[n, signature[n]] for n in kernel.arg_names if signature[n] != "constexpr"],
    "constexprs": {kernel.arg_names[k[0]]: repr(v) for k, v in constexprs.items()},
    "hints": [kernel.arg_names[k[0]] for k, v in attrs.items() if v],
    "versions": versions, "source": str(path)}, sys.stdout)
'''


def triton_python(option: str | None) -> str:
    """The Python of Triton's environment: ``option``, ``$CE_TVM_TRITON_PYTHON`` or
    ``$GSIM/triton-venv`` (``$CE_TVM_GPGPU_SIM`` first, as ``Simulator.find``)."""
    found = option or os.environ.get("CE_TVM_TRITON_PYTHON")
    if found:
        return found
    root = os.environ.get("CE_TVM_GPGPU_SIM") or os.environ.get("GSIM") or ""
    return str(Path(root) / "triton-venv" / "bin" / "python")


@dataclass
class Compiled:
    """A Triton kernel compiled for sm_86: PTX, name, every PTX parameter as
    ``(name, triton type)`` (the hidden scratch pointers last, typed ``*hidden``)."""

    name: str
    ptx: str
    num_warps: int
    shared: int
    params: list
    info: dict = field(default_factory=dict)


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PTX_PARAM = re.compile(r"\.param\s+\.(\w+)")
_PTX_WIDTH = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}
_WIDTH = {"i32": 4, "u32": 4, "i64": 8, "u64": 8, "fp32": 4}


def compile_peer(python: str, request: dict, cache: Path | None = None) -> Compiled:
    """``request``'s kernel compiled in Triton's environment (``_AOT``), its parameter
    list checked against the PTX entry's: the signature's non-constexpr arguments
    in order, then Triton's hidden pointers (scratch buffers this kernel must not need)."""
    env = {**os.environ, "TRITON_DISABLE_LINE_INFO": "1",  # no .loc, .file, debug sections
           "TRITON_DEFAULT_FP_FUSION": "1"}  # Triton 3.9's default, said explicitly
    if cache:
        env["TRITON_CACHE_DIR"] = str(cache)
    done = subprocess.run([python, "-c", _AOT], input=json.dumps(request), capture_output=True,
                          text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"Triton's compile failed ({python}):\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout)
    if out["global_scratch_size"] or out["profile_scratch_size"]:
        raise NotImplementedError(f"{out['name']} needs scratch memory")
    entry = _ENTRY.search(out["ptx"])
    if not entry or entry.group(1) != out["name"]:
        raise RuntimeError(f"no .entry {out['name']} in the PTX")
    widths = [_PTX_WIDTH[t] for t in _PTX_PARAM.findall(entry.group(2))]
    params = [tuple(p) for p in out["params"]]
    hidden = len(widths) - len(params)
    if hidden < 0:
        raise RuntimeError(f"{out['name']}: {len(widths)} PTX parameters, {len(params)} args")
    # Triton 3.x appends the global scratch pointer, then the profile scratch pointer
    names = ["global_scratch", "profile_scratch"] if hidden == 2 else \
        [f"hidden_{i}" for i in range(hidden)]
    params += [(name, "*hidden") for name in names]
    for (name, kind), width in zip(params, widths):
        if (8 if kind.startswith("*") else _WIDTH[kind]) != width:
            raise RuntimeError(f"{out['name']}: {name} ({kind}) is .param of {width} bytes")
    info = {k: out[k] for k in ("constexprs", "hints", "versions", "source")}
    return Compiled(out["name"], for_simulator(out["ptx"]), out["num_warps"], out["shared"],
                    params, info)


# Launch-bound hints GPGPU-Sim's PTX parser rejects; the launch sets the block's size.
_HINTS = re.compile(r"^\s*\.(reqntid|maxntid|minnctapersm|maxnreg)\b.*\n", re.M)
# Triton's inline-asm loads and stores name one register as a vector of one, `{ %r1 }`,
# which GPGPU-Sim takes for a vector operand (and asserts on writing it)
_ONE = re.compile(r"\{\s*(%\w+)\s*\}")


def for_simulator(ptx: str) -> str:
    """Triton's PTX as GPGPU-Sim's parser reads it, the same instructions (``ptx-rewrite``,
    which ``Simulator.execute`` runs, does the rest): without launch-bound hints, and
    one-register vectors as the register."""
    return _ONE.sub(r"\1", _HINTS.sub("", ptx))


_CTYPE = {"i32": "int", "u32": "unsigned", "i64": "long long", "u64": "unsigned long long",
          "fp32": "float"}


def host_program(kernel: Compiled) -> str:
    """A program launching ``kernel``: ``prog gx gy gz bx by bz shared TOKEN...``, one
    token per parameter: a pointer's buffer file (read into device memory, written
    back as ``out-FILE``) or ``null``, a scalar's value."""
    decl, setup, names = [], [], []
    for i, (name, kind) in enumerate(kernel.params):
        arg = f"argv[{8 + i}]"
        if kind.startswith("*"):
            decl.append(f"void *{name}")
            setup.append(f"  void *p{i} = ce_buffer({i}, {arg});")
        elif kind == "fp32":
            decl.append(f"float {name}")
            setup.append(f"  float p{i} = strtof({arg}, 0);")
        else:
            decl.append(f"{_CTYPE[kind]} {name}")
            setup.append(f"  {_CTYPE[kind]} p{i} = ({_CTYPE[kind]})strtoll({arg}, 0, 0);")
        names.append(f"p{i}")
    n = len(kernel.params)
    return "\n".join([
        "#include <cstdio>", "#include <cstdlib>", "#include <cstring>",
        "#define CE_CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \\",
        '  fprintf(stderr, "%s: %s\\n", #x, cudaGetErrorString(e)); exit(3); } } while (0)',
        f'extern "C" __global__ void {kernel.name}({", ".join(decl)}) {{}}',
        f"static const char *ce_file[{n}]; static void *ce_host[{n}], *ce_dev[{n}];",
        f"static long ce_bytes[{n}];",
        "static void *ce_buffer(int i, const char *file) {",
        '  if (!strcmp(file, "null")) return 0;',
        '  FILE *f = fopen(file, "rb"); if (!f) { fprintf(stderr, "no %s\\n", file); exit(2); }',
        "  fseek(f, 0, SEEK_END); ce_bytes[i] = ftell(f); fseek(f, 0, SEEK_SET);",
        "  ce_host[i] = malloc(ce_bytes[i] + 16); ce_file[i] = file;",
        "  if ((long)fread(ce_host[i], 1, ce_bytes[i], f) != ce_bytes[i]) exit(2); fclose(f);",
        "  CE_CHECK(cudaMalloc(&ce_dev[i], ce_bytes[i] + 16));",
        "  CE_CHECK(cudaMemcpy(ce_dev[i], ce_host[i], ce_bytes[i], cudaMemcpyHostToDevice));",
        "  return ce_dev[i]; }",
        "int main(int argc, char **argv) {",
        f'  if (argc != {8 + n}) {{ fprintf(stderr, "{8 + n} arguments\\n"); return 2; }}',
        "  dim3 grid(atoi(argv[1]), atoi(argv[2]), atoi(argv[3]));",
        "  dim3 block(atoi(argv[4]), atoi(argv[5]), atoi(argv[6]));",
        "  size_t shared = strtoull(argv[7], 0, 0);",
        *setup,
        "  if (shared > 48 * 1024) CE_CHECK(cudaFuncSetAttribute((const void *)"
        f"{kernel.name}, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared));",
        f"  {kernel.name}<<<grid, block, shared>>>({', '.join(names)});",
        "  CE_CHECK(cudaGetLastError()); CE_CHECK(cudaDeviceSynchronize());",
        f"  for (int i = 0; i < {n}; ++i) {{",
        "    if (!ce_host[i]) continue;",
        "    CE_CHECK(cudaMemcpy(ce_host[i], ce_dev[i], ce_bytes[i], cudaMemcpyDeviceToHost));",
        '    char out[256]; snprintf(out, sizeof out, "out-%s", ce_file[i]);',
        '    FILE *f = fopen(out, "wb"); fwrite(ce_host[i], 1, ce_bytes[i], f); fclose(f); }',
        '  printf("CE_HOST_DONE\\n"); return 0; }', ""])


# --- the peers' launches -----------------------------------------------------------

@dataclass
class Launch:
    """One peer kernel's launch: Triton's compile request, the launch's arguments by
    parameter name (arrays: device buffers; ``None``: null), its grid, which
    arrays it reads and writes (the floor's bytes) and its float64 expectations."""

    peer: str
    kernel: str
    request: dict
    args: dict
    grid: tuple
    reads: tuple
    writes: tuple
    check: object  # (outputs by name) -> [(label, actual, expected)]


# a buffer's Triton dtype by its NumPy one (bfloat16 is stored as its bits, uint16)
_TRITON_DTYPE = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                 np.dtype(np.uint16): "bfloat16", np.dtype(np.int64): "int64",
                 np.dtype(np.int32): "int32"}


def liger_cross_entropy(dtype: str, classes: int, rows: int, rng) -> Launch:
    """``LigerCrossEntropyFunction.forward`` with an input requiring grad (mean
    reduction, ignore_index -100, no weight, smoothing, z-loss or softcap): one
    program per row, BLOCK_SIZE min(32768, next power of 2 of V), 32 warps."""
    xk, x = store(rng.standard_normal((rows, classes)) * SCALE, dtype)
    y = rng.integers(0, classes, rows)
    y[::3] = IGNORE  # as cuda_cases' "some": every third row ignored
    live = y != IGNORE
    n = int(live.sum())
    loss0 = store(np.zeros(rows), dtype)[0]
    block = min(32768, 1 << (classes - 1).bit_length())
    args = dict(X_ptr=xk, X_stride=classes, Y_ptr=y, Y_stride=1, weight_ptr=None,
                loss_ptr=loss0, z_loss_ptr=None, loss_stride=1, token_accuracy_ptr=None,
                token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0,
                n_cols=classes, n_non_ignore=n, sum_non_ignore_weight=n, weight_sum=0.0,
                ignore_index=IGNORE, lse_square_scale=0.0, label_smoothing=0.0,
                reduction="mean", softcap=None, RETURN_Z_LOSS=False,
                RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False, BLOCK_SIZE=block,
                HAS_WEIGHT=False, HAS_SOFTCAPPING=False, HAS_GRADIENTS=True)
    request = dict(package="liger_kernel", distribution="liger-kernel",
                   file="ops/cross_entropy.py", kernel="liger_cross_entropy_kernel",
                   preamble=["from triton.language.extra.libdevice import tanh"],
                   options=dict(num_warps=32))
    # float64: per row lse - x_y over the non-ignored count; gradient (softmax - onehot) / n
    top = x.max(axis=1, keepdims=True)
    lse = (top + np.log(np.exp(x - top).sum(axis=1, keepdims=True)))[:, 0]
    rows_i = np.arange(rows)
    picked = x[rows_i, np.where(live, y, 0)]
    row_loss = np.where(live, lse - picked, 0.0) / n
    grad = np.exp(x - lse[:, None])
    grad[rows_i[live], y[live]] -= 1.0
    grad = np.where(live[:, None], grad / n, 0.0)

    def check(out):
        loss = value(out["loss_ptr"], dtype)
        return [("grad", value(out["X_ptr"], dtype).reshape(rows, classes), grad),
                ("row loss", loss, row_loss),
                ("mean loss", np.array([loss.sum()]), np.array([row_loss.sum()]))]

    return Launch("liger", "liger_cross_entropy_kernel", request, args, (rows, 1, 1),
                  ("X_ptr", "Y_ptr"), ("X_ptr", "loss_ptr"), check)


def _trl_reference(x: np.ndarray, index: np.ndarray):
    top = x.max(axis=1, keepdims=True)
    log_z = (top + np.log(np.exp(x - top).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(x - log_z[:, None])
    expected = (p * x).sum(axis=1)
    logp = x[np.arange(len(x)), index] - log_z
    return logp, log_z - expected, log_z, expected, p


def _trl_request(kernel: str) -> dict:
    return dict(package="trl", distribution="trl", file="kernels/logprob_entropy.py",
                kernel=kernel, options={})  # Triton's defaults: 4 warps, 3 stages


def trl_forward(dtype: str, classes: int, rows: int, rng) -> Launch:
    """``selective_log_softmax_and_entropy``'s forward on logits [rows, V] and
    index [rows] (temperature 1, no row mask: the index passed as the mask pointer)."""
    xk, x = store(rng.standard_normal((rows, classes)) * SCALE, dtype)
    index = rng.integers(0, classes, rows)
    outs = {k: np.full(rows, np.nan, np.float32)
            for k in ("logprobs_ptr", "entropy_ptr", "log_z_ptr", "expected_logit_ptr")}
    args = dict(logits_ptr=xk, index_ptr=index, row_mask_ptr=index, **outs,
                logits_batch_stride=0, logits_row_stride=classes, index_batch_stride=0,
                index_row_stride=1, mask_batch_stride=0, mask_row_stride=0, n_cols=classes,
                rows_per_batch=rows, TEMPERATURE=1.0, HAS_MASK=False, BLOCK_SIZE=1024)
    want = dict(zip(outs, _trl_reference(x, index)))

    def check(out):
        return [(k.removesuffix("_ptr"), out[k].astype(np.float64), want[k]) for k in outs]

    return Launch("trl", "_forward_kernel", _trl_request("_forward_kernel"), args,
                  (rows, 1, 1), ("logits_ptr", "index_ptr"), tuple(outs), check)


def trl_backward(dtype: str, classes: int, rows: int, rng) -> Launch:
    """``_LogProbEntropyFunction.backward`` with both gradients: grid (rows, V / 1024
    blocks), the saved log Z and expected logit (float32, from float64 here)."""
    xk, x = store(rng.standard_normal((rows, classes)) * SCALE, dtype)
    index = rng.integers(0, classes, rows)
    _, _, log_z, expected, p = _trl_reference(x, index)
    g, h = rng.random(rows) + 0.5, rng.random(rows)
    g32, h32 = g.astype(np.float32), h.astype(np.float32)
    grad = h[:, None] * p * (expected[:, None] - x) - g[:, None] * p
    grad[np.arange(rows), index] += g
    args = dict(logits_ptr=xk, index_ptr=index, row_mask_ptr=index,
                log_z_ptr=log_z.astype(np.float32), expected_logit_ptr=expected.astype(np.float32),
                grad_logprobs_ptr=g32, grad_entropy_ptr=h32,
                grad_logits_ptr=store(np.full((rows, classes), np.nan), dtype)[0],
                logits_batch_stride=0, logits_row_stride=classes, index_batch_stride=0,
                index_row_stride=1, mask_batch_stride=0, mask_row_stride=0,
                grad_logits_batch_stride=rows * classes, grad_logits_row_stride=classes,
                n_cols=classes, rows_per_batch=rows, TEMPERATURE=1.0, HAS_MASK=False,
                BLOCK_SIZE=1024, HAS_LOGPROB_GRAD=True, HAS_ENTROPY_GRAD=True)

    def check(out):
        return [("grad", value(out["grad_logits_ptr"], dtype).reshape(rows, classes), grad)]

    return Launch("trl", "_backward_kernel", _trl_request("_backward_kernel"), args,
                  (rows, -(-classes // 1024), 1),
                  ("logits_ptr", "index_ptr", "log_z_ptr", "expected_logit_ptr",
                   "grad_logprobs_ptr", "grad_entropy_ptr"), ("grad_logits_ptr",), check)


PEERS = {"liger": [liger_cross_entropy], "trl": [trl_forward, trl_backward]}
# each peer kernel's counterpart among ce-tvm's ops (gpgpu_sim_cycles' records' "op")
CE_TVM_OP = {"liger_cross_entropy_kernel": "train", "_forward_kernel": "log_probs",
             "_backward_kernel": "log_probs_grad"}


# --- running -----------------------------------------------------------------------

def request_for(launch: Launch) -> dict:
    args = {k: {"tensor": _TRITON_DTYPE[v.dtype]} if isinstance(v, np.ndarray) else v
            for k, v in launch.args.items()}
    return {**launch.request, "args": args}


def run(sim, kernel: Compiled, launch: Launch, folder: Path) -> dict:
    """``launch`` of ``kernel`` under ``sim`` in ``folder``: every array argument back."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = sim.compile(host_program(kernel), "peer")
    tokens, files = [], {}
    for name, kind in kernel.params:
        v = launch.args.get(name)
        if kind.startswith("*"):
            if v is None:
                tokens.append("null")
                continue
            files[name] = f"{name}.bin"
            (folder / files[name]).write_bytes(np.ascontiguousarray(v).tobytes())
            tokens.append(files[name])
        elif kind == "fp32":
            tokens.append(float(v).hex())
        else:
            tokens.append(str(int(v)))
    extents = [*launch.grid, kernel.num_warps * 32, 1, 1, kernel.shared]
    sim.execute(exe, folder, args=tuple(str(e) for e in extents) + tuple(tokens),
                ptx=kernel.ptx)
    arrays = {}
    for name, file in files.items():
        v = launch.args[name]
        arrays[name] = np.frombuffer((folder / f"out-{file}").read_bytes(), v.dtype) \
            .reshape(v.shape).copy()
    return arrays


def verify(launch: Launch, dtype: str, out: dict) -> tuple[float, float, list]:
    """(max |actual - expected|, worst ratio, problems) over the launch's outputs."""
    max_abs, worst, issues = 0.0, 0.0, []
    for label, actual, expected in launch.check(out):
        err, ratio, issue = compare(actual, np.asarray(expected, np.float64), TOL[dtype])
        max_abs, worst = max(max_abs, err), max(worst, ratio)
        if issue:
            issues.append(f"{label}: {issue}")
    return max_abs, worst, issues


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=5003)
    parser.add_argument("--rows", type=int, default=92)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--triton-python", help="Python of the environment with Triton")
    parser.add_argument("--functional-only", action="store_true",
                        help="check the results, skip the cycle model")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--ce-tvm", type=Path, help="gpgpu_sim_cycles.py's --json output: "
                        "its records of the peers' counterparts printed beside them")
    args = parser.parse_args(argv)
    reason = gpgpu_sim.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    python = triton_python(args.triton_python)
    if not Path(python).exists():
        print(f"no Triton environment at {python} (see this script's docstring)",
              file=sys.stderr)
        return 2
    functional = gpgpu_sim.Simulator.find()
    cycle_model = gpgpu_sim.Simulator.find(perf=True, launch_latency=0)
    c, n = args.classes, args.rows
    print(f"device: {cycle_model.name}; C = {c}, N = {n}; Triton peers compiled for sm_86")
    print(f"{'peer':6} {'kernel':28} {'dtype':8} {'warps':>5} {'cycles':>9} {'floor':>9} "
          f"{'ratio':>6}  check")
    records, failed = [], 0
    for peer in args.peers:
        for make in PEERS[peer]:
            for dtype in args.dtypes:
                launch = make(dtype, c, n, np.random.default_rng([c, n]))
                kernel = compile_peer(python, request_for(launch),
                                      functional.root / "run" / "triton-peer" / "cache")
                folder = functional.root / "run" / "triton-peer" / \
                    f"{peer}-{launch.kernel}-{dtype}-{c}x{n}"
                out = run(functional, kernel, launch, folder / "functional")
                max_abs, worst, issues = verify(launch, dtype, out)
                cycles = floor = None
                if not args.functional_only:
                    out = run(cycle_model, kernel, launch, folder / "cycles")
                    _, worst_perf, issues_perf = verify(launch, dtype, out)
                    worst = max(worst, worst_perf)
                    issues += [f"cycle model: {i}" for i in issues_perf]
                    cycles = sum(k for _, k in cycle_model.last.cycles)
                    reads = sum(np.asarray(launch.args[k]).nbytes for k in launch.reads)
                    writes = sum(np.asarray(launch.args[k]).nbytes for k in launch.writes)
                    floor = cycle_model.copy_floor(reads, writes)
                passed = not issues
                failed += not passed
                ratio = round(cycles / floor, 3) if cycles else None
                print(f"{peer:6} {launch.kernel:28} {dtype:8} {kernel.num_warps:>5} "
                      f"{cycles if cycles else '-':>9} {floor if floor else '-':>9} "
                      f"{ratio if ratio else '-':>6}  "
                      f"{'ok' if passed else 'FAIL ' + '; '.join(issues)} "
                      f"(max abs err {max_abs:.2e}, worst {worst:.2e})", flush=True)
                records.append(dict(
                    peer=peer, kernel=launch.kernel, dtype=dtype, classes=c, rows=n,
                    cycles=cycles, floor_cycles=floor, ratio=ratio, max_abs_err=max_abs,
                    worst=worst, tol=TOL[dtype], passed=passed, problem="; ".join(issues),
                    ce_tvm_op=CE_TVM_OP[launch.kernel], grid=list(launch.grid),
                    num_warps=kernel.num_warps, shared=kernel.shared,
                    params=[f"{k} {name}" for name, k in kernel.params],
                    constexprs=kernel.info["constexprs"], hints=kernel.info["hints"],
                    versions=kernel.info["versions"], device=cycle_model.name))
                if args.json:
                    args.json.write_text(json.dumps(records, indent=1) + "\n")
    if args.ce_tvm:
        beside(records, json.loads(args.ce_tvm.read_text()))
    return 1 if failed else 0


def beside(records: list, ce_tvm: list) -> None:
    """Each peer record's cycles beside ce-tvm's for its counterpart op (``CE_TVM_OP``)
    at the same dtype and sizes, each over its own floor."""
    print(f"\n{'peer kernel':36} {'dtype':8} {'peer':>9} {'ratio':>6}   "
          f"{'ce-tvm':36} {'cycles':>9} {'ratio':>6}")
    for r in records:
        for ce in ce_tvm:
            if (ce["op"], ce["dtype"], ce["classes"], ce["rows"]) != \
                    (CE_TVM_OP[r["kernel"]], r["dtype"], r["classes"], r["rows"]):
                continue
            print(f"{r['peer'] + ' ' + r['kernel']:36} {r['dtype']:8} {r['cycles'] or '-':>9} "
                  f"{r['ratio'] or '-':>6}   {ce['op'] + ' ' + ce['variant']:36} "
                  f"{ce['cycles']:>9} {ce['ratio']:>6}")


if __name__ == "__main__":
    sys.exit(main())
