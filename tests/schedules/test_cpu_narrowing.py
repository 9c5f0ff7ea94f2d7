"""bfloat16 rounding by AVX-512 BF16 (``schedules/cpu_narrowing.py``): which
targets get ``vcvtneps2bf16`` and ``vcvtne2ps2bf16`` (cross-compiled: only
assembly is made), what it saves in the training kernel's budget, and, on a
host that has the instruction, its results against torch's rounding bit for
bit."""

import re

import pytest
import torch
import tvm
from tvm import s_tir, te, tirx
from tvm.target import Target

from ce_tvm.schedules import cpu
from ce_tvm.schedules.cpu_narrowing import has_bf16_rounding
from ce_tvm.store.targets import target_description
from ce_tvm.testing import cpu_static

ROUNDING_BY_INSTRUCTION = {"znver5": True, "znver4": True, "sapphirerapids": True,
                           "icelake-server": False, "znver3": False, "haswell": False}


def _scale_to_bf16(size: int, lanes: int):
    """``out = bf16(x * 1.5)`` over ``size`` float32 values, ``lanes`` per vector
    (a tail of ``size % lanes`` scalar)."""
    x = te.placeholder((size,), "float32", name="x")
    out = te.compute((size,), lambda i: (x[i] * tirx.const(1.5, "float32")).astype("bfloat16"),
                     name="out")
    sch = s_tir.Schedule(te.create_prim_func([x, out]).with_attr("global_symbol", "main"))
    (loop,) = sch.get_loops(sch.get_sblock("out"))
    body, tail = sch.split(loop, [None, lanes])
    sch.vectorize(tail)
    return sch.mod


def _build(mod, mcpu: str):
    with tvm.transform.PassContext(opt_level=3):
        return tvm.compile(mod, target={"kind": "llvm", "mcpu": mcpu},
                           tir_pipeline=cpu.TIR_PIPELINE)


@pytest.mark.parametrize("mcpu", sorted(ROUNDING_BY_INSTRUCTION))
def test_which_targets_round_by_instruction(mcpu):
    assert has_bf16_rounding(Target({"kind": "llvm", "mcpu": mcpu})) \
        == ROUNDING_BY_INSTRUCTION[mcpu]


@pytest.mark.parametrize("lanes, instruction", [(16, "vcvtneps2bf16"), (32, "vcvtne2ps2bf16"),
                                                 (64, "vcvtne2ps2bf16")])
def test_vectors_round_by_instruction_on_avx512_bf16(lanes, instruction):
    """16 lanes: one ``vcvtneps2bf16``; a multiple of 32: one ``vcvtne2ps2bf16``
    per 32 (two registers into one, no merge); no integer rounding left."""
    asm = _build(_scale_to_bf16(4096, lanes), "znver5").mod.inspect_source("asm")
    assert len(re.findall(instruction + r"\s+%zmm", asm)) >= 2
    assert "vpmovdw" not in asm and "vpsrld" not in asm and "vinsert" not in asm
    other = {"vcvtneps2bf16": "vcvtne2ps2bf16", "vcvtne2ps2bf16": "vcvtneps2bf16"}[instruction]
    assert other not in asm


@pytest.mark.parametrize("mcpu", ["icelake-server", "haswell"])
def test_other_targets_keep_the_integer_rounding(mcpu):
    asm = _build(_scale_to_bf16(4096, 32), mcpu).mod.inspect_source("asm")
    assert "ps2bf16" not in asm and "vpsrld" in asm


def test_training_kernel_narrowing_budget():
    """The bf16 training kernel at C = 32000 on ``znver5`` narrows by the
    instruction; on ``icelake-server`` (AVX-512 without BF16) by integer
    arithmetic, which costs at least three times as much per element."""
    def narrow(mcpu):
        asm = cpu_static.cpu_asm("train", "bfloat16", 32000, f"llvm -mcpu={mcpu}")
        loops = cpu_static.row_loops(cpu_static.analyse_asm(asm, 2, 32000))
        return asm, cpu_static.kernel_categories(loops)["narrow"]

    asm, by_instruction = narrow("znver5")
    assert "vcvtne2ps2bf16" in asm and "vpmovdw" not in asm
    _, by_integers = narrow("icelake-server")
    assert 0 < 3 * by_instruction < by_integers


def test_rounding_once_on_avx2_budget():
    """On AVX2 the rounding's value is evaluated once: the bf16 training kernel's
    gradient loop keeps one copy of the one-hot term (``znver3``, C = 32000:
    grad and narrow 2.55 instructions per element before)."""
    asm = cpu_static.cpu_asm("train", "bfloat16", 32000, "llvm -mcpu=znver3")
    categories = cpu_static.kernel_categories(
        cpu_static.row_loops(cpu_static.analyse_asm(asm, 2, 32000)))
    assert 0 < categories["grad"] + categories["narrow"] < 2.0


def test_rounding_as_torch_on_this_cpu():
    """Built for this host (by the instruction where it has AVX-512 BF16, else
    by the integer arithmetic evaluated once): every value (random, spread over
    magnitudes; ties; infinities; NaN; values that round up to infinity) gives
    torch's round-to-nearest-even bfloat16, bit for bit; subnormal results are
    left out (the instruction flushes them to zero)."""
    import tvm_ffi

    size = 4096 + 7  # a scalar tail after the vectors
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, generator=gen) * torch.exp2(torch.randint(-60, 60, (size,),
                                                                    generator=gen).float())
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3895e38 / 1.5,
                         float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    x[:ties.numel()] = ties / 1.5
    out = torch.empty(size, dtype=torch.bfloat16)
    executable = _build(_scale_to_bf16(size, 32), target_description("llvm")["mcpu"])
    executable["main"](tvm_ffi.from_dlpack(x), tvm_ffi.from_dlpack(out))
    expected = (x * 1.5).to(torch.bfloat16)
    normal = (expected.float().abs() >= torch.finfo(torch.bfloat16).tiny) \
        | (expected.float() == 0) | ~torch.isfinite(expected.float())
    assert torch.equal(out[normal].view(torch.int16)[~expected[normal].isnan()],
                       expected[normal].view(torch.int16)[~expected[normal].isnan()])
    assert torch.equal(out.isnan(), expected.isnan())
