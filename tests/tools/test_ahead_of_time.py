"""What ``ce-tvm compile`` and ``ce-tvm bundle`` build (``build.all_specs`` and
its ``Extras``) covers what calls with those options load."""

import dataclasses

import pytest
import torch

import ce_tvm
from ce_tvm.compiler.build import Extras, all_specs
from ce_tvm.kernels.kinds import Variant
from ce_tvm.runtime import cache, launch, registry
from ce_tvm.store.files import sealed_problem
from ce_tvm.store.spec import KernelSpec
from support import CLI, DISTILL_PROBE, Forked, run

C = 37  # the softcap and temperature tests' class count: their kernels are built already
NAN_ROW = torch.tensor([[1.0], [float("nan")], [1.0], [1.0], [1.0]])  # scales 5 rows


def _untuned(spec):
    return dataclasses.replace(spec, tuned="", tuned_digest="")


def test_plain_build_is_unchanged_by_default():
    """69 kernels per (target, dtype, C) without the extras (``--softcap`` and the
    other flags): 46, the 16 forward and training kernels again without label
    smoothing, and the 7 kernels that compute a call of either again where a
    row's ``lse`` is not finite (``exact_path_specs``: a vocabulary shard's
    statistics with and without the smoothing's sum and class weights, and
    their combines)."""
    specs = all_specs("llvm", "float32", C)
    assert len(specs) == 69
    exact = [s for s in specs if s.op.startswith("shard_")]
    assert len(exact) == 7
    plain = [s for s in specs if s.variant.smoothing and s not in exact]
    assert len(plain) == 46
    assert {dataclasses.replace(s, variant=dataclasses.replace(s.variant, smoothing=True))
            for s in specs if not s.variant.smoothing and s not in exact} == {
        s for s in plain if s.op in ("forward", "train")}
    assert all_specs("llvm", "float32", C, (), Extras()) == all_specs("llvm", "float32", C)


def test_distill_adds_the_divergence_kernels():
    """``--distill``: 3 directions x with and without the gradient; with
    ``--softcap`` x either side capped or not (24)."""
    def divergence(extras):
        return [s for s in all_specs("llvm", "float32", C, (), extras) if s.op == "divergence"]

    assert divergence(Extras()) == divergence(Extras(softcap=True)) == []
    assert len(divergence(Extras(distill=True))) == 6
    assert len(set(divergence(Extras(softcap=True, distill=True)))) == 24


@pytest.mark.parametrize("extras,calls", [
    (Extras(softcap=True, temperature=True, accuracy=True), [
        lambda x, y: ce_tvm.cross_entropy(x, y, softcap=5.0, temperature=0.8,
                                          return_token_accuracy=True)[0],
        lambda x, y: ce_tvm.cross_entropy(x, y, reduction="none", temperature=1.5),
        lambda x, y: ce_tvm.cross_entropy(x, torch.softmax(x.detach(), 1), softcap=4.0),
        lambda x, y: ce_tvm.cross_entropy(x, y, label_smoothing=0.1, softcap=5.0,
                                          return_token_accuracy=True)[0],
    ]),
    (Extras(softcap=True, log_probs=(1, 3)), [
        lambda x, y: ce_tvm.log_probs(x, y.clamp(min=0), softcap=5.0, temperature=0.7),
        lambda x, y: ce_tvm.log_probs(x, torch.zeros(len(y), 3, dtype=torch.long)),
    ]),
    (Extras(softcap=True, log_probs=(1,), stats=True), [  # what TRL's trainers ask for
        lambda x, y: ce_tvm.log_probs(x, y.clamp(min=0), softcap=5.0, return_entropy=True,
                                      return_stats=True)[0],
    ]),
    (Extras(log_probs=(1,)), [  # a row not finite: computed again exactly
        lambda x, y: ce_tvm.cross_entropy(x * NAN_ROW, y),
        lambda x, y: ce_tvm.cross_entropy(x * NAN_ROW, y, torch.rand(C) + 0.5,
                                          reduction="none"),
        lambda x, y: ce_tvm.log_probs(x * NAN_ROW, y.clamp(min=0)),
    ]),
    (Extras(softcap=True, distill=True), [  # every direction, either side capped
        lambda x, y: ce_tvm.distillation_loss(x, x.detach().flip(0), y, beta=beta,
                                              reduction=reduction, **caps)
        for beta in (0.0, 0.3, 1.0) for reduction in ("mean", "none")
        for caps in ({}, dict(student_softcap=4.0), dict(teacher_softcap=3.0),
                     dict(student_softcap=4.0, teacher_softcap=3.0, temperature=0.7))
    ]),
], ids=["loss-variants", "log-probs", "log-prob-stats", "exact-paths", "distill"])
def test_what_calls_load_is_built(extras, calls, monkeypatch):
    """Every kernel the calls run (forward and backward) is in the build list."""
    built = {_untuned(s) for s in all_specs("llvm", "float32", C, (), extras)}
    ran = []

    def recording(spec, *args):
        ran.append(_untuned(spec))
        return registry.call(spec, *args)

    monkeypatch.setattr(launch, "call", recording)
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, C, (5,), generator=gen)
    y[0] = -100
    for call in calls:
        x = torch.randn(5, C, generator=gen, requires_grad=True)
        call(x, y).sum().backward()
    assert len(ran) >= len(calls)
    assert set(ran) <= built, sorted(s.stem() for s in set(ran) - built)


def test_export_module_keeps_copies_or_builds(tmp_path, monkeypatch):
    """``cache.export_module`` (``ce-tvm compile --out``, bundles): a verified module
    already in the directory is kept; else a verified one in the cache is copied;
    else it is built there. Each result verifies against its manifest."""
    spec = KernelSpec("forward", "float32", C, Variant("mean", False, False))
    cached = cache.ensure_cached(spec)  # the run's cache
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    lib, built = cache.export_module(spec, out)
    assert (lib, built) == (out / cached.name, False)
    assert lib.read_bytes() == cached.read_bytes() and sealed_problem(lib) is None
    assert cache.export_module(spec, out) == (lib, False)  # kept
    lib.write_bytes(lib.read_bytes()[:-1] + b"x")  # damaged: copied again
    assert cache.export_module(spec, out) == (lib, False) and sealed_problem(lib) is None
    monkeypatch.setenv("CE_TVM_CACHE", str(tmp_path / "empty"))
    fresh = tmp_path / "fresh"
    fresh.mkdir(mode=0o700)
    lib, built = cache.export_module(spec, fresh)
    assert built and sealed_problem(lib) is None and not (tmp_path / "empty").exists()


@pytest.mark.slow
def test_compile_distill_serves_the_distillation_losses(tmp_path):
    """``ce-tvm compile --distill --out DIR`` (a fresh cache): the distillation
    losses then load every kernel from ``DIR`` and compile nothing."""
    out, cache_dir = tmp_path / "modules", tmp_path / "cache"
    text = run([CLI, "compile", "--classes", "11", "--distill", "--out", out],
               CE_TVM_CACHE=cache_dir)
    assert "75 kernels" in text and "-divergence-" in text  # 69 and 6 divergence
    done = Forked(DISTILL_PROBE, 11, CE_TVM_MODULE_DIR=out,
                  CE_TVM_CACHE=tmp_path / "empty").result()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "distill probe ok" in done.stdout
    assert list((tmp_path / "empty").glob("*.so")) == []  # nothing built or copied there


def test_knobs_build_the_kernels_a_cuda_scope_loads(tmp_path, monkeypatch):
    """``ce-tvm compile|bundle --target cuda --knob NAME=VALUE``: every kernel with
    the options CUDA calls ask for inside ``ce_tvm.schedule("cuda", NAME=VALUE)``
    (values written as the typed knob is), checked against the knobs."""
    from types import SimpleNamespace

    from ce_tvm.runtime.tensors import kernel_target
    from ce_tvm.tools import bundle, cli

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    with ce_tvm.schedule("cuda", threads=512, gradient_backwards=False):
        asked = kernel_target(SimpleNamespace(device=SimpleNamespace(type="cuda")))[1]
    built = []
    monkeypatch.setattr(cache, "export_module",
                        lambda spec, out: (built.append(spec), (out / spec.file_name(), True))[1])
    args = ["--target", "cuda", "--arch", "sm_90", "--dtype", "bfloat16", "--classes", "17",
            "--knob", "threads=512", "--knob", "gradient_backwards=false"]
    assert cli.main(["compile", *args, "--out", str(tmp_path / "m")]) == 0
    assert built and {s.options for s in built} == {asked}
    monkeypatch.setattr(bundle, "RUNTIME_LIBS", {"cuda": []})
    built.clear()
    assert cli.main(["bundle", *args, "--out", str(tmp_path / "b")]) == 0
    assert built and {s.options for s in built} == {asked}
    assert 'ce_tvm.schedule("cuda", gradient_backwards=False, threads=512)' in (
        tmp_path / "b" / "README.md").read_text()
    for knob, why in [("threads", "NAME=VALUE"), ("thread=512", "unknown CUDA schedule option"),
                      ("threads=many", "expected an integer")]:
        with pytest.raises(SystemExit, match=why):
            cli.main(["compile", "--target", "cuda", "--classes", "17", "--knob", knob])
    with pytest.raises(SystemExit, match="needs --target cuda"):
        cli.main(["compile", "--classes", "17", "--knob", "threads=512"])
