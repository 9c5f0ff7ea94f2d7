"""Building blocks every kernel family shares: the inputs and scalar
arguments, the logits as the loss sees them (``Logits``), the ignore mask
and the class index of a target (``masked_target``), how a row is cut into
chunks (``ChunkLayout``), the weights of the weighted sums
(``ElementWeights``) and the row statistics (``RowStats``, ``row_stats``:
max, exp-sum and the other row reductions, chunk by chunk, merged by
``softmax_merge``). What the kernels compute from the statistics (loss
terms, sums over rows, gradient coefficients) is in ``loss_terms``. Stage
names are in ``stages``; ``N`` is a symbolic int64 variable, ``C`` a constant.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import te, tirx

from . import fastmath
from .choices import last_chunk_peeled
from .kinds import accum_dtype
from .stages import (
    CHUNK_BEATS,
    CHUNK_EXP,
    CHUNK_EXPSUM,
    CHUNK_FIRST,
    CHUNK_LOGITS,
    CHUNK_MAX,
    CHUNK_SQSUM,
    CHUNK_WSUM,
    CHUNK_WXSUM,
    CHUNK_ZSUM,
    LANE_STATS,
    LANES_EXPSUM,
    LANES_MAX,
    LANES_VALUES,
    LOGITS,
    ROW_SHIFT,
    ROW_TARGET_LOGIT,
    ROWSTATS,
    WSUM,
)

# How far a row's max may lie above its shift (``row_stats``' ``row_shift``):
# every term of its exp-sum is then at most e**64, and a row of up to 2**24
# classes sums to below float32's largest (3.4e38).
ROW_SHIFT_RANGE = 64.0


def matrix_param(func: tirx.PrimFunc):
    """The ``[N, C]`` input of a declared function (``x``, or ``log_prob``)."""
    return next(p for p in func.params if len(getattr(p, "shape", ())) == 2)


def symbolic_rows():
    return te.var("N", "int64")


def logits_inputs(classes: int, dtype: str, weighted: bool, probs: bool = False):
    """``(acc, N, x[N, C], target, weight[C] or None)``: the inputs of the
    kernels that read the logits; ``target`` is ``[N]`` int64 class indices,
    or with ``probs`` ``[N, C]`` probabilities in the logits' dtype."""
    acc = accum_dtype(dtype)
    n_rows = symbolic_rows()
    x = te.placeholder((n_rows, int64(classes)), dtype, name=LOGITS)
    if probs:
        y = te.placeholder((n_rows, int64(classes)), dtype, name="target")
    else:
        y = te.placeholder((n_rows,), "int64", name="target")
    w = te.placeholder((int64(classes),), acc, name="weight") if weighted else None
    return acc, n_rows, x, y, w


def int64(v: int):
    return tirx.IntImm("int64", v)


def scalar_args(acc: str, variant=None) -> tuple:
    """The scalar arguments: ``ignore_index``, ``label_smoothing``,
    ``zloss_scale``, then ``softcap`` for a capped ``variant`` and
    ``inv_temperature`` for a tempered one (``loss_logits`` reads them)."""
    return (
        te.var("ignore_index", "int64"),
        te.var("label_smoothing", acc),
        te.var("zloss_scale", acc),
    ) + ((te.var("softcap", acc),) if variant is not None and variant.softcap else ()) + (
        (te.var("inv_temperature", acc),) if variant is not None and variant.tempered else ())


@dataclass(frozen=True)
class Logits:
    """The logits ``x[N, C]`` as the loss sees them, in the accumulation dtype:
    ``t * tanh(x / t)`` when ``cap`` holds the ``softcap`` argument ``t``
    (docs/spec.md, section 4), else ``x`` itself (no ``tanh`` in the kernel); then
    times ``1 / T`` when ``scale`` holds the inverse temperature argument
    (docs/spec.md, section 4: the cap first, then the temperature)."""

    x: te.Tensor
    acc: str
    cap: tuple = ()  # () or (softcap,)
    scale: tuple = ()  # () or (inverse temperature,)

    def __call__(self, n, c):
        """``z[n, c]``: the logit capped, then scaled."""
        return self.scaled(self.capped(self.raw(n, c)))

    def raw(self, n, c):
        """``x[n, c]`` itself, uncapped."""
        return self.x[n, c].astype(self.acc)

    def capped(self, value):
        """``value`` (an uncapped logit, or a maximum of some: the cap is
        monotone, so it commutes with ``max``) capped, before the temperature."""
        if not self.cap:
            return value
        t = self.cap[0]
        return t * fastmath.tanh(value * (tirx.const(1.0, self.acc) / t))

    def scaled(self, value):
        """``value`` (a capped logit, or a difference of some) times ``1 / T``.
        Differences are scaled after they are taken: ``(x - max) / T`` is exact
        where ``x / T - max / T`` would round both terms at a large offset."""
        return value * self.scale[0] if self.scale else value

    def scaled_by_slope(self, n, c, grad):
        """``grad`` (with respect to the logit as the loss sees it) times its
        slope ``d x' / d x``: ``1 - tanh(x / t)^2`` when capped, times ``1 / T``
        when scaled; ``grad`` itself when neither."""
        if self.scale:
            grad = grad * self.scale[0]
        if not self.cap:
            return grad
        one = tirx.const(1.0, self.acc)
        th = fastmath.tanh(self.x[n, c].astype(self.acc) * (one / self.cap[0]))
        return grad * (one - th * th)


def loss_logits(x, acc: str, variant, scalars: tuple) -> Logits:
    """``x`` as a loss kernel reads it, from the arguments ``scalar_args`` gave:
    capped by ``softcap`` (capped variant), scaled by ``inv_temperature``
    (tempered variant)."""
    rest = list(scalars[3:])
    cap = (rest.pop(0),) if variant.softcap else ()
    return Logits(x, acc, cap, tuple(rest))


def masked_target(y, ii, classes: int):
    """Ignore mask ``m`` and a target index that is always in ``[0, C)``.

    The index of an ignored or (never validated) out-of-range target is 0, so
    the kernel can never read outside its row whatever the caller passes.
    """

    def mask(n):
        return (y[n] != ii).astype("int32")

    def index(n):
        inside = tirx.all(y[n] >= int64(0), y[n] < int64(classes))
        return tirx.Select(inside, y[n], int64(0))

    return mask, index


def same_class(c, index):
    """``c == index`` for a column and a per-row class index, compared in int32
    (C < 2**31): a vector of int32 lanes instead of int64 ones built by shuffles."""
    return c.astype("int32") == index.astype("int32")


# "No column": the identity of ``ce_chunk_first`` and of its merge (int32, as the
# column is compared: C < 2**31).
NO_COLUMN = 2**31 - 1


def softmax_merge(n_outputs: int, entropy: bool = False, scale: tuple = (),
                  stats: bool = False, top: bool = False):
    """Reducer merging per-chunk ``(max, sum exp(x - max), sums...)`` into a row's.

    Exact regrouping of the row reductions (the online-softmax identity): the
    partial exp-sums are rescaled to the common max; the other sums add.
    Identity max is the most negative finite value, as ``te.max``'s is, so an
    all ``-inf`` chunk merges without ``-inf - -inf``.

    ``entropy``: the third value is ``A = sum exp(x - max) (max - x)`` of
    ``row_stats(entropy=True)``, which moves with the max: rescaled to the
    common max ``m`` it is ``exp(mi - m) (Ai + (m - mi) Si)``, every term
    ``>= 0`` (no cancellation), 0 for an empty part.

    ``scale``: ``()``, or ``(1 / T,)`` when the maxima are of the logits before
    the temperature (``Logits.scaled``) and the sums of the scaled ones.

    ``stats``: the last three values are ``row_stats(stats=True)``'s
    ``sum exp(x - max)^2`` (rescaled by the square of the exp-sum's factor),
    ``sum x`` (adds) and the first column holding the max (the smaller of the
    parts' whose max is the common one; ``NO_COLUMN`` for none).

    ``top``: the last value is a maximum of its own (``row_stats``' row shift:
    the parts' first values are then all the shift, and this the row's max).
    """

    def combine(a, b):
        m = tirx.max(a[0], b[0])
        ta, tb = (merged_terms(v, m, entropy, scale, stats) for v in (a, b))
        merged = [ai + bi for ai, bi in zip(ta, tb)]
        if stats:
            merged[-1] = tirx.min(ta[-1], tb[-1])
        if top:
            merged[-1] = tirx.max(ta[-1], tb[-1])
        return [m] + merged

    def identity(*dtypes):
        values = [tirx.min_value(dtypes[0])] + [tirx.const(0, t) for t in dtypes[1:]]
        if stats:
            values[-1] = tirx.const(NO_COLUMN, dtypes[-1])
        if top:
            values[-1] = tirx.min_value(dtypes[-1])
        return values

    return te.comm_reducer(combine, identity,
                           name=f"softmax_merge{n_outputs}{'e' if entropy else ''}"
                                f"{'t' if scale else ''}{'s' if stats else ''}"
                                f"{'m' if top else ''}")


def merged_terms(v, m, entropy: bool, scale: tuple, stats: bool) -> list:
    """What a part ``v = (max, sum exp(x - max), ...)`` of ``softmax_merge`` adds to
    the merged values after the max, rescaled to the common max ``m >= v[0]``
    (``softmax_merge``'s arguments): the merged value is the sum of the parts'
    terms, the first column's (the last with ``stats``) their minimum."""
    mi = v[0]

    def scaled(d):
        return d * scale[0] if scale else d

    def factor():
        return fastmath.exp(scaled(mi - m), nonpositive=True)

    terms = [tirx.Select(mi == m, v[1], v[1] * factor())] + list(v[2:])
    if entropy:
        zero = tirx.const(0.0, str(v[1].ty))
        moved = factor() * (v[2] + scaled(m - mi) * v[1])
        terms[1] = tirx.Select(mi == m, v[2], tirx.Select(v[1] == zero, zero, moved))
    if stats:
        f = factor()
        terms[-3] = tirx.Select(mi == m, v[-3], v[-3] * f * f)
        terms[-1] = tirx.Select(mi == m, v[-1], tirx.const(NO_COLUMN, str(v[-1].ty)))
    return terms


@dataclass(frozen=True)
class ChunkLayout:
    """How a row of ``classes`` is cut into ``n_chunks`` chunks of ``chunk``.

    Chunk ``k`` starts at ``min(k * chunk, C - chunk)``: the last chunk ends at
    ``C``, overlapping the one before, so indices stay in the row and every
    chunk is contiguous and full. Its first ``overlap`` entries belong to the
    chunk before; sums count them as 0 (the max may count them twice).

    ``lanes`` (``row_stats``): the chunks are dealt round-robin to that many
    partial merges, over ``slots`` chunk positions (``n_chunks`` rounded up to
    a multiple of ``lanes``); a position past the row reads its last chunk
    again, and no lane merges it.
    """

    classes: int
    chunk: int
    lanes: int = 0

    @property
    def n_chunks(self) -> int:
        return -(-self.classes // self.chunk)

    @property
    def slots(self) -> int:
        return -(-self.n_chunks // self.lanes) * self.lanes if self.lanes else self.n_chunks

    @property
    def exact(self) -> bool:
        """True when the chunks tile the row without overlap."""
        return self.classes % self.chunk == 0

    def start(self, k):
        if self.exact and self.slots == self.n_chunks:
            return k * int64(self.chunk)
        return tirx.min(k * int64(self.chunk), int64(self.classes - self.chunk))

    def fresh(self, k, j):
        """Whether entry ``j`` of chunk ``k`` is not counted by an earlier chunk:
        every entry of a chunk but the last, the last's from ``overlap`` on."""
        overlap = tirx.const(self.n_chunks * self.chunk - self.classes, "int32")
        not_last = k < int64(self.n_chunks - 1)
        if last_chunk_peeled.get():  # vanishes from the chunks before the last
            return tirx.any(tirx.likely(not_last), j.astype("int32") >= overlap)
        return j.astype("int32") >= tirx.Select(not_last, tirx.const(0, "int32"), overlap)

    def last_full(self) -> int:
        """Columns ``[0, last_full)`` lie in chunk ``c // chunk`` at offset ``c % chunk``;
        the rest lie in the last chunk, at offset ``c - (C - chunk)``."""
        return self.classes if self.exact else (self.n_chunks - 1) * self.chunk


@dataclass(frozen=True)
class ElementWeights:
    """The weight ``v`` of the row statistics' weighted sums (``row_stats``).

    ``of(n, c)``: the weight of element ``(n, c)``. ``total``: the ``[1]``
    stage ``ce_wsum`` holding ``sum_c v`` when ``v`` depends on the class only
    (a class weight, ``class_weights``): one reduction over the classes per
    launch, not one per row. ``None`` when ``v`` depends on the row (a
    probability target's mass): ``sum_c v`` is then a chunk reduction of the
    row (``ce_chunk_wsum``)."""

    of: object  # (n, c) -> v
    total: te.Tensor | None = None


def class_weights(w) -> ElementWeights | None:
    """A ``[C]`` class weight (or ``None``) as ``row_stats`` takes it, with its
    row-independent total (``weight_total``)."""
    return None if w is None else ElementWeights(lambda n, c: w[c], weight_total(w))


def weight_total(w) -> te.Tensor:
    """``ce_wsum``: ``sum_c w[c]`` of a ``[C]`` class weight, a ``[1]`` stage."""
    c = te.reduce_axis((int64(0), w.shape[0]), name="c")
    return te.compute((1,), lambda _: te.sum(w[c], axis=c), name=WSUM)


@dataclass(frozen=True)
class RowStats:
    """Per-row statistics from ``row_stats`` (``[N]`` tensors), ``weight_sum(n)``
    (``sum_c v``: a stage's value, or ``C`` without a weight), the per-chunk
    maxima ``[N, n_chunks]``, and the kept ``exp(x' - chunk_top)``
    ``[N, n_chunks, chunk]`` when asked for (``x'``: the logit as the loss sees
    it, capped or not; ``chunk_top``: the chunk's max of ``x``, capped: the cap
    is monotone, so no ``tanh`` per element for it).

    With a temperature (``Logits.scale``) ``rowmax`` is the max before it
    (``lse = rowmax / T + log(expsum)``); ``chunk_top`` and the sums are of
    the scaled logits."""

    rowmax: te.Tensor
    expsum: te.Tensor
    wxsum: te.Tensor | None  # with ``entropy``: ``A`` merged to the row max
    weight_sum: object  # n -> sum_c v[n, c]
    chunk_max: te.Tensor
    chunk_top: object  # (n, k) -> the chunk's largest logit as the loss sees it (capped)
    chunk_exp: te.Tensor | None
    layout: ChunkLayout
    beats: te.Tensor | None = None
    sqsum: te.Tensor | None = None  # with ``stats``: ``sum exp(z - rowmax')^2``
    zsum: te.Tensor | None = None  # with ``stats``: ``sum_c x'`` (before the temperature)
    first: te.Tensor | None = None  # with ``stats``: the row's first argmax (int32)
    top: te.Tensor | None = None  # with ``row_shift``: the row's max (``rowmax`` the shift)

    def lse(self, n, logit: Logits):
        """Row ``n``'s log-sum-exp of the logits as the loss sees them
        (``+inf`` as ``log_expsum``)."""
        return logit.scaled(self.rowmax[n]) + self.log_expsum(n, logit)

    def log_expsum(self, n, logit: Logits):
        """``log(expsum[n])``; with ``row_stats``' ``row_shift``, ``+inf`` where
        the row's max lies more than ``ROW_SHIFT_RANGE`` above its shift (its
        exp-sum may have overflowed: the caller computes the row again)."""
        value = te.log(self.expsum[n])
        if self.top is None:
            return value
        acc = str(self.top.dtype)
        exceeded = logit.scaled(self.top[n] - self.rowmax[n]) > tirx.const(ROW_SHIFT_RANGE, acc)
        return tirx.Select(exceeded, tirx.const(float("inf"), acc), value)


def row_stats(logit: Logits, weights: ElementWeights | None, n_rows, classes: int, acc: str,
               chunk: int | None, keep_exp: bool = False, target=None, shift=None,
               stage: bool = False, entropy: bool = False, stats: bool = False,
               lanes: int = 0, weighted_sum: bool = True, row_shift: bool = False) -> RowStats:
    """Row statistics of the (capped) logits, reduced chunk by chunk
    (``ChunkLayout``) and merged by ``softmax_merge``.

    ``weights``: the weight ``v`` of the weighted sums (``sum v x``:
    ``ce_chunk_wxsum``; ``sum v``: ``weights.total``, or per row
    ``ce_chunk_wsum``); ``w[c]`` for class-index targets (``class_weights``),
    the target mass ``w[c] q'[n, c]`` for probability targets; ``None``: all
    ones (``sum v`` is ``C``). ``shift(n)``: a per-row value the weighted
    sum subtracts from every logit (``sum v (x - shift)``), so that a large
    common offset of the row does not cancel later.
    ``weighted_sum`` off (a loss without label smoothing, the only reader of
    ``sum v x`` and ``sum v``): neither is declared, ``wxsum`` is ``None``.

    ``keep_exp``: ``exp(x - chunk_max)`` is a stage of its own
    (``ce_chunk_exp``) that the chunk's exp-sum reduces, so a gradient can
    reuse it instead of evaluating ``exp`` again. ``target``: the per-row
    target index (a function of ``n``); then ``beats[n]`` counts the columns
    that come before the target in ``argmax`` order (a larger logit, or an
    equal one at a smaller index: 0 iff the target is the first maximum),
    from the target's logit ``ce_row_target_logit``.

    ``entropy`` (no ``weights``): the weighted sum is instead
    ``A = sum exp(x - top) (top - x)`` per chunk (``top``: the chunk's max),
    merged to the row's max (``softmax_merge``), so that the entropy is
    ``log(expsum) + A / expsum`` with no cancellation however large the
    logits; a term whose ``exp`` is 0 (``x = -inf``) is 0.

    ``stats``: three more chunk reductions over the same chunk, merged with
    the others: ``sum e^2`` of the chunk's ``e = exp(z - top)``
    (``ce_chunk_sqsum``: ``log sum p^2`` is ``log(sqsum) - 2 log(expsum)``,
    both sums of terms in ``[0, 1]`` with a 1 at the max, so nothing cancels
    at a large offset), ``sum x'`` (``ce_chunk_zsum``, before the
    temperature) and the smallest column whose logit equals the chunk's max
    (``ce_chunk_first``, compared exactly with the max of the same values;
    merged, the row's first argmax, ``NO_COLUMN`` when no logit is above the
    most negative finite value, e.g. a row of ``-inf``).

    ``stage`` (always with softcap): the chunk sums and the chunk max read
    the chunk from ``ce_chunk_logits``, a float32 copy of it (capped: one
    ``tanh`` per element; the max then still reads ``x``, the cap being
    monotone), which a schedule may keep on chip: read from memory once,
    converted once, aligned however the row is.

    ``row_shift`` (not with ``stage``, ``shift``, ``target``, ``entropy``,
    ``stats`` or ``lanes``): every chunk's exp-sum (and kept ``exp``) is taken
    against one shift per row, the max of its first chunk (``ce_row_shift``, a
    subset's max: never above the row's), so that it needs no chunk max before
    it and a schedule may sweep a chunk once for both; ``rowmax`` and every
    ``chunk_top`` are then the shift, ``expsum`` the row's sum against it, and
    ``top`` the row's max. The sum is right while ``top`` is at most
    ``ROW_SHIFT_RANGE`` above the shift (temperature applied), which
    ``RowStats.log_expsum`` tests. (``entropy``'s ``A`` against the shift
    would have terms of both signs, and the entropy would cancel the gap
    ``top - shift``: on a confident row, float32 rounding of that gap in
    place of an entropy near 0.)

    ``lanes``: the chunks are merged in ``lanes``
    round-robin partial merges first (``ce_lanestats``: lane ``t`` merges
    chunks ``t``, ``t + lanes``, ...), then across the lanes
    (``lane_merged``): a schedule gives each lane a thread, which merges its
    chunks alone, and the threads meet once per row in plain max, sum and min
    reductions. ``rowmax``/``expsum``/``wxsum`` and the other merged values
    are then stages of their own (``ce_lanes_*``).
    """
    x = logit.x
    chunk = classes if chunk is None else min(chunk, classes)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    layout = ChunkLayout(classes, chunk, lanes)

    if stage or logit.cap:
        staged = te.compute((n_rows, int64(layout.slots), int64(chunk)),
                            lambda n, k, j: logit.capped(logit.raw(n, layout.start(k) + j)),
                            name=CHUNK_LOGITS)

        def xf(n, c, k, j):
            return staged[n, k, j]
    else:
        def xf(n, c, k, j):
            return logit.raw(n, c)

    # xf and top are before the temperature, which scales their differences
    def shifted(n, c, k, j):
        z = logit.scaled(xf(n, c, k, j))
        return z if shift is None else z - shift(n)

    def per_chunk(stage, reducer, pad, body):
        """``pad``: what an overlapped entry counts as; ``None`` for an idempotent
        reducer (max), which may count it twice."""
        j = te.reduce_axis((int64(0), int64(chunk)), name="j")

        def value(n, k):
            term = body(n, layout.start(k) + j, k, j)
            if not layout.exact and pad is not None:
                term = tirx.Select(layout.fresh(k, j), term, pad)
            return reducer(term, axis=j)

        return te.compute((n_rows, int64(layout.slots)), value, name=stage)

    zero = tirx.const(0.0, acc)
    max_read = (lambda n, c, k, j: logit.raw(n, c)) if logit.cap else xf
    cmax = per_chunk(CHUNK_MAX, te.max, None, max_read)

    if row_shift:
        if stage or logit.cap or shift is not None or target is not None or \
                entropy or stats or lanes:
            raise ValueError("row_shift takes a plain row: no stage, cap, shift, target, "
                             "entropy, statistics or lanes")
        j0 = te.reduce_axis((int64(0), int64(chunk)), name="j")
        first = te.compute((n_rows,), lambda n: te.max(logit.raw(n, j0), axis=j0),
                           name=ROW_SHIFT)

        def top(n, k):
            return first[n]
    else:
        def top(n, k):
            return logit.capped(cmax[n, k])

    if keep_exp:
        kept = te.compute(
            (n_rows, int64(layout.slots), int64(chunk)),
            lambda n, k, j: fastmath.exp(logit.scaled(xf(n, layout.start(k) + j, k, j) - top(n, k)),
                                         nonpositive=True, storage=str(x.dtype)),
            name=CHUNK_EXP)
        exp_term = lambda n, c, k, j: kept[n, k, j]  # noqa: E731
    else:
        kept = None
        exp_term = lambda n, c, k, j: fastmath.exp(  # noqa: E731
            logit.scaled(xf(n, c, k, j) - top(n, k)), nonpositive=True, storage=str(x.dtype))

    def weighted(n, c, k, j):
        if entropy:
            # e (top - x)' as -(e max(s, lowest)), s = (x - top)' the exp's own
            # argument (computed once): a masked class (x = -inf, e = 0) adds 0,
            # not 0 * inf, with no branch.
            s = logit.scaled(xf(n, c, k, j) - top(n, k))
            return -(exp_term(n, c, k, j) * tirx.max(s, tirx.min_value(acc)))
        if weights is not None:
            return weights.of(n, c) * shifted(n, c, k, j)
        return shifted(n, c, k, j)

    parts = [cmax, per_chunk(CHUNK_EXPSUM, te.sum, zero, exp_term)]
    if weighted_sum:
        parts.append(per_chunk(CHUNK_WXSUM, te.sum, zero, weighted))
    per_row_wsum = weighted_sum and weights is not None and weights.total is None
    if per_row_wsum:
        parts.append(per_chunk(CHUNK_WSUM, te.sum, zero, lambda n, c, k, j: weights.of(n, c)))
    if target is not None:
        one = tirx.const(1.0, acc)
        tl = te.compute((n_rows,), lambda n: logit.capped(logit.raw(n, target(n))),
                        name=ROW_TARGET_LOGIT)

        def beats(n, c, k, j):
            v = xf(n, c, k, j)
            first = tirx.any(v > tl[n], tirx.all(v == tl[n], c < target(n)))
            return tirx.Select(first, one, zero)

        parts.append(per_chunk(CHUNK_BEATS, te.sum, zero, beats))
    n_before_stats = len(parts)
    if stats:
        none = tirx.const(NO_COLUMN, "int32")

        def squared(n, c, k, j):
            e = exp_term(n, c, k, j)
            return e * e

        def first(n, c, k, j):
            return tirx.Select(max_read(n, c, k, j) == cmax[n, k], c.astype("int32"), none)

        parts += [per_chunk(CHUNK_SQSUM, te.sum, zero, squared),
                  per_chunk(CHUNK_ZSUM, te.sum, zero, xf),
                  per_chunk(CHUNK_FIRST, te.min, None, first)]
    if row_shift:  # the chunks' maxima, merged last by max
        parts.append(cmax)
    if lanes:
        merged = lane_merged(parts, top, layout, n_rows, entropy, logit.scale, stats)
    else:
        k_axis = te.reduce_axis((int64(0), int64(layout.n_chunks)), name="k")
        merged = te.compute(
            (n_rows,), lambda n: softmax_merge(len(parts), entropy, logit.scale, stats,
                                               row_shift)(
                (top(n, k_axis), *(p[n, k_axis] for p in parts[1:])), axis=k_axis),
            name=ROWSTATS)
    if per_row_wsum:
        weight_sum = lambda n: merged[3][n]  # noqa: E731
    elif weights is not None:
        weight_sum = lambda n: weights.total[0]  # noqa: E731
    else:
        weight_sum = lambda n: tirx.const(float(classes), acc)  # noqa: E731
    extra = merged[n_before_stats:] if stats else (None, None, None)
    return RowStats(merged[0], merged[1], merged[2] if weighted_sum else None, weight_sum, cmax,
                    lambda n, k: logit.scaled(top(n, k)), kept, layout,
                    merged[n_before_stats - 1] if target is not None else None, *extra,
                    top=merged[-1] if row_shift else None)


def _expr(value):
    """A TE tensor element (``TensorSlice``) as the expression it reads."""
    return value.asobject() if isinstance(value, te.TensorSlice) else value


def lane_merged(parts: list, top, layout: ChunkLayout, n_rows, entropy: bool, scale: tuple,
                stats: bool) -> list:
    """``row_stats``' merge over ``layout.lanes`` lanes: per lane, ``softmax_merge``
    of its chunks (``ce_lanestats[n, t]``; a chunk position past the row merges
    as the identity); then the row's max of the lanes' maxima
    (``ce_lanes_max``) and each other value as the lanes' ``merged_terms``
    relative to it, summed (the first column: their minimum):
    ``ce_lanes_expsum``, then ``LANES_VALUES``. The same values as merging
    the chunks in order; returns them in ``parts``' order."""
    if len(parts) - 2 > len(LANES_VALUES):
        raise ValueError(f"lane_merged: at most {len(LANES_VALUES) + 2} merged values")
    lanes = int64(layout.lanes)
    i = te.reduce_axis((int64(0), int64(layout.slots // layout.lanes)), name="i")
    merge = softmax_merge(len(parts), entropy, scale, stats)

    identity = [tirx.min_value(parts[0].dtype)] + [tirx.const(0, p.dtype) for p in parts[1:]]
    if stats:
        identity[-1] = tirx.const(NO_COLUMN, parts[-1].dtype)

    def lane(n, t):
        k = i * lanes + t
        inside = k < int64(layout.n_chunks)
        values = [top(n, k)] + [p[n, k] for p in parts[1:]]
        return merge([tirx.Select(inside, _expr(v), e) for v, e in zip(values, identity)],
                     axis=i)

    per_lane = te.compute((n_rows, lanes), lane, name=LANE_STATS)

    def across(name, value, reducer=te.sum):
        t = te.reduce_axis((int64(0), lanes), name="t")
        return te.compute((n_rows,), lambda n: reducer(value(n, t), axis=t), name=name)

    rowmax = across(LANES_MAX, lambda n, t: per_lane[0][n, t], te.max)

    def term(j):
        def value(n, t):
            lane_values = [_expr(p[n, t]) for p in per_lane]
            return merged_terms(lane_values, rowmax[n], entropy, scale, stats)[j - 1]
        return value

    def reducer(j):
        return te.min if stats and j == len(parts) - 1 else te.sum

    return [rowmax] + [across(name, term(j), reducer(j)) for j, name in
                       zip(range(1, len(parts)), (LANES_EXPSUM, *LANES_VALUES))]
