"""bfloat16 widening by a word permutation (``schedules/cpu_widening.py``): which
targets get ``vpermt2w``, in which stores (a plain max or sum: yes; a value that
multiplies, a copy: no; cross-compiled, only assembly is made), how the
instruction counter classes it, and, on a host that has it, the same values
bit for bit as the zero-extension and shift."""

import re

import pytest
import torch
import tvm
from tvm import s_tir, te
from tvm.target import Target

from ce_tvm.schedules import cpu, cpu_widening
from ce_tvm.schedules.cpu_widening import has_word_permutes
from ce_tvm.store.targets import target_description
from ce_tvm.testing import cpu_static

PERMUTES = {"znver5": True, "znver4": True, "icelake-server": True, "skylake-avx512": True,
            "znver3": False, "haswell": False}
ROWS, COLUMNS = 8, 4096


def _kernel(kind: str, lanes: int = 32):
    """``out [ROWS]`` of the bfloat16 ``x [ROWS, COLUMNS]`` per row, in float32:
    ``max``, ``sum`` or ``squares`` (the sum of ``x * x``), rfactored into
    ``lanes`` vector accumulators; or ``copy``: ``x`` widened, ``[ROWS, COLUMNS]``."""
    x = te.placeholder((ROWS, COLUMNS), "bfloat16", name="x")
    if kind == "copy":
        out = te.compute((ROWS, COLUMNS), lambda i, j: x[i, j].astype("float32"), name="out")
    else:
        k = te.reduce_axis((0, COLUMNS), "k")

        def row(i):
            v = x[i, k].astype("float32")
            return {"max": te.max(v, axis=k), "sum": te.sum(v, axis=k),
                    "squares": te.sum(v * v, axis=k)}[kind]
        out = te.compute((ROWS,), row, name="out")
    sch = s_tir.Schedule(te.create_prim_func([x, out]).with_attr("global_symbol", "main"))
    block = sch.get_sblock("out")
    *_, inner = sch.get_loops(block)
    outer, step = sch.split(inner, [None, lanes])
    if kind == "copy":
        sch.vectorize(step)
    else:
        accumulators = sch.rfactor(step, 0)
        sch.vectorize(sch.get_loops(accumulators)[-1])
    return sch.mod


def _build(mod, mcpu: str):
    with tvm.transform.PassContext(opt_level=3):
        return tvm.compile(mod, target={"kind": "llvm", "mcpu": mcpu},
                           tir_pipeline=cpu.TIR_PIPELINE)


def _asm(kind: str, mcpu: str, lanes: int = 32) -> str:
    return _build(_kernel(kind, lanes), mcpu).mod.inspect_source("asm")


@pytest.mark.parametrize("mcpu", sorted(PERMUTES))
def test_which_targets_permute_words(mcpu):
    assert has_word_permutes(Target({"kind": "llvm", "mcpu": mcpu})) == PERMUTES[mcpu]


@pytest.mark.parametrize("kind", ["max", "sum"])
@pytest.mark.parametrize("lanes", [16, 32, 64])
def test_plain_updates_widen_by_permutation(kind, lanes):
    asm = _asm(kind, "znver4", lanes)
    assert re.search(r"vperm[ti]2w\s", asm) and "vpmovzxwd" not in asm


@pytest.mark.parametrize("kind", ["squares", "copy"])
def test_multiplied_or_copied_values_keep_the_shift(kind):
    """Where the widened value is multiplied (an ``exp``, a scaling) or only
    copied, the permutation measured slower: the zero-extension and shift stay."""
    asm = _asm(kind, "znver4")
    assert "vpmovzxwd" in asm and not re.search(r"vperm[ti]2w\s", asm)


@pytest.mark.parametrize("mcpu", ["znver3", "haswell"])
def test_avx2_targets_keep_the_shift(mcpu):
    asm = _asm("max", mcpu)
    assert "vpmovzxwd" in asm and "vperm" not in asm


def test_forward_kernel_streams_its_chunk_by_permutation():
    """The bf16 forward at C = 32000 on ``znver4``: its max loop widens by
    ``vpermt2w``, its exp loop by the shift; the counter classes both as ``load``."""
    asm = cpu_static.cpu_asm("forward", "bfloat16", 32000, "llvm -mcpu=znver4")
    assert re.search(r"vpermt2w\s", asm) and "vpmovzxwd" in asm
    loops = cpu_static.row_loops(cpu_static.analyse_asm(asm, 2, 32000))
    assert 0.1 < cpu_static.kernel_categories(loops)["load"] < 0.35


PERMUTED = """
	.type	k,@function
k:
	xorl	%eax, %eax
.LBB0_1:
	vmovdqu64	(%rsi,%rax), %zmm4
	vpxor	%xmm8, %xmm8, %xmm8
	vpermt2w	%zmm4, %zmm15, %zmm8
	vmaxps	%zmm8, %zmm0, %zmm0
	vpxor	%xmm9, %xmm9, %xmm9
	vpermt2w	%zmm4, %zmm16, %zmm9
	vmaxps	%zmm9, %zmm1, %zmm1
	addq	$64, %rax
	cmpq	$8000, %rax
	jne	.LBB0_1
	retq
"""


def test_counter_classes_the_permutation_and_its_zeros_as_load():
    (loop,) = cpu_static.analyse_asm(PERMUTED, dtype_bytes=2, classes=4000)
    assert loop.elements == 32
    assert (loop.categories["load"], loop.categories["max"], loop.categories["other"]) == (
        5, 2, 3)


@pytest.mark.skipif(not has_word_permutes(Target(target_description("llvm"))),
                    reason="this host has no AVX-512 BW")
@pytest.mark.parametrize("kind", ["max", "sum"])
def test_same_values_as_the_shift_on_this_cpu(kind, monkeypatch):
    """Built for this host with and without the permutation: the same results bit
    for bit on values spread over magnitudes, signed zeros, infinities, NaN and
    subnormals; the max is torch's (but where a NaN meets ``maxps``)."""
    import tvm_ffi

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(ROWS, COLUMNS, generator=gen) * torch.exp2(
        torch.randint(-130, 60, (ROWS, COLUMNS), generator=gen).float())).to(torch.bfloat16)
    x[0, :6] = torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), 1e-40, -1e-40])
    x[1, 5] = float("nan")
    mcpu = target_description("llvm")["mcpu"]
    results = []
    for permutes in (True, False):
        monkeypatch.setattr(cpu_widening, "has_word_permutes", lambda target, p=permutes: p)
        out = torch.empty(ROWS)
        _build(_kernel(kind), mcpu)["main"](tvm_ffi.from_dlpack(x), tvm_ffi.from_dlpack(out))
        results.append(out)
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))
    if kind == "max":
        expected = x.float().amax(1)
        kept = torch.arange(ROWS) != 1  # row 1 holds a NaN: maxps keeps one operand of two
        assert torch.equal(results[0][kept], expected[kept])
