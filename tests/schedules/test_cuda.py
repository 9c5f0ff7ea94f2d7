"""CUDA kernels: build-checked with nvcc on any machine; run only where a GPU is."""

import re
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import ce_tvm
from ce_tvm.compiler.build import compile_spec, cuda_binary, lower_and_compile, scheduled_func
from ce_tvm.kernels.kinds import CUDA_SCRATCH_ROWS, CUDA_SCRATCH_SINGLES, Variant
from ce_tvm.runtime import launch
from ce_tvm.runtime.tensors import kernel_target
from ce_tvm.schedules import cuda
from ce_tvm.store.spec import KernelSpec
from ce_tvm.store.targets import cpu_schedule

pytestmark = pytest.mark.slow  # nvcc builds (the GPU runs skip without one)

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def needs_gpu(test):
    """Marked ``gpu`` (``benchmarks/gpu_check.sh`` runs ``-m gpu``), skipped without a device."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="no CUDA device")(test))

ARCHS = ("sm_80", "sm_90")


def pairwise_archs(dtypes, class_counts):
    """``(arch, dtype, classes)`` for every dtype and C, the arch alternating so that
    each arch meets each dtype and each C. At these C, TVM writes the same CUDA
    source for both archs (its one arch-dependent choice, the log_prob forward's
    whole-row staging, agrees there): the full product compiled each source
    twice, for ptxas alone to differ."""
    return [(ARCHS[(i + j) % 2], dtype, classes) for i, dtype in enumerate(dtypes)
            for j, classes in enumerate(class_counts)]


# C = 1001 is not a multiple of any vector width; 256000 needs many shared-memory chunks.
BUILD_GRID = pairwise_archs(("float32", "float16", "bfloat16"), (17, 1001, 32000, 256000))


@needs_nvcc
@pytest.mark.parametrize("arch,dtype,classes", BUILD_GRID)
def test_kernels_compile_with_nvcc(arch, dtype, classes):
    options = (("arch", arch),)
    variants = {"forward": Variant("mean", True, True),
                "backward": Variant("none", False, grad_source="logits")}
    for op, variant in variants.items():
        spec = KernelSpec(op, dtype, classes, variant, "cuda", options)
        source, cubin = cuda_binary(compile_spec(spec), spec)  # raises on any nvcc error
        assert "__global__" in source and cubin[:4] == b"\x7fELF"


# C = 5003: the last chunk overlaps the one before. The unweighted forward there once
# hit "int64 vs int32" in TVM's simplifier; the int64 chunk axes build it.
@needs_nvcc
@pytest.mark.parametrize("op,variant", [
    ("forward", Variant("sum", False, False)),
    ("backward", Variant("mean", True, grad_source="log_prob")),
    ("backward", Variant("mean", True, grad_source="shard")),
    ("shard_stats", Variant(weighted=True)),
    ("shard_combine", Variant("mean")),
])
def test_other_variants_compile_with_nvcc(op, variant):
    spec = KernelSpec(op, "bfloat16", 5003, variant, "cuda", (("arch", "sm_90"),))
    assert cuda_binary(compile_spec(spec), spec) is not None  # raises on any nvcc error


# Softcap (tanh in every logit read, its slope in the gradient) and token accuracy
# (the target logit per row, a chunk reduction counting columns ahead of it):
# one whole-row and one chunked C.
@needs_nvcc
@pytest.mark.parametrize("classes", [1001, 32000])
@pytest.mark.parametrize("op,variant", [
    ("forward", Variant("mean", True, False, softcap=True, accuracy=True)),
    ("forward", Variant("none", False, False, accuracy=True)),
    ("train", Variant("mean", True, False, softcap=True, accuracy=True)),
    ("backward", Variant("none", True, grad_source="logits", softcap=True)),
    ("backward", Variant("mean", False, grad_source="shard", softcap=True)),
    ("shard_stats", Variant(weighted=False, softcap=True)),
])
def test_softcap_and_accuracy_compile_with_nvcc(op, variant, classes):
    spec = KernelSpec(op, "bfloat16", classes, variant, "cuda", (("arch", "sm_90"),))
    source, cubin = cuda_binary(compile_spec(spec), spec)  # raises on any nvcc error
    assert cubin[:4] == b"\x7fELF"
    assert ("float softcap" in source) == variant.softcap  # the kernel's scalar argument
    assert ("ce_row_hit" in source) == variant.accuracy
@needs_nvcc
@pytest.mark.parametrize("op", ["prob_forward", "prob_backward", "prob_target_grad"])
def test_probability_target_kernels_compile_with_nvcc(op):
    """Two chunks, the last overlapping (C = 5003), weighted and not."""
    for weighted in (False, True):
        spec = KernelSpec(op, "bfloat16", 5003, Variant("mean", weighted, False), "cuda",
                          (("arch", "sm_90"),))
        assert cuda_binary(compile_spec(spec), spec) is not None  # raises on any nvcc error


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("classes", [17, 32000])
def test_probability_targets_match_torch_on_gpu(dtype, classes):
    import ce_tvm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, classes, generator=gen) * 2).to(dtype)
    q = torch.softmax(torch.randn(64, classes, generator=gen), 1).to(dtype)
    w = torch.rand(classes, generator=gen) + 0.5
    xg, qg = x.cuda().requires_grad_(), q.cuda().requires_grad_()
    loss = ce_tvm.cross_entropy(xg, qg, w.cuda(), label_smoothing=0.1)
    loss.backward()
    xr, qr = x.double().requires_grad_(), q.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xr, qr, w.double(), label_smoothing=0.1)
    ref.backward()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=tol, atol=tol)
    for ours, theirs in ((xg.grad, xr.grad), (qg.grad, qr.grad)):
        scale = float(theirs.abs().max())
        torch.testing.assert_close(ours.double().cpu(), theirs, rtol=tol, atol=tol * scale)


# The one-pass training kernel: a row of one chunk (the staged row feeds the
# gradient) and one of 13 chunks whose last overlaps the one before.
@needs_nvcc
@pytest.mark.parametrize("arch,dtype,classes",
                         pairwise_archs(("float32", "float16", "bfloat16"), (1001, 50257)))
def test_training_kernel_compiles_with_nvcc(arch, dtype, classes):
    spec = KernelSpec("train", dtype, classes, Variant("mean", True, False), "cuda",
                      (("arch", arch),))
    source, cubin = cuda_binary(compile_spec(spec), spec)
    assert "x_grad" in source and cubin[:4] == b"\x7fELF"


SCRATCH_VARIANTS = [
    ("forward", Variant("mean", True, True)), ("forward", Variant("none", False, False)),
    ("train", Variant("mean", True, False)), ("train", Variant("sum", False, False)),
    ("backward", Variant("mean", True, grad_source="logits")),
    ("backward", Variant("mean", True, grad_source="shard")),
    ("shard_stats", Variant(weighted=True)), ("shard_combine", Variant("mean")),
    ("forward", Variant("mean", True, False, softcap=True, accuracy=True)),
    ("train", Variant("mean", True, False, softcap=True, accuracy=True)),
    ("prob_forward", Variant("mean", True, False)), ("prob_backward", Variant("mean", True, False)),
    ("prob_target_grad", Variant("sum", True, False))]


@pytest.mark.parametrize("op,variant", SCRATCH_VARIANTS)
def test_cuda_kernels_take_their_scratch_from_the_caller(op, variant):
    """No TVM workspace (not ordered with torch's streams, unsafe under graph
    replay): the host code allocates nothing, and the kernel ends with the
    scratch slots launch passes (``CUDA_SCRATCH_ROWS`` [N], ``_SINGLES`` [1])."""
    spec = KernelSpec(op, "bfloat16", 5003, variant, "cuda", (("arch", "sm_90"),))
    assert "TVMBackendAllocWorkspace" not in lower_and_compile(spec).mod.inspect_source("ll")
    slots = [p for p in scheduled_func(spec).params][-(CUDA_SCRATCH_ROWS + CUDA_SCRATCH_SINGLES):]
    shapes = [tuple(str(d) for d in p.shape) for p in slots]
    assert shapes == [("N",)] * CUDA_SCRATCH_ROWS + [("1",)] * CUDA_SCRATCH_SINGLES
    assert {str(p.dtype) for p in slots} == {"float32"}


@pytest.mark.parametrize("weighted", [False, True])
def test_fewer_launches(weighted):
    """Sums over rows and the finalisers run fused: a mean forward is one row
    kernel and one single-block kernel (it was 7 launches); with a
    class weight, one more single-block kernel before the rows sums the
    weights once (``ce_wsum``), where each row block summed them before."""
    spec = KernelSpec("forward", "bfloat16", 5003, Variant("mean", weighted, False), "cuda",
                      (("arch", "sm_90"),))
    source = lower_and_compile(spec).mod.imports[0].inspect_source()
    pieces = source.split("__global__")[1:]  # declarations, then definitions
    assert len(pieces) == 2 * (2 + weighted)
    kernels = pieces[len(pieces) // 2:]
    wsum_kernels = [k for k in kernels if "ce_wsum" in k]
    if weighted:  # one block of 1024 threads streams w once; the row kernel reads the sum
        assert "__launch_bounds__(1024)" in wsum_kernels[0].split("{")[0]
        assert "weight_ptr[" in wsum_kernels[0] and "ce_wsum_ptr[0] =" in wsum_kernels[0]
        assert all("ce_wsum_ptr[0] =" not in k for k in kernels[1:])


@pytest.mark.parametrize("rows", [1, 17, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_cuda_scratch_slots_are_aligned_views_of_one_buffer(rows, dtype):
    slots = launch._cuda_scratch(rows, dtype, "cpu")
    assert [tuple(t.shape) for t in slots] == (
        [(rows,)] * CUDA_SCRATCH_ROWS + [(1,)] * CUDA_SCRATCH_SINGLES)
    assert all(t.dtype == dtype and t.data_ptr() % 64 == 0 for t in slots)
    assert len({t.untyped_storage().data_ptr() for t in slots}) == 1
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in slots)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("classes", [17, 1001, 50257])
@pytest.mark.parametrize("reduction,weighted", [("mean", True), ("sum", False)])
def test_training_kernel_matches_reference_on_gpu(dtype, classes, reduction, weighted):
    """The CUDA one-pass kernel (``launch.train``, not yet the default path for
    CUDA tensors: ``nn.TRAINING_KERNEL_DEVICES``) against the float64 reference."""
    import numpy as np

    from ce_tvm.runtime.options import LossOptions
    from ce_tvm.testing import reference
    from support import TOL, assert_close

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(33, classes, generator=gen) * 3).to(dtype)
    y = torch.randint(0, classes, (33,), generator=gen)
    y[::5] = -100
    w = torch.rand(classes, generator=gen) + 0.5 if weighted else None
    options = LossOptions(reduction=reduction, label_smoothing=0.1, zloss_scale=1e-3)
    out, grad = launch.train(x.cuda(), y.cuda(), None if w is None else w.cuda(), options)
    wn = None if w is None else w.double().numpy()
    ref_loss, log_prob, _, lse = reference.forward(
        x.double().numpy(), y.numpy(), wn, reduction, -100, 0.1, 1e-3)
    ref_grad = reference.backward(np.array([1.0]), log_prob, y.numpy(), wn, None, lse,
                                  reduction, -100, 0.1, 1e-3)
    assert_close(out.loss.cpu().reshape(1), ref_loss, TOL[dtype], "loss")
    assert_close(grad.cpu(), ref_grad, TOL[dtype], "x grad")


def test_log_prob_forward_writes_from_the_row_staged_whole_when_it_fits():
    """The log_prob forward (seed API) stages a row of 32000 bf16 (64 KB) whole in
    dynamic shared memory and writes ``log_prob`` from it: no second read of
    ``x``. A row of 50257 bf16 (not 16-byte aligned) and one of 128256 bf16
    (250 KB) are staged chunk by chunk, and ``log_prob`` re-reads ``x``."""
    def source(classes):
        spec = KernelSpec("forward", "bfloat16", classes, Variant("mean", True, True), "cuda",
                          (("arch", "sm_90"),))
        return lower_and_compile(spec).mod.imports[0].inspect_source()

    def x_reads(src):  # statements that read the logits from global memory
        return [line for line in src.splitlines() if "x_ptr" in line and "__global__" not in line]

    staged = source(32000)
    assert "extern __shared__" in staged
    assert len(x_reads(staged)) == 2  # the staging copy, the target's logit
    for classes in (50257, 128256):
        chunked = source(classes)
        assert "extern __shared__" not in chunked
        assert len(x_reads(chunked)) > 2  # the log_prob pass reads x again


@pytest.mark.parametrize("op, variant, outputs", [
    ("forward", Variant("mean", True, False, accuracy=True), ["lse"]),
    ("forward", Variant("none", False, True), ["lse"]),  # log_prob, 128256: in lanes
    ("train", Variant("mean", True, False), ["lse"]),  # the gradient reads lse
    ("log_probs", Variant(columns=2, stats=True, softcap=True), ["row_max", "log_expsum"]),
])
def test_a_row_merged_in_lanes_reads_its_outputs_from_shared_memory(op, variant, outputs):
    """A row merged in lanes: the values after the lanes meet are written by thread 0
    (TVM predicates what reads a cross-thread reduction's result). The
    stages that read ``lse`` (``row_max``, ``log_expsum``) from all threads -- the
    z-loss, ``log_prob``, the token log-probs -- read it from shared memory after a
    barrier, never from the global output thread 0 writes: on an H200 they read
    garbage there (the log-probs off by 1e34). The outputs are only written. The
    training kernel's gradient reads ``lse`` so too."""
    spec = KernelSpec(op, "bfloat16", 128256, variant, "cuda", (("arch", "sm_90"),))
    source = lower_and_compile(spec).mod.imports[0].inspect_source()
    assert "ce_lanestats" in source
    body = source[source.index("{", source.index("__global__ void __launch_bounds__")):]
    for name in outputs:
        uses = [line.strip() for line in body.splitlines() if f"{name}_ptr[" in line]
        assert uses and all(use.startswith(f"{name}_ptr[") for use in uses), uses
        assert f"__shared__ alignas(64) float {name}_shared_ptr[1];" in source


def test_the_log_prob_gradient_loads_vectors_and_reads_its_row_values_once():
    """The log-prob gradient takes its width from the gradient it writes (not from
    ``grad_logp [N, K]``, which left it one bf16 per load), and holds its per-row
    inputs in registers: each is read once per row, not per element."""
    spec = KernelSpec("log_probs_grad", "bfloat16", 128256, Variant(columns=1), "cuda",
                      (("arch", "sm_90"),))
    source = lower_and_compile(spec).mod.imports[0].inspect_source()
    body = source[source.index("{", source.index("__global__ void __launch_bounds__")):]
    assert "nv_bfloat164" in body  # 4 logits per load, 4 gradients per store
    for name in ("row_max", "log_expsum", "grad_entropy"):
        assert body.count(f"{name}_ptr[") == 1, name


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("classes", [1001, 32000, 50257])
def test_log_prob_forward_matches_reference_on_gpu(dtype, classes):
    """The seed API's forward (``log_prob`` written): one-chunk rows, rows staged
    whole in dynamic shared memory (32000 bf16: 64 KB), chunked rows."""
    from ce_tvm.testing import reference
    from support import TOL, assert_close

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(33, classes, generator=gen) * 3).to(dtype)
    y = torch.randint(0, classes, (33,), generator=gen)
    y[::5] = -100
    w = torch.rand(classes, generator=gen) + 0.5
    loss, log_prob, _, _ = ce_tvm.cross_entropy_loss(x.cuda(), y.cuda(), w.cuda(),
                                                     label_smoothing=0.1)
    ref_loss, ref_log_prob, _, _ = reference.forward(
        x.double().numpy(), y.numpy(), w.double().numpy(), "mean", -100, 0.1, 0.0)
    assert_close(loss.cpu().reshape(1), ref_loss, TOL[dtype], "loss")
    assert_close(log_prob.cpu(), ref_log_prob, TOL[dtype], "log_prob")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("classes", [17, 1001, 32000, 128256])
def test_matches_reference_on_gpu(dtype, classes):
    import ce_tvm
    from support import TOL, Case

    case = Case(64, classes, dtype, "mean", weighted=True, ignore=True, label_smoothing=0.1,
                zloss_scale=1e-3)
    x, y, w = case.inputs()
    xg = x.cuda().requires_grad_()
    loss = ce_tvm.cross_entropy(xg, y.cuda(), w.cuda(), label_smoothing=case.label_smoothing,
                                lse_square_scale=case.zloss_scale)
    loss.backward()
    xr = x.float().requires_grad_()
    kept = y != case.ignore_index
    zloss = case.zloss_scale * (torch.logsumexp(xr, 1)[kept] ** 2).sum() / kept.sum()
    ref = torch.nn.functional.cross_entropy(xr, y, w, label_smoothing=case.label_smoothing) + zloss
    ref.backward()
    tol = TOL[dtype]
    torch.testing.assert_close(loss.float().cpu(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(xg.grad.float().cpu(), xr.grad, rtol=tol, atol=tol * 1e-2)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("classes", [1001, 50257])
def test_nan_rows_isolated_on_gpu(dtype, classes):
    """CUDA's fmaxf drops NaN: fastmath's explicit NaN test keeps a NaN logit's
    row NaN (loss and gradient) and leaves the other rows finite."""
    import ce_tvm

    x = torch.randn(4, classes, device="cuda").to(dtype)
    x[2, 7] = float("nan")
    y = torch.randint(0, classes, (4,), device="cuda")
    xg = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xg, y, torch.ones(classes, device="cuda"), reduction="none")
    loss.sum().backward()
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()
    assert torch.isnan(xg.grad[2]).any() and torch.isfinite(xg.grad[[0, 1, 3]]).all()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("classes", [1001, 50257])
def test_softcap_and_accuracy_on_gpu(dtype, classes):
    """Capped loss and gradient against torch on ``t * tanh(x / t)``; the token
    accuracy against ``torch.argmax`` (ties: the first maximum)."""
    import ce_tvm

    gen = torch.Generator().manual_seed(classes)
    x = (torch.randn(64, classes, generator=gen) * 20).to(dtype)
    y = torch.randint(0, classes, (64,), generator=gen)
    x[:4, 3] = x[:4, 11] = 1e4  # saturated ties: the first one is the argmax
    y[:2], y[2:4] = 3, 11
    y[::5] = -100
    y[7] = int(x[7].float().argmax())
    xg = x.cuda().requires_grad_()
    loss, accuracy = ce_tvm.cross_entropy(xg, y.cuda(), softcap=30.0, label_smoothing=0.1,
                                          return_token_accuracy=True)
    loss.backward()
    xr = x.float().requires_grad_()
    capped = 30.0 * torch.tanh(xr / 30.0)
    ref = torch.nn.functional.cross_entropy(capped, y, label_smoothing=0.1)
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(loss.float().cpu(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(xg.grad.float().cpu(), xr.grad, rtol=tol, atol=tol * 1e-2)
    kept = y != -100
    expected = ((capped.detach().argmax(1) == y) & kept).sum() / kept.sum()
    assert accuracy.item() == pytest.approx(expected.item())


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("classes", [1001, 50257])
def test_training_kernel_isolates_nan_rows_on_gpu(dtype, classes):
    from ce_tvm.runtime.options import LossOptions

    x = torch.randn(4, classes, device="cuda").to(dtype)
    x[2, 7] = float("nan")
    y = torch.randint(0, classes, (4,), device="cuda")
    out, grad = launch.train(x, y, None, LossOptions(reduction="sum"))
    assert torch.isnan(out.loss).all()
    assert torch.isnan(grad[2]).any() and torch.isfinite(grad[[0, 1, 3]]).all()


@needs_gpu
def test_scratch_is_safe_under_cuda_graph_replay_and_side_streams():
    """The kernels' scratch comes from torch on the current stream: a captured
    forward replays correctly after a larger call, and two streams run the
    kernels concurrently without sharing scratch."""
    import ce_tvm

    def inputs(n, seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        return (torch.randn(n, 1001, device="cuda", generator=gen),
                torch.randint(0, 1001, (n,), device="cuda", generator=gen))

    x, y = inputs(64, 0)
    ref = torch.nn.functional.cross_entropy(x, y)
    ce_tvm.cross_entropy(x, y)  # load the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ce_tvm.cross_entropy(x, y)
    big_x, big_y = inputs(4096, 1)
    ce_tvm.cross_entropy(big_x, big_y)
    graph.replay()
    torch.testing.assert_close(captured, ref, rtol=1e-5, atol=1e-5)
    streams = [torch.cuda.Stream() for _ in range(2)]
    cases = [inputs(2048, 2 + i) for i in range(2)]
    losses = []
    for stream, (xs, ys) in zip(streams, cases):
        with torch.cuda.stream(stream):
            losses.append(ce_tvm.cross_entropy(xs, ys))
    torch.cuda.synchronize()
    for loss, (xs, ys) in zip(losses, cases):
        torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(xs, ys),
                                   rtol=1e-5, atol=1e-5)


# The log-prob kernels (SPEC section 6) and the losses' tempered variants: one
# whole-row and one chunked C; the exp evaluated per sum (KEEPS_CHUNK_EXP).
@needs_nvcc
@pytest.mark.parametrize("classes", [1001, 32000])
@pytest.mark.parametrize("op,variant", [
    ("log_probs", Variant(columns=1)),
    ("log_probs", Variant(columns=5, softcap=True)),
    ("log_probs_grad", Variant(columns=5, softcap=True)),
    ("forward", Variant("mean", True, False, tempered=True)),
    ("backward", Variant("none", False, grad_source="logits", softcap=True, tempered=True)),
])
def test_log_prob_and_tempered_kernels_compile_with_nvcc(op, variant, classes):
    spec = KernelSpec(op, "bfloat16", classes, variant, "cuda", (("arch", "sm_90"),))
    source, cubin = cuda_binary(compile_spec(spec), spec)  # raises on any nvcc error
    assert cubin[:4] == b"\x7fELF"
    assert ("float inv_temperature" in source) == (op.startswith("log_probs") or
                                                   variant.tempered)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("classes", [1001, 50257])
def test_log_probs_and_tempered_loss_on_gpu(dtype, classes):
    """Log-probs (K = 3, a masked row, softcap, temperature) with their gradient,
    and a tempered loss, against torch in float32 on the CPU."""
    import ce_tvm

    gen = torch.Generator().manual_seed(classes)
    x = (torch.randn(64, classes, generator=gen) * 4).to(dtype)
    index = torch.randint(0, classes, (64, 3), generator=gen)
    mask = torch.ones(64, dtype=torch.bool)
    mask[5] = False
    a, b = torch.randn(64, 3, generator=gen), torch.randn(64, generator=gen)
    xg = x.cuda().requires_grad_()
    logp, entropy = ce_tvm.log_probs(xg, index.cuda(), temperature=0.7, softcap=30.0,
                                     row_mask=mask.cuda(), return_entropy=True)
    ((logp * a.cuda()).sum() + (entropy * b.cuda()).sum()).backward()
    xr = x.float().requires_grad_()
    lp = torch.log_softmax(30.0 * torch.tanh(xr / 30.0) / 0.7, -1)
    ref_logp = torch.where(mask[:, None], lp.gather(1, index), 0.0)
    ref_entropy = -(lp.exp() * lp).sum(-1)
    ((ref_logp * a).sum() + (ref_entropy * b).sum()).backward()
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(logp.cpu(), ref_logp.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(entropy.cpu(), ref_entropy.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(xg.grad.float().cpu(), xr.grad, rtol=tol, atol=tol * 1e-2)
    y = index[:, 0]
    loss = ce_tvm.cross_entropy(x.cuda(), y.cuda(), temperature=1.5)
    expected = torch.nn.functional.cross_entropy(x.float() / 1.5, y)
    torch.testing.assert_close(loss.float().cpu(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("op, variant", [("forward", Variant("mean", False, False)),
                                         ("log_probs", Variant(columns=1))])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("classes, vectors", [(128256, 2), (5008, 1)])
def test_a_lane_reduces_two_vectors_before_it_merges(op, variant, dtype, classes, vectors):
    """In lanes, a thread loads ``lane_vectors`` (2) 16-byte vectors of its chunk,
    reduces them, then merges once into its lane: the chunk loop holds two
    vector loads of the logits, each the full width. A short row keeps one
    (``LANE_PADDING``: at C = 5008 two vectors' rounds would span 33% (bf16)
    and 20% (fp32) more of the row than one's). The log-prob forward takes
    two rounds an iteration where they divide its rounds (``LOG_PROBS_KNOBS``:
    bf16 C = 128256, 32 rounds; not fp32's 63, nor C = 5008's 3 and 5)."""
    rounds = 2 if (op, dtype, classes) == ("log_probs", "bfloat16", 128256) else 1
    spec = KernelSpec(op, dtype, classes, variant, "cuda", (("arch", "sm_90"),))
    source = lower_and_compile(spec).mod.imports[0].inspect_source()
    assert "ce_lanestats" in source
    loads = [line for line in source.splitlines()
             if "x_local_ptr" in line and "x_ptr" in line
             and ("*(uint4*)" in line or "*(float4*)" in line)]
    assert len(loads) == vectors * rounds, loads


def test_a_loop_marked_backwards_runs_last_to_first():
    """``run_backwards``: a loop annotated ``BACKWARDS`` runs its iterations from the
    last to the first, each computing what it did: the last one to write ``last``
    is iteration 0 (forwards it would be 7)."""
    import numpy as np
    import tvm
    from tvm.script import tirx as T

    from ce_tvm.schedules.cuda import BACKWARDS, run_backwards

    @T.prim_func
    def doubled(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32"),
                last: T.Buffer((1,), "float32")):
        for i in T.serial(8, annotations={BACKWARDS: 1}):
            b[i] = a[i] * T.float32(2)
            last[0] = T.Cast("float32", i)

    func = run_backwards(doubled)
    assert BACKWARDS not in str(func)
    a = tvm.runtime.tensor(np.arange(8, dtype="float32"))
    b, last = (tvm.runtime.tensor(np.full(n, -1, "float32")) for n in (8, 1))
    tvm.compile(func, target="llvm")(a, b, last)
    assert b.numpy().tolist() == [2.0 * i for i in range(8)] and last.numpy()[0] == 0.0


def test_the_training_kernel_in_lanes_reads_its_row_again_backwards():
    """A long row's training kernel is the forward's lane sweep (1024 threads a row:
    ``TRAIN_LANES_KNOBS``), then its gradient from the logits read again, its
    sweep from the row's end: each iteration's stores step back by a sweep of
    the block (4 unrolled sweeps of 1024 threads, 4 bf16 each), so the row is
    read again from the lines read last."""
    spec = KernelSpec("train", "bfloat16", 128256, Variant("mean", True, False), "cuda",
                      (("arch", "sm_90"),))
    source = lower_and_compile(spec).mod.imports[0].inspect_source()
    row = next(k for k in source.split("extern \"C\" __global__")[1:]
               if "ce_lanestats" in k and "x_grad_ptr" in k and "{" in k)
    assert row.startswith(" void __launch_bounds__(1024)")
    stores = re.findall(r"\*\(nv_bfloat164\*\)\(x_grad_ptr \+ (.*)\) = ", row)
    assert stores and all(re.search(r" - \(\w+ \* \(int64_t\)16384\)\)$", s) for s in stores)


def _block_threads(spec: KernelSpec) -> set[int]:
    text = scheduled_func(spec).script()
    return {int(n) for n in re.findall(r'T\.int64\((\d+)\), thread="threadIdx\.x"', text)}


def test_cuda_schedule_options_are_kernels_of_their_own(monkeypatch):
    """``ce_tvm.schedule("cuda", knob=value)``: CUDA calls in the block ask for
    kernels with those knobs over the schedule's own (a name and a file of their
    own), built with them; CPU calls and calls outside the block are untouched."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    on_gpu = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    plain = kernel_target(on_gpu)
    with ce_tvm.schedule("cuda", threads=512, gradient_backwards=False):
        knobbed = kernel_target(on_gpu)
        assert cpu_schedule() == ("llvm", ())
    assert plain == ("cuda", (("arch", "sm_90"),)) == kernel_target(on_gpu)
    assert knobbed == ("cuda", (("arch", "sm_90"), ("gradient_backwards", "False"),
                                ("threads", "512")))
    base = KernelSpec("train", "bfloat16", 128256, Variant("mean", True, False), *plain)
    spec = replace(base, options=knobbed[1])
    assert "sm_90-gradient_backwardsFalse-threads512-train" in spec.name()
    assert spec.file_name() != base.file_name()
    assert _block_threads(base) == {cuda.TRAIN_LANES_KNOBS.threads}
    assert _block_threads(spec) == {512}
    # lane_vectors sizes the compute's chunk (bf16: a 16-byte vector is 8 logits)
    variant, target = base.variant, base.tvm_target()
    assert cuda.train_lanes(128256, "bfloat16", variant, target) == (16, 1024)
    assert cuda.train_lanes(128256, "bfloat16", variant, target, lane_vectors="1") == (8, 1024)


def test_cuda_schedule_options_are_checked():
    """An option that is no knob, or a value of the wrong kind, names the knobs."""
    assert cuda.with_options(cuda.CUDAKnobs(), {"gradient_backwards": "true", "unroll": "2"}
                             ) == cuda.CUDAKnobs(gradient_backwards=True, unroll=2)
    with pytest.raises(ValueError, match=r"unknown CUDA schedule options \['thread'\]; "
                                         r"the knobs are \['threads'"):
        cuda.with_options(cuda.CUDAKnobs(), {"thread": "512"})
    with pytest.raises(ValueError, match="threads='many': expected an integer"):
        cuda.with_options(cuda.CUDAKnobs(), {"threads": "many"})
    with pytest.raises(ValueError, match="gradient_backwards='yes': expected true or false"):
        cuda.with_options(cuda.CUDAKnobs(), {"gradient_backwards": "yes"})
    spec = KernelSpec("log_probs", "float32", 32000, Variant(columns=1), "cuda",
                      (("arch", "sm_90"), ("lane_width", "2")))
    with pytest.raises(ValueError, match="unknown CUDA schedule options"):
        scheduled_func(spec)
