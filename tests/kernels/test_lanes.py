"""The forward with its row merged in lanes (``row_stats(lanes=...)``, the CUDA
schedule's regrouping for long rows) computes the spec's values, and so do the
log-prob kernels in lanes: the compute itself, unscheduled, run by LLVM on
this CPU, against the float64 reference.

The shapes make every part of the regrouping count: C = 1001 in chunks of 8
(the last chunk overlapping the one before), 126 chunks dealt to 32 lanes (two
positions past the row, which no lane may merge), rows whose maxima sit in
different lanes, a row of one large logit, ignored rows.
"""

import numpy as np
import pytest
import tvm

from ce_tvm.kernels.common import ChunkLayout, lane_merged
from ce_tvm.kernels.forward import forward_func
from ce_tvm.kernels.kinds import Variant
from ce_tvm.kernels.stages import LANE_STATS, LANES_EXPSUM, LANES_MAX, ROWSTATS
from ce_tvm.testing import reference

C, CHUNK, LANES = 1001, 8, 32
SMOOTHING, ZLOSS, SOFTCAP = 0.1, 1e-3, 20.0


def _run(variant: Variant, x, y, w):
    func = forward_func(C, "float32", variant, CHUNK, lanes=LANES)
    f = tvm.compile(tvm.IRModule({"main": func}), target="llvm")["main"]
    n = x.shape[0]
    loss_shape = (n,) if variant.reduction == "none" else (1,)
    outs = [np.zeros(loss_shape, np.float32), np.zeros(loss_shape, np.float32),
            np.zeros(n, np.float32)] + ([np.zeros(n, np.float32)] if variant.accuracy else [])
    scalars = [-100, SMOOTHING, ZLOSS] + ([SOFTCAP] if variant.softcap else [])
    tensors = [tvm.runtime.tensor(a) for a in [x, y] + ([w] if variant.weighted else [])]
    out_tensors = [tvm.runtime.tensor(a) for a in outs]
    f(*tensors, *scalars, *out_tensors)
    return [t.numpy() for t in out_tensors]


def _inputs(rows: int = 9, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, C)) * 3).astype(np.float32)
    x[1, 1000] = 40.0  # the max in the overlapping last chunk
    x[2, 3] = 60.0  # one logit far above the rest: every other lane's sum rescaled to ~0
    x[3] -= 500.0  # a large common offset
    y = rng.integers(0, C, rows).astype(np.int64)
    y[2] = 3
    y[::4] = -100
    w = (rng.random(C) + 0.5).astype(np.float32)
    return x, y, w


def test_the_layout_pads_the_chunk_positions_to_whole_lanes():
    layout = ChunkLayout(C, CHUNK, LANES)
    assert (layout.n_chunks, layout.slots) == (126, 128)
    assert ChunkLayout(C, CHUNK).slots == 126


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("softcap", [False, True])
def test_lanes_forward_matches_the_reference(reduction, weighted, softcap):
    x, y, w = _inputs()
    variant = Variant(reduction, weighted, False, softcap=softcap)
    loss, zloss, lse = _run(variant, x, y, w)
    ref_loss, _, ref_z, ref_lse = reference.forward(
        x.astype(np.float64), y, w.astype(np.float64) if weighted else None, reduction,
        label_smoothing=SMOOTHING, zloss_scale=ZLOSS, softcap=SOFTCAP if softcap else 0.0)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-5)
    np.testing.assert_allclose(loss, np.atleast_1d(ref_loss), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(zloss, np.atleast_1d(ref_z), rtol=2e-5, atol=1e-6)


def test_lanes_forward_token_accuracy_is_the_first_argmax():
    x, y, w = _inputs(rows=12, seed=1)
    y[5] = int(np.argmax(x[5]))
    x[6, 7] = x[6, 900] = 50.0  # a tie: the first (column 7) is the argmax
    y[6], y[7] = 900, 7
    x[7, 7] = x[7, 900] = 50.0
    *_, hit = _run(Variant("none", False, False, accuracy=True), x, y, w)
    kept = y != -100
    expected = kept & (np.argmax(x, axis=1) == np.where(kept, y, 0))
    np.testing.assert_array_equal(hit, expected.astype(np.float32))
    assert hit[5] == 1 and hit[6] == 0 and hit[7] == 1


def test_lanes_replace_the_chunk_merge():
    text = forward_func(C, "float32", Variant("mean"), CHUNK, lanes=LANES).script()
    assert all(f'"{name}"' in text for name in (LANE_STATS, LANES_MAX, LANES_EXPSUM))
    assert f'"{ROWSTATS}"' not in text


def test_lanes_keep_no_more_values_than_they_name():
    x = tvm.te.placeholder((4, C), "float32", name="x")
    parts = [tvm.te.compute((4, 8), lambda n, k: x[n, k], name=f"p{i}") for i in range(7)]
    with pytest.raises(ValueError, match="at most 6 merged values"):
        lane_merged(parts, lambda n, k: parts[0][n, k], ChunkLayout(C, CHUNK, LANES), 4,
                    False, (), False)


@pytest.mark.parametrize("softcap", [False, True])
def test_lanes_log_probs_match_the_reference(softcap):
    """The log-prob kernel's sweep in lanes: entropy (its sum moved to each lane's
    max, then the row's), log sum p^2 (rescaled by the squared factor), the
    mean logit and the first argmax (the smallest column among the lanes at
    the row's max; a tie across lanes, columns 7 and 900)."""
    from ce_tvm.kernels.log_probs import log_probs_func

    x, _, _ = _inputs(rows=8, seed=2)
    x[4, 7] = x[4, 900] = 45.0
    index = np.stack([np.arange(8) * 97 % C, np.full(8, 900)], axis=1).astype(np.int64)
    index[4, 0], index[5, 1] = 7, -100
    temperature = 0.7
    variant = Variant(columns=2, softcap=softcap, stats=True)
    func = log_probs_func(C, "float32", variant, CHUNK, lanes=LANES)
    f = tvm.compile(tvm.IRModule({"main": func}), target="llvm")["main"]
    n = x.shape[0]
    outs = [np.zeros((n, 2), np.float32)] + [np.zeros(n, np.float32) for _ in range(5)]
    outs.append(np.zeros((n, 2), np.uint8))
    tensors = [tvm.runtime.tensor(a) for a in outs]
    f(tvm.runtime.tensor(x), tvm.runtime.tensor(index), -100, 1 / temperature,
      *([SOFTCAP] if softcap else []), *tensors)
    logp, entropy, _, _, log_sum_sq, mean, top1 = (t.numpy() for t in tensors)
    live = index != -100
    cap = SOFTCAP if softcap else 0.0
    ref_logp, ref_entropy = reference.policy_outputs(x.astype(np.float64), index, live,
                                                     temperature, cap)
    ref_sq, ref_mean, ref_top1 = reference.policy_stats(x, index, live, temperature, cap)
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(entropy, ref_entropy, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(log_sum_sq, ref_sq, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-5, atol=2e-5)
    np.testing.assert_array_equal(top1, ref_top1.astype(np.uint8))
    assert top1[4, 0] == 1 and top1[4, 1] == 0
