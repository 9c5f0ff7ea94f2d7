"""Lower, schedule and compile one kernel into a shared library.

A ``KernelSpec`` names everything that changes the generated code; its
``key()`` (which also fingerprints the compute and schedule sources, the TVM
version and the exact target) is what the module cache is keyed by. Building
a key reads no files: a tuning record's digest is resolved into the spec once
(``tuned_spec``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import tvm

from . import compute, fastmath, records
from .targets import tvm_target

__version__ = importlib.metadata.version("ce-tvm")
OPS = ("forward", "train", "backward", "shard_stats", "shard_combine")
TUNED_OPS = ("forward", "backward")  # the kernels tuning records exist for
log = logging.getLogger("ce_tvm")


@dataclass(frozen=True)
class KernelSpec:
    """One compiled kernel: op x target x storage dtype x C x variant."""

    op: str
    dtype: str
    classes: int
    variant: compute.Variant = field(default_factory=compute.Variant)
    target: str = "llvm"
    options: tuple = ()  # schedule options as sorted (name, value) pairs, e.g. the ascend profile
    tuned: str = ""  # id of a tuning record (``ce_tvm.records``) used instead of the hand schedule
    tuned_digest: str = ""  # that record's digest (``records.record_digest``), resolved once

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.dtype not in compute.DTYPES:
            raise ValueError(f"dtype must be one of {compute.DTYPES}, got {self.dtype!r}")
        if self.classes < 1:
            raise ValueError(f"classes must be >= 1, got {self.classes}")
        if bool(self.tuned) != bool(self.tuned_digest):
            raise ValueError("a tuned KernelSpec needs its record's digest (see tuned_spec)")

    def stem(self) -> str:
        """Readable file-name stem (the key hash is appended by the cache)."""
        return self.name() + ("-tuned" if self.tuned else "")

    def name(self) -> str:
        """The kernel's name, tuning aside: what its tuning records are filed under."""
        tag = self.variant.tag()
        if self.op != "backward":  # grad_source only changes the backward
            tag = tag.rsplit("-", 1)[0]
        else:  # nor does log_prob the backward
            tag = tag.replace("-lp-", "-").replace("-nolp-", "-")
        opts = "".join(f"-{v}" for _, v in self.options)
        return f"{self.target}{opts}-{self.op}-{self.dtype}-C{self.classes}-{tag}"

    def key(self) -> dict:
        """Everything the generated code depends on, as a JSON-able dict."""
        return {
            "ce_tvm": __version__,
            "tvm": tvm.__version__,
            "target": str(self.tvm_target().export()),
            "op": self.op,
            "dtype": self.dtype,
            "classes": self.classes,
            "variant": self.stem(),
            "options": [list(kv) for kv in self.options],
            "tuned": self.tuned_digest,
            "code": _code_fingerprint(self.target),
        }

    def tvm_target(self):
        """The TVM target (the CUDA arch is a schedule option of the ``cuda`` target)."""
        return tvm_target(self.target, dict(self.options).get("arch"))

    def schedule_options(self) -> dict:
        return {k: v for k, v in self.options if k != "arch"}

    def record_id(self, rows: int) -> str:
        """The id of this kernel's tuning record at ``rows`` rows."""
        return records.record_id(self.tvm_target(), self.name(), rows)

    def key_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.key(), sort_keys=True).encode()).hexdigest()[:16]

    def file_name(self) -> str:
        return f"{self.stem()}-{self.key_hash()}.so"


def schedule_module(target: str):
    """The ``schedules/<target>.py`` module (installed as ``ce_tvm.schedules.<target>``)."""
    return importlib.import_module(f"ce_tvm.schedules.{_schedule_name(target)}")


def _schedule_name(target: str) -> str:
    return "cpu" if target == "llvm" else target


_FINGERPRINTS: dict = {}


def _code_fingerprint(target: str) -> str:
    """Hash of the sources that define the generated code for ``target``: the
    compute, and the target's schedule with the schedule modules it imports."""
    if target not in _FINGERPRINTS:
        h = hashlib.sha256()
        for mod in (compute, fastmath, *_schedule_modules(schedule_module(target))):
            h.update(inspect.getsource(mod).encode())
        _FINGERPRINTS[target] = h.hexdigest()[:16]
    return _FINGERPRINTS[target]


def _schedule_modules(module) -> list:
    """``module`` and the ``ce_tvm.schedules`` modules it imports from (``from ._common ...``)."""
    tree = ast.parse(inspect.getsource(module))
    siblings = sorted({node.module for node in ast.walk(tree)
                       if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module})
    return [module] + [importlib.import_module(f"ce_tvm.schedules.{name}") for name in siblings]


def declared_func(spec: KernelSpec) -> tvm.tirx.PrimFunc:
    """The compute of ``spec``, unscheduled (forward rows chunked, and ``exp``
    scaled and NaN-tested, as the schedule asks: ``exp_scaling``, ``EXP_NAN_TEST``)."""
    schedule = schedule_module(spec.target)
    scaling = getattr(schedule, "exp_scaling", lambda target: "bits")(spec.tvm_target())
    with fastmath.scaling(scaling, nan_test=getattr(schedule, "EXP_NAN_TEST", False)):
        return _declare(spec, schedule)


def _declare(spec: KernelSpec, schedule) -> tvm.tirx.PrimFunc:
    args = (spec.classes, spec.dtype, spec.variant)
    if spec.op in ("forward", "train", "shard_stats"):
        chunk_of = getattr(schedule, f"{spec.op}_chunk", schedule.forward_chunk)
        chunk = chunk_of(spec.classes, spec.dtype, spec.tvm_target(), **spec.schedule_options())
        declare = {"forward": compute.forward_func, "train": compute.train_func,
                   "shard_stats": compute.shard_stats_func}[spec.op]
        return declare(*args, chunk)
    if spec.op == "shard_combine":
        return compute.shard_combine_func(*args)
    return compute.backward_func(*args)


SCHEDULE_OF_OP = {"forward": "forward", "train": "train", "shard_stats": "forward",
                  "backward": "backward", "shard_combine": "per_row"}


def scheduled_func(spec: KernelSpec) -> tvm.tirx.PrimFunc:
    """The compute of ``spec`` with its tuning record, or its target's hand schedule."""
    func = declared_func(spec)
    if spec.tuned:
        try:
            return records.apply_record(spec.tuned, func, spec.tvm_target())
        except RuntimeError as err:  # a record of an older compute: never fail the build
            log.warning("ce_tvm: %s (it was tuned for another version of the compute); "
                        "using the hand schedule. Retune it with ce-tvm tune.", err)
    schedule = getattr(schedule_module(spec.target), SCHEDULE_OF_OP[spec.op])
    return schedule(func, spec.tvm_target(), **spec.schedule_options())


_told: set = set()


def tuned_spec(spec: KernelSpec, rows: int) -> KernelSpec:
    """``spec`` with the tuning record nearest to ``rows`` rows, if one applies
    (``records.nearest_record``); its digest is read here, once per record."""
    if spec.op not in TUNED_OPS:
        return spec
    found = records.nearest_record(spec.tvm_target(), spec.name(), rows)
    if found is None:
        if spec not in _told:
            _told.add(spec)
            log.debug("ce_tvm: no tuning record for %s; tune it with: ce-tvm tune --target %s "
                      "--dtype %s --classes %d --rows %d", spec.stem(), spec.target, spec.dtype,
                      spec.classes, max(rows, 1))
        return spec
    rid, digest = found
    return replace(spec, tuned=rid, tuned_digest=digest)


def lower_and_compile(spec: KernelSpec):
    """``tvm.compile`` the scheduled kernel; returns the Executable. A schedule
    module may name its own lowering pipeline (``TIR_PIPELINE``: the CPU's adds
    prefetches) and pass options (``PASS_CONFIG``)."""
    schedule = schedule_module(spec.target)
    pipeline = getattr(schedule, "TIR_PIPELINE", None)
    config = getattr(schedule, "PASS_CONFIG", {})
    with tvm.transform.PassContext(opt_level=3, config=config):
        return tvm.compile(scheduled_func(spec), target=spec.tvm_target(),
                           **({"tir_pipeline": pipeline} if pipeline else {}))


def compile_spec(spec: KernelSpec):
    """``lower_and_compile``; for CUDA on a machine without a GPU, TVM keeps the
    CUDA source: it is then compiled with ``nvcc`` when one is on ``PATH`` so
    that errors surface here."""
    executable = lower_and_compile(spec)
    if spec.target == "cuda" and shutil.which("nvcc") and not tvm.cuda().exist:
        check_cuda_source(executable, spec.tvm_target())
    return executable


def check_cuda_source(executable, target) -> bytes:
    """Compile the CUDA source TVM generated with ``nvcc`` (raises on any error)."""
    from tvm.support import nvcc

    source = executable.mod.imports[0].inspect_source()
    arch = str(target.attrs["arch"])
    with target:
        return nvcc.compile_cuda(source, target_format="cubin", arch=arch, compiler="nvcc")


def export_atomically(executable, path: Path) -> None:
    """Write the shared library to ``path`` so that readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        executable.export_library(tmp)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
