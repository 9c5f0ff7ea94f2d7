"""``[N, C]`` outputs stored past the caches (``schedules/cpu_stores.py``):
which kernels get non-temporal stores (a float32 gradient or seed ``log_prob``,
its rows 64-byte multiples, on AVX-512 and AVX2, or staged by blocks where
they are not, on AVX-512; a lagged 16-bit training gradient; not the
divergence's, not a 16-bit backward; cross-compiled, only assembly is made), that a
kernel carries both versions and a launch picks one by the output's size, and
that the streamed path writes the same bits as the plain one and matches torch."""

import re

import pytest
import torch
import torch.nn.functional as F
import tvm
import tvm_ffi
from tvm import tirx

import ce_tvm
from ce_tvm.compiler.build import KernelSpec, lower_and_compile
from ce_tvm.kernels.kinds import Variant
from ce_tvm.runtime import launch
from ce_tvm.runtime.options import LossOptions
from ce_tvm.schedules import cpu, cpu_stores
from ce_tvm.schedules._common import collect_nodes
from ce_tvm.schedules.cpu_lagged_rows import lags_rows
from ce_tvm.schedules.cpu_stores import STREAM_MIN_BYTES
from ce_tvm.store.targets import tvm_target
from ce_tvm.testing import cpu_static
from ce_tvm.tools.cli import TUNED_VARIANTS
from support import TOL


@pytest.mark.parametrize("mcpu", ["znver4", "haswell"])
@pytest.mark.parametrize("op", ["train", "backward"])
def test_aligned_float32_gradients_stream(op, mcpu):
    """As a launch above the size runs it: every gradient store non-temporal, no
    ``prefetchw`` of the gradient."""
    asm = cpu_static.cpu_asm(op, "float32", 2048, f"llvm -mcpu={mcpu}")
    assert "vmovntps" in asm and "prefetchw" not in asm
    assert not [line for line in asm.splitlines()
                if "vmovaps\t%" in line and "%rsp" not in line and "(" in line]


@pytest.mark.parametrize("op", ["train", "backward"])
def test_unaligned_float32_gradients_stream_by_blocks_on_avx512(op):
    """Rows of 2050 classes (not 64-byte multiples): each block of the gradient is
    streamed from its first line boundary, its first and last elements stored
    under a mask, and the gradient's lines are not prefetched for writing."""
    asm = cpu_static.cpu_asm(op, "float32", 2050, "llvm -mcpu=znver4")
    assert "vmovntps" in asm and "prefetchw" not in asm
    assert re.search(r"vmovups\t%zmm\d+, .*\) \{%k", asm)


@pytest.mark.parametrize("op", ["train", "backward"])
def test_unaligned_float32_gradients_keep_plain_stores_on_avx2(op):
    asm = cpu_static.cpu_asm(op, "float32", 2050, "llvm -mcpu=haswell")
    assert "vmovnt" not in asm


@pytest.mark.parametrize("op, classes, mcpu", [("backward", 2048, "znver4"),
                                               ("train", 2050, "znver4"),
                                               ("train", 2048, "haswell")])
def test_bfloat16_gradients_keep_plain_stores(op, classes, mcpu):
    """The backward's, and the training kernel's where it is not lagged
    (``cpu_lagged_rows``: AVX2) or its rows are not whole lines."""
    asm = cpu_static.cpu_asm(op, "bfloat16", classes, f"llvm -mcpu={mcpu}")
    assert "vmovnt" not in asm


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_lagged_16_bit_gradient_streams(dtype):
    """The 16-bit training kernel on AVX-512, its gradient a row late
    (``cpu_lagged_rows``): each store of a 64-byte line non-temporal, no
    ``prefetchw`` of the gradient."""
    asm = cpu_static.cpu_asm("train", dtype, 2048, "llvm -mcpu=znver4")
    assert re.search(r"vmovnt(dq|ps)\t%zmm", asm) and "prefetchw" not in asm


def _calls(node, name: str) -> list:
    return [c for c in collect_nodes(node, tvm.ir.expr.Call) if c.op.same_as(tvm.ir.Op.get(name))]


def test_a_launch_streams_from_the_size_on(monkeypatch):
    """In the lowered training kernel the streamed stores are the ``then`` of a
    test that holds from ``STREAM_MIN_BYTES`` of gradient on (N read from the
    launch's arguments), the plain stores its ``else``."""
    lowered = []
    real = cpu.stream_output_stores

    @tvm.tirx.transform.prim_func_pass(opt_level=0)
    def recording(func, mod, ctx):
        lowered.append(real(tvm.IRModule({"main": func}))["main"])
        return lowered[-1]

    monkeypatch.setattr(cpu, "stream_output_stores", recording)
    classes = 2048
    lower_and_compile(KernelSpec("train", "float32", classes, TUNED_VARIANTS["train"]("mean"),
                                 "llvm"))
    (func,) = lowered
    tests = [n for n in collect_nodes(func.body, tirx.IfThenElse)
             if any("ce_tvm_stream" in str(c.args[0])
                    for c in _calls(n.then_case, "tirx.call_extern"))]
    assert tests
    threshold_rows = STREAM_MIN_BYTES // (4 * classes)
    for test in tests:
        assert [s for s in collect_nodes(test.else_case, tirx.BufferStore)
                if s.buffer.name == "x_grad"]
        assert not [s for s in collect_nodes(test.then_case, tirx.BufferStore)
                    if s.buffer.name == "x_grad"]
        for rows in (threshold_rows - 1, threshold_rows):
            def shape_read(call, rows=rows):  # the launch's N, an int64 field of its args
                named = call.op.same_as(tvm.ir.Op.get("tirx.tvm_struct_get"))
                return tirx.const(rows, "int64") if named and str(call.ty) == "int64" else call
            held = tvm.sym.Analyzer().simplify(tvm_ffi.structural_map(
                cpu_stores.unbound(test.condition, cpu_stores.binds(func.body)),
                [(tvm.ir.expr.Call, shape_read)], order="post"))
            assert bool(held.value) == (rows == threshold_rows), (rows, test.condition)


@pytest.mark.parametrize("op,variant,streamed", [
    ("log_probs_grad", TUNED_VARIANTS["log_probs_grad"]("sum"), True),
    ("forward", Variant("mean", log_prob=True), True),
    ("forward", Variant("mean", log_prob=False), False),
    ("divergence", TUNED_VARIANTS["divergence"]("sum"), False)],
    ids=["log-probs-backward", "seed-forward", "forward", "divergence"])
def test_which_other_kernels_stream(op, variant, streamed):
    """The log-probs' backward and the seed API's forward (its ``log_prob``)
    stream; a forward without ``log_prob`` has no ``[N, C]`` output; the
    divergence, marked ``keep_outputs_cached`` by its schedule, does not."""
    spec = KernelSpec(op, "float32", 2048, variant, "llvm")
    assert ("vmovntps" in lower_and_compile(spec).mod.inspect_source("asm")) == streamed


def _rows_to_stream(classes: int, itemsize: int = 4) -> int:
    return -(-STREAM_MIN_BYTES // (itemsize * classes))


@pytest.mark.parametrize("dtype,classes", [
    (torch.float32, 2048), (torch.float32, 2049),
    pytest.param(torch.bfloat16, 2048, marks=pytest.mark.skipif(
        not lags_rows(tvm_target("llvm")), reason="this CPU's training kernels are not lagged"))],
    ids=["aligned", "staged", "bf16-lagged"])
def test_streamed_gradient_matches_torch_and_the_plain_path(dtype, classes):
    """A gradient of 64 MiB (streamed; float32 by blocks on AVX-512 where its rows
    are not 64-byte multiples: rows of 2049 classes start at every offset within
    a line; bf16 where the training kernel writes it a row late,
    ``cpu_lagged_rows``) against float64 torch, and its first rows against the
    same rows launched alone (plain stores): float32 bit for bit, since a summed
    loss's rows do not depend on one another; bf16 within one rounding (LLVM may
    contract a multiply and a subtraction otherwise in the two loops)."""
    rows = _rows_to_stream(classes, dtype.itemsize)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, classes, generator=gen) * 3).to(dtype)
    y = torch.randint(0, classes, (rows,), generator=gen)
    y[::5] = -100
    grads = []
    for n in (rows, 64):
        xg = x[:n].clone().requires_grad_()
        ce_tvm.cross_entropy(xg, y[:n], reduction="sum", label_smoothing=0.1).backward()
        grads.append(xg.grad)
    if dtype == torch.float32:
        assert torch.equal(grads[0][:64], grads[1])
    else:
        rounding = grads[1].float().abs() * 2.0 ** -7
        assert bool(((grads[0][:64].float() - grads[1].float()).abs() <= rounding).all())
    ref = x.double().requires_grad_()
    F.cross_entropy(ref, y, reduction="sum", label_smoothing=0.1).backward()
    torch.testing.assert_close(grads[0].double(), ref.grad, rtol=TOL[dtype],
                               atol=1e-7 if dtype == torch.float32 else 1e-6)


@pytest.mark.parametrize("classes", [2048, 2049], ids=["aligned", "staged"])
def test_streamed_log_prob_matches_torch_and_the_plain_path(classes):
    """The seed API's ``log_prob`` of 64 MiB (streamed; by blocks on AVX-512
    where its rows are not 64-byte multiples) against float64 torch, and its
    first rows against the same rows launched alone (plain stores)."""
    rows = _rows_to_stream(classes)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, classes, generator=gen) * 3
    y = torch.randint(0, classes, (rows,), generator=gen)
    big = ce_tvm.cross_entropy_loss(x, y)[1]
    assert torch.equal(big[:64], ce_tvm.cross_entropy_loss(x[:64], y[:64])[1])
    torch.testing.assert_close(big.double(), torch.log_softmax(x.double(), -1),
                               rtol=1e-6, atol=1e-5)


def test_a_staged_gradient_written_over_its_logits():
    """The backward writing its gradient over the logits (as the fused linear
    loss's chunks do), staged at an unaligned row length: the same bits as
    into a buffer of its own."""
    classes = 2049
    rows = _rows_to_stream(classes)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, classes, generator=gen) * 3
    y = torch.randint(0, classes, (rows,), generator=gen)
    options = LossOptions.from_schema("sum", -100, 0.1, 0.0, 0.0, 1.0)
    lse = launch.forward(x, y, None, options, log_prob=False).lse
    grad = torch.ones(1)
    apart = launch.backward(grad, torch.zeros(1), x, lse, y, None, options, source_kind="logits")
    over = launch.backward(grad, torch.zeros(1), x, lse, y, None, options, source_kind="logits",
                           out=x)
    assert over.data_ptr() == x.data_ptr()
    assert torch.equal(over, apart)
