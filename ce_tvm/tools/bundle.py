"""``ce-tvm bundle``: every kernel the training and seed APIs need for some
shapes, with the TVM runtime libraries they need, in one directory that runs
without the TVM compiler.

Layout::

    <dir>/bundle.json            what is inside: versions, target, shapes, kernels,
                                 size and SHA-256 of each runtime library
    <dir>/<stem>-<keyhash>.so    the kernels and their manifests (the cache's layout);
                                 CUDA kernels also a .cubin built with nvcc (the module
                                 keeps its source, which only TVM could compile)
    <dir>/host-<cpu>.json        (CPU bundles) LLVM's name of the CPU they were built for
    <dir>/lib/libtvm_runtime*.so the TVM runtime, copied from the installed apache-tvm
    <dir>/licenses/              apache-tvm's LICENSE and NOTICE
    <dir>/README.md

Files are 0600 and directories 0700, as in the cache; the runtime checks
permissions and SHA-256 sums before loading anything from a bundle.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..compiler.build import Extras, ahead_of_time_specs
from ..runtime import cache
from ..store.files import copy_file, fingerprint, make_private_dir, write_file
from ..store.paths import BUNDLE_MANIFEST
from ..store.spec import __version__
from ..store.targets import write_host_descriptor
from ..store.tvmlib import RUNTIME_LIBS, runtime_source

README = """# ce_tvm kernel bundle

Kernels for target {target}, {dtype}, C in {classes}: every variant the
training API (`ce_tvm.cross_entropy`, `CrossEntropyLoss`) and the seed pair
(`cross_entropy_loss`, `cross_entropy_loss_grad`) use, built by ce_tvm
{ce_tvm} with Apache TVM {tvm}. `lib/` holds the TVM runtime libraries they
need (Apache License 2.0, see `licenses/`).

Use it on a host with torch, `apache-tvm-ffi` and ce_tvm (`pip install
--no-deps ce-tvm`; the compiler, `apache-tvm`, is not needed):

    export CE_TVM_MODULE_DIR={out}     # or: ce_tvm.use_bundle("{out}")

{knobs_note}Check it with `ce-tvm cache verify --dir {out}`. Keep its files private
(0600, directories 0700): ce_tvm refuses files others can write.
"""


def make_bundle(out: Path, *, target: str, dtype: str, classes: list[int],
                arch: str | None = None, knobs: tuple = (), progress=print,
                extras: Extras = Extras()) -> dict:
    """Build the bundle in ``out`` (kernels already there or in the cache, and
    verified, are reused) with the variants ``extras`` asks for, and for CUDA
    with the schedule ``knobs`` (``(name, value)`` pairs, as
    ``ce_tvm.schedule("cuda", ...)`` asks for them); returns its manifest."""
    options = (("arch", arch), *knobs) if target == "cuda" else ()
    make_private_dir(out)
    kernels = []
    for c in classes:
        for spec in ahead_of_time_specs(target, dtype, c, options, extras):
            lib, _ = cache.export_module(spec, out)
            kernels.append(lib.name)
            progress(f"  {lib.name}")
    if target == "llvm":
        write_host_descriptor(out)
    directory, version, _ = runtime_source()
    make_private_dir(out / "lib")
    sums = {}
    for name in RUNTIME_LIBS[target]:
        copy_file(directory / name, out / "lib" / name)
        sums[name] = fingerprint(out / "lib" / name)
    make_private_dir(out / "licenses")
    for name in ("LICENSE", "NOTICE"):
        copy_file(directory.parent / name, out / "licenses" / f"apache-tvm-{name}")
    manifest = {"ce_tvm": __version__, "tvm": version, "target": target, "arch": arch,
                **({"knobs": dict(knobs)} if knobs else {}),
                "dtype": dtype, "classes": classes, "kernels": kernels, "runtime_libs": sums}
    write_file(out / BUNDLE_MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    knob_text = ", ".join(f"{k}={v}" for k, v in knobs)
    write_file(out / "README.md", README.format(
        target=target + (f" ({', '.join(filter(None, [arch, knob_text]))})" if arch else ""),
        dtype=dtype, classes=classes, ce_tvm=__version__, tvm=version, out=out.resolve(),
        knobs_note=(f'Its kernels serve the calls inside `ce_tvm.schedule("cuda", {knob_text})`.'
                    "\n\n" if knobs else "")).encode())
    return manifest

