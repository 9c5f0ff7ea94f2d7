"""The divergence between a student's and a teacher's next-token distributions
(docs/spec.md, section 15), and the student logits' gradient, per row.

``p = softmax(z_s)``, ``q = softmax(z_t)`` with ``z = cap(x) / T`` on either
side (``Logits``: each side its own cap, a variant, and its own inverse
temperature, a scalar argument: a logit scale folds into both, as
``LossOptions.kernel_softcap``/``kernel_temperature`` do). The direction is
the variant's ``divergence`` (TRL's ``beta``):

- ``fkl`` (beta 0): ``KL(q || p) = sum q (log q - log p)``, gradient ``p - q``;
- ``rkl`` (beta 1): ``KL(p || q) = sum p (log p - log q) = K``, gradient
  ``p (log p - log q - K)``;
- ``jsd`` (0 < beta < 1): with ``m = (1 - beta) p + beta q``,
  ``beta KL(q || m) + (1 - beta) KL(p || m)``; with ``K = KL(p || m)`` its
  gradient is ``(1 - beta) p (log p - log m - K)`` (the ``q / m`` terms of
  ``d/dp`` cancel against the ``p / m`` ones).

Every log-prob is ``z - max z - log(expsum)`` (nothing large cancels); a term
whose probability is 0 is 0 (``0 log 0``).
"""

from __future__ import annotations

from tvm import te, tirx

from . import fastmath
from .common import Logits, int64, symbolic_rows
from .kinds import Variant, accum_dtype
from .stages import (
    KL_AUX,
    KL_S_EXPSUM,
    KL_S_MAX,
    KL_S_PLOGIT,
    KL_T_EXPSUM,
    KL_T_MAX,
    KL_T_PART,
    ROW_DIVERGENCE,
    ROW_ENTROPY,
    X_GRAD,
)


def divergence_func(classes: int, dtype: str, variant: Variant) -> tirx.PrimFunc:
    """Per row: the divergence, the student's entropy and, unless
    ``variant.reduction == "none"``, the student logits' gradient of
    ``sum_n g[n] divergence[n]``.

    Arguments, in order: ``student[N, C]``, ``teacher[N, C]`` (dtype),
    ``g[N]`` (accumulation dtype; read only with the gradient), ``beta``,
    the student's and the teacher's inverse temperature, the student's
    softcap (``softcap`` variant), the teacher's (``teacher_softcap``);
    outputs ``divergence[N]``, ``entropy[N]`` (accumulation dtype) and
    ``x_grad[N, C]`` (dtype; may be the student buffer itself: each logit is
    read before its gradient is written in its place).
    """
    if variant.divergence not in ("fkl", "rkl", "jsd"):
        raise ValueError(f"a divergence kernel needs a direction, got {variant.divergence!r}")
    acc = accum_dtype(dtype)
    n_rows = symbolic_rows()
    cols = int64(classes)
    xs = te.placeholder((n_rows, cols), dtype, name="student")
    xt = te.placeholder((n_rows, cols), dtype, name="teacher")
    g = te.placeholder((n_rows,), acc, name="g")
    beta = te.var("beta", acc)
    inv_s, inv_t = te.var("inv_temperature_s", acc), te.var("inv_temperature_t", acc)
    cap_s = (te.var("softcap_s", acc),) if variant.softcap else ()
    cap_t = (te.var("softcap_t", acc),) if variant.teacher_softcap else ()
    ls, lt = Logits(xs, acc, cap_s, (inv_s,)), Logits(xt, acc, cap_t, (inv_t,))
    zero, one = tirx.const(0.0, acc), tirx.const(1.0, acc)

    def reduce_axis():
        return te.reduce_axis((int64(0), cols), name="c")

    def row_max(logit, name):  # before cap and temperature (both monotone)
        c = reduce_axis()
        return te.compute((n_rows,), lambda n: te.max(logit.raw(n, c), axis=c), name=name)

    ms, mt = row_max(ls, KL_S_MAX), row_max(lt, KL_T_MAX)

    def shifted(logit, top):  # z - max z, <= 0
        return lambda n, c: logit.scaled(logit.capped(logit.raw(n, c)) - logit.capped(top[n]))

    zs, zt = shifted(ls, ms), shifted(lt, mt)

    def expsum(z, name):
        c = reduce_axis()
        return te.compute((n_rows,), lambda n: te.sum(
            fastmath.exp(z(n, c), nonpositive=True), axis=c), name=name)

    ss, st = expsum(zs, KL_S_EXPSUM), expsum(zt, KL_T_EXPSUM)

    def logp(n, c):
        return zs(n, c) - te.log(ss[n])

    def logq(n, c):
        return zt(n, c) - te.log(st[n])

    def prob(lp):
        return fastmath.exp(lp, nonpositive=True)

    # The log names its argument ~70 times, each naming both sides' exp, softcap
    # and logits: bound once by a Let (a capped fp32 kernel builds in 2 s, not
    # minutes). Not for half inputs: TVM 0.27's bfloat16 legalisation then reads
    # the bound loads wrongly (silently) and the vectoriser refuses the Let.
    bind = dtype == "float32"

    def log_mix(n, c):  # log((1 - beta) p + beta q), read only where p > 0 or q > 0
        return fastmath.log((one - beta) * prob(logp(n, c)) + beta * prob(logq(n, c)), bind)

    def term(weight_log, other_log):  # w (log w - log o); 0 where w = 0
        w = prob(weight_log)
        return tirx.Select(w == zero, zero, w * (weight_log - other_log))

    def row_sum(f, name):
        c = reduce_axis()
        return te.compute((n_rows,), lambda n: te.sum(f(n, c), axis=c), name=name)

    plogit = row_sum(lambda n, c: prob(logp(n, c)) * zs(n, c), KL_S_PLOGIT)
    entropy = te.compute((n_rows,), lambda n: te.log(ss[n]) - plogit[n], name=ROW_ENTROPY)
    kind = variant.divergence
    if kind == "fkl":
        part = row_sum(lambda n, c: term(logq(n, c), logp(n, c)), KL_T_PART)
        div = te.compute((n_rows,), lambda n: part[n], name=ROW_DIVERGENCE)
    elif kind == "rkl":
        aux = row_sum(lambda n, c: term(logp(n, c), logq(n, c)), KL_AUX)
        div = te.compute((n_rows,), lambda n: aux[n], name=ROW_DIVERGENCE)
    else:
        aux = row_sum(lambda n, c: term(logp(n, c), log_mix(n, c)), KL_AUX)
        part = row_sum(lambda n, c: term(logq(n, c), log_mix(n, c)), KL_T_PART)
        div = te.compute((n_rows,), lambda n: beta * part[n] + (one - beta) * aux[n],
                         name=ROW_DIVERGENCE)
    outputs = [div, entropy]
    if variant.reduction != "none":
        def grad(n, c):
            p = prob(logp(n, c))
            if kind == "fkl":
                dz = p - prob(logq(n, c))
            elif kind == "rkl":
                dz = tirx.Select(p == zero, zero, p * (logp(n, c) - logq(n, c) - aux[n]))
            else:
                dz = tirx.Select(p == zero, zero,
                                 (one - beta) * p * (logp(n, c) - log_mix(n, c) - aux[n]))
            return ls.scaled_by_slope(n, c, g[n] * dz).astype(dtype)

        outputs.append(te.compute((n_rows, cols), grad, name=X_GRAD))
    return te.create_prim_func([xs, xt, g, beta, inv_s, inv_t, *cap_s, *cap_t,
                                *outputs]).with_attr("global_symbol", "main")
