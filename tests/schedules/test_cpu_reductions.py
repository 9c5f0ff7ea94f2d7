"""Vector accumulators merged by halves (``schedules/cpu_reductions.py``): which
loops the pass rewrites, that a rewritten reduction gives float64's result (a
max or min exactly), and that the kernels' chunk loops lose their lane-by-lane
chains (cross-compiled for Zen 4, only assembly is made)."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir, te, tirx

from ce_tvm.schedules import cpu
from ce_tvm.schedules._common import collect_nodes, split_reduction, vector_accumulator
from ce_tvm.testing import cpu_static

_REDUCERS = {"sum": (te.sum, np.sum), "max": (te.max, np.max), "min": (te.min, np.min)}


def _row_reduction(kind: str, classes: int, lanes: int):
    """``out[i] = kind(x[i, :])`` split by ``lanes`` and rfactored, its vector
    accumulators vectorised (as the kernels' chunk reductions are)."""
    x = te.placeholder((8, classes), "float32", name="x")
    k = te.reduce_axis((0, classes), name="k")
    out = te.compute((8,), lambda i: _REDUCERS[kind][0](x[i, k], axis=k), name="out")
    sch = s_tir.Schedule(te.create_prim_func([x, out]))
    rf, final = split_reduction(sch, "out", lanes)
    sch.compute_at(rf, sch.get_loops(final)[0])
    vector_accumulator(sch, rf, 1)
    return sch.mod


def _compiled(mod, monkeypatch):
    """``mod`` compiled for this host through ``cpu``'s pipeline; returns the
    library and the function as the pass got it and as it left it."""
    seen = []
    real = cpu.tree_lane_reductions

    @tvm.tirx.transform.prim_func_pass(opt_level=0)
    def recording(func, mod, ctx):
        seen.extend([func, real(tvm.IRModule({"main": func}))["main"]])
        return seen[-1]

    monkeypatch.setattr(cpu, "tree_lane_reductions", recording)
    with tvm.transform.PassContext(opt_level=3):
        lib = tvm.compile(mod, target="llvm", tir_pipeline=cpu.TIR_PIPELINE)
    return lib, *seen


def _lane_loops(func, lanes: int) -> list:
    return [f for f in collect_nodes(func.body, tirx.For)
            if isinstance(f.extent, tirx.IntImm) and f.extent.value == lanes]


@pytest.mark.parametrize("kind", sorted(_REDUCERS))
def test_a_lane_reduction_becomes_halves(kind, monkeypatch):
    _, func, tree = _compiled(_row_reduction(kind, 256, 32), monkeypatch)
    assert _lane_loops(func, 32)  # the serial merge of the 32 accumulators
    assert not _lane_loops(tree, 32)
    widths = sorted(int(tvm.runtime.DataType(str(s.ty)).lanes)
                    for s in collect_nodes(tree.body, tirx.Shuffle))
    assert widths == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16]  # 32 -> 16 -> 8 -> 4 -> 2 -> 1


def test_lanes_not_a_power_of_two_stay_serial(monkeypatch):
    """29 lanes (C = 29 * 12): no halving, the loop is left as it is."""
    _, func, tree = _compiled(_row_reduction("sum", 29 * 12, 29), monkeypatch)
    assert _lane_loops(func, 29) and tvm_ffi.structural_equal(tree.body, func.body)


@pytest.mark.parametrize("kind", sorted(_REDUCERS))
def test_a_tree_reduction_gives_float64s_result(kind, monkeypatch):
    lib, _, tree = _compiled(_row_reduction(kind, 4096, 32), monkeypatch)
    assert not _lane_loops(tree, 32)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 4096)) * 30).astype(np.float32)
    x[3] = -1e30  # a row whose every lane holds the same value
    x[5, 4095] = 1e4  # the extreme in the last lane
    out = tvm.runtime.tensor(np.zeros(8, np.float32))
    lib["main"](tvm.runtime.tensor(x), out)
    expected = _REDUCERS[kind][1](x.astype(np.float64), axis=1)
    if kind == "sum":
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5,
                                   atol=1e-6 * np.abs(x).sum(axis=1).max())
    else:
        np.testing.assert_array_equal(out.numpy(), expected.astype(np.float32))


def _scalar(asm: str, mnemonic: str) -> int:
    return sum(line.strip().startswith(mnemonic + "\t") for line in asm.splitlines())


@pytest.mark.parametrize("mcpu", ["znver4", "haswell"])
@pytest.mark.parametrize("op,dtype", [("train", "float32"), ("train", "bfloat16"),
                                      ("forward", "float32"), ("forward", "bfloat16"),
                                      ("train-ns", "float32"), ("forward-ns", "bfloat16"),
                                      ("log_probs", "float32")])
def test_chunk_loops_merge_by_halves(op, dtype, mcpu):
    """The kernels' scalar merges: a chunk's max over 32 accumulator lanes (16
    on AVX2) took one ``vmaxss`` per lane, lane by lane (35 in the training
    kernel on Zen 4, 69 with the row shift of ``eps = 0``); by halves, the
    last two lanes only. The log-probs' two sums likewise (71 ``vaddss``)."""
    asm = cpu_static.cpu_asm(op, dtype, 32000, f"llvm -mcpu={mcpu}")
    assert _scalar(asm, "vmaxss") <= 10
    if op == "log_probs":
        assert _scalar(asm, "vaddss") <= 15
