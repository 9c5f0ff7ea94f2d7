"""What names a compiled kernel, and the key the module cache files it under,
computed without importing TVM.

A ``KernelSpec`` names everything that changes the generated code; its
``key()`` also fingerprints the compute and schedule sources (read as files,
not imported), the version of the TVM that runs the kernels and the target
(for the CPU, LLVM's name of this host's CPU, ``ce_tvm.store.targets.host_cpu``).
Building a key reads no tuning records: a record's digest is resolved into
the spec once (``tuned_spec``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..kernels.kinds import DTYPES, Variant
from . import records
from .targets import target_description
from .tvmlib import tvm_version

__version__ = importlib.metadata.version("ce-tvm")
OPS = ("forward", "train", "backward", "shard_stats", "shard_combine", "prob_forward",
       "prob_backward", "prob_target_grad", "log_probs", "log_probs_grad", "divergence")
LOG_PROB_OPS = ("log_probs", "log_probs_grad")  # docs/spec.md, section 9
TUNED_OPS = ("forward", "train", "backward", *LOG_PROB_OPS)  # the kernels tuning records exist for
log = logging.getLogger("ce_tvm")


# Options whose value alone names them in a kernel's name (``sm_90``, ``910b``); a
# schedule knob is named with its value (``threads512``).
NAMED_BY_VALUE = ("arch", "profile")


@dataclass(frozen=True)
class KernelSpec:
    """One compiled kernel: op x target x storage dtype x C x variant."""

    op: str
    dtype: str
    classes: int
    variant: Variant = field(default_factory=Variant)
    target: str = "llvm"
    options: tuple = ()  # schedule options as sorted (name, value) pairs, e.g. the ascend profile
    # id of a tuning record (``ce_tvm.store.records``) used instead of the hand schedule
    tuned: str = ""
    tuned_digest: str = ""  # that record's digest (``records.record_digest``), resolved once

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
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
        if self.op in LOG_PROB_OPS:  # only the index columns, cap, stats and entropy change them
            tag = "-".join([f"k{self.variant.columns}", *(["sc"] if self.variant.softcap else []),
                            *(["st"] if self.variant.stats else []),
                            *([] if self.variant.entropy else ["nh"])])
        elif self.op != "backward":  # grad_source only changes the backward
            tag = tag.rsplit("-", 1)[0]
        else:  # nor does log_prob the backward
            tag = tag.replace("-lp-", "-").replace("-nolp-", "-")
        opts = "".join(f"-{v}" if k in NAMED_BY_VALUE else f"-{k}{v}" for k, v in self.options)
        return f"{self.target}{opts}-{self.op}-{self.dtype}-C{self.classes}-{tag}"

    def key(self) -> dict:
        """Everything the generated code depends on, as a JSON-able dict."""
        return {
            "ce_tvm": __version__,
            "tvm": tvm_version(),
            "target": self.target_description(),
            "op": self.op,
            "dtype": self.dtype,
            "classes": self.classes,
            "variant": self.stem(),
            "options": [list(kv) for kv in self.options],
            "tuned": self.tuned_digest,
            "code": code_fingerprint(self.target),
        }

    def record_name(self) -> str:
        """The name whose tuning records this kernel uses: its own, but for a kernel
        without label smoothing (``Variant.smoothing`` off), which is never tuned
        and uses its sibling's with it on: the same loops but for one sum, so the
        record's knobs apply (``schedule_with_knobs``), not its trace."""
        if self.variant.smoothing:
            return self.name()
        return replace(self, variant=replace(self.variant, smoothing=True)).name()

    def target_description(self) -> dict:
        """The TVM target as a JSON dict (the CUDA arch is a schedule option of ``cuda``)."""
        return target_description(self.target, dict(self.options).get("arch"))

    def tvm_target(self):
        """The TVM target (imports the compiler)."""
        from .targets import tvm_target

        return tvm_target(self.target, dict(self.options).get("arch"))

    def schedule_options(self) -> dict:
        return {k: v for k, v in self.options if k != "arch"}

    def record_id(self, rows: int) -> str:
        """The id of this kernel's tuning record at ``rows`` rows."""
        return records.record_id(self.target_description(), self.name(), rows)

    def key_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.key(), sort_keys=True).encode()).hexdigest()[:16]

    def file_name(self) -> str:
        return f"{self.stem()}-{self.key_hash()}.so"


def schedule_name(target: str) -> str:
    """The module of ``schedules/`` that schedules ``target`` (``llvm`` -> ``cpu``)."""
    return "cpu" if target == "llvm" else target


_FINGERPRINTS: dict = {}


def code_fingerprint(target: str) -> str:
    """Hash of the sources that define the generated code for ``target``: every
    module of ``ce_tvm.kernels`` (the compute) and of ``ce_tvm.compiler`` (which
    schedule and lowering choices a kernel gets), and the target's schedule with
    the schedule modules it imports (read from their files: nothing is imported).
    So a cache kept between versions of the source rebuilds what a change touches."""
    if target not in _FINGERPRINTS:
        h = hashlib.sha256()
        for package in ("ce_tvm.kernels", "ce_tvm.compiler"):
            folder = Path(importlib.util.find_spec(package).submodule_search_locations[0])
            for path in sorted(folder.glob("*.py")):
                h.update(path.read_text().encode())
        for name in _schedule_modules(f"ce_tvm.schedules.{schedule_name(target)}"):
            h.update(_source(name).encode())
        _FINGERPRINTS[target] = h.hexdigest()[:16]
    return _FINGERPRINTS[target]


def _source(module: str) -> str:
    return Path(importlib.util.find_spec(module).origin).read_text()


def _schedule_modules(module: str) -> list[str]:
    """``module`` and the ``ce_tvm.schedules`` modules it imports from (``from ._common ...``)."""
    tree = ast.parse(_source(module))
    siblings = sorted({node.module for node in ast.walk(tree)
                       if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module})
    return [module] + [f"ce_tvm.schedules.{name}" for name in siblings]


_told: set = set()


def tuned_spec(spec: KernelSpec, rows: int) -> KernelSpec:
    """``spec`` with the tuning record nearest to ``rows`` rows, if one applies
    (``records.nearest_record``); its digest is read here, once per record."""
    if spec.op not in TUNED_OPS:
        return spec
    found = records.nearest_record(spec.target_description(), spec.record_name(), rows)
    if found is None:
        if spec not in _told:
            _told.add(spec)
            log.debug("ce_tvm: no tuning record for %s; tune it with: ce-tvm tune --target %s "
                      "--dtype %s --classes %d --rows %d", spec.stem(), spec.target, spec.dtype,
                      spec.classes, max(rows, 1))
        return spec
    rid, digest = found
    return replace(spec, tuned=rid, tuned_digest=digest)


def tuned_variants(spec: KernelSpec) -> list[KernelSpec]:
    """``spec`` with each tuning record that applies to it, at any row count
    (what a bundle ships so that every N finds its kernel)."""
    if spec.op not in TUNED_OPS:
        return []
    return [replace(spec, tuned=rid, tuned_digest=digest) for _, rid, digest in
            records.applicable(spec.target_description(), spec.record_name())]
