"""A loss forward or training step (with or without label smoothing; not with
``log_prob``, accuracy or a softcap), and a log-prob forward without the
entropy, on an AVX-512 CPU take each row against the max of its first chunk
(``Variant.shifts_rows``, ``kernels.choices.row_shift``). A row whose max lies
more than ``ROW_SHIFT_RANGE`` above that shift, or one that is not finite, is
computed again by kernels that take each chunk against its own max
(``launch._exact_forward``: the call; ``launch._exact_log_probs``: the row).
Both paths against the float64 reference and torch; on a CPU whose schedule
takes no row against a shift (AVX2) only a row not finite goes again."""

import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.kernels.common import ROW_SHIFT_RANGE
from ce_tvm.runtime import launch
from ce_tvm.schedules import cpu
from ce_tvm.store import targets
from ce_tvm.testing import reference
from support import TOL, assert_close

C = 5003  # two chunks on every CPU: the first ends near the middle of the row
SHIFTED = cpu.shifts_rows(targets.tvm_target("llvm"))  # this host's kernels shift rows


@pytest.fixture
def again(monkeypatch):
    """The calls computed again exactly (a list, one entry per call)."""
    calls = []
    exact = launch._exact_forward

    def counted(*args):
        calls.append(args[0].shape)
        exact(*args)

    monkeypatch.setattr(launch, "_exact_forward", counted)
    return calls


def _logits(dtype, spike: float, weighted: bool = False):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(9, C, generator=gen) * 3
    y = torch.randint(0, C, (9,), generator=gen)
    y[4] = -100
    x[2, C - 3] = spike  # in the last chunk, far above the first chunk's max
    x[6, 5] = spike  # in the first chunk: the shift itself
    y[7] = C - 3
    w = torch.rand(C, generator=gen) + 0.5 if weighted else None
    return x.to(dtype), y, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_a_row_far_above_its_shift_is_computed_again_exactly(again, dtype, reduction, weighted,
                                                               eps):
    x, y, w = _logits(dtype, 90.0, weighted)
    loss = ce_tvm.cross_entropy(x, y, w, reduction=reduction, lse_square_scale=1e-3,
                                label_smoothing=eps)
    assert len(again) == SHIFTED
    ref, _, _, _ = reference.forward(x.double().numpy(), y.numpy(),
                                     None if w is None else w.double().numpy(),
                                     reduction, -100, eps, 1e-3)
    assert_close(loss.reshape(-1), ref.reshape(-1), TOL[dtype], "loss")


@pytest.mark.parametrize("weighted", [False, True])
def test_none_computes_only_those_rows_again(monkeypatch, weighted):
    """Unreduced, the rows are independent: only the one far above its shift and
    the one not finite go again (a reduced loss computes every row again)."""
    seen = []
    stats = launch.shard_stats

    def counted(x, *args):
        seen.append(x.shape[0])
        return stats(x, *args)

    monkeypatch.setattr(launch, "shard_stats", counted)
    x, y, w = _logits(torch.float32, 90.0, weighted)
    x[7, 11] = float("nan")
    loss = ce_tvm.cross_entropy(x, y, w, reduction="none", label_smoothing=0.0)
    assert seen == [1 + SHIFTED]
    ref = F.cross_entropy(x, y, w, reduction="none")
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_within_the_range_take_one_sweep(again, dtype):
    """A max up to ``ROW_SHIFT_RANGE`` above the shift: terms up to e**64 summed,
    no second computation, the same loss and gradient as float64."""
    x, y, _ = _logits(dtype, 0.0)
    x[2, C - 3] = float(x[2, :2000].float().max()) + ROW_SHIFT_RANGE - 2
    xs = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xs, y, reduction="none")
    loss.backward(torch.ones_like(loss))
    assert not again
    ref, log_prob, _, lse = reference.forward(x.double().numpy(), y.numpy(), None, "none")
    assert_close(loss, ref, TOL[dtype], "loss")
    grad = reference.backward(torch.ones(9, dtype=torch.float64).numpy(), log_prob, y.numpy(),
                              reduction="none", lse=lse)
    assert_close(xs.grad, grad, TOL[dtype], "grad")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_gradient_after_a_second_computation(again, reduction, weighted, eps):
    """``none``: the backward reads the ``lse`` the exact kernels wrote;
    ``mean``/``sum``: the one-pass training kernel's call is computed again,
    the gradient by the backward from the logits."""
    x, y, w = _logits(torch.float32, 90.0, weighted)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xs, y, w, reduction=reduction, label_smoothing=eps)
    ref = F.cross_entropy(xr, y, w, reduction=reduction, label_smoothing=eps)
    loss.sum().backward()
    ref.sum().backward()
    assert len(again) == SHIFTED
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_training_kernel_within_the_range(again, dtype, eps):
    """The one-pass kernel's kept ``exp`` against the shift: loss and gradient as
    float64, no second computation."""
    x, y, _ = _logits(dtype, 0.0)
    x[2, C - 3] = float(x[2, :2000].float().max()) + ROW_SHIFT_RANGE - 2
    xs = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xs, y, label_smoothing=eps)
    loss.backward()
    assert not again
    ref, log_prob, _, lse = reference.forward(x.double().numpy(), y.numpy(), None, "mean",
                                              label_smoothing=eps)
    assert_close(loss.reshape(1), ref, TOL[dtype], "loss")
    grad = reference.backward(torch.ones(1, dtype=torch.float64).numpy(), log_prob, y.numpy(),
                              reduction="mean", lse=lse, label_smoothing=eps)
    assert_close(xs.grad, grad, TOL[dtype], "grad")


def test_a_temperature_scales_the_range(again):
    """The range is of the scaled logits: a gap of 40 at T = 0.5 is 80."""
    x, y, _ = _logits(torch.float32, 0.0)
    x[2, C - 3] = float(x[2, :2000].max()) + 40
    loss = ce_tvm.cross_entropy(x, y, reduction="none", temperature=0.5)
    assert len(again) == SHIFTED
    torch.testing.assert_close(loss, F.cross_entropy(x / 0.5, y, reduction="none"),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rows_as_the_exact_kernels_give_them(again, bad):
    x, y, _ = _logits(torch.float32, 0.0)
    x[3, C - 10] = bad
    x[5, :] = float("-inf")
    loss = ce_tvm.cross_entropy(x, y, reduction="none")
    ref, _, _, _ = reference.forward(x.double().numpy(), y.numpy(), None, "none")
    assert_close(loss, ref, 1e-5, "loss")
    assert len(again) == 1


# --- The log-prob kernels without the entropy: the rows, again --------------------


@pytest.fixture
def rows_again(monkeypatch):
    """How many rows each shifted log-prob call computed again."""
    calls = []
    exact = launch._exact_log_probs

    def counted(x, index, options, outputs):
        calls.append(int((~outputs[2].isfinite()).sum()))
        exact(x, index, options, outputs)

    monkeypatch.setattr(launch, "_exact_log_probs", counted)
    return calls


def _policy_case(dtype, spike: float):
    x, y, _ = _logits(dtype, spike)
    index = torch.stack([y.clamp(min=0), torch.full_like(y, C - 3)], dim=1)
    index[4, 0] = -100
    return x, index


def _expected(x, index, temperature: float = 1.0):
    """float64 ``logp`` and the gradient of ``sum logp``."""
    xd, live = x.double().numpy(), (index != -100).numpy()
    logp, entropy = reference.policy_outputs(xd, index.numpy(), live, temperature)
    grad = reference.policy_grad(xd, index.numpy(), live, live.astype("float64"),
                                 0 * entropy, temperature)
    return logp, entropy, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_row_far_above_its_shift_is_computed_again(rows_again, dtype, temperature):
    """Only the row whose max lies 90 above its first chunk's is computed again
    (the one whose spike is in its first chunk is that chunk's max)."""
    x, index = _policy_case(dtype, 90.0)
    xs = x.clone().requires_grad_()
    logp = ce_tvm.log_probs(xs, index, temperature=temperature)
    logp.sum().backward()
    assert rows_again == [int(SHIFTED)]
    ref_logp, _, ref_grad = _expected(x, index, temperature)
    assert_close(logp, ref_logp, TOL[torch.float32], "logp")
    assert_close(xs.grad, ref_grad, TOL[dtype], "grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_within_the_range_take_one_sweep(rows_again, dtype):
    x, index = _policy_case(dtype, 0.0)
    x[2, C - 3] = float(x[2, :2000].float().max()) + ROW_SHIFT_RANGE - 2
    xs = x.clone().requires_grad_()
    logp = ce_tvm.log_probs(xs, index)
    logp.sum().backward()
    assert rows_again == [0]
    ref_logp, _, ref_grad = _expected(x, index)
    assert_close(logp, ref_logp, TOL[torch.float32], "logp")
    assert_close(xs.grad, ref_grad, TOL[dtype], "grad")


def test_log_probs_with_the_entropy_take_no_shift(rows_again):
    """The kernel with the entropy takes each chunk against its own max: a
    confident row's entropy, 2e-7 or 1e-15, is right to 10% (against the shift
    it would be float32 rounding of the gap of 20 or 40 between the row's max
    and the shift: about 1e-6)."""
    x, index = _policy_case(torch.float32, 0.0)
    for row, gap in ((2, 20.0), (3, 40.0)):
        x[row, C - 3 - row] = float(x[row, :2000].max()) + gap
    logp, entropy = ce_tvm.log_probs(x, index, return_entropy=True)
    assert not rows_again
    ref_logp, ref_entropy, _ = _expected(x, index)
    assert_close(logp, ref_logp, TOL[torch.float32], "logp")
    for row in (2, 3):
        assert ref_entropy[row] < 1e-5
        assert abs(float(entropy[row]) - ref_entropy[row]) < 0.1 * ref_entropy[row]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_log_probs_non_finite_rows_as_the_kernel_with_the_entropy_gives_them(rows_again, bad):
    """A row with a NaN, an infinite logit or nothing but ``-inf`` is computed
    again, and comes out as the kernel that takes each chunk against its own
    max gives it; the other rows as float64."""
    x, index = _policy_case(torch.float32, 0.0)
    x[3, C - 10] = bad
    x[5, :] = float("-inf")
    logp = ce_tvm.log_probs(x, index)
    assert rows_again == [2 if bad != float("-inf") else 1]
    exact = ce_tvm.log_probs(x, index, return_entropy=True)[0]
    torch.testing.assert_close(logp, exact, equal_nan=True)
    finite = [r for r in range(9) if r not in (3, 5)]
    ref_logp, _, _ = _expected(x[finite], index[finite])
    assert_close(logp[finite], ref_logp, TOL[torch.float32], "logp")
