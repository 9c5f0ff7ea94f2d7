"""``ce_tvm.topk_distillation_loss``: the forward KL from a teacher's stored top-k
to the student's LM head, against the same formula in float64 PyTorch on the
student's full logits (values and gradients)."""

import pytest
import torch

import ce_tvm
from ce_tvm.losses.topk_distillation import topk_kl

V, H, K = 500, 16, 8


def full_reference(h, W, index, teacher_logp, kept, temperature, tail):
    """The loss in float64 from the full softmax of the student's logits."""
    logp_all = torch.log_softmax((h.double() @ W.double().T) / temperature, -1)
    student = logp_all.gather(-1, index)[kept]  # the counted positions only
    q = teacher_logp.double()[kept]
    if tail == "renormalize":
        q = q - torch.logsumexp(q, -1, keepdim=True)
        student = student - torch.logsumexp(student, -1, keepdim=True)
        per_row = (q.exp() * (q - student)).sum(-1)
    else:
        rest_q = torch.log1p(-q.exp().sum(-1))
        rest_p = torch.log1p(-student.exp().sum(-1))
        per_row = (q.exp() * (q - student)).sum(-1) + rest_q.exp() * (rest_q - rest_p)
    return per_row.sum() / kept.sum()


def teacher_topk(gen, rows):
    """A teacher's stored top-k: the K most likely tokens of random logits, and
    their log-probs (at the distillation temperature)."""
    teacher = torch.log_softmax(torch.randn(*rows, V, generator=gen) * 3, -1)
    logp, index = teacher.topk(K, -1)
    return index, logp


@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_kl_matches_the_full_softmax_reference(tail, temperature):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 6, H, generator=gen, requires_grad=True)
    W = (torch.randn(V, H, generator=gen) * 0.5).requires_grad_()
    index, teacher_logp = teacher_topk(gen, (2, 6))
    target = torch.zeros(2, 6, dtype=torch.long)
    target[0, :2] = -100  # left out: a prompt
    teacher_logp[0, 0] = float("-inf")  # padding in a left-out position is never read
    ref_h, ref_W = (t.detach().double().requires_grad_() for t in (h, W))
    expected = full_reference(ref_h, ref_W, index, teacher_logp, target != -100, temperature,
                              tail)
    expected.backward()
    loss = ce_tvm.topk_distillation_loss(h, W, index, teacher_logp, target,
                                         temperature=temperature, tail=tail, chunk_rows=5)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    torch.testing.assert_close(h.grad.double(), ref_h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(W.grad.double(), ref_W.grad, rtol=1e-4, atol=1e-6)


def test_a_student_that_is_the_teacher_has_zero_loss():
    gen = torch.Generator().manual_seed(1)
    h, W = torch.randn(4, H, generator=gen), torch.randn(V, H, generator=gen)
    teacher = torch.log_softmax(h @ W.T, -1)
    logp, index = teacher.topk(K, -1)
    for tail in ("bucket", "renormalize"):
        loss = ce_tvm.topk_distillation_loss(h, W, index, logp, tail=tail)
        assert abs(float(loss)) < 1e-5, (tail, loss)
    assert (topk_kl(logp - 0.1, logp) > 0).all()  # and a different one a positive loss


def test_bad_inputs_are_refused():
    h, W = torch.randn(4, H), torch.randn(V, H)
    index, logp = torch.zeros(4, K, dtype=torch.long), torch.zeros(4, K)
    with pytest.raises(ValueError, match="tail must be one of"):
        ce_tvm.topk_distillation_loss(h, W, index, logp - 3, tail="drop")
    with pytest.raises(ValueError, match=r"\[\*, K\]"):
        ce_tvm.topk_distillation_loss(h, W, index, logp[:, :2])
    with pytest.raises(ValueError, match="student's positions"):
        ce_tvm.topk_distillation_loss(h, W, index[:3], logp[:3])
    with pytest.raises(ValueError, match="reduction"):
        ce_tvm.topk_distillation_loss(h, W, index, logp, reduction="avg")
