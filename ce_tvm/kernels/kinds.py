"""What a kernel is declared for, without TVM: storage dtypes, reductions and
the compile-time ``Variant`` (``ce_tvm.kernels`` builds the stages from them;
the runtime names kernels with them)."""

from __future__ import annotations

from dataclasses import dataclass

REDUCTIONS = ("none", "sum", "mean")
# Storage dtypes and their sizes in bytes (the one table of them).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
DTYPES = tuple(DTYPE_BYTES)
# The divergence kernels' directions: KL(teacher || student), KL(student || teacher)
# and the generalized JSD of TRL's ``beta`` strictly inside (0, 1).
DIVERGENCES = ("fkl", "rkl", "jsd")
# The ops with kernels without label smoothing (``Variant.smoothing`` off).
SMOOTHING_OPS = ("forward", "train", "shard_stats")


# A CUDA kernel's scratch (per-row terms and sums over rows, passed between its
# launches) comes from the caller, allocated by torch on the caller's stream,
# never from TVM's per-thread workspace pool (not ordered with torch's streams,
# not safe under CUDA-graph replay): after its documented arguments every CUDA
# kernel takes CUDA_SCRATCH_ROWS ``[N]`` and then CUDA_SCRATCH_SINGLES ``[1]``
# buffers in the accumulation dtype, of which it uses what it needs.
CUDA_SCRATCH_ROWS = 3
CUDA_SCRATCH_SINGLES = 4


def accum_dtype(dtype: str) -> str:
    """Arithmetic dtype for a storage dtype: float64 stays, all others use float32."""
    return "float64" if dtype == "float64" else "float32"


@dataclass(frozen=True)
class Variant:
    """The options that change the loop nest (everything else is a runtime argument).

    ``grad_source`` only matters for the backward: ``"log_prob"`` reads the
    seed API's ``log_prob``; ``"logits"`` recomputes it as ``x - lse``;
    ``"shard"`` does that for one vocabulary shard, with the row statistics
    of the full vocabulary passed in.

    ``softcap``: the logits are capped, ``t * tanh(x / t)`` with ``t`` a scalar
    argument (docs/spec.md, section 4); without it the kernel has no ``tanh`` at all.
    ``accuracy``: the forward and training kernels also write, per row,
    whether the target is the row's first maximal logit (token accuracy).
    ``tempered``: the logits are divided by a temperature ``T``, its inverse a
    scalar argument after ``softcap`` (docs/spec.md, section 4); without it the kernel
    has no such multiply. ``columns``: the log-prob kernels' ``K``, the class indices per row
    (``index[N, K]``); 0 for the loss kernels. ``stats``: the log-prob forward also
    reduces, in the same sweep, ``log sum p^2``, the mean logit of every row and
    whether each index is its row's first argmax (docs/spec.md, section 9).
    ``divergence``: the student-teacher divergence kernels' direction
    (``DIVERGENCES``: forward KL, reverse KL, generalized JSD; "" for the
    others); there ``softcap`` caps the student's logits, ``teacher_softcap``
    the teacher's, and ``reduction`` ``"none"`` writes no gradient
    (docs/spec.md, section 15). ``wide_loss``: the loss kernels (forward,
    training, probability targets, the shards' combine) write ``loss`` and
    ``zloss`` in the accumulation dtype instead of the storage dtype (the
    ``loss_dtype=torch.float32`` of docs/spec.md, section 7); off, the kernels are
    exactly those without the field (names, keys and tuning records unchanged).
    ``smoothing``: the forward and training kernels compute label smoothing's
    terms, ``eps`` a scalar argument (0 allowed). Off (the runtime's choice
    for ``eps = 0``, most calls), they declare neither the terms nor the
    per-row sums they read (``sum_c w[c] x[n, c]``: a vector add per element
    in the chunk sweep) and ignore the argument, which they still take (a
    vocabulary shard's statistics, which take no ``eps``, then have no
    ``wxsum`` output). On, the kernels are exactly those without the field;
    the ops other than ``SMOOTHING_OPS`` always have it on.
    ``entropy``: the log-prob forward also reduces the entropy's sum and
    writes the entropy. Off (the runtime's choice for a call that returns no
    entropy: a gradient never flows to it), it does neither; on, the kernels
    are exactly those without the field. The statistics variant keeps it on.
    """

    reduction: str = "mean"
    weighted: bool = False
    log_prob: bool = True
    grad_source: str = "log_prob"
    softcap: bool = False
    accuracy: bool = False
    tempered: bool = False
    columns: int = 0
    stats: bool = False
    divergence: str = ""
    teacher_softcap: bool = False
    wide_loss: bool = False
    smoothing: bool = True
    entropy: bool = True

    def __post_init__(self):
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.grad_source not in ("log_prob", "logits", "shard"):
            raise ValueError(
                f"grad_source must be 'log_prob', 'logits' or 'shard', got {self.grad_source!r}")
        if self.divergence not in ("", *DIVERGENCES):
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")

    def shifts_rows(self) -> bool:
        """Whether this forward may take its rows against a shift, where its
        schedule asks (``choices.row_shift``): a loss kernel without
        ``log_prob``, accuracy or a softcap (what a training step runs, with
        label smoothing or without); a log-prob kernel (``columns``) without a softcap, the
        statistics or the entropy (whose sum would cancel the gap between the
        row's max and its shift). Its ``lse`` (a log-prob kernel's
        ``log_expsum``) is then ``+inf`` for a row whose max lies too far above
        its first chunk's (``row_stats``' ``row_shift``); the caller computes
        such a row again exactly, as it does a row that is not finite."""
        if self.columns:
            return not (self.softcap or self.stats or self.entropy)
        return not (self.log_prob or self.accuracy or self.softcap)

    def tag(self) -> str:
        """A short string naming the variant (used in cache keys and file names)."""
        return "-".join(
            [self.reduction, "w" if self.weighted else "nw", "lp" if self.log_prob else "nolp",
             *(["sc"] if self.softcap else []), *(["t"] if self.tempered else []),
             *(["acc"] if self.accuracy else []),
             *([f"k{self.columns}"] if self.columns else []), *(["st"] if self.stats else []),
             *([self.divergence] if self.divergence else []),
             *(["tsc"] if self.teacher_softcap else []),
             *(["wl"] if self.wide_loss else []),
             *([] if self.smoothing else ["ns"]),
             *([] if self.entropy else ["nh"]),
             self.grad_source]
        )
