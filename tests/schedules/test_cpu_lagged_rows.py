"""A 16-bit training kernel's gradient written a row late, during the next row's
sweep (``schedules/cpu_lagged_rows.py``): which kernels are restructured
(cross-compiled, the TIR after the pass), that a row's gradient reads its own
row's values (batches whose tasks hold several rows, a last task cut short, an
overlapping last chunk, every option) against float64. The streamed gradient of
a large launch against the plain stores of a small one: test_cpu_stores.py."""

import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import tirx
from tvm.target import Target

import ce_tvm
from ce_tvm.compiler.build import declared_func
from ce_tvm.schedules import cpu, cpu_lagged_rows
from ce_tvm.schedules._common import collect_nodes
from ce_tvm.schedules.cpu_lagged_rows import LAGGED_ATTR, lags_rows
from ce_tvm.store.targets import target_description
from ce_tvm.testing.cpu_static import cross_spec
from support import TOL, check_training_step, lowered_after

LAGS_HERE = lags_rows(Target(target_description("llvm")))


def _lagged(spec, scheduled=None) -> bool:
    func = lowered_after(spec, "lagged_gradient_rows", scheduled)
    return any(LAGGED_ATTR in f.annotations for f in collect_nodes(func.body, tirx.For))


@pytest.mark.parametrize("dtype,mcpu,lagged", [
    ("bfloat16", "znver4", True), ("float16", "znver4", True),
    ("float32", "znver4", False),  # memory-bound already: not lagged
    ("bfloat16", "haswell", False)])  # AVX2: not measured
@pytest.mark.parametrize("classes", [2048, 4099])
def test_which_kernels_lag(dtype, mcpu, lagged, classes):
    assert _lagged(cross_spec("train", dtype, classes, f"llvm -mcpu={mcpu}")) == lagged


def test_rows_split_into_tasks_by_the_schedule_are_left_alone():
    """A record's ``row_grain`` (rows a task, split by the schedule) guards every
    statement of a row: not the form the pass takes; the kernel stays as built."""
    spec = cross_spec("train", "bfloat16", 2048, "llvm -mcpu=znver4")
    split = cpu.schedule_with_knobs(declared_func(spec), "train", spec.tvm_target(),
                                    {"row_grain": 8})
    assert not _lagged(spec, split)


def test_the_gradient_of_the_row_before_reads_its_own_values():
    """In the lagged kernel the gradient's loops run inside the sweep's chunk loop,
    on the row before (``row - 1``), and read the scales and terms of that row
    from their ``_lag`` copies, never the scratch the sweep is writing."""
    func = lowered_after(cross_spec("train", "bfloat16", 2048, "llvm -mcpu=znver4",
                                    weighted=True), "lagged_gradient_rows")
    (tasks,) = [f for f in collect_nodes(func.body, tirx.For) if LAGGED_ATTR in f.annotations]
    grads = [st for st in collect_nodes(tasks.body, tirx.BufferStore) if st.buffer.name == "x_grad"]
    assert grads
    for store in grads:
        names = {ld.source.name for ld in collect_nodes(store.value, tvm.ir.expr.TensorLoad)}
        scratch = {n for n in names if n.startswith("ce_") and n != "ce_chunk_exp"}
        assert scratch and all(n.endswith("_lag") for n in scratch), names


@pytest.mark.skipif(not LAGS_HERE, reason="this CPU's training kernels are not lagged")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n,c", [(300, 2048), (200, 4099), (130, 32000), (260, 2050),
                                 (260, 100)])
def test_lagged_rows_against_float64(n, c, dtype):
    """Several rows a task (``task_rows``: 2-4 here), the last task short, an
    overlapping last chunk (4099), columns after the vector steps (2050), a row
    shorter than two chunks (100), with class weights, ignored rows, label
    smoothing and the z-loss."""
    check_training_step(n, c, dtype, "mean", True, True, 0.1, 1e-3, 1.0, seed=n)
    check_training_step(n, c, dtype, "sum", False, False, 0.0, 0.0, 0.7, seed=c)


@pytest.mark.skipif(not LAGS_HERE, reason="this CPU's training kernels are not lagged")
@pytest.mark.parametrize("c", [37, 4099])
def test_lagged_rows_with_the_token_accuracy(c):
    """The kernel variant that also counts the rows' hits, whose gradient loops
    read columns a loop after the sweep writes (the last chunk's)."""
    gen = torch.Generator().manual_seed(c)
    x = (torch.randn(260, c, generator=gen) * 3).to(torch.bfloat16)
    y = torch.randint(0, c, (260,), generator=gen)
    xg = x.clone().requires_grad_()
    loss, accuracy = ce_tvm.cross_entropy(xg, y, label_smoothing=0.1,
                                          return_token_accuracy=True)
    loss.backward()
    ref = x.double().requires_grad_()
    F.cross_entropy(ref, y, label_smoothing=0.1).backward()
    torch.testing.assert_close(xg.grad.double(), ref.grad, rtol=TOL[torch.bfloat16], atol=1e-5)
    assert float(accuracy) == pytest.approx(float((x.float().argmax(1) == y).double().mean()))


def test_unlagged_builds_keep_each_gradient_in_its_row():
    """``unlagged``: the form the static counter attributes to a row."""
    with cpu_lagged_rows.unlagged():
        assert not _lagged(cross_spec("train", "bfloat16", 2048, "llvm -mcpu=znver4"))
