"""The LM head given as a module (``linear_cross_entropy(hidden, model.lm_head, ...)``,
``linear_log_probs``, ``LinearCrossEntropyLoss``), in one process: the same values
and gradients (weight and bias included) as passing its parameters; a module
without hooks takes the plain path, which ``torch.compile(fullgraph=True)``
traces; a module with hooks runs the loss inside its own call (the hooks see
it); wrong uses are clear errors. Sharded modules: ``test_distributed.py``."""

import pytest
import torch

import ce_tvm

V, H = 300, 16


def setup():
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(H, V)
    hidden = torch.randn(2, 5, H, generator=gen, requires_grad=True)
    target = torch.randint(0, V, (2, 5), generator=gen)
    target[0, 0] = -100
    return head, hidden, target


def grads(*tensors):
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


def test_the_module_equals_its_parameters_and_compiles_in_one_graph():
    head, hidden, target = setup()
    opts = dict(label_smoothing=0.1, softcap=5.0)
    expected = ce_tvm.linear_cross_entropy(hidden, head.weight, target, linear_bias=head.bias,
                                           **opts)
    expected.backward()
    expected_grads = grads(hidden, head.weight, head.bias)
    for call in (lambda h: ce_tvm.linear_cross_entropy(h, head, target, **opts),
                 lambda h: ce_tvm.LinearCrossEntropyLoss(**opts)(h, head, target),
                 torch.compile(lambda h: ce_tvm.linear_cross_entropy(h, head, target, **opts),
                               fullgraph=True)):
        loss = call(hidden)
        torch.testing.assert_close(loss, expected)
        loss.backward()
        for got, want in zip(grads(hidden, head.weight, head.bias), expected_grads):
            torch.testing.assert_close(got, want)
    logp = ce_tvm.linear_log_probs(hidden, head, target.clamp(min=0), temperature=0.7)
    torch.testing.assert_close(logp, ce_tvm.linear_log_probs(
        hidden, head.weight, target.clamp(min=0), linear_bias=head.bias, temperature=0.7))


def test_a_module_with_hooks_runs_the_loss_inside_its_call():
    head, hidden, target = setup()
    seen = []
    head.register_forward_pre_hook(lambda module, args: seen.append("pre"))
    head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    loss = ce_tvm.linear_cross_entropy(hidden, head, target)
    assert seen == ["pre", loss.shape]
    torch.testing.assert_close(loss, ce_tvm.linear_cross_entropy(
        hidden, head.weight, target, linear_bias=head.bias))
    assert "forward" not in head.__dict__  # its forward is its own again


def test_wrong_uses_of_a_module_are_clear_errors():
    head, hidden, target = setup()
    with pytest.raises(ValueError, match="not a module and linear_bias"):
        ce_tvm.linear_cross_entropy(hidden, head, target, linear_bias=head.bias)
    with pytest.raises(TypeError, match=r"must hold its weight \[V, H\] as .weight"):
        ce_tvm.linear_log_probs(hidden, torch.nn.ReLU(), target)
    with pytest.raises(ValueError, match="not a module and linear_bias"):
        ce_tvm.linear_distillation_loss(hidden, head, hidden, head, student_bias=head.bias)


def test_distillation_runs_inside_both_hooked_heads_calls():
    """A student head with hooks (as FSDP's): the loss runs inside its call, its
    outputs seen by its forward hook; a hooked teacher's weight is read in its own
    call; the same loss and student gradients as from the bare tensors."""
    student, hidden, target = setup()
    torch.manual_seed(1)
    teacher = torch.nn.Linear(hidden.shape[-1], student.out_features)
    seen = []
    for name, head in (("student", student), ("teacher", teacher)):
        head.register_forward_pre_hook(lambda module, args, name=name: seen.append(name))
    student.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    leaves = [hidden, student.weight, student.bias]
    loss = ce_tvm.linear_distillation_loss(hidden, student, hidden, teacher, target)
    assert seen == ["teacher", "student", loss.shape]
    loss.backward()
    mine = grads(*leaves)
    plain = ce_tvm.linear_distillation_loss(leaves[0], student.weight, hidden,
                                            teacher.weight.detach(), target,
                                            student_bias=student.bias,
                                            teacher_bias=teacher.bias.detach())
    plain.backward()
    torch.testing.assert_close(loss, plain)
    for ours, theirs in zip(mine, leaves):
        torch.testing.assert_close(ours, theirs.grad)
    assert teacher.weight.grad is None
