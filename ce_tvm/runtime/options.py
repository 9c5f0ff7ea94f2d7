"""The losses' runtime scalars as validated values (docs/spec.md, section 11): all
options in one module.

Everything a loss does that is not a compile-time variant travels as one
``LossOptions`` (cross-entropy, the fused heads, log-probs) or ``DivergenceOptions``
(distillation), from the Python surface through ``ce_tvm.runtime.launch`` to the
kernels' scalar arguments; changing any of them never recompiles. Every number is
checked by one rule (``real``: any ``numbers.Real`` but ``bool``, NumPy scalars
included, never NaN).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import InitVar, dataclass

from ..kernels.kinds import REDUCTIONS, Variant


@dataclass(frozen=True)
class LossOptions:
    """``reduction`` (``none``, ``sum`` or ``mean``), ``ignore_index`` (an int),
    ``label_smoothing`` in ``[0, 1)``, the z-loss scale ``zloss_scale``
    (finite, ``>= 0``; the ``s`` of ``s * lse^2``), ``softcap`` (finite,
    ``>= 0``; the ``t`` of ``t * tanh(x / t)``; 0 is off), ``temperature``
    (finite, ``> 0``) and ``logit_scale`` (finite, ``> 0``; a model family's
    multiplier): every part of the loss is computed on ``z = cap(s x) / T``
    (docs/spec.md, section 4). ``wide_loss``: the loss and z-loss are written in
    the accumulation dtype (float32 for 16-bit logits; ``loss_dtype=torch.float32``,
    read by ``losses.checks.wide_loss``), not rounded to the logits' dtype.

    Constructing one checks every field, in that order, and raises
    ``TypeError``/``ValueError`` saying what was expected; ``zloss_name`` is the
    name the caller's API gives the z-loss scale, for those messages.
    """

    reduction: str = "mean"
    ignore_index: int = -100
    label_smoothing: float = 0.0
    zloss_scale: float = 0.0
    softcap: float = 0.0
    temperature: float = 1.0
    logit_scale: float = 1.0
    wide_loss: bool = False
    zloss_name: InitVar[str] = "lse_square_scale"

    def __post_init__(self, zloss_name: str):
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        ii = self.ignore_index
        if type(ii) is not int:  # the common case skips the (slower) ABC checks
            if isinstance(ii, bool) or not isinstance(ii, numbers.Integral):
                raise TypeError(f"ignore_index must be an int, got {type(ii).__name__}")
            object.__setattr__(self, "ignore_index", int(ii))
        eps = real(self.label_smoothing, "label_smoothing")
        if not 0.0 <= eps < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {eps}")
        s = real(self.zloss_scale, zloss_name)
        if s < 0.0 or s == math.inf:
            raise ValueError(f"{zloss_name} must be finite and >= 0, got {s}")
        t = real(self.softcap, "softcap")
        if t < 0.0 or t == math.inf:
            raise ValueError(f"softcap must be finite and >= 0 (0 turns it off), got {t}")
        temp = real(self.temperature, "temperature")
        if not 0.0 < temp < math.inf:
            raise ValueError(f"temperature must be finite and > 0, got {temp}")
        object.__setattr__(self, "label_smoothing", eps)
        object.__setattr__(self, "zloss_scale", s)
        object.__setattr__(self, "softcap", t)
        scale = real(self.logit_scale, "logit_scale")
        if not 0.0 < scale < math.inf:
            raise ValueError(f"logit_scale must be finite and > 0, got {scale}")
        object.__setattr__(self, "temperature", temp)
        object.__setattr__(self, "logit_scale", scale)

    @classmethod
    def from_schema(cls, reduction, ignore_index, label_smoothing, lse_square_scale, softcap,
                    temperature, wide_loss: bool = False) -> LossOptions:
        """The ops' schema scalars (primitive, the logit scale already folded into
        the softcap and the temperature: ``schema_scalars``) as one ``LossOptions``."""
        return cls(reduction=reduction, ignore_index=ignore_index,
                   label_smoothing=label_smoothing, zloss_scale=lse_square_scale,
                   softcap=softcap, temperature=temperature, wide_loss=bool(wide_loss))

    def schema_scalars(self) -> dict:
        """The options by the names of the ops' schema, the logit scale folded into
        the softcap and the temperature (``from_schema`` reads them back)."""
        return dict(reduction=self.reduction, ignore_index=self.ignore_index,
                    label_smoothing=self.label_smoothing, lse_square_scale=self.zloss_scale,
                    softcap=self.kernel_softcap, temperature=self.kernel_temperature,
                    wide_loss=self.wide_loss)

    # The distribution is softmax(cap_t(s x) / T), and cap_t(s x) = s cap_{t/s}(x): the
    # kernels take the scale folded into the softcap and the temperature, so a scale
    # is no kernel of its own (s = 1: the same numbers, names and keys as without it).
    @property
    def kernel_softcap(self) -> float:
        """The softcap the kernels apply to the unscaled logits: ``t / s``."""
        return self.softcap / self.logit_scale

    @property
    def kernel_temperature(self) -> float:
        """The temperature the kernels divide the capped logits by: ``T / s``."""
        return self.temperature / self.logit_scale


def real(v, name: str) -> float:
    """``v`` as a float: any real number but a ``bool`` (NumPy scalars included),
    never NaN; else ``TypeError``/``ValueError`` naming ``name``."""
    if type(v) is not float and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    v = float(v)
    # Comparisons, not math.isnan/isinf: under torch.compile(dynamic=True) a
    # default argument may arrive as a symbolic float, which they refuse.
    if v != v:
        raise ValueError(f"{name} must not be NaN")
    return v


DIVERGENCE_KINDS = {0.0: "fkl", 1.0: "rkl"}  # TRL's beta at its ends; the JSD in between


@dataclass(frozen=True)
class DivergenceOptions:
    """The divergence kernels' runtime scalars and variant: ``kind`` (``fkl``,
    ``rkl``, ``jsd``; ``kinds.DIVERGENCES``), ``beta``, and per side the cap
    and the inverse temperature with the logit scale folded in
    (``cap(s x) / T = s cap_{t / s}(x) / T``: ``softcap`` ``t / s``, inverse
    temperature ``s / T``). The fields are the ops' schema scalars; ``checked``
    builds one from the user's options."""

    kind: str
    beta: float
    student_softcap: float
    student_inv_temperature: float
    teacher_softcap: float
    teacher_inv_temperature: float

    def op_scalars(self) -> tuple:
        """The fields in order, as the ops take them: ``dataclasses.astuple`` without its
        deep copy, which ``torch.compile(fullgraph=True)`` cannot trace in torch 2.9."""
        return (self.kind, self.beta, self.student_softcap, self.student_inv_temperature,
                self.teacher_softcap, self.teacher_inv_temperature)

    @classmethod
    def checked(cls, *, beta, temperature, student_logit_scale, teacher_logit_scale,
                student_softcap, teacher_softcap) -> DivergenceOptions:
        """Every option checked (``TypeError``/``ValueError`` saying what was
        expected): ``beta`` in ``[0, 1]`` (0: forward KL, 1: reverse KL, else the
        generalized JSD), ``temperature`` finite and ``> 0``, logit scales finite and
        ``> 0``, softcaps finite and ``>= 0`` (0: off)."""
        beta = real(beta, "beta")
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), "
                             f"got {beta}")
        temp = real(temperature, "temperature")
        if not 0.0 < temp < math.inf:
            raise ValueError(f"temperature must be finite and > 0, got {temp}")
        sides = []
        for side, scale, cap in (("student", student_logit_scale, student_softcap),
                                 ("teacher", teacher_logit_scale, teacher_softcap)):
            scale = real(scale, f"{side}_logit_scale")
            cap = real(cap, f"{side}_softcap")
            if not 0.0 < scale < math.inf:
                raise ValueError(f"{side}_logit_scale must be finite and > 0, got {scale}")
            if not 0.0 <= cap < math.inf:
                raise ValueError(f"{side}_softcap must be finite and >= 0 (0 turns it off), "
                                 f"got {cap}")
            sides += [cap / scale, scale / temp]
        return cls(DIVERGENCE_KINDS.get(beta, "jsd"), beta, *sides)

    def variant(self, grad: bool) -> Variant:
        return Variant("sum" if grad else "none", divergence=self.kind,
                       softcap=self.student_softcap != 0.0,
                       teacher_softcap=self.teacher_softcap != 0.0)

    def scalars(self) -> tuple:
        return (self.beta, self.student_inv_temperature, self.teacher_inv_temperature,
                *((self.student_softcap,) if self.student_softcap != 0.0 else ()),
                *((self.teacher_softcap,) if self.teacher_softcap != 0.0 else ()))
