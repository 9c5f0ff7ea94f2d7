"""bfloat16 widening (``schedules/cpu_widening.py``).

By 32-bit pairs, on every CPU: which loops (words only accumulated into
``rfactor`` lanes, with or without a column test, or kept a vector at a
time for the sums: yes; a copy, a second vector read: no; cross-compiled,
only assembly is made), the same maxima bit for bit and the same sums within
rounding as the legalised widening, on this host, and the forward and
log-prob kernels against float64 where their last chunk overlaps the one
before.

By a word permutation (the pairs pass left out): which targets get
``vpermt2w``, in which stores (a plain max or sum: yes; a value that
multiplies, a copy: no), how the instruction counter classes it, and, on a
host that has it, the same values bit for bit as the zero-extension and
shift."""

import re

import pytest
import torch
import torch.nn.functional as F
import tvm
import tvm_ffi
from tvm import s_tir, te
from tvm.target import Target

import ce_tvm
from ce_tvm.schedules import cpu, cpu_widening
from ce_tvm.schedules.cpu_knobs import forward_chunk
from ce_tvm.schedules.cpu_widening import has_word_permutes
from ce_tvm.store.targets import target_description, tvm_target
from ce_tvm.testing import cpu_static
from support import TOL, assert_close

PERMUTES = {"znver5": True, "znver4": True, "icelake-server": True, "skylake-avx512": True,
            "znver3": False, "haswell": False}
ROWS, COLUMNS = 8, 4096


KINDS = ("max", "sum", "squares", "tail", "weighted", "copy")
TAIL = 100  # ``tail`` sums the columns from here on


def _kernel(kind: str, lanes: int = 32):
    """``out [ROWS]`` of the bfloat16 ``x [ROWS, COLUMNS]`` per row, in float32:
    ``max``, ``sum``, ``squares`` (the sum of ``x * x``), ``tail`` (the sum of
    the columns from ``TAIL`` on: a column test in the loop) or ``weighted``
    (the sum of ``x * w`` with a float32 ``w [COLUMNS]``, a second vector read),
    rfactored into ``lanes`` vector accumulators; or ``copy``: ``x`` widened,
    ``[ROWS, COLUMNS]``."""
    x = te.placeholder((ROWS, COLUMNS), "bfloat16", name="x")
    w = te.placeholder((COLUMNS,), "float32", name="w")
    if kind == "copy":
        out = te.compute((ROWS, COLUMNS), lambda i, j: x[i, j].astype("float32"), name="out")
    else:
        k = te.reduce_axis((0, COLUMNS), "k")

        def row(i):
            v = x[i, k].astype("float32")
            zero = tvm.tirx.const(0.0, "float32")
            return {"max": lambda: te.max(v, axis=k), "sum": lambda: te.sum(v, axis=k),
                    "squares": lambda: te.sum(v * v, axis=k),
                    "tail": lambda: te.sum(tvm.tirx.Select(k >= TAIL, v, zero), axis=k),
                    "weighted": lambda: te.sum(v * w[k], axis=k)}[kind]()
        out = te.compute((ROWS,), row, name="out")
    args = [x, w, out] if kind == "weighted" else [x, out]
    sch = s_tir.Schedule(te.create_prim_func(args).with_attr("global_symbol", "main"))
    block = sch.get_sblock("out")
    *_, inner = sch.get_loops(block)
    outer, step = sch.split(inner, [None, lanes])
    if kind == "copy":
        sch.vectorize(step)
    else:
        accumulators = sch.rfactor(step, 1)  # [ROWS, lanes]: a row's lanes in a line
        sch.vectorize(sch.get_loops(accumulators)[-1])
        sch.decompose_reduction(accumulators, sch.get_loops(accumulators)[1])
    return sch.mod


def _build(mod, mcpu: str):
    with tvm.transform.PassContext(opt_level=3):
        return tvm.compile(mod, target={"kind": "llvm", "mcpu": mcpu},
                           tir_pipeline=cpu.TIR_PIPELINE)


def _asm(kind: str, mcpu: str, lanes: int = 32) -> str:
    return _build(_kernel(kind, lanes), mcpu).mod.inspect_source("asm")


@pytest.fixture
def no_pairs(monkeypatch):
    """The pairs pass left out (every loop kept as lowered)."""
    monkeypatch.setattr(cpu_widening, "_pairs_in_loop", lambda loop, *_: loop)


@pytest.mark.parametrize("mcpu, lanes", [("znver4", 32), ("znver4", 64), ("haswell", 16),
                                         ("haswell", 32)])
@pytest.mark.parametrize("kind", ["max", "sum", "squares", "tail"])
def test_accumulated_words_widen_by_pairs(mcpu, kind, lanes):
    """Words only accumulated (multiplied or not, tested by column or not), two
    registers or more, are widened by a shift and a mask (``vpand``, or a blend
    with zeros): no zero-extension, no permutation."""
    asm = _asm(kind, mcpu, lanes)
    assert "vpmovzxwd" not in asm and not re.search(r"vperm[ti]2w\s", asm)
    assert re.search(r"vpslld\s+\$16", asm) and re.search(r"(vpand[dq]?|vpblendw)\s", asm)


def test_one_register_of_words_keeps_its_order():
    """16 words on AVX-512 fill one register of floats: pairs would fill two
    halves and join them, so the words stay in order."""
    assert "vpand" not in _asm("sum", "znver4", 16)


@pytest.mark.parametrize("kind", ["weighted", "copy"])
def test_other_vectors_or_copies_keep_the_legalised_widening(kind):
    """A loop that reads a second vector (its lanes would need the same order),
    or stores the widened words where they are read in order, keeps them in
    order."""
    asm = _asm(kind, "haswell")
    assert "vpmovzxwd" in asm


def _run(kind: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.empty(ROWS)
    args = [x, w, out] if kind == "weighted" else [x, out]
    _build(_kernel(kind), target_description("llvm")["mcpu"])["main"](
        *[tvm_ffi.from_dlpack(a) for a in args])
    return out


@pytest.mark.parametrize("kind", ["max", "sum", "squares", "tail"])
def test_pairs_give_the_values_of_the_legalised_widening(kind, monkeypatch):
    """Built for this host with and without the pairs: the same maxima bit for
    bit, sums within float32 rounding of each other and of float64 (the same
    terms, grouped otherwise): the column test follows the lanes' order."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(ROWS, COLUMNS, generator=gen) * 4).to(torch.bfloat16)
    x[:, :TAIL] += 1000  # a column test that misses its lanes shows at once
    w = torch.rand(COLUMNS, generator=gen)
    pairs = _run(kind, x, w)
    monkeypatch.setattr(cpu_widening, "_pairs_in_loop", lambda loop, *_: loop)
    legalised = _run(kind, x, w)
    v = x.double()
    expected = {"max": v.amax(1), "sum": v.sum(1), "squares": (v * v).sum(1),
                "tail": v[:, TAIL:].sum(1)}[kind]
    if kind == "max":
        assert torch.equal(pairs, legalised) and torch.equal(pairs.double(), expected)
    else:
        assert_close(pairs, expected, 1e-6, kind)
        assert_close(pairs, legalised.double(), 1e-6, kind)


def test_log_probs_kernel_keeps_its_exp_in_pair_order():
    """The bf16 log-probs at C = 32000 on ``znver4``: the loop that keeps each
    vector's ``exp`` for its two sums (a temporary only that loop reads)
    widens by pairs too, as does its max loop: no zero-extension left."""
    asm = cpu_static.cpu_asm("log_probs", "bfloat16", 32000, "llvm -mcpu=znver4")
    assert "vpmovzxwd" not in asm and not re.search(r"vpermt2w\s", asm)


def _spiked(classes: int, rows_past_overlap: int = 40):
    """bf16 logits ``[rows, classes]`` with one large logit per row, at every
    column from the last chunk's start (inside the chunk before) to past the
    overlap's end, and a target per row."""
    chunk = forward_chunk(classes, "bfloat16", tvm_target("llvm"))
    assert classes % chunk, "the row must end in an overlapping chunk"
    first = classes - chunk
    rows = min(2 * chunk - classes + rows_past_overlap, classes - first)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, classes, generator=gen)
    x[torch.arange(rows), first + torch.arange(rows)] = 12.0
    return x.to(torch.bfloat16), torch.randint(0, classes, (rows,), generator=gen)


def test_forward_where_its_last_chunk_overlaps():
    """The bf16 forward at a row whose last chunk overlaps the one before (its
    loop tests which columns are new): one large logit per row, at every
    column from the overlap's start to past its end, each counted once."""
    x, y = _spiked(4099)
    for eps in (0.0, 0.1):
        loss = ce_tvm.cross_entropy(x, y, reduction="none", label_smoothing=eps)
        expected = F.cross_entropy(x.double(), y, reduction="none", label_smoothing=eps)
        assert_close(loss, expected.numpy(), TOL[torch.bfloat16], f"eps {eps}")


@pytest.mark.parametrize("mcpu", sorted(PERMUTES))
def test_which_targets_permute_words(mcpu):
    assert has_word_permutes(Target({"kind": "llvm", "mcpu": mcpu})) == PERMUTES[mcpu]


@pytest.mark.parametrize("kind", ["max", "sum"])
@pytest.mark.parametrize("lanes", [16, 32, 64])
def test_plain_updates_widen_by_permutation(kind, lanes, no_pairs):
    asm = _asm(kind, "znver4", lanes)
    assert re.search(r"vperm[ti]2w\s", asm) and "vpmovzxwd" not in asm


@pytest.mark.parametrize("kind", ["squares", "copy"])
def test_multiplied_or_copied_values_keep_the_shift(kind, no_pairs):
    """Where the widened value is multiplied (an ``exp``, a scaling) or only
    copied, the permutation measured slower: the zero-extension and shift stay."""
    asm = _asm(kind, "znver4")
    assert "vpmovzxwd" in asm and not re.search(r"vperm[ti]2w\s", asm)


@pytest.mark.parametrize("mcpu", ["znver3", "haswell"])
def test_avx2_targets_keep_the_shift(mcpu, no_pairs):
    asm = _asm("max", mcpu)
    assert "vpmovzxwd" in asm and "vperm" not in asm


def test_forward_kernel_streams_its_chunk_by_pairs():
    """The bf16 forward at C = 32000 on ``znver4``: its max loop and its exp loop
    widen by pairs; the counter classes the load, shift and mask as ``load``."""
    asm = cpu_static.cpu_asm("forward", "bfloat16", 32000, "llvm -mcpu=znver4")
    assert not re.search(r"vpermt2w\s", asm) and "vpmovzxwd" not in asm
    loops = cpu_static.row_loops(cpu_static.analyse_asm(asm, 2, 32000))
    assert 0.05 < cpu_static.kernel_categories(loops)["load"] < 0.2


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
def test_same_values_as_the_shift_on_this_cpu(kind, monkeypatch, no_pairs):
    """Built for this host with and without the permutation: the same results bit
    for bit on values spread over magnitudes, signed zeros, infinities, NaN and
    subnormals; the max is torch's (but where a NaN meets ``maxps``)."""
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


@pytest.mark.parametrize("entropy", [False, True])
def test_log_probs_where_the_last_chunk_overlaps(entropy):
    """The bf16 log-probs (with and without the entropy) at such rows: each
    column counted once, against float64."""
    x, y = _spiked(4099)
    out = ce_tvm.log_probs(x, y, return_entropy=entropy)
    reference = torch.log_softmax(x.double(), -1)
    logp = out[0] if entropy else out
    assert_close(logp, reference.gather(1, y[:, None])[:, 0].numpy(), 1e-5, "log-probs")
    if entropy:
        expected = -(reference.exp() * reference).sum(-1)
        assert_close(out[1], expected.numpy(), 1e-5, "entropy")
