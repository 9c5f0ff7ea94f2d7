"""The Ascend-style tiled schedule: plans that fit, numerics through LLVM, the CLI."""

import itertools
import json

import numpy as np
import pytest
import torch

import ce_tvm
from ce_tvm.kernels.kinds import DTYPE_BYTES
from ce_tvm.schedules import ascend_plan
from ce_tvm.testing import reference
from support import CLI, Case, assert_close, check_once, run

CLASSES = [1, 2, 3, 7, 17, 31, 64, 127, 1000, 4096, 8191, 32000, 65536, 131071, 151936,
           262144, 524287, 1048576]  # primes, powers of two, real vocabularies
DTYPES = ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize("profile", sorted(ascend_plan.PROFILES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ascend_plan.OPS)
def test_plans_fit_and_cover_every_row(profile, dtype, op):
    prof = ascend_plan.PROFILES[profile]
    esize = DTYPE_BYTES[dtype]
    quantum = 64  # one float32 vector repeat; also a multiple of 32 bytes of every dtype
    for classes, rows in itertools.product(CLASSES, [0, 1, 47, 48, 49, 8192]):
        p = ascend_plan.plan(profile, rows, classes, dtype, op)
        where = f"{profile} {dtype} {op} C={classes} N={rows}"
        assert p.ub_bytes <= prof.ub_bytes, where
        assert p.chunk == classes or (p.chunk * esize) % prof.ub_align == 0, where
        assert p.chunk == classes or p.chunk % quantum == 0, where
        # The tiles cover the row, and the last one is not empty.
        assert (p.tiles - 1) * p.chunk < classes <= p.tiles * p.chunk, where
        assert p.buffers in (1, 2), where
        # Largest tile that fits: one more repeat would not (whole rows aside).
        if p.chunk < classes:
            bigger = ascend_plan.ub_bytes(prof, p.chunk + quantum, dtype, op, p.buffers)
            assert bigger > prof.ub_bytes, where
        assert sum(p.rows_per_core) == rows and len(p.rows_per_core) == p.block_dim, where
        assert p.block_dim <= prof.vector_cores, where
        assert max(p.rows_per_core) - min(p.rows_per_core) <= 1, where
        one_pass = p.tiles == 1 or op in ascend_plan.ONE_PASS_OPS
        tiled_passes = ascend_plan.OP_MODELS[op].tiled_passes
        assert p.passes == (1 if one_pass else tiled_passes), where


def test_ub_accounting_of_a_worked_example():
    """910B, bfloat16, C = 151936, forward: 9728-element tiles, worked by hand.

    Input and output tiles, double-buffered: 4 x 9728 x 2 B = 77824; the
    float32 cast of the input, a float32 work tile and the float32 weight
    tile: 3 x 9728 x 4 B = 116736; reduction scratch 4 x 256 B and 256 B of
    per-row scalars: 1280. Total 195840 of 196608 bytes; a 9792-element tile
    (one more repeat) would take 197120.
    """
    p = ascend_plan.plan("910b", 8192, 151936, "bfloat16")
    assert (p.chunk, p.buffers, p.ub_bytes, p.tiles, p.passes) == (9728, 2, 195840, 16, 2)
    assert (p.block_dim, p.rows_per_core.count(171), p.rows_per_core.count(170)) == (48, 32, 16)
    prof = ascend_plan.PROFILES["910b"]
    assert ascend_plan.ub_bytes(prof, 9792, "bfloat16", "forward", 2) == 197120


def test_cost_model_against_the_vendor_tiling():
    p = ascend_plan.plan("910b", 8192, 151936, "bfloat16")
    est = ascend_plan.cost(p)
    assert (est["ce_tvm"]["reads"], est["vendor"]["reads"]) == (2, 3)
    assert est["ce_tvm"]["bytes_moved"] == 3 * 8192 * 151936 * 2
    assert est["ce_tvm"]["time_us"] < est["vendor"]["time_us"]
    whole_row = ascend_plan.cost(ascend_plan.plan("910b", 8192, 4096, "bfloat16"))
    assert whole_row["ce_tvm"]["reads"] == 1


def test_training_plan_reads_once_when_the_row_fits():
    """1 read + 1 write when the row's tiles fit the UB (exp kept there), else 2 + 1;
    the vendor's training step is its forward (3 + 1) then its backward (1 + 1)."""
    fits = ascend_plan.cost(ascend_plan.plan("910b", 8192, 4096, "bfloat16", "train"))
    assert (fits["ce_tvm"]["reads"], fits["ce_tvm"]["writes"]) == (1, 1)
    big = ascend_plan.plan("910b", 8192, 151936, "bfloat16", "train")
    est = ascend_plan.cost(big)
    assert big.tiles > 1
    assert (est["ce_tvm"]["reads"], est["ce_tvm"]["writes"]) == (2, 1)
    assert (est["vendor"]["reads"], est["vendor"]["writes"]) == (4, 2)
    assert est["ce_tvm"]["time_us"] < est["vendor"]["time_us"]
    # Keeping exp(x - max) costs UB: the training tile is never larger than the forward's.
    assert big.chunk <= ascend_plan.plan("910b", 8192, 151936, "bfloat16").chunk


def test_log_prob_plans_read_once_and_write_no_matrix():
    """The log-probs and entropy: one read whatever the tiles, no [N, C] written (the
    vendor: log_softmax 3 + 1, then the entropy over it, 1 more read); their
    gradient 1 + 1 (the vendor's log_softmax backward at best 2 + 1). No output
    tile in UB: in float32 the log-prob tile is larger than the forward's."""
    args = ("910b", 8192, 151936)
    for dtype in ("bfloat16", "float32"):
        p = ascend_plan.plan(*args, dtype, "log_probs")
        est = ascend_plan.cost(p)
        assert p.tiles > 1 and p.passes == 1
        assert (est["ce_tvm"]["reads"], est["ce_tvm"]["writes"]) == (1, 0)
        assert (est["vendor"]["reads"], est["vendor"]["writes"]) == (4, 1)
        assert est["ce_tvm"]["bytes_moved"] == 8192 * 151936 * DTYPE_BYTES[dtype]
        assert est["ce_tvm"]["time_us"] < est["vendor"]["time_us"] / 3
        grad = ascend_plan.cost(ascend_plan.plan(*args, dtype, "log_probs_grad"))
        assert (grad["ce_tvm"]["reads"], grad["ce_tvm"]["writes"]) == (1, 1)
        assert (grad["vendor"]["reads"], grad["vendor"]["writes"]) == (2, 1)
    forward = ascend_plan.plan(*args, "float32", "forward")
    assert p.chunk > forward.chunk and p.ub_bytes <= ascend_plan.PROFILES["910b"].ub_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("classes", [1000, 20011])
def test_training_kernel_numerics(classes, dtype):
    """The one-pass training kernel under the tiled schedule (row in UB, and not)."""
    gen = torch.Generator().manual_seed(classes)
    x = (torch.randn(40, classes, generator=gen) * 3).to(dtype)
    y = torch.randint(0, classes, (40,), generator=gen)
    y[::5] = -100
    w = torch.rand(classes, generator=gen) + 0.5
    ours, ref = x.clone().requires_grad_(), x.double().requires_grad_()
    with ce_tvm.schedule("ascend", profile="910b"):
        loss = ce_tvm.cross_entropy(ours, y, w, label_smoothing=0.1, lse_square_scale=1e-3)
    loss.backward()
    ref_loss = torch.nn.functional.cross_entropy(ref, y, w.double(), label_smoothing=0.1)
    m = (y != -100).double()
    ref_loss = ref_loss + 1e-3 * (torch.logsumexp(ref, 1) ** 2 * m).sum() / m.sum()
    ref_loss.backward()
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=tol, atol=tol * 1e-2)


def test_divergence_plan_stages_both_sides():
    """The student-teacher divergence stages two input tiles and writes one: both
    rows in UB (one read of each) at C = 4096 fp32, worked by hand: input and
    output tiles double-buffered, 3 x 2 x 16384 B = 98304, three float32 work
    tiles 49152, scratch and scalars 1280: 148736 of 196608 bytes. At C = 128256
    the tiles are re-staged by each of six passes over each side."""
    small = ascend_plan.plan("910b", 8192, 4096, "float32", "divergence")
    assert (small.tiles, small.buffers, small.ub_bytes, small.passes) == (1, 2, 148736, 1)
    est = ascend_plan.cost(small)
    assert (est["ce_tvm"]["reads"], est["ce_tvm"]["writes"]) == (2, 1)
    big = ascend_plan.plan("910b", 8192, 128256, "bfloat16", "divergence")
    assert big.tiles > 1 and big.passes == 6
    est = ascend_plan.cost(big)
    assert (est["ce_tvm"]["reads"], est["vendor"]["reads"]) == (12, 12)
    assert est["ce_tvm"]["time_us"] < est["vendor"]["time_us"]
    forward = ascend_plan.plan("910b", 8192, 128256, "bfloat16", "forward")
    assert big.chunk < forward.chunk  # two inputs and a third work tile share the UB


# Directions and options per C: the row in UB (every direction), tiles of a prime C
# (scalar accumulators, a partial last tile), tiles with vector accumulators (bf16).
DIVERGENCE_CASES = [(1000, torch.float32, 0.0, dict(temperature=2.0)),
                    (1000, torch.float32, 0.5, dict(student_softcap=20.0, teacher_softcap=15.0)),
                    (1000, torch.float32, 1.0, dict(teacher_softcap=15.0, temperature=0.7)),
                    (20011, torch.float32, 0.5, dict(temperature=2.0)),
                    (32000, torch.bfloat16, 0.5, dict(student_softcap=20.0)),
                    (32000, torch.bfloat16, 0.0, {})]
# slow: the bfloat16 JSD kernel takes 2-4 min to build beside the other tests (about a
# minute alone: docs/distillation.md); a kept cache serves it until its compute changes
SLOW_DIVERGENCE = {(32000, torch.bfloat16, 0.5)}


@pytest.mark.parametrize("classes,dtype,beta,options", [
    pytest.param(c, d, b, o, id=f"C{c}-{str(d)[6:]}-beta{b}",
                 marks=[pytest.mark.slow] if (c, d, b) in SLOW_DIVERGENCE else [])
    for c, d, b, o in DIVERGENCE_CASES])
def test_divergence_numerics(classes, dtype, beta, options):
    """``distillation_loss`` under the tiled schedule: the loss, the student's
    entropy and its logits' gradient against float64 (masked rows included)."""
    from support import DISTILL_TOL, logits_reference

    gen = torch.Generator().manual_seed(classes)
    s = (torch.randn(37, classes, generator=gen) * 3).to(dtype)
    t = (torch.randn(37, classes, generator=gen) * 3).to(dtype)
    y = torch.randint(0, classes, (37,), generator=gen)
    y[::5] = -100
    ours = s.clone().requires_grad_()
    with ce_tvm.schedule("ascend", profile="910b"):
        loss, entropy = ce_tvm.distillation_loss(ours, t, y, beta=beta, return_entropy=True,
                                                 **options)
        loss.backward()
    kept = (y != -100).double()
    ref = s.double().requires_grad_()
    div, ref_entropy = logits_reference(ref, t, kept, beta=beta, **options)
    ref_loss = div.sum() / kept.sum()
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss.detach(), **DISTILL_TOL[dtype])
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), **DISTILL_TOL[dtype])
    scale = ref.grad.abs().max()
    torch.testing.assert_close(ours.grad.double() / scale, ref.grad / scale, **DISTILL_TOL[dtype])


# One tile (the row fits the UB), several tiles, and a prime C whose last tile is partial.
NUMERIC_C = [1000, 32000, 20011]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("classes", NUMERIC_C)
def test_numerics_against_reference(classes, dtype):
    with ce_tvm.schedule("ascend", profile="910b"):
        check_once(Case(50, classes, dtype, "mean", weighted=True, ignore=True,
                        label_smoothing=0.1, zloss_scale=1e-3))


def test_other_profile_and_autograd_path():
    x = torch.randn(60, 20011, requires_grad=True)
    y = torch.randint(0, 20011, (60,))
    with ce_tvm.schedule("ascend", profile="950"):
        check_once(Case(7, 20011, torch.float32, "none", label_smoothing=0.1))
        loss = ce_tvm.cross_entropy(x, y, label_smoothing=0.1)
        loss.backward()
    xr = x.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xr, y, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-8)


def test_probability_targets_under_the_ascend_schedule():
    """Multi-tile rows (C = 20011): loss and both gradients against the float64 reference."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6, 20011, generator=gen) * 3
    q = torch.softmax(torch.randn(6, 20011, generator=gen), 1)
    w = torch.rand(20011, generator=gen) + 0.5
    xa, qa = x.clone().requires_grad_(), q.clone().requires_grad_()
    with ce_tvm.schedule("ascend", profile="910b"):
        loss = ce_tvm.cross_entropy(xa, qa, w, reduction="sum", label_smoothing=0.1,
                                    lse_square_scale=1e-3)
        loss.backward()
    args = (x.double().numpy(), q.double().numpy(), w.double().numpy(), "sum", 0.1, 1e-3)
    assert_close(loss.reshape(1), reference.prob_forward(*args)[0], 1e-5, "loss")
    x_grad, q_grad = reference.prob_backward(np.ones(1), *args)
    assert_close(xa.grad, x_grad, 1e-5, "x_grad")
    assert_close(qa.grad, q_grad, 1e-5, "target_grad")


def test_unknown_schedule_and_profile_are_rejected():
    with pytest.raises(ValueError, match="'llvm' or 'ascend'"):
        with ce_tvm.schedule("tpu"):
            pass
    with pytest.raises(ValueError, match="unknown Ascend profile"):
        with ce_tvm.schedule("ascend", profile="310p"):
            ce_tvm.cross_entropy_loss(torch.randn(2, 3), torch.tensor([0, 1]))


@pytest.mark.slow  # processes: the command line, and 62 kernels compiled
def test_plan_and_compile_cli(tmp_path):
    out = run([CLI, "plan", "--profile", "910b", "--classes", "151936", "--rows", "8192",
               "--dtype", "bfloat16", "--json"])
    data = json.loads(out)
    assert data["plan"]["passes"] == 2 and data["cost"]["vendor"]["reads"] == 3
    text = run([CLI, "plan", "--profile", "950", "--classes", "4096", "--rows", "64",
                "--dtype", "float16"])
    assert "passes over the logits 1" in text
    data = json.loads(run([CLI, "plan", "--classes", "151936", "--rows", "8192", "--op",
                           "log_probs", "--json"]))
    assert data["plan"]["op"] == "log_probs" and data["plan"]["passes"] == 1
    assert (data["cost"]["ce_tvm"]["writes"], data["cost"]["vendor"]["reads"]) == (0, 4)
    built = run([CLI, "compile", "--target", "ascend", "--profile", "950", "--dtype", "bfloat16",
                 "--classes", "3000", "--out", tmp_path / "mods"])
    assert "62 kernels" in built  # 28 for class indices, 18 for probability targets, 16 eps = 0
    assert all("ascend-950-" in p.name for p in (tmp_path / "mods").glob("*.so"))
