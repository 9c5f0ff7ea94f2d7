"""Static evidence for the CUDA kernels (``ce_tvm.testing.cuda_static``): budgets
on their machine code, checked without a GPU (nvcc + nvdisasm/cuobjdump).

Budgets, per element of the row kernel's element loops (sm_90), and why.
Counts since 2026-12-04's evening are of the machine code that runs: nvcc with
TVM's flags (``cuda_static.nvcc_flags``: ``--use_fast_math``, under which
``exp2f`` is one ``MUFU.EX2``); the history below was counted without fast
math, which reads 10-40% higher (the lanes' forward 16.6 -> 12.3, the
log-prob forward 29.4 -> 23.5, its gradient 20.3 -> 17.3; bf16, C = 128256).

- ``exp`` is CUDA's ``exp2f`` of ``x log2(e)`` (``fastmath`` scaling
  ``"exp2"``): an FMUL, the special-function unit's ``MUFU.EX2`` and its
  denormal fix-up, ~5 SASS instructions (the branchless polynomial it
  replaced took ~19). A pass over a staged chunk adds a load, a conversion
  and the accumulation. The forward makes three passes per chunk (stage, max,
  exp-sum) plus the chunk's cross-thread reductions; the log_prob forward a
  fourth pass; the backward one (load, exp, coefficients, store; 4 block
  sweeps unrolled per iteration); the training kernel the forward's chunk
  passes, then the backward's (the logits read again, ``exp`` again).
  Measured on the cuda3 branch (weighted forwards and training kernel,
  unweighted backward; bf16/fp32, C = 50257/128256): forward 32-36, log_prob
  forward 35-45, backward 13-26 (the high end is the scalar loop of rows not
  16-byte aligned: C = 50257), training kernel 47-54 (its gradient's last,
  overlapping chunk runs in a scalar loop of its own; the tool charges every
  element the costlier of the two gradient loops). Budgets leave ~20%
  headroom. The class weights' sum is reduced once per launch (``ce_wsum``,
  a kernel of its own before the rows), no longer in every row's chunk loop:
  the weighted forward went from 40-42 to 32-36 (cuda2's budgets: forward 50,
  log_prob forward 62, training 74; short rows 150/156/216). Before the
  second round of work on the CUDA kernels (main 2380dd4, polynomial exp,
  one load in flight): forward 56-58, log_prob forward 60-71, backward
  27-50; before its first round the forward was 100-120 and the log_prob
  forward 106-131 (the chunk max re-read from a volatile shared slot: 9-13
  broadcast shared loads per element).
- Broadcast shared loads (a per-row or per-chunk scalar read from shared
  memory inside an element loop): at most one per 4 elements (a chunk's
  reduction results, read once per chunk, amortised) - never one per element.
  The training kernel reads per chunk its 3-4 reduction results and, in the
  gradient, the chunk's max and scale, over the 16 elements a thread owns
  per chunk: (4 + 2) / 16 = 0.375 (0.12-0.36 measured).
- No local-memory spills in any kernel; static shared memory under 48 KB; at
  most 64 registers per thread in the row kernel (4 blocks of 256 threads
  per SM), 80 in the training kernel (the float32 weighted one holds 73 at
  C = 50257, 3 blocks per SM: its chunk loop keeps the logits, the weights
  and their sums live across the unrolled passes).
- Short rows (C = 1001: 4 elements per thread) run without loops; the whole
  kernel over its 4 elements per thread is bounded instead (per-row
  reductions dominate there): measured forward 106, log_prob forward 118
  (the row is read once, from shared memory), backward 70, training 174
  (cuda2: 124, 130, 70, 180).

The weighted forward and training kernel are measured (the unweighted ones
share their element loops).

- Rows of more than 4096 classes in the forward and log-prob kernels are
  merged in lanes (``schedule_forward_lanes``: no staging, no block-wide
  reduction per chunk): the forward took 16.6/20.8 per element (bf16/fp32,
  C = 128256, unweighted), the log-probs 29.4/38.0, their stats variant
  39.1/52.5 (2026-12-04, without fast math; with it 12.3/15.2, 23.5/29.0,
  31.5/40.8; a lane reducing two vectors before it merges, ``lane_vectors``:
  10.2/10.9, 19.1/20.6, 25.9/29.1), well inside the budgets below, which the chunked
  schedule set; the log-prob gradient, its per-row values held in registers and
  its logits loaded in vectors, 20.3/18.3 (with fast math 17.3/15.3). The
  history of the chunked kernels follows.
- The log-prob kernels (SPEC section 6, one index per row): the
  forward evaluates ``exp`` in each of a chunk's two sums (``KEEPS_CHUNK_EXP``
  is off on CUDA) and adds the entropy term: 47-51 per element (bf16/fp32,
  C = 50257/128256), 126-130 for the whole short row. Its gradient took
  28-39 (the high end C = 50257, rows not 16-byte aligned) until the
  vocabulary-sharded head's gradient needed the index tested against the
  shard (another shard's entry counts in the upstream sum, matches no
  column): now 37-65 (the index is re-read per element: the compiler cannot
  tell it from the gradient's stores), 40-42 short. A per-row stage of the
  hot columns would win that back.
- Their stats variant (``return_stats=True``: ``log sum p^2``, the mean
  logit, the first argmax) adds three chunk reductions, each a pass over the
  staged chunk with its own cross-thread reduction (the ``exp`` evaluated
  once more for the sum of squares): 77-83 per element (bf16/fp32, C =
  50257/128256), 206-208 for the whole short row, 48-59 registers, and 6
  reduction results per chunk read over the 16 elements a thread owns (0.375
  broadcast loads per element). Merging its passes into the exp-sum's, as the
  CPU schedule does, would need the chunk reductions rfactored: TVM lowers a
  cross-thread reduction only when its block is the last under its loop.
- The student-teacher divergence (``DIVERGENCE_BUDGET``): the simple nest, a
  block per row, every row reduction a pass of its own over global memory.
"""

import math
import shutil

import pytest

from ce_tvm.compiler.build import compile_spec, cuda_binary
from ce_tvm.kernels.kinds import Variant
from ce_tvm.store.spec import KernelSpec
from ce_tvm.testing import cuda_static

needs_tools = pytest.mark.skipif(
    shutil.which("nvcc") is None or cuda_static.disassembler() is None,
    reason="needs nvcc and nvdisasm/cuobjdump (pip install nvidia-cuda-nvdisasm)")

BUDGET = {"forward": 43, "forward-lp": 54, "backward": 32, "train": 65,
          "log_probs": 61, "log_probs_grad": 78, "log_probs-st": 100}  # insn/el, loops
SHORT_ROW_BUDGET = {"forward": 128, "forward-lp": 142, "backward": 85,
                    "train": 209, "log_probs": 156, "log_probs_grad": 51,
                    "log_probs-st": 250}  # C = 1001, no loops
MAX_BROADCAST_LDS = {"train": 0.4, "log_probs-st": 0.45}  # else 0.25
MAX_REGISTERS = {"train": 80}  # else 64
MAX_STATIC_SMEM = 48 * 1024
# The divergence (section 15, with its gradient; C = 128256) makes up to seven
# passes over the student row and five over the teacher's, each with its exps,
# the JSD three software logs of its mixture: measured 2026-12-02 (bf16/fp32)
# jsd 282/239, forward KL 155/114 insn/el, 32 registers, no spills; ~20% headroom.
DIVERGENCE_BUDGET = {"divergence-jsd": 340, "divergence-fkl": 190}
SHAPES = [(op, dtype, classes) for op in BUDGET for dtype in ("bfloat16", "float32")
          for classes in (1001, 50257, 128256)]


def _summary(op, dtype, classes):
    kernels = cuda_static.analyse(op, dtype, classes, weighted=op != "backward")
    return kernels, cuda_static.summarise(kernels, classes)


@needs_tools
@pytest.mark.slow
@pytest.mark.parametrize("op,dtype,classes", SHAPES)
def test_machine_code_within_budget(op, dtype, classes):
    kernels, s = _summary(op, dtype, classes)
    shape = f"{op} {dtype} C={classes}"
    assert s.spill_bytes == 0, f"{shape}: {s.spill_bytes} bytes spilled"
    assert s.kernel.registers <= MAX_REGISTERS.get(op, 64), (
        f"{shape}: {s.kernel.registers} registers")
    assert s.kernel.smem < MAX_STATIC_SMEM, f"{shape}: {s.kernel.smem} B shared"
    if s.kernel.loops:
        assert s.insn_per_element <= BUDGET[op], f"{shape}: {s.insn_per_element:.1f} insn/el"
        assert s.broadcast_per_element <= MAX_BROADCAST_LDS.get(op, 0.25), (
            f"{shape}: {s.broadcast_per_element:.2f} broadcast shared loads per element")
    else:
        assert classes <= 4096, f"{shape}: a long row without an element loop"
        assert s.insn_per_element <= SHORT_ROW_BUDGET[op], (
            f"{shape}: {s.insn_per_element:.1f} insn/el (whole kernel)")


@needs_tools
@pytest.mark.slow
@pytest.mark.parametrize("dtype,budget", [("bfloat16", 15.5), ("float32", 18.5)])
def test_log_prob_forward_entropy_term_has_no_branch(dtype, budget):
    """The log-prob forward in lanes (C = 128256) sums the entropy's term
    ``e (top - x)'`` as ``-(e max(s, lowest))`` of the exp's own argument ``s``:
    a max and an FMA per element. Written as a select on ``e == 0`` (a masked
    class gives ``0 * inf``) nvcc made it predicated instructions after a second
    ``x - top``: 19.1 (bf16) and 20.6 (fp32) instructions per element, where
    the branch-free term takes 13.9 and 16.8 (bf16 13.2 since its lane loop
    takes two rounds an iteration: ``LOG_PROBS_KNOBS``)."""
    _, s = _summary("log_probs", dtype, 128256)
    assert s.kernel.loops and s.insn_per_element <= budget, f"{s.insn_per_element:.1f} insn/el"


@needs_tools
@pytest.mark.slow  # nvcc
@pytest.mark.parametrize("op", ["forward", "backward", "train"])
def test_exp_is_exp2f_which_keeps_nan(op):
    """The CUDA kernels' ``exp`` is ``exp2f`` (``fastmath`` scaling ``"exp2"``),
    which returns NaN for NaN by itself: no clamp through CUDA's ``fmaxf``
    (which drops NaN) stands between a NaN logit and its row's sums. Before,
    the polynomial's clamp needed an explicit test on the bits."""
    source = cuda_static.cuda_source(op, "bfloat16", 1001)
    assert "exp2f(" in source
    assert "nearbyintf" not in source  # no polynomial (and no clamp) left


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.slow  # nvcc
@pytest.mark.parametrize("classes", [1001, 32000])
@pytest.mark.parametrize("variant", [Variant(columns=1, stats=True),
                                     Variant(columns=5, softcap=True, stats=True)],
                         ids=["k1", "k5-cap"])
def test_log_prob_stats_variant_compiles_with_nvcc(variant, classes):
    """The log-probs' stats variant (``return_stats=True``) builds for CUDA and
    nvcc compiles it; its three statistics are outputs of the one row kernel."""
    spec = KernelSpec("log_probs", "bfloat16", classes, variant, "cuda", (("arch", "sm_90"),))
    source, cubin = cuda_binary(compile_spec(spec), spec)  # raises on any nvcc error
    assert cubin[:4] == b"\x7fELF"
    assert all(name in source for name in ("log_sum_sq_probs", "mean_logits", "is_top1"))


@needs_tools
@pytest.mark.slow
@pytest.mark.parametrize("op", ["divergence-jsd", "divergence-fkl"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_divergence_machine_code_within_budget(op, dtype):
    """The student-teacher divergence (docs/spec.md, section 15; its gradient
    variant) at C = 128256: no spills, its registers and static shared memory
    within the row kernels' limits, and its instructions per element (all its
    row passes: two maxima, two exp-sums, the divergence's sums, the gradient)
    within ``DIVERGENCE_BUDGET``."""
    kernels, s = _summary(op, dtype, 128256)
    shape = f"{op} {dtype} C=128256"
    assert s.spill_bytes == 0, f"{shape}: {s.spill_bytes} bytes spilled"
    assert s.kernel.registers <= 64, f"{shape}: {s.kernel.registers} registers"
    assert s.kernel.smem < MAX_STATIC_SMEM, f"{shape}: {s.kernel.smem} B shared"
    assert s.kernel.loops and s.insn_per_element <= DIVERGENCE_BUDGET[op], (
        f"{shape}: {s.insn_per_element:.1f} insn/el")


@needs_tools
@pytest.mark.slow  # nvcc
def test_counts_the_machine_code_that_ships():
    """The tool compiles with the flags TVM's own CUDA build uses
    (``nvcc_flags``: fast math, its ptxas options), so it counts the same
    instructions as the cubin a bundle ships (``cuda_binary``). Before, it
    compiled without fast math: an ``exp2f`` of five instructions where the
    shipped kernel has one ``MUFU.EX2``."""
    import subprocess
    import tempfile
    from pathlib import Path

    spec = cuda_static._spec("forward", "bfloat16", 1001, "sm_90", False, "mean")
    _, cubin = cuda_binary(compile_spec(spec), spec)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run(cuda_static.disassembler() + [str(path)], capture_output=True,
                              text=True, check=True).stdout
    shipped = {name: count for name, (count, _) in cuda_static.parse_sass(sass, 2).items()}
    counted = {name: k.instructions
               for name, k in cuda_static.analyse("forward", "bfloat16", 1001).items()}
    assert counted == shipped


@needs_tools
@pytest.mark.slow  # nvcc
def test_unweighted_multi_chunk_forward_builds():
    """An int32 chunk axis once mixed int32 and int64 threadIdx.x in one kernel (TVM's
    UnifyThreadBinding then failed to build it); the chunk axes are int64 again."""
    cuda_static.cuda_source("forward", "bfloat16", 50257)


SASS = """
.text.k:
        /*0000*/                   S2R R2, SR_TID.X ;
        /*0010*/                   MOV R9, R2 ;
.L_x_1:
        /*0020*/                   S2UR UR7, SR_CgaCtaId ;
        /*0030*/                   UMOV UR6, 0x400 ;
        /*0040*/                   ULEA UR6, UR7, UR6, 0x18 ;
        /*0050*/                   LDS.U16 R12, [R9] ;
        /*0060*/                   LDS R13, [UR6+0x2080] ;
        /*0070*/                   FADD R13, R12, -R13 ;
        /*0080*/                   IADD3 R9, R9, 0x200, RZ ;
        /*0090*/               @P2 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
.L_x_2:
        /*00b0*/                   BRA `(.L_x_2);
"""


def test_sass_loops_streams_and_broadcasts():
    """The loop is found (the spin loop after EXIT is not an element loop); the
    16-bit shared load moves with R9 (1 element per iteration); the load at a
    uniform address rebuilt each iteration is a broadcast."""
    (count, loops), = cuda_static.parse_sass(SASS, dtype_bytes=2).values()
    assert count == 12
    (loop,) = loops
    assert (loop.instructions, loop.elements, loop.lds, loop.broadcast_lds) == (8, 1, 2, 1)


STORING_LOOP = """
.text.k:
        /*0000*/                   S2R R2, SR_TID.X ;
.L_x_1:
        /*0010*/                   LDG.E.128 R4, desc[UR6][R2.64] ;
        /*0020*/                   LDS R8, [R2+0x10] ;
        /*0030*/                   FADD R4, R4, -R8 ;
        /*0040*/                   STG.E.128 desc[UR6][R2.64+0x100], R4 ;
        /*0050*/                   IADD3 R2, R2, 0x200, RZ ;
        /*0060*/               @P2 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
"""


def test_a_loop_that_stores_is_counted_by_its_stores():
    """A loop streaming a 16-byte vector in and out (8 bf16 elements) that also
    reads a per-thread 4-byte scalar from shared memory at a moving address (a
    chunk's value at the chunk index): 8 elements per iteration, from its global
    streams; the shared read is not a row staged before the loop (it counted 2)."""
    (_, loops), = cuda_static.parse_sass(STORING_LOOP, dtype_bytes=2).values()
    (loop,) = loops
    assert loop.elements == 8


def test_loop_free_kernel_is_bounded_by_its_size():
    kernel = cuda_static.Kernel("k", instructions=400)
    s = cuda_static.summarise({"k": kernel}, classes=1001)
    assert s.insn_per_element == 100 and math.isnan(s.broadcast_per_element)


@needs_tools
@pytest.mark.slow
def test_knob_variants_reach_the_machine_code():
    """A kernel counted with other CUDA knobs (``analyse(..., knobs=...)``, what the
    GPU check times beside each kernel) is built with them: the bf16 training kernel
    with two rounds of its lane loop an iteration holds more registers (a 1024-thread
    block per SM on sm_90) for fewer instructions, and one vector per lane costs
    instructions."""
    plain = cuda_static.summarise(cuda_static.analyse("train", "bfloat16", 128256), 128256)
    rounds, one_vector = (cuda_static.summarise(cuda_static.analyse(
        "train", "bfloat16", 128256, knobs=(knob,)), 128256)
        for knob in (("lane_rounds", "2"), ("lane_vectors", "1")))
    assert plain.kernel.registers <= 32 < rounds.kernel.registers
    assert rounds.insn_per_element < plain.insn_per_element < one_vector.insn_per_element
