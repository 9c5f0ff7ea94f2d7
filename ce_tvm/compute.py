"""The cross-entropy math, declared once in TVM TE (SPEC.md sections 1 and 2).

Nothing here knows about targets, schedules or torch. Every stage has a stable
name, exported below as a constant (``CHUNK_MAX = "ce_chunk_max"``, ...; all of
them in ``STAGES``); those constants are the contract schedules look blocks up
by:

forward (``forward_func``), per row ``n`` of ``x[N, C]``, the row cut into
chunks ``k`` of ``chunk`` classes:

=====================  =====================================================
``ce_chunk_max``       ``max_j x[n, kB + j]`` (uncapped: the cap is monotone)
``ce_chunk_expsum``    ``sum_j exp(x[n, kB + j] - chunk_max[n, k])``
``ce_chunk_wxsum``     ``sum_j w[kB + j] x[n, kB + j]``
``ce_wsum``            ``sum_c w[c]``, once for all rows (weighted only)
``ce_rowstats``        the chunks merged: row max, exp-sum, sum w x
``lse``                ``rowmax + log(expsum)`` (output, accumulation dtype)
``ce_row_mask``        ``m[n]``
``ce_row_ce``          ``ce[n]`` (nll and smoothing terms of SPEC section 1)
``ce_row_z``           ``z[n]``
``ce_row_weight``      ``w[y[n]] * m[n]``           (mean only)
``log_prob``           ``x - lse``               (output, log-prob variant only)
``ce_total_*``         serial fixed-order sums over rows (sum and mean only)
``ce_loss``            output ``loss``
``ce_zloss``           output ``zloss``
``ce_target_logit``    ``x[n, y[n]]``             (accuracy variant only)
``ce_chunk_beats``     columns ahead of the target in argmax order (accuracy)
``ce_row_hit``         output ``hit``: target is the first maximum (accuracy)
``ce_chunk_logits``    a chunk's logits as the loss sees them (float32; capped
                       with softcap), read by its sums: declared with softcap
                       or ``stage=True``
=====================  =====================================================

With ``softcap`` (capped variant) every read of a logit is ``t * tanh(x / t)``
(``Logits``; the chunk sums read the chunk's ``ce_chunk_logits``, which a
schedule keeps on chip or inlines) and every gradient is multiplied by
``1 - tanh(x / t)^2``.

backward (``backward_func``):

=====================  =====================================================
``ce_total_weight``    ``D = sum_n w[y[n]] m[n]``    (mean only)
``ce_total_count``     ``M = sum_n m[n]``           (mean only)
``ce_wsum``            ``sum_c w[c]``             (weighted only)
``ce_grad_mask``       ``m[n]``
``ce_grad_hot``        ``a[n] w[y[n]]``: coefficient of the one-hot term
``ce_grad_smooth``     ``b[n]``: coefficient of ``w[c]``
``ce_grad_pscale``     coefficient of ``p[n, c]`` (z-loss included)
``x_grad``             output ``a w[y] (p - onehot) + b (p sum w - w[c]) + z-term``
=====================  =====================================================

training (``train_func``: the forward's stages, and the backward's
coefficients for a unit upstream gradient, plus):

=====================  =====================================================
``ce_chunk_exp``       ``e = exp(x[n, kB + j] - chunk_max[n, k])``, kept
``ce_mean_norms``      ``(D, M)`` from the targets, before the sweep (mean only)
``ce_chunk_pscale``    ``exp(chunk_max[n, k] - lse[n]) * pscale[n]``
``x_grad``             output ``e * chunk_pscale - onehot - smooth w[c]``
=====================  =====================================================

vocabulary shards (``shard_stats_func``, ``shard_combine_func``, and the
``shard`` source of ``backward_func``) reuse the same stages, plus
``ce_shard_local`` (target index in the shard), ``ce_shard_target_logit`` and
``ce_shard_target_weight``.

probability targets (``prob_forward_func``, ``prob_backward_func``; SPEC
section 5) reuse the forward's and backward's stages with the target mass
``v[n, c] = w[c] q'[n, c]`` as the per-element weight (``ce_chunk_wxsum`` is
``sum_j v x``; ``ce_row_mask`` is 1: every row counts), plus:

=====================  =====================================================
``ce_chunk_wsum``      ``sum_j v[n, kB + j]``: the mass depends on the row, so
                       it is a chunk reduction (``ce_rowstats`` merges it)
``ce_row_ref``         ``r[n]``: the row's first logit (0 if not finite); the
                       weighted sums are of ``x - r``
``ce_row_mass``        ``sum_c v[n, c]`` (output, for the backward)
``ce_grad_smooth``     ``r[n]``: the row's upstream gradient, coefficient of ``v``
``ce_grad_pscale``     ``r[n] (sum_c v + 2 s lse)``: coefficient of ``p``
``target_grad``        output ``-r (1 - eps) w[c] logp`` (``prob_target_grad_func``)
=====================  =====================================================

``N`` is a symbolic int64 variable, so one compiled module serves every batch
size; ``C`` is a compile-time constant. ``ignore_index``, ``label_smoothing``
and ``zloss_scale`` are scalar kernel arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

from tvm import te, tirx

from . import fastmath

# The dtype and reduction tables live in kinds (no TVM there); re-exported for the schedules.
from .kinds import DTYPE_BYTES, DTYPES, REDUCTIONS, Variant, accum_dtype  # noqa: F401

# Stage names (see the tables above).
CHUNK_MAX = "ce_chunk_max"
CHUNK_EXPSUM = "ce_chunk_expsum"
CHUNK_WXSUM = "ce_chunk_wxsum"
CHUNK_WSUM = "ce_chunk_wsum"
ROWSTATS = "ce_rowstats"
LSE = "lse"
ROW_MASK = "ce_row_mask"
ROW_CE = "ce_row_ce"
ROW_Z = "ce_row_z"
ROW_WEIGHT = "ce_row_weight"
LOG_PROB = "log_prob"
TOTAL_CE = "ce_total_ce"
TOTAL_Z = "ce_total_z"
TOTAL_WEIGHT = "ce_total_weight"
TOTAL_COUNT = "ce_total_count"
LOSS = "ce_loss"
ZLOSS = "ce_zloss"
WSUM = "ce_wsum"
GRAD_MASK = "ce_grad_mask"
GRAD_HOT = "ce_grad_hot"
GRAD_SMOOTH = "ce_grad_smooth"
GRAD_PSCALE = "ce_grad_pscale"
X_GRAD = "x_grad"
SHARD_LOCAL = "ce_shard_local"
SHARD_TARGET_LOGIT = "ce_shard_target_logit"
SHARD_TARGET_WEIGHT = "ce_shard_target_weight"
CHUNK_EXP = "ce_chunk_exp"
CHUNK_PSCALE = "ce_chunk_pscale"
MEAN_NORMS = "ce_mean_norms"
ROW_TARGET_LOGIT = "ce_target_logit"
CHUNK_BEATS = "ce_chunk_beats"
ROW_HIT = "ce_row_hit"
ROW_MASS = "ce_row_mass"
ROW_REF = "ce_row_ref"
TARGET_GRAD = "target_grad"
CHUNK_LOGITS = "ce_chunk_logits"
LOGITS = "x"  # the input logits
STAGES = (CHUNK_MAX, CHUNK_EXPSUM, CHUNK_WXSUM, CHUNK_WSUM, ROWSTATS, LSE, ROW_MASK, ROW_CE,
          ROW_Z, ROW_WEIGHT, LOG_PROB, TOTAL_CE, TOTAL_Z, TOTAL_WEIGHT, TOTAL_COUNT, LOSS, ZLOSS,
          WSUM, GRAD_MASK, GRAD_HOT, GRAD_SMOOTH, GRAD_PSCALE, X_GRAD, SHARD_LOCAL,
          SHARD_TARGET_LOGIT, SHARD_TARGET_WEIGHT, CHUNK_EXP, CHUNK_PSCALE, MEAN_NORMS,
          ROW_TARGET_LOGIT, CHUNK_BEATS, ROW_HIT, ROW_MASS, TARGET_GRAD, ROW_REF,
          CHUNK_LOGITS)


def matrix_param(func: tirx.PrimFunc):
    """The ``[N, C]`` input of a declared function (``x``, or ``log_prob``)."""
    return next(p for p in func.params if len(getattr(p, "shape", ())) == 2)


def _rows():
    return te.var("N", "int64")


def _logits_inputs(classes: int, dtype: str, weighted: bool, probs: bool = False):
    """``(acc, N, x[N, C], target, weight[C] or None)``: the inputs of the
    kernels that read the logits; ``target`` is ``[N]`` int64 class indices,
    or with ``probs`` ``[N, C]`` probabilities in the logits' dtype."""
    acc = accum_dtype(dtype)
    n_rows = _rows()
    x = te.placeholder((n_rows, _int64(classes)), dtype, name=LOGITS)
    if probs:
        y = te.placeholder((n_rows, _int64(classes)), dtype, name="target")
    else:
        y = te.placeholder((n_rows,), "int64", name="target")
    w = te.placeholder((_int64(classes),), acc, name="weight") if weighted else None
    return acc, n_rows, x, y, w


def _int64(v: int):
    return tirx.IntImm("int64", v)


def _scalars(acc: str, softcap: bool = False) -> tuple:
    """The scalar arguments: ``ignore_index``, ``label_smoothing``,
    ``zloss_scale``, and ``softcap`` for a capped variant."""
    return (
        te.var("ignore_index", "int64"),
        te.var("label_smoothing", acc),
        te.var("zloss_scale", acc),
    ) + ((te.var("softcap", acc),) if softcap else ())


@dataclass(frozen=True)
class Logits:
    """The logits ``x[N, C]`` as the loss sees them, in the accumulation dtype:
    ``t * tanh(x / t)`` when ``cap`` holds the ``softcap`` argument ``t``
    (SPEC section 5), else ``x`` itself (no ``tanh`` in the kernel)."""

    x: te.Tensor
    acc: str
    cap: tuple = ()  # () or (softcap,)

    def __call__(self, n, c):
        return self.capped(self.raw(n, c))

    def raw(self, n, c):
        """``x[n, c]`` itself, uncapped."""
        return self.x[n, c].astype(self.acc)

    def capped(self, value):
        """``value`` (an uncapped logit, or a maximum of some: the cap is
        monotone, so it commutes with ``max``) as the loss sees it."""
        if not self.cap:
            return value
        t = self.cap[0]
        return t * fastmath.tanh(value * (tirx.const(1.0, self.acc) / t))

    def scaled_by_slope(self, n, c, grad):
        """``grad`` (with respect to the capped logit) times ``d x' / d x =
        1 - tanh(x / t)^2``; ``grad`` itself when uncapped."""
        if not self.cap:
            return grad
        one = tirx.const(1.0, self.acc)
        th = fastmath.tanh(self.x[n, c].astype(self.acc) * (one / self.cap[0]))
        return grad * (one - th * th)


def _masked_target(y, ii, classes: int):
    """Ignore mask ``m`` and a target index that is always in ``[0, C)``.

    The index of an ignored or (never validated) out-of-range target is 0, so
    the kernel can never read outside its row whatever the caller passes.
    """

    def mask(n):
        return (y[n] != ii).astype("int32")

    def index(n):
        inside = tirx.all(y[n] >= _int64(0), y[n] < _int64(classes))
        return tirx.Select(inside, y[n], _int64(0))

    return mask, index


def _same_class(c, index):
    """``c == index`` for a column and a per-row class index, compared in int32
    (C < 2**31): a vector of int32 lanes instead of int64 ones built by shuffles."""
    return c.astype("int32") == index.astype("int32")


def _row_total(stage, term, n_rows):
    """Serial, fixed-order sum over rows of a per-row term (deterministic, no atomics)."""
    r = te.reduce_axis((_int64(0), n_rows), name="r")
    return te.compute((1,), lambda _: te.sum(term[r], axis=r), name=stage)


def _softmax_merge(n_outputs: int):
    """Reducer merging per-chunk ``(max, sum exp(x - max), sums...)`` into a row's.

    Exact regrouping of the row reductions (the online-softmax identity): the
    partial exp-sums are rescaled to the common max; the other sums add.
    Identity max is the most negative finite value, as ``te.max``'s is, so an
    all ``-inf`` chunk merges without ``-inf - -inf``.
    """

    def combine(a, b):
        m = tirx.max(a[0], b[0])

        def rescaled(mi, si):
            return tirx.Select(mi == m, si, si * fastmath.exp(mi - m, nonpositive=True))

        return [m, rescaled(a[0], a[1]) + rescaled(b[0], b[1])] + [
            ai + bi for ai, bi in zip(a[2:], b[2:])]

    def identity(*dtypes):
        return [tirx.min_value(dtypes[0])] + [tirx.const(0, t) for t in dtypes[1:]]

    return te.comm_reducer(combine, identity, name=f"softmax_merge{n_outputs}")


_LAST_CHUNK_PEELED = contextvars.ContextVar("ce_tvm_last_chunk_peeled", default=False)


@contextlib.contextmanager
def last_chunk_peeled(peeled: bool = True):
    """Declare computes inside the block for a lowering that peels a row's last
    chunk off its chunk loop (TVM's LoopPartition on ``likely`` conditions,
    ``partition_const_loop``): the overlap test (``ChunkLayout.fresh``) is then
    written so that it vanishes from the other chunks. Otherwise it is one
    compare per element against a per-chunk bound, which costs less where it
    stays in every chunk. The predicate is the same either way."""
    token = _LAST_CHUNK_PEELED.set(peeled)
    try:
        yield
    finally:
        _LAST_CHUNK_PEELED.reset(token)


_ONE_HOT_BY_CHUNK = contextvars.ContextVar("ce_tvm_one_hot_by_chunk", default=False)


@contextlib.contextmanager
def one_hot_by_chunk(by_chunk: bool = True):
    """Declare the training gradient inside the block for a schedule that loops
    over its columns chunk by chunk, with a compiler that takes a loop-invariant
    test out of the loop (LLVM): the one-hot term is then tested per column only
    within the target's chunk, behind a test on the chunk. Otherwise it is one
    compare per column (on CUDA the test on the chunk costs instructions). The
    gradient is the same either way."""
    token = _ONE_HOT_BY_CHUNK.set(by_chunk)
    try:
        yield
    finally:
        _ONE_HOT_BY_CHUNK.reset(token)


@dataclass(frozen=True)
class ChunkLayout:
    """How a row of ``classes`` is cut into ``n_chunks`` chunks of ``chunk``.

    Chunk ``k`` starts at ``min(k * chunk, C - chunk)``: the last chunk ends at
    ``C``, overlapping the one before, so indices stay in the row and every
    chunk is contiguous and full. Its first ``overlap`` entries belong to the
    chunk before; sums count them as 0 (the max may count them twice).
    """

    classes: int
    chunk: int

    @property
    def n_chunks(self) -> int:
        return -(-self.classes // self.chunk)

    @property
    def exact(self) -> bool:
        """True when the chunks tile the row without overlap."""
        return self.classes % self.chunk == 0

    def start(self, k):
        if self.exact:
            return k * _int64(self.chunk)
        return tirx.min(k * _int64(self.chunk), _int64(self.classes - self.chunk))

    def fresh(self, k, j):
        """Whether entry ``j`` of chunk ``k`` is not counted by an earlier chunk:
        every entry of a chunk but the last, the last's from ``overlap`` on."""
        overlap = tirx.const(self.n_chunks * self.chunk - self.classes, "int32")
        not_last = k < _int64(self.n_chunks - 1)
        if _LAST_CHUNK_PEELED.get():  # vanishes from the chunks before the last
            return tirx.any(tirx.likely(not_last), j.astype("int32") >= overlap)
        return j.astype("int32") >= tirx.Select(not_last, tirx.const(0, "int32"), overlap)

    def last_full(self) -> int:
        """Columns ``[0, last_full)`` lie in chunk ``c // chunk`` at offset ``c % chunk``;
        the rest lie in the last chunk, at offset ``c - (C - chunk)``."""
        return self.classes if self.exact else (self.n_chunks - 1) * self.chunk


@dataclass(frozen=True)
class ElementWeights:
    """The weight ``v`` of the row statistics' weighted sums (``_row_stats``).

    ``of(n, c)``: the weight of element ``(n, c)``. ``total``: the ``[1]``
    stage ``ce_wsum`` holding ``sum_c v`` when ``v`` depends on the class only
    (a class weight, ``_class_weights``): one reduction over the classes per
    launch, not one per row. ``None`` when ``v`` depends on the row (a
    probability target's mass): ``sum_c v`` is then a chunk reduction of the
    row (``ce_chunk_wsum``)."""

    of: object  # (n, c) -> v
    total: te.Tensor | None = None


def _class_weights(w) -> ElementWeights | None:
    """A ``[C]`` class weight (or ``None``) as ``_row_stats`` takes it, with its
    row-independent total (``_weight_total``)."""
    return None if w is None else ElementWeights(lambda n, c: w[c], _weight_total(w))


def _weight_total(w) -> te.Tensor:
    """``ce_wsum``: ``sum_c w[c]`` of a ``[C]`` class weight, a ``[1]`` stage."""
    c = te.reduce_axis((_int64(0), w.shape[0]), name="c")
    return te.compute((1,), lambda _: te.sum(w[c], axis=c), name=WSUM)


@dataclass(frozen=True)
class RowStats:
    """Per-row statistics from ``_row_stats`` (``[N]`` tensors), ``weight_sum(n)``
    (``sum_c v``: a stage's value, or ``C`` without a weight), the per-chunk
    maxima ``[N, n_chunks]``, and the kept ``exp(x' - chunk_top)``
    ``[N, n_chunks, chunk]`` when asked for (``x'``: the logit as the loss sees
    it, capped or not; ``chunk_top``: the chunk's max of ``x``, capped: the cap
    is monotone, so no ``tanh`` per element for it)."""

    rowmax: te.Tensor
    expsum: te.Tensor
    wxsum: te.Tensor
    weight_sum: object  # n -> sum_c v[n, c]
    chunk_max: te.Tensor
    chunk_top: object  # (n, k) -> the chunk's largest logit as the loss sees it (capped)
    chunk_exp: te.Tensor | None
    layout: ChunkLayout
    beats: te.Tensor | None = None


def _row_stats(logit: Logits, weights: ElementWeights | None, n_rows, classes: int, acc: str,
               chunk: int | None, keep_exp: bool = False, target=None, shift=None,
               stage: bool = False) -> RowStats:
    """Row statistics of the (capped) logits, reduced chunk by chunk
    (``ChunkLayout``) and merged by ``_softmax_merge``.

    ``weights``: the weight ``v`` of the weighted sums (``sum v x``:
    ``ce_chunk_wxsum``; ``sum v``: ``weights.total``, or per row
    ``ce_chunk_wsum``); ``w[c]`` for class-index targets (``_class_weights``),
    the target mass ``w[c] q'[n, c]`` for probability targets; ``None``: all
    ones (``sum v`` is ``C``). ``shift(n)``: a per-row value the weighted
    sum subtracts from every logit (``sum v (x - shift)``), so that a large
    common offset of the row does not cancel later.

    ``keep_exp``: ``exp(x - chunk_max)`` is a stage of its own
    (``ce_chunk_exp``) that the chunk's exp-sum reduces, so a gradient can
    reuse it instead of evaluating ``exp`` again. ``target``: the per-row
    target index (a function of ``n``); then ``beats[n]`` counts the columns
    that come before the target in ``argmax`` order (a larger logit, or an
    equal one at a smaller index: 0 iff the target is the first maximum),
    from the target's logit ``ce_row_target_logit``.

    ``stage`` (always with softcap): the chunk sums and the chunk max read
    the chunk from ``ce_chunk_logits``, a float32 copy of it (capped: one
    ``tanh`` per element; the max then still reads ``x``, the cap being
    monotone), which a schedule may keep on chip: read from memory once,
    converted once, aligned however the row is.
    """
    x = logit.x
    chunk = classes if chunk is None else min(chunk, classes)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    layout = ChunkLayout(classes, chunk)

    if stage or logit.cap:
        staged = te.compute((n_rows, _int64(layout.n_chunks), _int64(chunk)),
                            lambda n, k, j: logit(n, layout.start(k) + j), name=CHUNK_LOGITS)

        def xf(n, c, k, j):
            return staged[n, k, j]
    else:
        def xf(n, c, k, j):
            return logit(n, c)

    def shifted(n, c, k, j):
        return xf(n, c, k, j) if shift is None else xf(n, c, k, j) - shift(n)

    def per_chunk(stage, reducer, pad, body):
        """``pad``: what an overlapped entry counts as; ``None`` for an idempotent
        reducer (max), which may count it twice."""
        j = te.reduce_axis((_int64(0), _int64(chunk)), name="j")

        def value(n, k):
            term = body(n, layout.start(k) + j, k, j)
            if not layout.exact and pad is not None:
                term = tirx.Select(layout.fresh(k, j), term, pad)
            return reducer(term, axis=j)

        return te.compute((n_rows, _int64(layout.n_chunks)), value, name=stage)

    zero = tirx.const(0.0, acc)
    cmax = per_chunk(CHUNK_MAX, te.max, None,
                     (lambda n, c, k, j: logit.raw(n, c)) if logit.cap else xf)

    def top(n, k):
        return logit.capped(cmax[n, k])

    if keep_exp:
        kept = te.compute(
            (n_rows, _int64(layout.n_chunks), _int64(chunk)),
            lambda n, k, j: fastmath.exp(xf(n, layout.start(k) + j, k, j) - top(n, k),
                                         nonpositive=True, storage=str(x.dtype)),
            name=CHUNK_EXP)
        exp_term = lambda n, c, k, j: kept[n, k, j]  # noqa: E731
    else:
        kept = None
        exp_term = lambda n, c, k, j: fastmath.exp(  # noqa: E731
            xf(n, c, k, j) - top(n, k), nonpositive=True, storage=str(x.dtype))
    parts = [
        cmax,
        per_chunk(CHUNK_EXPSUM, te.sum, zero, exp_term),
        per_chunk(CHUNK_WXSUM, te.sum, zero, lambda n, c, k, j: (
            weights.of(n, c) * shifted(n, c, k, j)) if weights is not None
            else shifted(n, c, k, j)),
    ]
    per_row_wsum = weights is not None and weights.total is None
    if per_row_wsum:
        parts.append(per_chunk(CHUNK_WSUM, te.sum, zero, lambda n, c, k, j: weights.of(n, c)))
    if target is not None:
        one = tirx.const(1.0, acc)
        tl = te.compute((n_rows,), lambda n: logit(n, target(n)), name=ROW_TARGET_LOGIT)

        def beats(n, c, k, j):
            v = xf(n, c, k, j)
            first = tirx.any(v > tl[n], tirx.all(v == tl[n], c < target(n)))
            return tirx.Select(first, one, zero)

        parts.append(per_chunk(CHUNK_BEATS, te.sum, zero, beats))
    k_axis = te.reduce_axis((_int64(0), _int64(layout.n_chunks)), name="k")
    stats = te.compute(
        (n_rows,), lambda n: _softmax_merge(len(parts))(
            (top(n, k_axis), *(p[n, k_axis] for p in parts[1:])), axis=k_axis), name=ROWSTATS)
    if per_row_wsum:
        weight_sum = lambda n: stats[3][n]  # noqa: E731
    elif weights is not None:
        weight_sum = lambda n: weights.total[0]  # noqa: E731
    else:
        weight_sum = lambda n: tirx.const(float(classes), acc)  # noqa: E731
    return RowStats(stats[0], stats[1], stats[2], weight_sum, cmax, top, kept, layout,
                    stats[len(parts) - 1] if target is not None else None)


def _row_hits(n_rows, acc, mask, beats):
    """``ce_row_hit``: 1 where the row counts and its target is the first
    maximal logit, else 0 (token accuracy, SPEC section 5)."""
    one, zero = tirx.const(1.0, acc), tirx.const(0.0, acc)
    return te.compute((n_rows,), lambda n: tirx.Select(
        tirx.all(mask(n) != 0, beats[n] == zero), one, zero), name=ROW_HIT)


def _row_losses(n_rows, classes, acc, eps, s, mask, lse, target_logit, target_weight, wxsum,
                wsum, reduction):
    """The per-row terms of SPEC section 1 from row statistics.

    ``target_logit(n)``/``target_weight(n)``: ``x[n, y[n]]`` and ``w[y[n]]``;
    ``wxsum(n)``: ``sum_c w[c] x[n, c]``; ``wsum(n)``: ``sum_c w[c]``; ``classes``
    is the full C (an expression for a vocabulary shard). Returns the dict
    ``_reduce_forward`` reduces.
    """
    one, zero = tirx.const(1.0, acc), tirx.const(0.0, acc)
    m = te.compute((n_rows,), lambda n: mask(n).astype(acc), name=ROW_MASK)

    def masked(n, value):
        # A select, not a product: an ignored row is exactly 0 even when its logits are NaN.
        return tirx.Select(m[n] != zero, value, zero)

    def nll(n):
        return -target_weight(n) * (target_logit(n) - lse[n])

    def smoothing(n):
        # -sum_c w[c] logp[n, c]; zero, not 0 * inf, when smoothing is off and a
        # logit is -inf (a masked class).
        term = eps / classes * -(wxsum(n) - lse[n] * wsum(n))
        return tirx.Select(eps != zero, term, zero)

    rows = {
        "ce": te.compute((n_rows,), lambda n: masked(n, (one - eps) * nll(n) + smoothing(n)),
                         name=ROW_CE),
        "z": te.compute((n_rows,), lambda n: masked(n, s * lse[n] * lse[n]), name=ROW_Z),
    }
    if reduction == "mean":
        rows["weight"] = te.compute((n_rows,), lambda n: target_weight(n) * m[n],
                                    name=ROW_WEIGHT)
        rows["count"] = m
    return rows


def forward_func(classes: int, dtype: str, variant: Variant,
                 chunk: int | None = None, stage: bool = False) -> tirx.PrimFunc:
    """The fused forward of SPEC section 1 as a PrimFunc.

    A row is reduced in ``ceil(C / chunk)`` chunks of ``chunk`` classes (one
    chunk by default), merged exactly by ``_softmax_merge``: a target-free
    regrouping that lets a schedule keep each chunk on chip between its max
    and its exp-sum. ``stage``: each chunk is first copied to float32
    (``ce_chunk_logits``, see ``_row_stats``).

    Arguments, in order: ``x[N, C]`` (dtype), ``target[N]`` (int64),
    ``weight[C]`` (accumulation dtype, weighted variant only), ``ignore_index``,
    ``label_smoothing``, ``zloss_scale``, ``softcap`` (capped variant only:
    every logit is read as ``t * tanh(x / t)``); outputs ``loss`` and ``zloss``
    (``[N]`` for ``none``, else ``[1]``, dtype), ``lse[N]`` (accumulation
    dtype), ``log_prob[N, C]`` (dtype, log-prob variant only), and
    ``hit[N]`` (accumulation dtype, accuracy variant only: 1 where the row is
    not ignored and its target is its first maximal logit, else 0).
    """
    acc, n_rows, x, y, w = _logits_inputs(classes, dtype, variant.weighted)
    ii, eps, s, *cap = scalars = _scalars(acc, variant.softcap)
    logit = Logits(x, acc, tuple(cap))
    mask, index = _masked_target(y, ii, classes)
    st = _row_stats(logit, _class_weights(w), n_rows, classes, acc, chunk,
                    target=index if variant.accuracy else None, stage=stage)
    rowmax, expsum, wxsum = st.rowmax, st.expsum, st.wxsum
    lse = te.compute((n_rows,), lambda n: rowmax[n] + te.log(expsum[n]), name=LSE)
    rows = _row_losses(
        n_rows, tirx.const(float(classes), acc), acc, eps, s, mask, lse,
        target_logit=lambda n: logit(n, index(n)),
        target_weight=lambda n: w[index(n)] if w is not None else tirx.const(1.0, acc),
        wxsum=lambda n: wxsum[n], wsum=st.weight_sum, reduction=variant.reduction)
    outs = _reduce_forward(rows, n_rows, dtype, variant.reduction).outputs
    args = [x, y] + ([w] if w is not None else []) + list(scalars) + outs + [lse]
    if variant.log_prob:
        log_prob = te.compute(
            (n_rows, _int64(classes)),
            lambda n, c: (logit(n, c) - lse[n]).astype(dtype),
            name=LOG_PROB,
        )
        args.append(log_prob)
    if variant.accuracy:
        args.append(_row_hits(n_rows, acc, mask, st.beats))
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def shard_stats_func(classes: int, dtype: str, variant: Variant,
                     chunk: int | None = None, stage: bool = False) -> tirx.PrimFunc:
    """Per-row statistics of one vocabulary shard ``x[N, C_r]`` (columns
    ``[shard_offset, shard_offset + C_r)`` of the full logits), chunked and
    staged (``stage``) as in ``forward_func``.

    Arguments: ``x``, ``target[N]`` (global class ids), ``weight[C_r]``
    (weighted only), ``shard_offset``, ``softcap`` (capped variant only);
    outputs (accumulation dtype, ``[N]``): the shard's row max,
    ``sum exp(x - max)``, ``sum w x``, and the target's logit and weight
    where the target falls in this shard (0 elsewhere).
    """
    acc, n_rows, x, y, w = _logits_inputs(classes, dtype, variant.weighted)
    offset = te.var("shard_offset", "int64")
    cap = _scalars(acc, variant.softcap)[3:]
    logit = Logits(x, acc, cap)
    st = _row_stats(logit, _class_weights(w), n_rows, classes, acc, chunk, stage=stage)
    rowmax, expsum, wxsum = st.rowmax, st.expsum, st.wxsum
    local = te.compute((n_rows,), lambda n: y[n] - offset, name=SHARD_LOCAL)

    def here(n):
        return tirx.all(local[n] >= _int64(0), local[n] < _int64(classes))

    def clamp(n):
        return tirx.Select(here(n), local[n], _int64(0))

    zero = tirx.const(0.0, acc)
    xt = te.compute((n_rows,), lambda n: tirx.Select(here(n), logit(n, clamp(n)), zero),
                    name=SHARD_TARGET_LOGIT)
    wy = te.compute((n_rows,), lambda n: tirx.Select(
        here(n), w[clamp(n)] if w is not None else tirx.const(1.0, acc), zero),
        name=SHARD_TARGET_WEIGHT)
    args = ([x, y] + ([w] if w is not None else []) + [offset, *cap]
            + [rowmax, expsum, wxsum, xt, wy])
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def shard_combine_func(classes: int, dtype: str, variant: Variant) -> tirx.PrimFunc:
    """The loss from statistics already combined over all shards (SPEC section 1).

    Arguments: ``lse[N]``, ``target_logit[N]``, ``target_weight[N]``,
    ``wxsum[N]`` (accumulation dtype), ``target[N]``, ``weight_sum`` (the
    global ``sum_c w[c]``, or C), ``ignore_index``, ``label_smoothing``,
    ``zloss_scale``; outputs ``loss`` and ``zloss`` as in ``forward_func``.
    ``classes`` is the full C.
    """
    acc = accum_dtype(dtype)
    n_rows = _rows()
    vec = {name: te.placeholder((n_rows,), acc, name=name)
           for name in ("lse", "target_logit", "target_weight", "wxsum")}
    y = te.placeholder((n_rows,), "int64", name="target")
    wsum = te.var("weight_sum", acc)
    ii, eps, s = _scalars(acc)
    mask, _ = _masked_target(y, ii, classes)
    rows = _row_losses(
        n_rows, tirx.const(float(classes), acc), acc, eps, s, mask, vec["lse"],
        target_logit=lambda n: vec["target_logit"][n],
        target_weight=lambda n: vec["target_weight"][n],
        wxsum=lambda n: vec["wxsum"][n], wsum=lambda n: wsum, reduction=variant.reduction)
    outs = _reduce_forward(rows, n_rows, dtype, variant.reduction).outputs
    args = list(vec.values()) + [y, wsum, ii, eps, s] + outs
    return te.create_prim_func(args).with_attr("global_symbol", "main")


_TOTALS = {"ce": TOTAL_CE, "z": TOTAL_Z, "weight": TOTAL_WEIGHT, "count": TOTAL_COUNT}


@dataclass(frozen=True)
class Totals:
    """``outputs``: ``[loss, zloss]``; ``weight``/``count``: the mean's ``D`` and
    ``M`` (``[1]`` stages; ``None`` unless the reduction is ``mean``)."""

    outputs: list
    weight: te.Tensor | None = None
    count: te.Tensor | None = None


def _reduce_forward(rows, n_rows, dtype, reduction) -> Totals:
    """``loss`` and ``zloss`` outputs from the per-row terms (SPEC section 1 table)."""
    ce, z = rows["ce"], rows["z"]
    if reduction == "none":
        loss = te.compute((n_rows,), lambda n: (ce[n] + z[n]).astype(dtype), name=LOSS)
        zloss = te.compute((n_rows,), lambda n: z[n].astype(dtype), name=ZLOSS)
        return Totals([loss, zloss])
    tot = {name: _row_total(_TOTALS[name], term, n_rows) for name, term in rows.items()}
    ce_t, z_t = tot["ce"][0], tot["z"][0]
    if reduction == "mean":
        ce_t, z_t = ce_t / tot["weight"][0], z_t / tot["count"][0]
    loss = te.compute((1,), lambda _: (ce_t + z_t).astype(dtype), name=LOSS)
    zloss = te.compute((1,), lambda _: z_t.astype(dtype), name=ZLOSS)
    return Totals([loss, zloss], tot.get("weight"), tot.get("count"))


def _mean_totals(n_rows, acc, mask, target_weight):
    """``D = sum_n w[y[n]] m[n]`` and ``M = sum_n m[n]``, serial over rows, from
    the targets alone (``ce_total_weight``, ``ce_total_count``)."""
    r1 = te.reduce_axis((_int64(0), n_rows), name="r")
    denom = te.compute(
        (1,), lambda _: te.sum(target_weight(r1) * mask(r1).astype(acc), axis=r1),
        name=TOTAL_WEIGHT)
    r2 = te.reduce_axis((_int64(0), n_rows), name="r")
    count = te.compute(
        (1,), lambda _: te.sum(mask(r2).astype(acc), axis=r2), name=TOTAL_COUNT)
    return denom, count


def _grad_coefficients(n_rows, acc, eps, s, mask, lse, target_weight, total_w, c_full,
                       row_grad, row_zgrad):
    """Per-row coefficients of SPEC section 2: ``(hot, smooth, pscale)`` with
    ``x_grad = p * pscale - [c == y] hot - smooth * w[c]``.

    ``row_grad(n)``/``row_zgrad(n)``: the upstream gradient of row ``n``'s
    loss and z-loss terms, normalisers included; ``total_w(n)``: ``sum_c w[c]``;
    ``c_full``: the number of classes (of the full vocabulary for a shard).
    """
    one, zero = tirx.const(1.0, acc), tirx.const(0.0, acc)

    def row(stage, f):
        return te.compute((n_rows,), f, name=stage)

    m = row(GRAD_MASK, lambda n: mask(n).astype(acc))

    def masked(n, value):
        # An ignored row contributes exactly 0, also when every row is ignored
        # (D = 0 or M = 0 would make SPEC's formula 0/0): PyTorch's behaviour.
        return tirx.Select(m[n] != zero, value, zero)

    hot = row(GRAD_HOT, lambda n: masked(n, row_grad(n) * (one - eps) * target_weight(n)))
    smooth = row(GRAD_SMOOTH, lambda n: masked(n, row_grad(n) * eps / c_full))
    p_scale = row(
        GRAD_PSCALE,
        lambda n: hot[n] + smooth[n] * total_w(n)
        + tirx.Select(s != zero, masked(n, tirx.const(2.0, acc) * s * lse[n] * row_zgrad(n)), zero),
    )
    return hot, smooth, p_scale


def backward_func(classes: int, dtype: str, variant: Variant) -> tirx.PrimFunc:
    """The logits gradient of SPEC section 2 as a PrimFunc.

    Arguments, in order: ``grad_loss[G]`` and ``grad_zloss[G]`` (accumulation
    dtype; ``G = N`` for ``none``, else 1; pass zeros for an absent
    ``grad_zloss``), the source (``log_prob[N, C]``, or ``x[N, C]`` for the
    ``logits`` and ``shard`` sources), ``lse[N]`` (accumulation dtype; only
    read when ``zloss_scale != 0`` or for a logits source), ``target[N]``,
    ``weight[C]`` (weighted only); for the ``shard`` source (``x`` holds
    columns ``[shard_offset, shard_offset + C)`` of the full logits, ``lse``
    is the full row's) also ``target_weight[N]`` (``w[y[n]]`` over the full
    vocabulary), ``shard_offset``, ``weight_sum`` and ``global_classes``;
    then ``ignore_index``, ``label_smoothing``, ``zloss_scale``, and
    ``softcap`` (capped variant with a logits or shard source: the gradient
    is taken through ``t * tanh(x / t)``); output ``x_grad[N, C]`` (dtype).
    """
    acc = accum_dtype(dtype)
    n_rows = _rows()
    g_shape = (n_rows,) if variant.reduction == "none" else (1,)
    g = te.placeholder(g_shape, acc, name="grad_loss")
    gzl = te.placeholder(g_shape, acc, name="grad_zloss")
    src = te.placeholder((n_rows, _int64(classes)), dtype,
                         name="log_prob" if variant.grad_source == "log_prob" else "x")
    lse = te.placeholder((n_rows,), acc, name="lse")
    y = te.placeholder((n_rows,), "int64", name="target")
    w = te.placeholder((_int64(classes),), acc, name="weight") if variant.weighted else None
    if variant.softcap and variant.grad_source == "log_prob":
        raise ValueError("the backward from log_prob (the seed pair) has no softcap")
    ii, eps, s, *cap = scalars = _scalars(acc, variant.softcap)
    logit = Logits(src, acc, tuple(cap))
    mask, index = _masked_target(y, ii, classes)
    one, zero = tirx.const(1.0, acc), tirx.const(0.0, acc)

    def wc(c):
        return w[c] if w is not None else one

    if variant.grad_source == "shard":
        tw = te.placeholder((n_rows,), acc, name="target_weight")
        offset, total_w = te.var("shard_offset", "int64"), te.var("weight_sum", acc)
        c_full = te.var("global_classes", acc)
        shard_args = [tw, offset, total_w, c_full]

        def target_weight(n):
            return tw[n]

        def onehot_index(n):  # -1 (no column) when the target lives in another shard
            local = y[n] - offset
            inside = tirx.all(local >= _int64(0), local < _int64(classes))
            return tirx.Select(inside, local, _int64(-1))
    else:
        shard_args, c_full, onehot_index = [], tirx.const(float(classes), acc), index

        def target_weight(n):
            return wc(index(n))

        if w is not None:
            total_w = _weight_total(w)[0]
        else:
            total_w = tirx.const(float(classes), acc)

    def logp(n, c):
        value = logit(n, c)
        return value if variant.grad_source == "log_prob" else value - lse[n]

    if variant.reduction == "mean":
        denom, count = _mean_totals(n_rows, acc, mask, target_weight)

    def row_grad(n):
        g_n = g[n if variant.reduction == "none" else 0]
        return g_n / denom[0] if variant.reduction == "mean" else g_n

    def row_zgrad(n):
        gi = n if variant.reduction == "none" else 0
        gz = g[gi] + gzl[gi]
        return gz / count[0] if variant.reduction == "mean" else gz

    hot, smooth, p_scale = _grad_coefficients(n_rows, acc, eps, s, mask, lse, target_weight,
                                              lambda n: total_w, c_full, row_grad, row_zgrad)

    def grad(n, c):
        onehot = tirx.Select(_same_class(c, onehot_index(n)), hot[n], zero)
        # x - lse <= 0 for a logits source; a caller's log_prob gets the full clamps.
        p = fastmath.exp(logp(n, c), nonpositive=variant.grad_source != "log_prob",
                         storage=dtype)
        return logit.scaled_by_slope(n, c, p * p_scale[n] - onehot - smooth[n] * wc(c)).astype(
            dtype)

    x_grad = te.compute((n_rows, _int64(classes)), grad, name=X_GRAD)
    args = ([g, gzl, src, lse, y] + ([w] if w is not None else []) + shard_args
            + list(scalars) + [x_grad])
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def train_func(classes: int, dtype: str, variant: Variant,
               chunk: int | None = None) -> tirx.PrimFunc:
    """The forward of SPEC section 1 and, in the same sweep over each row, the
    logits gradient of SPEC section 2 for a unit upstream gradient
    (``grad_loss = 1``, no ``grad_zloss``): what autograd needs in training.

    Per row, chunk by chunk (the layout of ``forward_func``): the chunk max,
    ``e = exp(x - chunk_max)`` kept (``ce_chunk_exp``, float32) and summed;
    after the chunks merge into ``lse``, the gradient reads ``e`` back, scaled
    per chunk by ``exp(chunk_max - lse) * pscale`` (``ce_chunk_pscale``: one
    ``exp`` per chunk, not per element). ``D`` and ``M`` of the mean come
    from the targets alone. ``sum`` and ``mean`` only: ``none`` needs an
    upstream gradient per row, so its gradient waits for the backward.

    Arguments: those of ``forward_func``; outputs (``mean`` only) ``norms[2]``
    = ``(D, M)`` (accumulation dtype), ``x_grad[N, C]`` (dtype, rounded once),
    ``lse[N]``, ``loss`` and ``zloss`` as in ``forward_func``, then (accuracy
    variant) ``hit[N]`` as in ``forward_func``.
    """
    if variant.reduction == "none":
        raise ValueError("train_func needs reduction 'sum' or 'mean'")
    acc, n_rows, x, y, w = _logits_inputs(classes, dtype, variant.weighted)
    ii, eps, s, *cap = scalars = _scalars(acc, variant.softcap)
    logit = Logits(x, acc, tuple(cap))
    mask, index = _masked_target(y, ii, classes)
    one, zero = tirx.const(1.0, acc), tirx.const(0.0, acc)
    st = _row_stats(logit, _class_weights(w), n_rows, classes, acc, chunk, keep_exp=True,
                    target=index if variant.accuracy else None)
    lse = te.compute((n_rows,), lambda n: st.rowmax[n] + te.log(st.expsum[n]), name=LSE)

    def wc(c):
        return w[c] if w is not None else one

    def target_weight(n):
        return wc(index(n))

    rows = _row_losses(
        n_rows, tirx.const(float(classes), acc), acc, eps, s, mask, lse,
        target_logit=lambda n: logit(n, index(n)), target_weight=target_weight,
        wxsum=lambda n: st.wxsum[n], wsum=st.weight_sum, reduction=variant.reduction)
    totals = _reduce_forward(rows, n_rows, dtype, variant.reduction)
    outs = totals.outputs
    if variant.reduction == "mean":
        denom, count = totals.weight, totals.count
        row_grad, row_zgrad = (lambda n: one / denom[0]), (lambda n: one / count[0])
        norms = [te.compute((2,), lambda i: tirx.Select(i == 0, denom[0], count[0]),
                            name=MEAN_NORMS)]
    else:
        row_grad = row_zgrad = lambda n: one
        norms = []
    hot, smooth, p_scale = _grad_coefficients(
        n_rows, acc, eps, s, mask, lse, target_weight, st.weight_sum,
        tirx.const(float(classes), acc), row_grad, row_zgrad)
    lay, kept = st.layout, st.chunk_exp
    chunk_scale = te.compute(
        (n_rows, _int64(lay.n_chunks)),
        lambda n, k: fastmath.exp(st.chunk_top(n, k) - lse[n], nonpositive=True) * p_scale[n],
        name=CHUNK_PSCALE)
    size = _int64(lay.chunk)

    def grad(n, c):
        if lay.exact:
            k, j = tirx.floordiv(c, size), tirx.floormod(c, size)
        else:  # columns past the last full chunk are read from the (overlapping) last one
            tail = c >= _int64(lay.last_full())
            k = tirx.Select(tail, _int64(lay.n_chunks - 1), tirx.floordiv(c, size))
            j = tirx.Select(tail, c - _int64(classes - lay.chunk), tirx.floormod(c, size))
        onehot = tirx.Select(_same_class(c, index(n)), hot[n], zero)
        if _ONE_HOT_BY_CHUNK.get():  # see one_hot_by_chunk
            onehot = tirx.if_then_else(
                tirx.floordiv(c, size) == tirx.floordiv(index(n), size), onehot, zero)
        return logit.scaled_by_slope(
            n, c, kept[n, k, j] * chunk_scale[n, k] - onehot - smooth[n] * wc(c)).astype(dtype)

    x_grad = te.compute((n_rows, _int64(classes)), grad, name=X_GRAD)
    # Outputs in dependence order (the kernel's stages follow them): the mean's
    # D and M before the row sweep, the sweep's x_grad before the sums over rows.
    args = ([x, y] + ([w] if w is not None else []) + list(scalars) + norms + [x_grad, lse]
            + outs)
    if variant.accuracy:
        args.append(_row_hits(n_rows, acc, mask, st.beats))
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def _target_mass(q, w, eps, classes: int, acc: str):
    """``v(n, c) = w[c] q'[n, c]`` with ``q' = (1 - eps) q + eps / C`` (SPEC
    section 5): the weight of ``logp[n, c]`` in a probability target's loss."""
    one, spread = tirx.const(1.0, acc), eps / tirx.const(float(classes), acc)

    def mass(n, c):
        smoothed = (one - eps) * q[n, c].astype(acc) + spread
        return w[c] * smoothed if w is not None else smoothed

    return mass


def prob_forward_func(classes: int, dtype: str, variant: Variant,
                      chunk: int | None = None) -> tirx.PrimFunc:
    """The loss of probability targets (SPEC section 5) as a PrimFunc.

    With the target mass ``v = w q'`` (``_target_mass``) as the per-element
    weight of the row statistics (chunked as in ``forward_func``), a row's
    loss is ``-sum_c v logp = (lse - r) sum_c v - sum_c v (x - r)``
    (``ce_row_ce``), with ``r`` the row's first logit (0 if not finite): no
    cancellation of a large common offset, ``lse - r`` taken as
    ``(rowmax - r) + log(expsum)``. Its z-loss is ``s * lse^2``. Every row
    counts: the mean divides both by ``N`` (the ``ce_row_mask`` of this
    kernel is 1).

    Arguments, in order: ``x[N, C]``, ``target[N, C]`` (dtype),
    ``weight[C]`` (accumulation dtype, weighted variant only),
    ``label_smoothing``, ``zloss_scale``, ``softcap`` (capped variant only:
    ``x`` is read as ``t * tanh(x / t)``); outputs ``loss`` and ``zloss``
    (``[N]`` for ``none``, else ``[1]``, dtype), ``lse[N]`` and
    ``target_mass[N]`` (``sum_c v``; accumulation dtype), which the backward
    takes.
    """
    acc, n_rows, x, q, w = _logits_inputs(classes, dtype, variant.weighted, probs=True)
    _, eps, s, *cap = _scalars(acc, variant.softcap)
    logit = Logits(x, acc, tuple(cap))

    def first_logit(n):  # a value near the row's others, read before the row's reductions
        first = logit(n, _int64(0))
        return tirx.Select(tirx.isfinite(first), first, tirx.const(0.0, acc))

    # a stage of its own for the chunks (whose schedules stage only their chunk of x)
    ref = te.compute((n_rows,), first_logit, name=ROW_REF)
    st = _row_stats(logit, ElementWeights(_target_mass(q, w, eps, classes, acc)), n_rows,
                    classes, acc, chunk, shift=lambda n: ref[n])
    lse = te.compute((n_rows,), lambda n: st.rowmax[n] + te.log(st.expsum[n]), name=LSE)
    mass = te.compute((n_rows,), st.weight_sum, name=ROW_MASS)
    every = te.compute((n_rows,), lambda n: tirx.const(1.0, acc), name=ROW_MASK)
    rows = {
        "ce": te.compute((n_rows,), lambda n: (
            (st.rowmax[n] - first_logit(n)) + te.log(st.expsum[n])) * st.weight_sum(n)
            - st.wxsum[n],
            name=ROW_CE),
        "z": te.compute((n_rows,), lambda n: s * lse[n] * lse[n], name=ROW_Z),
    }
    if variant.reduction == "mean":
        rows["weight"] = rows["count"] = every
    outs = _reduce_forward(rows, n_rows, dtype, variant.reduction).outputs
    args = [x, q] + ([w] if w is not None else []) + [eps, s, *cap] + outs + [lse, mass]
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def _prob_row_grad(g, n_rows, reduction: str, acc: str):
    """``ce_grad_smooth``: each row's upstream gradient ``r[n]`` (``g[n]`` for
    ``none``; ``g``, divided by ``N`` for ``mean``)."""
    def row_grad(n):
        if reduction == "none":
            return g[n]
        return g[0] / n_rows.astype(acc) if reduction == "mean" else g[0]

    return te.compute((n_rows,), row_grad, name=GRAD_SMOOTH)


def _grad_input(n_rows, acc: str, reduction: str):
    """The ``grad_loss`` placeholder: ``[N]`` for ``none``, else ``[1]``."""
    return te.placeholder((n_rows,) if reduction == "none" else (1,), acc, name="grad_loss")


def prob_backward_func(classes: int, dtype: str, variant: Variant) -> tirx.PrimFunc:
    """The logits gradient of probability targets (SPEC section 5) as a PrimFunc:
    ``x_grad = r (sum_c v + 2 s lse) p - r v`` with ``v`` the target mass and
    ``r`` the upstream gradient of the row (divided by ``N`` for ``mean``).

    Arguments, in order: ``grad_loss[G]`` (accumulation dtype; ``G = N`` for
    ``none``, else 1), ``x[N, C]``, ``target[N, C]`` (dtype), ``lse[N]``,
    ``target_mass[N]`` (accumulation dtype; the forward's), ``weight[C]``
    (weighted only), ``label_smoothing``, ``zloss_scale``, ``softcap``
    (capped variant only: the gradient is taken through ``t * tanh(x / t)``);
    output ``x_grad[N, C]`` (dtype).
    """
    acc, n_rows, x, q, w = _logits_inputs(classes, dtype, variant.weighted, probs=True)
    g = _grad_input(n_rows, acc, variant.reduction)
    lse = te.placeholder((n_rows,), acc, name="lse")
    total = te.placeholder((n_rows,), acc, name="target_mass")
    _, eps, s, *cap = _scalars(acc, variant.softcap)
    logit = Logits(x, acc, tuple(cap))
    mass = _target_mass(q, w, eps, classes, acc)
    zero, two = tirx.const(0.0, acc), tirx.const(2.0, acc)
    coef = _prob_row_grad(g, n_rows, variant.reduction, acc)
    p_scale = te.compute(
        (n_rows,), lambda n: coef[n] * total[n]
        + tirx.Select(s != zero, two * s * lse[n] * coef[n], zero), name=GRAD_PSCALE)

    def grad(n, c):
        p = fastmath.exp(logit(n, c) - lse[n], nonpositive=True, storage=dtype)
        return logit.scaled_by_slope(n, c, p * p_scale[n] - coef[n] * mass(n, c)).astype(dtype)

    x_grad = te.compute((n_rows, _int64(classes)), grad, name=X_GRAD)
    args = [g, x, q, lse, total] + ([w] if w is not None else []) + [eps, s, *cap, x_grad]
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def prob_target_grad_func(classes: int, dtype: str, variant: Variant) -> tirx.PrimFunc:
    """The gradient of the probability-target loss with respect to the targets:
    ``target_grad = -r (1 - eps) w[c] (x - lse)`` (``r`` as in
    ``prob_backward_func``; ``x`` capped in the capped variant).

    Arguments, in order: ``grad_loss[G]``, ``x[N, C]`` (dtype), ``lse[N]``,
    ``weight[C]`` (weighted only), ``label_smoothing``, ``softcap`` (capped
    variant only); output ``target_grad[N, C]`` (dtype).
    """
    acc, n_rows, x, _, w = _logits_inputs(classes, dtype, variant.weighted, probs=True)
    g = _grad_input(n_rows, acc, variant.reduction)
    lse = te.placeholder((n_rows,), acc, name="lse")
    _, eps, _, *cap = _scalars(acc, variant.softcap)
    logit = Logits(x, acc, tuple(cap))
    coef = _prob_row_grad(g, n_rows, variant.reduction, acc)
    one = tirx.const(1.0, acc)

    def grad(n, c):
        scale = coef[n] * (one - eps) * (w[c] if w is not None else one)
        return (-scale * (logit(n, c) - lse[n])).astype(dtype)

    target_grad = te.compute((n_rows, _int64(classes)), grad, name=TARGET_GRAD)
    args = [g, x, lse] + ([w] if w is not None else []) + [eps, *cap, target_grad]
    return te.create_prim_func(args).with_attr("global_symbol", "main")
