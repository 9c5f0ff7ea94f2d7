"""The student-teacher divergence (``ce_tvm.linear_distillation_loss``,
``ce_tvm.distillation_loss``; docs/distillation.md): values and the student's
gradients against a float64 reference from whole logits (torch autograd), for
TRL's three directions (beta 0, 1/2, 1), two temperatures, logit scales and
softcaps on either side, masked positions, float32 and bfloat16; equality with
TRL 1.16's ``generalized_jsd_loss`` and ``ChunkedDivergenceFunction``; TRL's
``DistillationTrainer`` and ``GKDTrainer`` with and without
``ce_tvm.integrations.trl.apply()``;
the errors. One vocabulary (``V``, not a multiple of the vector width's
power-of-two tiles) so kernels compile once per variant."""

import pytest
import torch

import ce_tvm
from support import DISTILL_TOL as TOL
from support import logits_reference

V, H, HT = 1000, 24, 40  # the teacher is wider than the student: only V must align


def reference(xs, Ws, bs, xt, Wt, bt, kept, *, beta, temperature=1.0, student_logit_scale=1.0,
              teacher_logit_scale=1.0, student_softcap=0.0, teacher_softcap=0.0):
    """``(per-row divergence, per-row entropy)`` in float64 from whole logits, as
    TRL's ``generalized_jsd_loss`` defines them (0 where not ``kept``)."""
    def logits(x, W, b, scale):
        return (x.double() @ W.double().t() + (0 if b is None else b.double())) * scale

    return logits_reference(logits(xs, Ws, bs, student_logit_scale),
                            logits(xt, Wt, bt, teacher_logit_scale), kept, beta=beta,
                            temperature=temperature, student_softcap=student_softcap,
                            teacher_softcap=teacher_softcap)


def heads(n, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    xs, Ws = r(n, H), r(V, H, scale=0.5)
    xt, Wt = r(n, HT), r(V, HT, scale=0.4)
    bs, bt = (r(V), r(V)) if bias else (None, None)
    y = torch.randint(0, V, (n,), generator=g)
    y[::4] = -100
    return xs, Ws, bs, xt, Wt, bt, y


SIDES = {
    "plain": {},
    "student": dict(student_logit_scale=0.7, student_softcap=6.0),
    "teacher": dict(teacher_logit_scale=1.3, teacher_softcap=4.0),
}


def _check_once(dtype, beta, temperature, side, reduction="mean", chunk_rows=16):
    xs, Ws, bs, xt, Wt, bt, y = heads(37, dtype)
    kw = dict(beta=beta, temperature=temperature, **SIDES[side])
    leaves = [t.clone().requires_grad_() for t in (xs, Ws, bs)]
    loss, ent = ce_tvm.linear_distillation_loss(
        leaves[0], leaves[1], xt, Wt, y, student_bias=leaves[2], teacher_bias=bt,
        reduction=reduction, return_entropy=True, chunk_rows=chunk_rows, **kw)
    upstream = torch.linspace(0.5, 1.5, 37) if reduction == "none" else torch.tensor(1.0)
    (loss * upstream).sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (xs, Ws, bs)]
    kept = (y != -100).double()
    div, ref_ent = reference(ref_leaves[0], ref_leaves[1], ref_leaves[2], xt, Wt, bt, kept, **kw)
    ref = {"none": div, "sum": div.sum(), "mean": div.sum() / kept.sum()}[reduction]
    (ref * upstream.double()).sum().backward()
    tol = TOL[dtype]
    torch.testing.assert_close(loss.double(), ref, **tol)
    torch.testing.assert_close(ent.double(), ref_ent, **tol)
    for mine, theirs in zip(leaves, ref_leaves):
        scale = theirs.grad.abs().max()
        torch.testing.assert_close(mine.grad.double() / scale, theirs.grad / scale, **tol)


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_linear_values_and_student_gradients_fp32(beta, temperature, side):
    _check_once(torch.float32, beta, temperature, side)


# slow: the bfloat16 JSD kernel (beta 0.5) takes 2-4 min to build beside the other tests
# (about a minute alone: docs/distillation.md); a kept cache serves it until its compute
# changes
@pytest.mark.parametrize("beta", [0.0, pytest.param(0.5, marks=pytest.mark.slow), 1.0])
def test_linear_values_and_student_gradients_bf16(beta):
    _check_once(torch.bfloat16, beta, 2.0, "student")


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions(reduction):
    _check_once(torch.float32, 0.5, 1.0, "plain", reduction)


def test_one_chunk_and_many_agree():
    xs, Ws, bs, xt, Wt, bt, y = heads(37, torch.float32)
    a = ce_tvm.linear_distillation_loss(xs, Ws, xt, Wt, y, beta=0.3, chunk_rows=5)
    b = ce_tvm.linear_distillation_loss(xs, Ws, xt, Wt, y, beta=0.3, chunk_rows=64)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_teacher_gets_no_gradient_and_all_masked_is_zero():
    xs, Ws, bs, xt, Wt, bt, y = heads(8, torch.float32)
    Wt = Wt.clone().requires_grad_()
    loss = ce_tvm.linear_distillation_loss(xs, Ws.requires_grad_(), xt, Wt, y)
    loss.backward()
    assert Wt.grad is None and Ws.grad is not None
    none = ce_tvm.linear_distillation_loss(xs, Ws, xt, Wt, torch.full((8,), -100))
    assert none.item() == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_logits_form_matches_trl_generalized_jsd(beta):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    g = torch.Generator().manual_seed(1)
    s = (torch.randn(2, 9, V, generator=g) * 3).requires_grad_()
    t = torch.randn(2, 9, V, generator=g) * 3
    y = torch.randint(0, V, (2, 9), generator=g)
    y[:, :3] = -100
    mine = ce_tvm.distillation_loss(s, t, y, beta=beta, temperature=2.0)
    (gs,) = torch.autograd.grad(mine, s)
    theirs = GKDTrainer.generalized_jsd_loss(s, t, y, beta=beta, temperature=2.0)
    (gt,) = torch.autograd.grad(theirs, s)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gs, gt, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("reduction, labelled, items", [
    ("batchmean", True, None), ("batchmean", False, None), ("mean", True, None),
    ("mean", False, None), ("sum", True, None), ("batchmean", True, 11),
    ("batchmean", True, "tensor"), ("none", True, None)])
def test_gkd_loss_under_apply_matches_trls(reduction, labelled, items):
    """``apply()`` replaces ``GKDTrainer.generalized_jsd_loss``: TRL's value and
    student gradient for each of its reductions, with and without labels and
    ``num_items_in_batch``; ``remove()`` restores TRL's own."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    from ce_tvm.integrations import trl as cetrl

    g = torch.Generator().manual_seed(4)
    s = (torch.randn(3, 5, V, generator=g) * 3).requires_grad_()
    t = torch.randn(3, 5, V, generator=g) * 3
    y = torch.randint(0, V, (3, 5), generator=g)
    y[0, :4] = -100
    args = dict(labels=y if labelled else None, beta=0.3, temperature=1.5, reduction=reduction,
                num_items_in_batch=torch.tensor(11) if items == "tensor" else items)
    theirs = GKDTrainer.generalized_jsd_loss(s, t, **args)
    cetrl.apply()
    try:
        assert GKDTrainer.generalized_jsd_loss is cetrl.generalized_jsd_loss
        mine = GKDTrainer.generalized_jsd_loss(s, t, **args)
    finally:
        cetrl.remove()
    assert GKDTrainer.generalized_jsd_loss is not cetrl.generalized_jsd_loss
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    (gs,) = torch.autograd.grad(mine.sum(), s)
    (gt,) = torch.autograd.grad(theirs.sum(), s)
    torch.testing.assert_close(gs, gt, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_matches_trl_chunked_divergence_function(beta):
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    xs, Ws, bs, xt, Wt, bt, _ = heads(23, torch.float32)
    args = dict(temperature=1.5, student_logit_scale=0.8, teacher_softcap=5.0)
    leaves = [t.clone().requires_grad_() for t in (xs, Ws, bs)]
    div, ent = ce_tvm.linear_distillation_loss(
        leaves[0], leaves[1], xt, Wt, student_bias=leaves[2], teacher_bias=bt, beta=beta,
        reduction="none", return_entropy=True, **args)
    div.sum().backward()
    theirs_leaves = [t.clone().requires_grad_() for t in (xs, Ws, bs)]
    tdiv, tent = ChunkedDivergenceFunction.apply(
        theirs_leaves[0], theirs_leaves[1], theirs_leaves[2], xt, Wt, bt, beta, 1.5, 0.8, None,
        1.0, 5.0)
    tdiv.sum().backward()
    torch.testing.assert_close(div, tdiv, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(ent, tent, rtol=1e-5, atol=2e-6)
    for mine, theirs in zip(leaves, theirs_leaves):
        scale = theirs.grad.abs().max()
        torch.testing.assert_close(mine.grad / scale, theirs.grad / scale, rtol=1e-4, atol=1e-5)


def test_errors():
    xs, Ws, bs, xt, Wt, bt, y = heads(4, torch.float32)
    with pytest.raises(ValueError, match="vocabularies must align"):
        ce_tvm.linear_distillation_loss(xs, Ws, xt, Wt[:-1], y)
    with pytest.raises(ValueError, match="vocabularies must align"):
        ce_tvm.distillation_loss(torch.randn(4, V), torch.randn(4, V + 1))
    for beta in (-0.1, 1.5):
        with pytest.raises(ValueError, match="beta must be in"):
            ce_tvm.linear_distillation_loss(xs, Ws, xt, Wt, y, beta=beta)
    for temperature in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature must be finite and > 0"):
            ce_tvm.distillation_loss(torch.randn(4, V), torch.randn(4, V),
                                     temperature=temperature)


@pytest.mark.slow
def test_distillation_trainer_logs_the_same_with_ce_tvm(tmp_path):
    """A few ``DistillationTrainer`` steps (on-policy: the student generates) with
    TRL's divergence and with ce_tvm's: the same logged losses, to the bounds
    ``test_trl_trainers.py`` argues for (1e-3 relative or 1e-4 absolute: the
    trainer's, the tiny model's gradient being ill-conditioned)."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    from ce_tvm.integrations import trl as cetrl
    from support import assert_same_logs, common, logged, sentence, tiny_llama, tokenizer

    def make(path):
        tok = tokenizer()
        gen = torch.Generator().manual_seed(5)
        data = Dataset.from_dict({"prompt": [sentence(gen, 4) for _ in range(8)]})
        student = tiny_llama(tok)
        torch.manual_seed(1)
        teacher = type(student)(student.config)
        args = DistillationConfig(**common(path), max_completion_length=6, beta=0.5,
                                  temperature=0.9)
        return DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                   processing_class=tok, train_dataset=data)

    expected = logged(make, tmp_path / "trl")
    calls = []
    cetrl.apply()
    original = cetrl.ChunkedDivergence.apply
    try:
        cetrl.ChunkedDivergence.apply = staticmethod(
            lambda *a, **k: calls.append(1) or original(*a, **k))
        got = logged(make, tmp_path / "ce_tvm")
    finally:
        cetrl.ChunkedDivergence.apply = staticmethod(original)
        cetrl.remove()
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    from trl.trainer import distillation_trainer

    assert distillation_trainer.ChunkedDivergenceFunction is ChunkedDivergenceFunction
    assert calls, "DistillationTrainer did not call the patched divergence"
    assert_same_logs(got, expected)


@pytest.mark.slow
def test_gkd_trainer_logs_the_same_with_ce_tvm(tmp_path):
    """A few ``GKDTrainer`` steps (half on-policy) with TRL's loss and with
    ce_tvm's (``apply()``): the same logged losses, to the bounds of the
    ``DistillationTrainer`` test above."""
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from ce_tvm.integrations import trl as cetrl
    from support import assert_same_logs, common, logged, sentence, tiny_llama, tokenizer

    def make(path):
        tok = tokenizer()
        tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        gen = torch.Generator().manual_seed(6)
        data = Dataset.from_dict({"messages": [
            [{"role": "user", "content": sentence(gen, 4)},
             {"role": "assistant", "content": sentence(gen, 3)}] for _ in range(8)]})
        student = tiny_llama(tok)
        torch.manual_seed(1)
        teacher = type(student)(student.config)
        args = GKDConfig(**common(path), max_new_tokens=4, lmbda=0.5, beta=0.4,
                         temperature=0.9, max_length=32)
        return GKDTrainer(model=student, teacher_model=teacher, args=args,
                          processing_class=tok, train_dataset=data)

    expected = logged(make, tmp_path / "trl")
    calls = []
    cetrl.apply()
    try:
        GKDTrainer.generalized_jsd_loss = staticmethod(
            lambda *a, **k: calls.append(1) or cetrl.generalized_jsd_loss(*a, **k))
        got = logged(make, tmp_path / "ce_tvm")
    finally:
        cetrl.remove()
    assert calls, "GKDTrainer did not call the patched loss"
    assert_same_logs(got, expected)


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.slow  # nvcc
@pytest.mark.parametrize("kind,grad,caps", [("jsd", True, True), ("rkl", False, False),
                                            ("fkl", True, False)])
def test_cuda_kernel_builds_with_nvcc(kind, grad, caps):
    """The CUDA schedule builds every direction, with and without the gradient
    and the softcaps, and nvcc compiles it (the machine code's budgets are in
    ``test_cuda_static.py``)."""
    from ce_tvm.compiler.build import compile_spec, cuda_binary
    from ce_tvm.kernels.kinds import Variant
    from ce_tvm.store.spec import KernelSpec

    variant = Variant("sum" if grad else "none", divergence=kind, softcap=caps,
                      teacher_softcap=caps)
    spec = KernelSpec("divergence", "bfloat16", 1001, variant, "cuda", (("arch", "sm_90"),))
    source, cubin = cuda_binary(compile_spec(spec), spec)  # raises on any nvcc error
    assert cubin[:4] == b"\x7fELF" and ("x_grad" in source) == grad
