"""The CUDA schedule's kernels on PoCL (``ce_tvm.testing.pocl``): the cases, their
float64 expected outputs (``ce_tvm.testing.reference``) and the comparison.

Every op family: the forward, the backward (from ``log_prob``, from the
logits, and in place), the one-pass training kernel, probability targets,
softcap, token accuracy, the vocabulary-shard statistics (and the combine and
shard backward), per-token log-probs and their gradient (also in place),
temperature, and the distillation kernel (the student-teacher divergence,
its entropy and gradient, also in place; its float64 reference is
``_distill_problem``'s); float32, float16 and bfloat16; C = 1000, 5003 (prime),
32000 and 128256; rows 1, 7, 64 and 1000 (1000 at C = 1000 and 5003 only, see
``MAX_ROWS``); ignored rows, every row ignored, class weights (``matrix``). The
stress pass (``stress``) runs the same kernels with the fewest and the most
threads per block ``schedules/cuda.py`` offers (and 4 rows per block where the
schedule allows it), three launches each: a race shows up as a result that
differs between launches or from the reference.

``run_case`` builds (once per kernel), runs and compares one case: its
``Result`` holds ``max_abs_err`` (the largest ``|actual - reference|`` over
every output), ``worst`` (the largest ``|actual - reference| / (|reference| +
max(1, max |reference|))``, per output), ``tol`` (``worst`` must not exceed
it: the tolerances of ``tests/support.py``), ``passed`` (within ``tol``, NaN
and infinities in the same places, hit flags and repeated launches bit for
bit equal), ``kernels`` (device kernels per launch of the host function),
``device`` (as PoCL names it) and ``seconds``. ``benchmarks/gpu_schedule_on_pocl.py``
runs the whole matrix and writes the results; ``tests/schedules/test_pocl.py``
a part of it.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from ..kernels.kinds import Variant
from ..schedules.cuda import knob_space
from ..store.spec import KernelSpec
from . import pocl, reference

# As tests/support.py: float32 to 1e-5; half types to about one unit of their last bit.
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
DTYPES = tuple(TOL)
CLASSES = (1000, 5003, 32000, 128256)
ROWS = (1, 7, 64, 1000)
# 1000 rows at C <= 5003 only: a short run and a small float64 reference (one array
# of 1000 x 128256 is 1 GB); a longer vocabulary's chunks and launches are the same at
# 64 rows, only the grid is longer.
MAX_ROWS = {32000: 64, 128256: 64}
IGNORE = -100
ARCH = "sm_90"
SCALE = 3.0  # logits ~ N(0, 3^2)
SOFTCAP = 5.0
TEMPERATURE = 0.7


@dataclass(frozen=True)
class Case:
    """One kernel (op, variant, dtype, C, knobs) at one row count. ``knobs``:
    ``(name, value)`` pairs of the CUDA schedule's knobs over the op's own, as
    ``ce_tvm.schedule("cuda", name=value)`` sets them."""

    family: str
    op: str
    variant: Variant
    label: str
    dtype: str
    classes: int
    rows: int
    smoothing: float = 0.0
    zloss: float = 0.0
    ignore: str = "some"  # "none", "some" (every third row), "all"
    inplace: bool = False  # the gradient written over the logits
    masked: bool = False  # log-probs: every fifth class -inf (a masked vocabulary)
    knobs: tuple = ()
    repeats: int = 1
    seed: int = 0
    arch: str = ARCH

    def spec(self) -> KernelSpec:
        return KernelSpec(self.op, self.dtype, self.classes, self.variant, "cuda",
                          (("arch", self.arch), *sorted(self.knobs)))

    @property
    def softcap(self) -> float:
        return SOFTCAP if self.variant.softcap else 0.0

    @property
    def temperature(self) -> float:
        return TEMPERATURE if self.variant.tempered else 1.0


# --- the cases ----------------------------------------------------------------


def _loss(op, reduction="mean", weighted=False, **fields):
    return op, Variant(reduction, weighted, fields.pop("log_prob", False),
                       fields.pop("grad_source", "log_prob"), **fields)


# family -> [(op, Variant, label, Case fields)]
KERNELS = {
    "forward": [
        (*_loss("forward", "mean", True, log_prob=True), "mean w lp smooth z",
         dict(smoothing=0.1, zloss=1e-3)),
        (*_loss("forward", "none"), "none", {}),
        (*_loss("forward", "sum", True), "sum w no-ignore", dict(ignore="none")),
        (*_loss("forward", "mean", True, log_prob=True), "mean w all-ignored",
         dict(ignore="all")),
        (*_loss("forward", "mean", True, smoothing=False), "mean w no smoothing z",
         dict(zloss=1e-3)),
    ],
    "backward": [
        (*_loss("backward", "mean", True), "from log_prob mean w smooth z",
         dict(smoothing=0.1, zloss=1e-3)),
        (*_loss("backward", "none", grad_source="logits"), "from logits none z",
         dict(zloss=1e-3)),
        (*_loss("backward", "sum", True, grad_source="logits"), "from logits sum w in place",
         dict(inplace=True, smoothing=0.1)),
    ],
    "train": [
        (*_loss("train", "mean", True), "mean w smooth z", dict(smoothing=0.1, zloss=1e-3)),
        (*_loss("train", "sum"), "sum", {}),
        (*_loss("train", "mean", True), "mean w all-ignored", dict(ignore="all")),
        (*_loss("train", "mean", True, smoothing=False), "mean w no smoothing z",
         dict(zloss=1e-3)),
    ],
    "prob_targets": [
        (*_loss("prob_forward", "mean", True), "mean w smooth z",
         dict(smoothing=0.1, zloss=1e-3)),
        (*_loss("prob_forward", "none"), "none", {}),
        (*_loss("prob_backward", "mean", True), "mean w smooth z",
         dict(smoothing=0.1, zloss=1e-3)),
        (*_loss("prob_target_grad", "none", True), "none w smooth", dict(smoothing=0.1)),
    ],
    "softcap": [
        (*_loss("forward", "mean", True, softcap=True), "mean w softcap smooth z",
         dict(smoothing=0.1, zloss=1e-3)),
        (*_loss("train", "sum", softcap=True), "sum softcap", {}),
        (*_loss("backward", "none", True, grad_source="logits", softcap=True),
         "from logits none w softcap z", dict(zloss=1e-3)),
        (*_loss("prob_forward", "mean", softcap=True), "mean softcap", {}),
    ],
    "accuracy": [
        (*_loss("forward", "none", accuracy=True), "none hits", {}),
        (*_loss("train", "mean", True, accuracy=True), "mean w hits smooth",
         dict(smoothing=0.1)),
        (*_loss("train", "sum", accuracy=True, smoothing=False), "sum hits no smoothing", {}),
    ],
    "shards": [
        ("shard_stats", Variant(weighted=True), "w", {}),
        ("shard_stats", Variant(softcap=True), "softcap", {}),
        ("shard_stats", Variant(weighted=True, smoothing=False), "w no smoothing", {}),
        ("shard_combine", Variant("mean"), "mean smooth z", dict(smoothing=0.1, zloss=1e-3)),
        (*_loss("backward", "mean", True, grad_source="shard"), "shard mean w smooth z",
         dict(smoothing=0.1, zloss=1e-3)),
        (*_loss("backward", "none", grad_source="shard"), "shard none in place",
         dict(inplace=True)),
    ],
    "log_probs": [
        ("log_probs", Variant(columns=1), "K=1", dict(ignore="none")),
        ("log_probs", Variant(columns=2, softcap=True), "K=2 softcap ignored", {}),
        ("log_probs_grad", Variant(columns=2), "K=2 ignored", {}),
        ("log_probs_grad", Variant(columns=1, softcap=True), "K=1 softcap in place",
         dict(inplace=True, ignore="none")),
        ("log_probs", Variant(columns=1), "K=1 masked", dict(ignore="none", masked=True)),
        ("log_probs_grad", Variant(columns=2), "K=2 masked", dict(masked=True)),
        ("log_probs", Variant(columns=2, entropy=False), "K=2 no entropy ignored", {}),
    ],
    "temperature": [
        (*_loss("forward", "mean", True, tempered=True), "mean w T smooth z",
         dict(smoothing=0.1, zloss=1e-3)),
        (*_loss("train", "mean", tempered=True, softcap=True), "mean T softcap", {}),
        (*_loss("backward", "sum", True, grad_source="logits", tempered=True),
         "from logits sum w T", dict(zloss=1e-3)),
        ("log_probs", Variant(columns=2), "K=2 T", {}),
        ("log_probs_grad", Variant(columns=2, softcap=True), "K=2 T softcap", {}),
    ],
    "distillation": [
        ("divergence", Variant("mean", divergence="jsd"), "jsd beta 0.5", {}),
        ("divergence", Variant("none", divergence="fkl"), "fkl T 2 no gradient", {}),
        ("divergence", Variant("mean", divergence="rkl", softcap=True, teacher_softcap=True),
         "rkl T 2 softcaps in place", dict(inplace=True)),
    ],
}
FAMILIES = tuple(KERNELS)
# The log-prob kernels' temperature is a scalar of every kernel (no variant):
# the temperature family runs them at T != 1, the others at T = 1.
TEMPERED_LOG_PROBS = "temperature"


def matrix(families=FAMILIES, dtypes=DTYPES, classes=CLASSES, rows=ROWS) -> list[Case]:
    """The full matrix: every kernel of ``families`` x dtype x C x rows."""
    out = []
    for family, dtype, c in itertools.product(families, dtypes, classes):
        for n in rows:
            if n > MAX_ROWS.get(c, n):
                continue
            out += [_case(family, k, dtype, c, n) for k in KERNELS[family]]
    return out


def _case(family, kernel, dtype, classes, rows, **more) -> Case:
    op, variant, label, fields = kernel
    return Case(family, op, variant, label, dtype, classes, rows, **{**fields, **more})


# The kernels scheduled by ``schedules/cuda.py``'s ``backward`` (rows per block a knob).
GRADIENT_OPS = ("backward", "prob_backward", "prob_target_grad", "log_probs_grad")


def stress(dtypes=("float32", "bfloat16"), classes=(5003,), rows=7) -> list[Case]:
    """The stress pass: the first two kernels of every family and every gradient
    kernel, with the fewest and the most threads per block the schedule offers
    (``knob_space``), and the gradient kernels with 4 rows per block too (7
    rows: the last block has rows past N), launched 3 times each."""
    out = []
    threads = knob_space("backward", 1000, "float32", None)["threads"]
    kernels = [(f, k) for f in FAMILIES for i, k in enumerate(KERNELS[f])
               if i < 2 or k[0] in GRADIENT_OPS]
    for (family, kernel), dtype, c in itertools.product(kernels, dtypes, classes):
        grad = kernel[0] in GRADIENT_OPS
        choices = [{"threads": min(threads)}, {"threads": max(threads)}]
        if grad:
            choices.append({"threads": min(threads), "rows_per_block": 4})
        for knobs in choices:
            label = " ".join([kernel[2], *(f"{k}={v}" for k, v in knobs.items())])
            case = _case(family, kernel, dtype, c, rows, repeats=3,
                         knobs=tuple((k, str(v)) for k, v in knobs.items()))
            out.append(replace(case, label=label + " x3"))
    return out


# --- inputs and the reference --------------------------------------------------


def store(values: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``(what the kernel reads, its values in float64)`` for ``values`` in ``dtype``."""
    if dtype == "bfloat16":
        bits = pocl.bf16_bits(values.astype(np.float32))
        return bits, pocl.bf16_values(bits).astype(np.float64)
    stored = values.astype(dtype)
    return stored, stored.astype(np.float64)


def value(array: np.ndarray, dtype: str) -> np.ndarray:
    return (pocl.bf16_values(array) if dtype == "bfloat16" else array).astype(np.float64)


@dataclass
class Problem:
    """A case's kernel inputs (``arrays``, ``scalars``, ``aliases``) and the
    reference values of its outputs (``expected``; ``exact``: compared bit for bit)."""

    arrays: dict
    scalars: dict
    expected: dict
    aliases: dict = field(default_factory=dict)
    exact: tuple = ()


def _targets(case: Case, rng, classes: int, z=None) -> np.ndarray:
    y = rng.integers(0, classes, case.rows)
    if z is not None:  # token accuracy: every other target is its row's first maximum
        y[1::2] = np.argmax(z[1::2], axis=1)
    if case.ignore == "some":
        y[::3] = IGNORE
    elif case.ignore == "all":
        y[:] = IGNORE
    return y


def _weights(case: Case, rng, classes: int):
    if not case.variant.weighted:
        return None, None
    w = (rng.random(classes) + 0.5).astype(np.float32)
    return w, w.astype(np.float64)


def _logit_scalars(case: Case) -> dict:
    return {"softcap": case.softcap, "inv_temperature": 1.0 / case.temperature}


def _loss_problem(case: Case, rng) -> Problem:
    """forward, train, backward (log_prob and logits sources)."""
    n, c, op, v = case.rows, case.classes, case.op, case.variant
    xk, x = store(rng.standard_normal((n, c)) * SCALE, case.dtype)
    z = reference.capped(x, case.softcap) / case.temperature
    y = _targets(case, rng, c, z if v.accuracy else None)
    wk, w = _weights(case, rng, c)
    scalars = {"ignore_index": IGNORE, "label_smoothing": case.smoothing,
               "zloss_scale": case.zloss, **_logit_scalars(case)}
    loss, logp, zloss, lse = reference.forward(z, y, w, v.reduction, IGNORE, case.smoothing,
                                               case.zloss)
    arrays = {"x": xk, "target": y, **({"weight": wk} if v.weighted else {})}
    if op == "forward":
        expected = {"ce_loss": loss, "ce_zloss": zloss, "lse": lse}
        if v.log_prob:
            expected["log_prob"] = logp
        exact = ()
        if v.accuracy:
            expected["ce_row_hit"] = ((y != IGNORE) & (np.argmax(z, axis=1) == y)).astype(float)
            exact = ("ce_row_hit",)
        return Problem(arrays, scalars, expected, exact=exact)
    rows_g = n if v.reduction == "none" else 1
    if op == "train":
        g, gz = np.ones(rows_g), None
    else:
        g, gz = rng.random(rows_g) + 0.5, rng.random(rows_g)
    if op == "backward" and v.grad_source == "log_prob":
        arrays["log_prob"], logp = store(logp, case.dtype)
        del arrays["x"]
    grad = reference.backward(g, logp, y, w, gz, lse, v.reduction, IGNORE, case.smoothing,
                              case.zloss) / case.temperature
    grad = reference.through_softcap(grad, x, case.softcap)
    if op == "train":
        expected = {"x_grad": grad, "lse": lse, "ce_loss": loss, "ce_zloss": zloss}
        if v.reduction == "mean":
            expected["ce_mean_norms"] = np.array(reference.totals(y, w, IGNORE, c))
        exact = ()
        if v.accuracy:
            expected["ce_row_hit"] = ((y != IGNORE) & (np.argmax(z, axis=1) == y)).astype(float)
            exact = ("ce_row_hit",)
        return Problem(arrays, scalars, expected, exact=exact)
    arrays.update(grad_loss=g.astype(np.float32), grad_zloss=gz.astype(np.float32),
                  lse=lse.astype(np.float32))
    aliases = {"x_grad": "x"} if case.inplace else {}
    return Problem(arrays, scalars, {"x_grad": grad}, aliases)


def _prob_problem(case: Case, rng) -> Problem:
    """prob_forward, prob_backward, prob_target_grad."""
    n, c, v, eps = case.rows, case.classes, case.variant, case.smoothing
    xk, x = store(rng.standard_normal((n, c)) * SCALE, case.dtype)
    logits_q = rng.standard_normal((n, c)) * 2
    q = np.exp(logits_q - logits_q.max(1, keepdims=True))
    qk, q = store(q / q.sum(1, keepdims=True), case.dtype)
    wk, w = _weights(case, rng, c)
    z = reference.capped(x, case.softcap) / case.temperature
    scalars = {"label_smoothing": eps, "zloss_scale": case.zloss, **_logit_scalars(case)}
    loss, zloss, lse = reference.prob_forward(z, q, w, v.reduction, eps, case.zloss)
    mass = ((w if w is not None else 1.0) * ((1 - eps) * q + eps / c)).sum(axis=1)
    weight = {"weight": wk} if v.weighted else {}
    if case.op == "prob_forward":
        return Problem({"x": xk, "target": qk, **weight}, scalars,
                       {"ce_loss": loss, "ce_zloss": zloss, "lse": lse, "ce_row_mass": mass})
    g = rng.random(n if v.reduction == "none" else 1) + 0.5
    x_grad, target_grad = reference.prob_backward(g, x, q, w, v.reduction, eps, case.zloss)
    common = {"grad_loss": g.astype(np.float32), "x": xk, "lse": lse.astype(np.float32),
              **weight}
    if case.op == "prob_backward":
        return Problem({**common, "target": qk, "target_mass": mass.astype(np.float32)},
                       scalars, {"x_grad": x_grad})
    return Problem(common, scalars, {"target_grad": target_grad})


def _shard_problem(case: Case, rng) -> Problem:
    """The second shard (columns ``[C, 2C)``) of a ``2C`` vocabulary: its statistics,
    the combine of the full rows' statistics, its gradient."""
    n, c, v = case.rows, case.classes, case.variant
    full = 2 * c if case.op != "shard_combine" else c
    xk_full, x_full = store(rng.standard_normal((n, full)) * SCALE, case.dtype)
    y = _targets(case, rng, full)
    w_full = (rng.random(full) + 0.5).astype(np.float32)
    w64 = w_full.astype(np.float64) if v.weighted or case.op == "shard_combine" else None
    if case.op == "shard_combine":
        loss, _, zloss, lse = reference.forward(x_full, y, w64, v.reduction, IGNORE,
                                                case.smoothing, case.zloss)
        t = np.where(y != IGNORE, y, 0)
        live = (y != IGNORE).astype(np.float64)
        arrays = {"lse": lse, "target_logit": x_full[np.arange(n), t] * live,
                  "target_weight": w64[t] * live, "wxsum": (x_full * w64).sum(axis=1),
                  "target": y}
        arrays = {k: a.astype(np.float32) if a.dtype == np.float64 else a
                  for k, a in arrays.items()}
        scalars = {"weight_sum": float(w64.sum()), "ignore_index": IGNORE,
                   "label_smoothing": case.smoothing, "zloss_scale": case.zloss}
        return Problem(arrays, scalars, {"ce_loss": loss, "ce_zloss": zloss})
    xk, x = xk_full[:, c:], x_full[:, c:]
    w_shard = w_full[c:] if v.weighted else None
    weight = {"weight": w_shard} if v.weighted else {}
    if case.op == "shard_stats":
        zs = reference.capped(x, case.softcap)
        top = zs.max(axis=1)
        local = y - c
        here = (local >= 0) & (local < c)
        at = np.where(here, local, 0)
        ws = w_shard.astype(np.float64) if v.weighted else np.ones(c)
        wxsum = [(zs * ws).sum(axis=1)] if v.smoothing else []
        outs = (top, np.exp(zs - top[:, None]).sum(axis=1), *wxsum,
                np.where(here, zs[np.arange(n), at], 0.0), np.where(here, ws[at], 0.0))
        return Problem({"x": xk, "target": y, **weight},
                       {"shard_offset": c, **_logit_scalars(case)}, dict(enumerate(outs)))
    # the shard's gradient, from the full rows' lse and the full target weights
    wf = w64 if v.weighted else np.ones(full)
    _, logp, _, lse = reference.forward(x_full, y, w64, v.reduction, IGNORE, case.smoothing,
                                        case.zloss)
    rows_g = n if v.reduction == "none" else 1
    g, gz = rng.random(rows_g) + 0.5, rng.random(rows_g)
    grad = reference.backward(g, logp, y, w64, gz, lse, v.reduction, IGNORE, case.smoothing,
                              case.zloss)[:, c:]
    t = np.where(y != IGNORE, y, 0)
    arrays = {"grad_loss": g.astype(np.float32), "grad_zloss": gz.astype(np.float32),
              "x": np.ascontiguousarray(xk), "lse": lse.astype(np.float32), "target": y,
              **weight, "target_weight": (wf[t] * (y != IGNORE)).astype(np.float32)}
    scalars = {"shard_offset": c, "weight_sum": float(wf.sum()), "global_classes": float(full),
               "ignore_index": IGNORE, "label_smoothing": case.smoothing,
               "zloss_scale": case.zloss}
    return Problem(arrays, scalars, {"x_grad": grad}, {"x_grad": "x"} if case.inplace else {})


MASK_STRIDE = 5


def _policy_problem(case: Case, rng) -> Problem:
    """log_probs and log_probs_grad (temperature from the family)."""
    n, c, k = case.rows, case.classes, case.variant.columns
    values = rng.standard_normal((n, c)) * SCALE
    index = rng.integers(0, c, (n, k))
    if case.masked:  # classes 1, 6, 11, ... masked; the indices on classes 0, 5, 10, ...
        values[:, 1::MASK_STRIDE] = -np.inf
        index -= index % MASK_STRIDE
    xk, x = store(values, case.dtype)
    if case.ignore != "none":
        index[::3, -1] = IGNORE
    live = index != IGNORE
    temp = TEMPERATURE if case.family == TEMPERED_LOG_PROBS else 1.0
    cap = case.softcap
    scalars = {"ignore_index": IGNORE, "inv_temperature": 1.0 / temp, "softcap": cap}
    logp, entropy = reference.policy_outputs(x, index, live, temp, cap)
    zc = reference.capped(x, cap)
    top = zc.max(axis=1)
    log_s = np.log(np.exp((zc - top[:, None]) / temp).sum(axis=1))
    if case.op == "log_probs":
        expected = {"logp": logp, "entropy": entropy, "row_max": top, "log_expsum": log_s}
        if not case.variant.entropy:  # the kernel without it (Variant.entropy)
            del expected["entropy"]
        return Problem({"x": xk, "index": index}, scalars, expected)
    g, h = rng.random((n, k)) + 0.5, rng.random(n)
    grad = reference.policy_grad(x, index, live, g, h, temp, cap)
    arrays = {"grad_logp": g.astype(np.float32), "grad_entropy": h.astype(np.float32),
              "x": xk, "row_max": top.astype(np.float32), "log_expsum": log_s.astype(np.float32),
              "entropy": entropy.astype(np.float32), "index": index}
    return Problem(arrays, scalars, {"x_grad": grad}, {"x_grad": "x"} if case.inplace else {})


# The distillation kernel's direction -> TRL's beta; its temperature and caps by label.
BETA = {"fkl": 0.0, "rkl": 1.0, "jsd": 0.5}
TEACHER_SOFTCAP = 4.0


def _log_softmax(z: np.ndarray) -> np.ndarray:
    top = z.max(axis=1, keepdims=True)
    return z - top - np.log(np.exp(z - top).sum(axis=1, keepdims=True))


def _distill_problem(case: Case, rng) -> Problem:
    """The student-teacher divergence (TRL's generalized JSD: beta 0 forward KL,
    1 reverse KL), the student's entropy and the student logits' gradient of
    ``sum_n g[n] divergence[n]``, in float64 from the definitions (the gradient
    through softmax, the temperature and the softcap by the chain rule)."""
    n, c, v = case.rows, case.classes, case.variant
    xk, xs = store(rng.standard_normal((n, c)) * SCALE, case.dtype)
    tk, xt = store(rng.standard_normal((n, c)) * SCALE, case.dtype)
    temp = 1.0 if v.divergence == "jsd" else 2.0
    cap_s, cap_t = (SOFTCAP if v.softcap else 0.0), (TEACHER_SOFTCAP if v.teacher_softcap else 0.0)
    beta = BETA[v.divergence]
    lp = _log_softmax(reference.capped(xs, cap_s) / temp)
    lq = _log_softmax(reference.capped(xt, cap_t) / temp)
    p, q = np.exp(lp), np.exp(lq)
    with np.errstate(divide="ignore"):
        lm = np.logaddexp(lp + np.log1p(-beta), lq + np.log(beta))
    kl_p = (p * (lp - (lq if beta == 1 else lm))).sum(axis=1)  # KL(p || q or m)
    if beta == 0:
        div, dz = (q * (lq - lp)).sum(axis=1), p - q
    elif beta == 1:
        div, dz = kl_p, p * (lp - lq - kl_p[:, None])
    else:
        div = beta * (q * (lq - lm)).sum(axis=1) + (1 - beta) * kl_p
        dz = (1 - beta) * p * (lp - lm - kl_p[:, None])
    g = rng.random(n) + 0.5
    scalars = {"beta": beta, "inv_temperature_s": 1.0 / temp, "inv_temperature_t": 1.0 / temp,
               "softcap_s": cap_s, "softcap_t": cap_t}
    expected = {"divergence": div, "entropy": -(p * lp).sum(axis=1)}
    if v.reduction != "none":
        expected["x_grad"] = reference.through_softcap(g[:, None] * dz / temp, xs, cap_s)
    return Problem({"student": xk, "teacher": tk, "g": g.astype(np.float32)}, scalars,
                   expected, {"x_grad": "student"} if case.inplace else {})


def problem(case: Case) -> Problem:
    rng = np.random.default_rng([case.seed, case.classes, case.rows])
    if case.op.startswith("prob_"):
        return _prob_problem(case, rng)
    if case.op.startswith("shard_") or case.variant.grad_source == "shard":
        return _shard_problem(case, rng)
    if case.op.startswith("log_probs"):
        return _policy_problem(case, rng)
    if case.op == "divergence":
        return _distill_problem(case, rng)
    return _loss_problem(case, rng)


# --- running and comparing -------------------------------------------------------


@dataclass
class Result:
    op: str
    family: str
    dtype: str
    classes: int
    rows: int
    variant: str
    max_abs_err: float
    worst: float
    worst_output: str
    tol: float
    passed: bool
    kernels: int
    device: str
    seconds: float
    problem: str = ""  # why it failed
    arch: str = ARCH  # the CUDA arch the kernels are scheduled for
    instructions: int | None = None  # thread instructions executed (simulators only)


def run_case(case: Case, device=None) -> Result:
    """Build (once per kernel), run and compare one case. ``device``: what runs
    the kernels, PoCL's CPU device (the default) or ``gpgpu_sim.Simulator``: its
    ``kernels(spec)`` builds, its ``run`` launches (``pocl.PoCL.run``'s
    signature), its ``instructions`` counts the last run (``None``: not counted)."""
    device = device or pocl.PoCL.get()
    start = time.perf_counter()
    kernels = device.kernels(case.spec())
    prob = problem(case)
    runs = [device.run(kernels, case.rows, prob.arrays, prob.scalars, prob.aliases)
            for _ in range(case.repeats)]
    outputs = _outputs(kernels, prob)
    tol = TOL[case.dtype]
    max_abs, worst, worst_name, issues = 0.0, 0.0, "", []
    for key, expected in prob.expected.items():
        name = outputs[key]
        actual = value(runs[0][name], kernels.param(name).dtype).reshape(np.shape(expected))
        err, ratio, issue = compare(actual, np.asarray(expected, np.float64), tol,
                                    exact=key in prob.exact)
        max_abs = max(max_abs, err)
        if ratio > worst:
            worst, worst_name = ratio, str(name)
        if issue:
            issues.append(f"{name}: {issue}")
    for i, other in enumerate(runs[1:], 2):
        for name in outputs.values():
            if not np.array_equal(runs[0][name], other[name], equal_nan=True):
                issues.append(f"{name}: launch {i} differs from launch 1")
    return Result(case.op, case.family, case.dtype, case.classes, case.rows, case.label,
                  float(max_abs), float(worst), worst_name, tol, not issues,
                  len(kernels.launches), device.name, round(time.perf_counter() - start, 3),
                  "; ".join(issues), case.arch, device.instructions)


def case_arguments(parser, rows=ROWS) -> None:
    """The command-line options that choose cases (``matrix``'s arguments) and ``--json``,
    as the benchmark scripts running the matrix on a device take them."""
    parser.add_argument("--json", type=Path, help="write one record per case here")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--classes", nargs="+", type=int, default=list(CLASSES))
    parser.add_argument("--rows", nargs="+", type=int, default=list(rows))


def run_cases(cases: list, device, json_path=None, kept: list = ()) -> list[Result]:
    """Run ``cases`` on ``device`` (as ``run_case``), printing a line per case and,
    with ``json_path``, writing ``kept`` (records of an earlier run) and every record
    so far after each case (a long run leaves its records behind). A build or launch
    failure is a failed case."""
    results, start = [], time.perf_counter()
    for i, case in enumerate(cases, 1):
        try:
            result = run_case(case, device)
        except Exception as err:  # noqa: BLE001 - the failure is the record
            result = Result(case.op, case.family, case.dtype, case.classes, case.rows,
                            case.label, float("inf"), float("inf"), "", TOL[case.dtype],
                            False, 0, device.name, 0.0, f"{type(err).__name__}: {err}"[:500],
                            case.arch)
        results.append(result)
        print(f"[{i}/{len(cases)}] {'ok  ' if result.passed else 'FAIL'} {case.family:12} "
              f"{case.op:16} {case.dtype:8} C={case.classes:<6} N={case.rows:<4} {case.arch} "
              f"{case.label:36} worst {result.worst:.2e} ({result.seconds:.1f} s) "
              f"{result.problem}", flush=True)
        if json_path:
            Path(json_path).write_text(
                json.dumps([*kept, *(asdict(r) for r in results)], indent=1) + "\n")
    passed = sum(r.passed for r in results)
    print(f"{passed} passed, {len(results) - passed} failed "
          f"({time.perf_counter() - start:.0f} s on {device.name})")
    return results


def _outputs(kernels: pocl.Kernels, prob: Problem) -> dict:
    """The expected outputs' parameter names (an int key: the n-th of the last
    buffers, for kernels whose outputs carry stage names)."""
    buffers = [p.name for p in kernels.buffers() if not p.name.startswith("scratch_")]
    count = sum(isinstance(k, int) for k in prob.expected)
    tail = buffers[len(buffers) - count:] if count else []
    names = {}
    for key in prob.expected:
        names[key] = tail[key] if isinstance(key, int) else key
    return names


def compare(actual: np.ndarray, expected: np.ndarray, tol: float,
            exact: bool = False) -> tuple[float, float, str]:
    """``(max |a - e|, max |a - e| / (|e| + scale), problem or "")`` with
    ``scale = max(1, max |e|)``, as ``tests/support.assert_close``."""
    if actual.shape != expected.shape:
        return float("inf"), float("inf"), f"shape {actual.shape} != {expected.shape}"
    finite = np.isfinite(expected)
    if not np.array_equal(finite, np.isfinite(actual)):
        return float("inf"), float("inf"), "NaN/Inf in different places"
    if not np.array_equal(np.nan_to_num(actual[~finite]), np.nan_to_num(expected[~finite])):
        return float("inf"), float("inf"), "different infinities"
    if not finite.any():
        return 0.0, 0.0, ""
    a, e = actual[finite], expected[finite]
    diff = np.abs(a - e)
    if exact:
        return float(diff.max()), float(diff.max()), "" if not diff.any() else "not exact"
    scale = max(1.0, float(np.abs(e).max()))
    ratio = diff / (np.abs(e) + scale)
    worst = float(ratio.max())
    return float(diff.max()), worst, "" if worst <= tol else f"{worst:.3g} > tol {tol}"
