"""Randomized differential test: drawn cases against the float64 reference.

Each case is drawn from ``(seed, index)`` alone, so any one replays by
itself; a failure prints the seed, the index and every parameter:

    CE_TVM_RANDOM_SEED=<seed> CE_TVM_RANDOM_STREAM=<stream> .venv/bin/python -m pytest \\
        "tests/losses/test_random_differential.py::test_random_case[<index>]"

``CE_TVM_RANDOM_SEED`` (default 16) draws other cases, ``CE_TVM_RANDOM_CASES``
(default 80) more or fewer, ``CE_TVM_RANDOM_STREAM`` (default 0; the threads'
cases are stream 1) the other values of the same groups. Cases come in groups
of ``GROUP`` that share one kernel configuration (C, dtype, reduction, weight,
entry point: what compiles a new module, ~0.5 s each); within a group only runtime arguments and
layouts change (N, smoothing, z-loss, ignore_index, ignored rows, special
logits, strides). C comes from ``CLASS_POOL``: small widths around the
vector width (32 float32 lanes on AVX-512, two accumulators of 16), widths
around ``schedules.cpu_knobs.MAX_CHUNK`` (6144) and its multiples, primes, and
vocabularies up to ~70000. Every loss, ``log_prob``, ``lse`` and gradient
is compared with ``reference`` after rounding it to the output dtype (an
overflow to Inf in float16 is then expected, not a mismatch).
``test_concurrent_calls_from_threads`` runs other cases of the same groups
(``stream=1``) from several threads at once.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np
import pytest
import torch

import ce_tvm
from ce_tvm.testing import reference
from support import TOL, assert_close

SEED = int(os.environ.get("CE_TVM_RANDOM_SEED", "16"))
CASES = int(os.environ.get("CE_TVM_RANDOM_CASES", "80"))
STREAM = int(os.environ.get("CE_TVM_RANDOM_STREAM", "0"))
GROUP = 5  # cases per kernel configuration
THREAD_CASES = 12  # drawn cases run concurrently in THREADS threads
THREADS = 4
MAX_ELEMENTS = 1 << 16  # N * d * C bound, unless one row is more (keeps the checks cheap)
MAX_ROWS = 48

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = ("mean", "sum", "none")
CLASS_POOL = {
    # vector-width edges (1, 2 lanes, 16 = one AVX-512 vector, 32 = two) and small primes
    "small": (1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 127, 128, 129, 1021, 4093),
    # one chunk up to MAX_CHUNK = 6144; above it, chunks that divide C (6144 * k, 6400)
    # or padded equal chunks (6145, 6176 = 32 * 193, primes)
    "chunk": (6143, 6144, 6145, 6176, 6400, 8191, 12288, 12289, 18433),
    "vocabulary": (32000, 50257, 65536, 65537, 69997),
}
POOL_WEIGHTS = {"small": 0.5, "chunk": 0.3, "vocabulary": 0.2}


@dataclass(frozen=True)
class DrawnCase:
    """Every parameter of one case; ``str`` gives the line that replays it."""

    seed: int
    index: int
    stream: int
    entry: str          # "pair" (seed pair), "function" (cross_entropy), "module"
    classes: int
    dtype: str
    reduction: str
    weighted: bool
    zero_weights: bool  # some classes weigh 0
    rows: int
    layout: str         # "NC", "NCd" (d = spatial), "C" (1-D input, 0-d target)
    spatial: int
    x_strides: str      # "contiguous", "strided", "transposed", "odd" (canonical in effect)
    aux_strides: bool   # targets, weight, upstream gradients (and log_prob) strided
    int32_target: bool
    label_smoothing: float
    zloss_scale: float
    ignore_index: int
    ignored: str        # "none", "some", "all"
    logits: str         # "normal", "-inf", "huge", "nan"
    scale: float
    grad_zloss: bool    # pair: pass grad_zloss

    def __str__(self):
        params = ", ".join(f"{k}={v!r}" for k, v in asdict(self).items())
        stream = f" CE_TVM_RANDOM_STREAM={self.stream}" if self.stream else ""
        replay = (f"CE_TVM_RANDOM_SEED={self.seed}{stream} .venv/bin/python -m pytest "
                  f"\"tests/losses/test_random_differential.py::test_random_case[{self.index}]\"")
        return f"DrawnCase({params})\nreplay: {replay}"


def _pick(rng, options, weights=None):
    p = None if weights is None else np.asarray(weights, dtype=float) / sum(weights)
    return options[int(rng.choice(len(options), p=p))]


def draw(seed: int, index: int, stream: int = 0) -> DrawnCase:
    """Case ``index``: its group's kernel configuration from ``(seed, group)``, the
    rest from ``(seed, group, member, stream)``. Dtype and reduction cycle over
    the groups, so every pair of them is drawn in any nine consecutive groups."""
    group, member = divmod(index, GROUP)
    krng = np.random.default_rng([seed, group])
    pool = CLASS_POOL[_pick(krng, list(POOL_WEIGHTS), list(POOL_WEIGHTS.values()))]
    classes = int(_pick(krng, pool))
    entry = _pick(krng, ("pair", "function", "module"))
    weighted = bool(krng.random() < 0.5)
    rng = np.random.default_rng([seed, group, member, stream])
    layout = "NC" if entry == "pair" else _pick(rng, ("NC", "NCd", "C"), (6, 3, 1))
    spatial = int(rng.integers(1, 4)) if layout == "NCd" else 1
    max_rows = max(1, min(MAX_ROWS, MAX_ELEMENTS // (classes * spatial)))
    many = int(rng.integers(2, max_rows + 1)) if max_rows > 1 else 1
    rows = 1 if layout == "C" else int(_pick(rng, (0, 1, many), (1, 1, 6)))
    x_strides = _pick(rng, {"NC": ("contiguous", "strided", "transposed", "odd"),
                            "NCd": ("contiguous", "strided", "transposed"),
                            "C": ("contiguous", "strided")}[layout])
    ignore_index = int(_pick(rng, (-100, int(rng.integers(-5, 0)),
                                   int(rng.integers(0, classes))), (5, 2, 3)))
    return DrawnCase(
        seed=seed, index=index, stream=stream, entry=entry, classes=classes,
        dtype=str(DTYPES[group % 3]).removeprefix("torch."),
        reduction=REDUCTIONS[(group // 3) % 3], weighted=weighted,
        zero_weights=weighted and bool(rng.random() < 0.3), rows=rows, layout=layout,
        spatial=spatial, x_strides=x_strides, aux_strides=bool(rng.random() < 0.4),
        int32_target=bool(rng.random() < 0.2),
        label_smoothing=0.0 if rng.random() < 0.4 else round(float(rng.uniform(0, 0.5)), 3),
        zloss_scale=0.0 if rng.random() < 0.4 else float(10 ** rng.uniform(-5, -1)),
        ignore_index=ignore_index, ignored=_pick(rng, ("none", "some", "all"), (4, 4, 2)),
        logits=_pick(rng, ("normal", "-inf", "huge", "nan"), (5, 2, 2, 1)),
        scale=float(10 ** rng.uniform(-1, 1.3)), grad_zloss=bool(rng.random() < 0.5),
    )


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` in every other element of a buffer twice its size (non-contiguous)."""
    return torch.empty(*t.shape, 2, dtype=t.dtype).select(-1, 0).copy_(t)


def odd_strides_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of row-major ``t`` with strides torch calls contiguous but that are
    not row-major: 0 on an empty tensor, 7 * numel + 3 on size-1 dimensions
    (a plain copy when ``t`` has neither)."""
    if t.numel() == 0:
        return torch.empty_strided(t.shape, (0,) * t.dim(), dtype=t.dtype)
    stride = list(t.stride())
    for dim, size in enumerate(t.shape):
        if size == 1:
            stride[dim] = 7 * t.numel() + 3
    return torch.empty_strided(t.shape, stride, dtype=t.dtype).copy_(t)


def logits_of(case: DrawnCase, gen: torch.Generator) -> torch.Tensor:
    """Logits ``[M, C]`` in float32 (rounded to the case dtype later)."""
    rows = case.rows * case.spatial
    x = torch.randn(rows, case.classes, generator=gen) * case.scale
    special = torch.rand(rows, case.classes, generator=gen)
    if case.logits == "-inf":  # masked classes, a target's sometimes among them
        x[special < 0.2] = float("-inf")
    elif case.logits == "huge":
        # Past exp's float32 range (e^88.7), yet small enough that the float32
        # lse (ulp 3e-5 at 400) keeps p = exp(x - lse) within the float32
        # tolerance: the gradient recomputes p from the rounded lse, so logits
        # of 1e4 and more lose gradient precision that torch's float32 keeps.
        huge = 90.0 + 310.0 * float(torch.rand((), generator=gen))
        x[special < 0.05] = huge
        x[special > 0.97] = -huge
    elif case.logits == "nan":
        x[special < 0.3 / case.classes] = float("nan")  # about one row in three
    return x


def targets_of(case: DrawnCase, gen: torch.Generator, m: int) -> torch.Tensor:
    y = torch.randint(0, case.classes, (m,), generator=gen)
    if case.ignored == "all":
        y[:] = case.ignore_index
    elif case.ignored == "some":
        y[torch.rand(m, generator=gen) < 0.3] = case.ignore_index
    return y


def weight_of(case: DrawnCase, gen: torch.Generator):
    if not case.weighted:
        return None
    w = torch.rand(case.classes, generator=gen) + 0.5
    if case.zero_weights:
        w[torch.rand(case.classes, generator=gen) < 0.2] = 0.0
    return w


def as_input(case: DrawnCase, flat_x: torch.Tensor) -> torch.Tensor:
    """The logits ``[M, C]`` in the case's dtype, layout and strides."""
    x = flat_x.to(getattr(torch, case.dtype))
    if case.layout == "C":
        x = x.reshape(case.classes)
    elif case.layout == "NCd":  # [N, C, d] from [N, d, C]: channels last, "transposed"
        x = x.reshape(case.rows, case.spatial, case.classes).movedim(-1, 1)
        if case.x_strides != "transposed":
            x = x.contiguous()
    elif case.x_strides == "transposed":
        x = x.t().contiguous().t()
    if case.x_strides == "strided":
        return strided_copy(x)
    if case.x_strides == "odd":
        return odd_strides_copy(x)
    return x


def flatten(case: DrawnCase, t: torch.Tensor) -> torch.Tensor:
    """Logits-shaped ``t`` (input or gradient) as ``[M, C]`` rows."""
    if case.layout == "C":
        return t.reshape(1, -1)
    return t.movedim(1, -1).reshape(-1, case.classes)


def aux(case: DrawnCase, t):
    """Targets, weights, upstream gradients: strided or with odd strides when drawn."""
    if t is None or not case.aux_strides:
        return t
    return odd_strides_copy(t) if t.numel() <= 1 else strided_copy(t)


def expected(values, dtype: torch.dtype) -> np.ndarray:
    """The float64 reference rounded to the dtype ce_tvm stores it in."""
    return torch.as_tensor(np.asarray(values, dtype=np.float64)).to(dtype).double().numpy()


def check_pair(case, x, y, w, gen):
    dtype, tol = x.dtype, TOL[x.dtype]
    opts = dict(reduction=case.reduction, ignore_index=case.ignore_index,
                label_smoothing=case.label_smoothing,
                lse_square_scale_for_zloss=case.zloss_scale)
    loss, log_prob, zloss, lse = ce_tvm.cross_entropy_loss(x, aux(case, y), aux(case, w),
                                                           return_zloss=True, **opts)
    assert loss.dtype == log_prob.dtype == zloss.dtype == lse.dtype == dtype
    y64, w64 = y.numpy(), None if w is None else w.double().numpy()
    scalars = (case.ignore_index, case.label_smoothing, case.zloss_scale)
    ref_loss, ref_lp, ref_z, ref_lse = reference.forward(x.double().numpy(), y64, w64,
                                                         case.reduction, *scalars)
    assert_close(loss, expected(ref_loss, dtype), tol, "loss")
    assert_close(zloss, expected(ref_z, dtype), tol, "zloss")
    assert_close(lse, expected(ref_lse, dtype), tol, "lse")
    assert_close(log_prob, expected(ref_lp, dtype), tol, "log_prob")

    # the seed pair takes its upstream gradients in log_prob's dtype
    g = (torch.rand(loss.shape, generator=gen) + 0.5).to(dtype)
    gz = torch.rand(loss.shape, generator=gen).to(dtype) if case.grad_zloss else None
    lp_in = strided_copy(log_prob) if case.aux_strides else log_prob
    x_grad = ce_tvm.cross_entropy_loss_grad(
        aux(case, g), lp_in, aux(case, y), aux(case, w), grad_zloss=aux(case, gz),
        lse_for_zloss=aux(case, lse) if case.zloss_scale or case.grad_zloss else None, **opts)
    assert x_grad.dtype == dtype and x_grad.shape == x.shape
    ref = reference.backward(g.double().numpy(), log_prob.double().numpy(), y64, w64,
                             None if gz is None else gz.double().numpy(), lse.double().numpy(),
                             case.reduction, *scalars)
    assert_close(x_grad, expected(ref, dtype), tol, "x_grad")


def check_drop_in(case, x, y, w, gen):
    dtype, tol = x.dtype, TOL[x.dtype]
    opts = dict(ignore_index=case.ignore_index, reduction=case.reduction,
                label_smoothing=case.label_smoothing, lse_square_scale=case.zloss_scale)
    target = y.reshape(()) if case.layout == "C" else y.reshape(case.rows, *(
        (case.spatial,) if case.layout == "NCd" else ()))
    leaf = x.detach().requires_grad_()  # the drawn strides kept
    if case.entry == "module":
        fn = ce_tvm.CrossEntropyLoss(weight=aux(case, w), return_zloss=True, **opts)
        loss, zloss = fn(leaf, aux(case, target))
    else:
        loss, zloss = ce_tvm.cross_entropy(leaf, aux(case, target), aux(case, w),
                                           return_zloss=True, **opts)
    assert loss.dtype == zloss.dtype == dtype and loss.shape == (
        target.shape if case.reduction == "none" else ())
    flat = flatten(case, x.detach()).double().numpy()
    y64, w64 = y.numpy(), None if w is None else w.double().numpy()
    scalars = (case.ignore_index, case.label_smoothing, case.zloss_scale)
    ref_loss, ref_lp, ref_z, ref_lse = reference.forward(flat, y64, w64, case.reduction,
                                                         *scalars)
    assert_close(loss.reshape(-1), expected(ref_loss, dtype), tol, "loss")
    assert_close(zloss.reshape(-1), expected(ref_z, dtype), tol, "zloss")

    g = torch.rand(loss.shape, generator=gen) + 0.5
    loss.backward(aux(case, g))
    grad = leaf.grad
    assert grad.dtype == dtype and grad.shape == x.shape
    ref = reference.backward(g.reshape(-1).numpy(), ref_lp, y64, w64, None, ref_lse,
                             case.reduction, *scalars)
    assert_close(flatten(case, grad), expected(ref, dtype), tol, "x_grad")


def run_case(case: DrawnCase) -> None:
    """Draw the tensors of ``case``, run it, compare; on failure the message holds the case."""
    try:
        gen = torch.Generator().manual_seed(case.seed * 1_000_003 + case.index * 7 + case.stream)
        flat_x = logits_of(case, gen)
        y = targets_of(case, gen, flat_x.shape[0])
        y = y.to(torch.int32) if case.int32_target else y
        w = weight_of(case, gen)
        x = as_input(case, flat_x)
        if case.entry == "pair":
            check_pair(case, x, y, w, gen)
        else:
            check_drop_in(case, x, y, w, gen)
    except Exception as err:
        raise AssertionError(f"{type(err).__name__}: {err}\n{case}") from err


@pytest.mark.parametrize("index", range(CASES), ids=str)
def test_random_case(index):
    run_case(draw(SEED, index, stream=STREAM))


def test_concurrent_calls_from_threads():
    """Cases of different shapes and dtypes at once from several threads (kernels
    of the drawn groups, other runtime options), each result checked."""
    step = max(1, CASES // THREAD_CASES)
    cases = [draw(SEED, i * step % CASES, stream=1) for i in range(THREAD_CASES)]

    def outcome(case):
        try:
            run_case(case)
            return None
        except AssertionError as err:
            return str(err)

    with ThreadPoolExecutor(THREADS) as pool:
        failures = [f for f in pool.map(outcome, cases) if f is not None]
    assert not failures, "\n\n".join(failures)
