"""Imports run one way: ce_tvm's modules and schedules/ form layers, lowest first.

Every module is parsed with ``ast``; every import counts, also one inside a
function. The graph of imports between the package's own modules must be
acyclic and point downward (or sideways within a layer).
"""

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The packages' floors, lowest first: a module imports only from its own floor or those
# below. ``losses`` has two: its ground floor (the input check, the autograd protocol,
# output shapes) under ``distributed``, its families above it.
PACKAGES = ("kernels", "schedules", "store", "compiler", "runtime", "testing", "losses",
            "distributed", "losses", "", "tools", "integrations")
# Lowest first. A module may import modules of its own layer or of layers below; the
# layers of one floor are contiguous, in PACKAGES' order ("" is ce_tvm's top level).
LAYERS = [
    # the math, target-free
    # dtypes, reductions, variants; the exp; the lowering choices a schedule declares
    ("kernels.kinds", "kernels.fastmath", "kernels.choices"),
    ("kernels.stages",),
    ("kernels.common",),
    ("kernels.loss_terms",),  # per-row loss terms, sums over rows, gradient coefficients
    ("kernels.forward", "kernels.shards", "kernels.backward", "kernels.training",
     "kernels.prob_targets", "kernels.log_probs", "kernels.divergence"),
    ("kernels",),
    # one module per target
    # what the target modules share; the Ascend plan; the CPU's sizes and knobs, its
    # bfloat16 rounding and widening, its streamed gradient stores, its lane merges,
    # its training rows lagged
    ("schedules._common", "schedules.ascend_plan", "schedules.cpu_knobs",
     "schedules.cpu_narrowing", "schedules.cpu_reductions", "schedules.cpu_stores",
     "schedules.cpu_widening", "schedules.cpu_lagged_rows"),
    ("schedules.cpu", "schedules.cuda", "schedules.ascend", "schedules"),
    # a kernel's name and files, without the compiler or torch
    ("store.paths",),  # where modules live and who may write them
    ("store.files",),  # atomic writes, manifests and locks
    ("store.tvmlib", "store.targets"),  # the TVM runtime library; target descriptions
    ("store.records",),  # tuning records, read side
    ("store.spec", "store"),  # KernelSpec and its cache key
    ("compiler.build", "compiler"),
    # kernels in a process
    ("runtime.options", "runtime.omp_pool"),  # loss options; the OpenMP launcher
    ("runtime.cache",),
    ("runtime.registry", "runtime.tensors", "runtime.pool"),
    ("runtime.launch",),
    # what the ranks of a vocabulary-parallel group exchange; a head's log-probs by
    # vocabulary blocks and their merge (a shard's too)
    ("runtime.collectives", "runtime.vocab_blocks"),
    ("runtime.linear_sweep", "runtime"),  # the chunked linear + loss sweep; no autograd
    # what ce_tvm is checked against: the float64 reference, the GPU schedules on PoCL and
    # in GPGPU-Sim (its self-check), their machine code; never through the torch surface
    ("testing", "testing.reference", "testing.pocl", "testing.cuda_static", "testing.cpu_static",
     "testing.gpgpu_sim_checks"),
    ("testing.gpgpu_sim", "testing.cuda_cases"),
    # the losses' ground floor: the one input check; op registration and the one protocol
    # for gradients computed in the forward; result and fake-output shapes (the package's
    # __init__ imports nothing: here, where importing a floor-mate runs it)
    ("losses", "losses.checks", "losses.autograd", "losses.outputs"),
    # multi-device: the vocabulary-parallel losses and the one rule for sharded heads
    ("distributed.vocab_parallel", "distributed.heads", "distributed.eager", "distributed"),
    ("distributed.dtensors",),  # what DTensors mean, for each family
    # the losses users call, one module per family (ops and public API)
    ("losses.cross_entropy", "losses.seed", "losses.linear", "losses.log_probs",
     "losses.distillation"),
    ("losses.topk_distillation",),
    # the public names; optional dependencies (an import naming the extra to install)
    ("optional", "__init__"),
    # what users run beside the loss
    ("tools.measure", "tools.bench_args"),
    ("tools.bench_linear", "tools.bench_policy", "tools.tuning", "tools.bundle"),
    ("tools.bench", "tools.demo"),
    ("tools.cli", "tools"),
    # training frameworks, on the public surface (each imports its framework)
    ("integrations", "integrations.transformers", "integrations.trl",
     "integrations.torchtitan"),
]
# Modules that must not depend on torch or on meta_schedule (the search).
NO_TORCH_PACKAGES = ("kernels", "schedules", "store", "compiler")
NO_TORCH_MODULES = ("runtime.options", "runtime.omp_pool", "runtime.cache", "optional")
SEARCH_ONLY = "tools.tuning"
# What ``import ce_tvm`` and a call served by an already-built kernel import: none of
# them may import the tvm package (the compiler) when it is imported itself; only a
# function that builds or tunes may (``tvm_ffi``, the FFI, is not the compiler).
RUNTIME_PATH = ("kernels", "kernels.kinds", "store", "store.paths", "store.files",
                "store.tvmlib", "store.targets", "store.records", "store.spec", "runtime",
                "runtime.options", "runtime.cache", "runtime.registry", "runtime.tensors",
                "runtime.pool", "runtime.launch", "runtime.collectives", "losses",
                "losses.checks", "losses.autograd", "losses.outputs", "losses.cross_entropy",
                "losses.seed", "losses.linear", "losses.log_probs", "losses.distillation",
                "losses.topk_distillation", "distributed", "distributed.vocab_parallel",
                "distributed.heads", "distributed.eager", "distributed.dtensors", "__init__")

SUBPACKAGES = {"schedules": ROOT / "schedules",
               **{p: ROOT / "ce_tvm" / p for p in PACKAGES if p and p != "schedules"}}


def module_files() -> dict:
    """``{name relative to ce_tvm: path}`` for the package's modules (a
    subpackage's ``__init__.py`` under the subpackage's name)."""
    files = {p.stem: p for p in (ROOT / "ce_tvm").glob("*.py")}
    for package, directory in SUBPACKAGES.items():
        files.update({f"{package}.{p.stem}": p for p in directory.glob("*.py")})
        files[package] = files.pop(f"{package}.__init__")
    return files


def package_name(module: str) -> str:
    """The package a module belongs to (``""`` for ce_tvm's top level)."""
    return module if module in SUBPACKAGES else module.rpartition(".")[0]


def package_of(name: str) -> str:
    """The package that the relative imports of module ``name`` start from."""
    if name in SUBPACKAGES:  # the subpackage's __init__.py
        return f"ce_tvm.{name}"
    parent = name.rpartition(".")[0]
    return f"ce_tvm.{parent}" if parent else "ce_tvm"


def imports(name: str, path: Path) -> set:
    """Absolute names of every module ``path`` imports, at any depth of its code."""
    package = package_of(name)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            if node.module:
                found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # submodules
    return found


def package_graph() -> dict:
    """``{module: {package modules it imports}}``, names relative to ce_tvm."""
    files = module_files()
    graph = {}
    for name, path in files.items():
        deps = set()
        for full in imports(name, path):
            if full == "ce_tvm":
                deps.add("__init__")
            elif full.startswith("ce_tvm."):
                rel = full.removeprefix("ce_tvm.")
                if rel in files:
                    deps.add(rel)
        graph[name] = deps - {name}
    return graph


def layer_of(name: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if name in layer)


def test_every_module_has_a_layer():
    assert sorted(module_files()) == sorted(m for layer in LAYERS for m in layer)


def test_imports_are_acyclic():
    graphlib.TopologicalSorter(package_graph()).prepare()  # raises CycleError on a cycle


def test_imports_point_downward():
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
              for a, deps in package_graph().items() for b in deps if layer_of(b) > layer_of(a)]
    assert not upward, "\n".join(upward)


def test_layers_follow_the_package_order():
    """Each layer lies in one package, and the layers walk PACKAGES' floors in order:
    a package's layers are contiguous on each of its floors."""
    floor = 0
    for layer in LAYERS:
        packages = {package_name(m) for m in layer}
        assert len(packages) == 1, f"{layer} spans packages {packages}"
        (package,) = packages
        assert package in PACKAGES[floor:], f"{layer} is below a floor already left"
        floor = PACKAGES.index(package, floor)


def test_only_the_cli_imports_the_search():
    importers = sorted(a for a, deps in package_graph().items() if SEARCH_ONLY in deps)
    assert importers == ["tools.cli"]


NO_TORCH = sorted(m for m in module_files()
                  if package_name(m) in NO_TORCH_PACKAGES or m in NO_TORCH_MODULES)


@pytest.mark.parametrize("name", NO_TORCH)
def test_kernel_side_needs_neither_torch_nor_the_search(name):
    found = imports(name, module_files()[name])
    assert not [m for m in found if m == "torch" or m.startswith("torch.")], name
    assert not [m for m in found if "meta_schedule" in m], name


def module_level_imports(path: Path) -> set:
    """Names the module imports when it is itself imported (not inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module)
    return found


@pytest.mark.parametrize("name", RUNTIME_PATH)
def test_runtime_path_does_not_import_the_compiler(name):
    found = module_level_imports(module_files()[name])
    assert not [m for m in found if m == "tvm" or m.startswith("tvm.")], name


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """The graph counts a function-level import (the kind that hid a cycle before)."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from . import tuning\n    from .compute import Variant\n")
    assert {"ce_tvm.tuning", "ce_tvm.compute"} <= imports("probe", path)


@pytest.mark.slow  # a process
def test_the_command_line_starts_without_the_compiler_or_torch():
    """``ce-tvm cache``, ``plan`` and ``--help`` import neither TVM (5.4 s of a 10 s
    ``ce-tvm cache list``) nor torch (2.6 s of the 3.3 s left; now 0.25 s);
    ``compile``, ``bundle`` and ``tune`` import TVM, ``bench`` and ``demo`` torch."""
    code = ("import sys, ce_tvm.tools.cli; "
            "assert not {'tvm', 'torch'} & set(sys.modules), sorted(sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_losses_package_init_imports_nothing():
    """``losses/__init__.py`` sits on the ground floor because it imports nothing."""
    assert not imports("losses", module_files()["losses"])
