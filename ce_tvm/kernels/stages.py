"""Stage names: the contract between the compute and the schedules.


Nothing here knows about targets, schedules or torch. Every stage has a stable
name, exported below as a constant (``CHUNK_MAX = "ce_chunk_max"``, ...; all of
them in ``STAGES``); those constants are the contract schedules look blocks up
by:

forward (``forward_func``), per row ``n`` of ``x[N, C]``, the row cut into
chunks ``k`` of ``chunk`` classes:

=====================  =====================================================
``ce_chunk_max``       ``max_j x[n, kB + j]`` (uncapped: the cap is monotone)
``ce_chunk_expsum``    ``sum_j exp(x[n, kB + j] - chunk_max[n, k])``
``ce_chunk_wxsum``     ``sum_j w[kB + j] x[n, kB + j]`` (not without smoothing)
``ce_wsum``            ``sum_c w[c]``, once for all rows (weighted only)
``ce_rowstats``        the chunks merged: row max, exp-sum, sum w x
``ce_lanestats``       with lanes: the chunks ``t``, ``t + L``, ... merged (``[N, L]``)
``ce_lanes_*``         with lanes: the lanes merged (``max``, ``expsum``, ``v2``...),
                       in place of ``ce_rowstats``
``ce_row_shift``       with a row shift (``choices.row_shift``): the first
                       chunk's max, what every chunk's exp-sum is taken against
``lse``                ``rowmax + log(expsum)`` (output, accumulation dtype)
``ce_row_mask``        ``m[n]``
``ce_row_ce``          ``ce[n]`` (nll and smoothing terms of docs/spec.md, section 2)
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
coefficients for a unit upstream gradient, without ``ce_grad_smooth`` and
``b`` where the kernel has no label smoothing, plus):

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

probability targets (``prob_forward_func``, ``prob_backward_func``;
docs/spec.md, section 5) reuse the forward's and backward's stages with the target mass
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

per-token log-probs and entropy (``log_probs_func``, ``log_probs_grad_func``;
docs/spec.md, section 9; every read of a logit is ``z = cap(x) / T``, the inverse
temperature a scalar argument) reuse the forward's chunk stages with
``ce_chunk_exp`` kept for the chunk's two sums, ``ce_chunk_wxsum`` being
``A = sum_j e (chunk_max - z)`` (merged to the row max by ``ce_rowstats``),
and the backward's ``ce_grad_pscale``, plus:

=====================  =====================================================
``row_max``            the row's max before the temperature (output)
``log_expsum``         ``log(expsum)`` (output)
``entropy``            ``H[n] = log(expsum) + A / expsum`` (output)
``logp``               ``(x'[n, i[n, k]] - row_max) / T - log_expsum``, 0 where
                       the index is ``ignore_index`` (output ``[N, K]``)
``ce_grad_pscale``     ``G[n] = sum_k g[n, k]`` over the live indices
``x_grad``             output ``p (h (-log p - H) - G) + sum_k g [c = i_k]``,
                       times the logit's slope
=====================  =====================================================

and, in the stats variant (``Variant.stats``), three more chunk reductions
merged by ``ce_rowstats`` and three more outputs:

=====================  =====================================================
``ce_chunk_sqsum``     ``sum_j e^2`` (``e`` the kept ``exp(z - chunk_max)``),
                       merged with the square of the exp-sum's rescale
``ce_chunk_zsum``      ``sum_j x'`` (the capped logits before the temperature)
``ce_chunk_first``     the smallest column of the chunk holding its max
                       (int32; the row's first argmax once merged)
``log_sum_sq_probs``   ``log(sum p^2) = log(sqsum) - 2 log(expsum)`` (output)
``mean_logits``        ``zsum / T / C`` (output)
``is_top1``            ``i[n, k]`` is live and the row's first argmax (output
                       ``[N, K]``, uint8)
=====================  =====================================================

student-teacher divergence (``divergence_func``; docs/spec.md, section 15;
``p`` the student's softmax, ``q`` the teacher's, both of ``z = cap(x) / T``):

=====================  =====================================================
``kl_student_max``     the student row's max logit (before cap and temperature)
``kl_teacher_max``     the teacher row's
``kl_student_expsum``  ``sum exp(z_s - max z_s)``
``kl_teacher_expsum``  ``sum exp(z_t - max z_t)``
``kl_student_plogit``  ``sum p (z_s - max z_s)`` (the entropy's)
``kl_aux``             ``sum p (log p - log m)``: the gradient's row term
                       (``m = q`` reverse KL, the mixture for the JSD)
``kl_teacher_part``    ``sum q (log q - log m)`` (``m = p`` forward KL)
``divergence``         output ``[N]``: the row's divergence
``entropy``            output ``[N]``: the student's entropy
``x_grad``             output: the student logits' gradient times ``g[n]``
=====================  =====================================================

``N`` is a symbolic int64 variable, so one compiled module serves every batch
size; ``C`` is a compile-time constant. ``ignore_index``, ``label_smoothing``
and ``zloss_scale`` are scalar kernel arguments.
"""

# Stage names (see the tables above).
CHUNK_MAX = "ce_chunk_max"
CHUNK_EXPSUM = "ce_chunk_expsum"
CHUNK_WXSUM = "ce_chunk_wxsum"
CHUNK_WSUM = "ce_chunk_wsum"
ROWSTATS = "ce_rowstats"
LANE_STATS = "ce_lanestats"
LANES_MAX = "ce_lanes_max"
LANES_EXPSUM = "ce_lanes_expsum"
# the other merged values, in row_stats' order (wxsum or the entropy's sum, then
# the accuracy's count, or the log-prob statistics' three)
LANES_VALUES = ("ce_lanes_v2", "ce_lanes_v3", "ce_lanes_v4", "ce_lanes_v5")
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
ROW_SHIFT = "ce_row_shift"
TARGET_GRAD = "target_grad"
CHUNK_LOGITS = "ce_chunk_logits"
ROW_MAX = "row_max"
ROW_LOG_EXPSUM = "log_expsum"
ROW_ENTROPY = "entropy"
TOKEN_LOGP = "logp"
CHUNK_SQSUM = "ce_chunk_sqsum"
CHUNK_ZSUM = "ce_chunk_zsum"
CHUNK_FIRST = "ce_chunk_first"
ROW_LOG_SUM_SQ = "log_sum_sq_probs"
ROW_MEAN_LOGITS = "mean_logits"
TOKEN_TOP1 = "is_top1"
KL_S_MAX = "kl_student_max"
KL_T_MAX = "kl_teacher_max"
KL_S_EXPSUM = "kl_student_expsum"
KL_T_EXPSUM = "kl_teacher_expsum"
KL_S_PLOGIT = "kl_student_plogit"
KL_AUX = "kl_aux"
KL_T_PART = "kl_teacher_part"
ROW_DIVERGENCE = "divergence"
LOGITS = "x"  # the input logits
STAGES = (CHUNK_MAX, CHUNK_EXPSUM, CHUNK_WXSUM, CHUNK_WSUM, ROWSTATS, LANE_STATS, LANES_MAX,
          LANES_EXPSUM, *LANES_VALUES, LSE, ROW_MASK, ROW_CE,
          ROW_Z, ROW_WEIGHT, LOG_PROB, TOTAL_CE, TOTAL_Z, TOTAL_WEIGHT, TOTAL_COUNT, LOSS, ZLOSS,
          WSUM, GRAD_MASK, GRAD_HOT, GRAD_SMOOTH, GRAD_PSCALE, X_GRAD, SHARD_LOCAL,
          SHARD_TARGET_LOGIT, SHARD_TARGET_WEIGHT, CHUNK_EXP, CHUNK_PSCALE, MEAN_NORMS,
          ROW_TARGET_LOGIT, CHUNK_BEATS, ROW_HIT, ROW_MASS, TARGET_GRAD, ROW_REF, ROW_SHIFT,
          CHUNK_LOGITS, ROW_MAX, ROW_LOG_EXPSUM, ROW_ENTROPY, TOKEN_LOGP, CHUNK_SQSUM,
          CHUNK_ZSUM, CHUNK_FIRST, ROW_LOG_SUM_SQ, ROW_MEAN_LOGITS, TOKEN_TOP1,
          KL_S_MAX, KL_T_MAX, KL_S_EXPSUM, KL_T_EXPSUM, KL_S_PLOGIT, KL_AUX, KL_T_PART,
          ROW_DIVERGENCE)
