"""Static evidence for the CPU kernels (``ce_tvm.testing.cpu_static``): the
counting method on a known snippet, and one real kernel built for an AVX-512
target and one for an AVX2 target (cross-compiled: only assembly is made)."""

import math

import pytest

from ce_tvm.testing import cpu_static

# A function with one element loop: 4 widened bf16 loads (16 lanes each: 64
# elements), a max into two accumulators, loop control; after it a horizontal
# step that is not a loop.
ASM = """
	.type	k,@function
k:
	xorl	%eax, %eax
	vbroadcastss	.LCPI0_0(%rip), %zmm0
	vmovaps	%zmm0, %zmm1
.LBB0_1:
	vpmovzxwd	(%rsi,%rax), %zmm2
	vpmovzxwd	32(%rsi,%rax), %zmm3
	vpslld	$16, %zmm2, %zmm2
	vpslld	$16, %zmm3, %zmm3
	vmaxps	%zmm2, %zmm0, %zmm0
	vmaxps	%zmm3, %zmm1, %zmm1
	vpmovzxwd	64(%rsi,%rax), %zmm2
	vpmovzxwd	96(%rsi,%rax), %zmm3
	vpslld	$16, %zmm2, %zmm2
	vpslld	$16, %zmm3, %zmm3
	vmaxps	%zmm2, %zmm0, %zmm0
	vmaxps	%zmm3, %zmm1, %zmm1
	subq	$-128, %rax
	cmpq	$8000, %rax
	jne	.LBB0_1
	vmaxps	%zmm1, %zmm0, %zmm0
	retq
"""


def test_snippet_loop_elements_and_categories():
    (loop,) = cpu_static.analyse_asm(ASM, dtype_bytes=2, classes=4000)
    assert loop.element_loop and loop.instructions == 15
    assert loop.elements == 64 and loop.trip == 63  # ceil(8000 / 128)
    assert loop.categories == {"load": 8, "max": 4, "exp": 0, "sum": 0, "grad": 0,
                               "narrow": 0, "store": 0, "other": 3}
    assert loop.per_element == pytest.approx(15 / 64)
    assert cpu_static.kernel_per_element([loop]) == pytest.approx(15 / 64)


EXP_STORE = """
	.type	k,@function
k:
	xorl	%eax, %eax
.LBB0_1:
	vmovups	(%rdi,%rax,4), %ymm2
	vsubps	%ymm0, %ymm2, %ymm2
	vmovaps	%ymm9, %ymm4
	vfmsub213ps	%ymm10, %ymm2, %ymm4
	vpslld	$23, %ymm4, %ymm6
	vfmadd213ps	%ymm12, %ymm4, %ymm2
	vmulps	%ymm6, %ymm2, %ymm2
	vaddps	%ymm2, %ymm5, %ymm5
	vpsrld	$16, %ymm2, %ymm7
	vpackusdw	%ymm7, %ymm7, %ymm7
	vmovdqu	%xmm7, (%rdx,%rax,2)
	addq	$8, %rax
	cmpq	$4000, %rax
	jne	.LBB0_1
	retq
"""


def test_snippet_exp_sum_narrow_store():
    """The exp's chain (its argument, polynomial, power of two) is ``exp``; the
    accumulator ``sum``; the integer work feeding the 16-bit store ``narrow``."""
    (loop,) = cpu_static.analyse_asm(EXP_STORE, dtype_bytes=2, classes=4000)
    assert loop.elements == 8 and loop.trip == 500 and loop.share == 1.0
    c = loop.categories
    assert (c["load"], c["exp"], c["sum"], c["narrow"], c["store"], c["other"]) == (
        1, 6, 1, 2, 1, 3)


def test_avx512_lines_found():
    assert cpu_static.avx512_lines(ASM)  # zmm
    assert not cpu_static.avx512_lines(EXP_STORE.replace("%zmm", "%ymm"))


def test_target_string():
    assert cpu_static.parse_target("llvm -mcpu=haswell")["mcpu"] == "haswell"
    with pytest.raises(ValueError):
        cpu_static.parse_target("cuda")


@pytest.mark.parametrize("target,avx512", [("llvm -mcpu=znver5", True),
                                           ("llvm -mcpu=haswell", False)])
def test_real_kernel_loops_and_instruction_set(target, avx512):
    """The bf16 training kernel at C = 4000 (one chunk): element loops found,
    instructions per element positive and finite; the AVX2 target's assembly
    holds no AVX-512 (no zmm or mask register, no EVEX-only instruction)."""
    asm = cpu_static.cpu_asm("train", "bfloat16", 4000, target, lagged=False)
    loops = cpu_static.row_loops(cpu_static.analyse_asm(asm, 2, 4000))
    assert sum(loop.element_loop for loop in loops) >= 3
    per_element = cpu_static.kernel_per_element(loops)
    assert 0 < per_element < 100 and math.isfinite(per_element)
    categories = cpu_static.kernel_categories(loops)
    assert categories["exp"] > 0 and categories["store"] > 0
    if avx512:
        assert "%zmm" in asm
    else:
        assert "%zmm" not in asm
        assert cpu_static.avx512_lines(asm) == []


def test_rows_of_a_parallel_task_are_not_a_rows_elements():
    """The bf16 backward's hand schedule runs 16 rows a parallel task (a loop over
    rows inside the task's loop): every loop runs at most a row's elements per
    row, and the kernel counts what its one element loop counts."""
    asm = cpu_static.cpu_asm("backward", "bfloat16", 4000, "llvm -mcpu=znver3")
    loops = cpu_static.row_loops(cpu_static.analyse_asm(asm, 2, 4000))
    assert any(loop.trip == 16 and not loop.element_loop for loop in loops)
    assert all(loop.share <= 1.0 for loop in loops)
    element = [loop for loop in loops if loop.element_loop]
    assert len(element) == 1
    assert cpu_static.kernel_per_element(loops) == pytest.approx(element[0].per_element, rel=0.05)


def test_a_loop_counted_up_to_zero_has_its_trip():
    """LLVM counts a loop from minus its length up to zero (``movq $-5600``,
    ``addq $160``, ``jne``): the peeled last chunk of C = 50257 runs 5600 elements
    a row, not a whole row (it was charged as a row before)."""
    asm = cpu_static.cpu_asm("train", "bfloat16", 50257, "llvm -mcpu=znver5", lagged=False)
    loops = cpu_static.row_loops(cpu_static.analyse_asm(asm, 2, 50257))
    assert all(loop.trip for loop in loops if loop.element_loop)
    per_element = cpu_static.kernel_per_element(loops)
    assert per_element == pytest.approx(cpu_static.analyse("train", "bfloat16", 32000).per_element,
                                        rel=0.1)
