"""The one sharded-head rule (``ce_tvm.distributed.heads``) in one process: every
family that takes a head routes a module the same way, and the tensor-parallel
layout hooks are recognised where torch defines them today."""

import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.distributed import heads


def test_tensor_parallel_layout_hooks_are_recognised(one_rank):
    """Fails when torch moves the hooks its parallel styles register
    (``heads.LAYOUT_HOOKS_MODULE``): the fused call must set aside exactly the
    output-layout hook of a column-wise parallel head (its input hook, a forward
    pre-hook, still runs)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    head = torch.nn.Linear(8, 30, bias=False)
    plain_weight = head.weight.detach().clone()
    parallelize_module(head, one_rank, ColwiseParallel())
    assert [heads.is_layout_hook(h) for h in head._forward_hooks.values()] == [True]
    x = torch.randn(5, 8)
    y = torch.randint(0, 30, (5,))
    torch.testing.assert_close(ce_tvm.linear_cross_entropy(x, head, y),
                               F.cross_entropy(x @ plain_weight.T, y))
    assert len(head._forward_hooks) == 1 and len(head._forward_pre_hooks) == 1  # restored


class Counting(torch.nn.Linear):
    """A head whose own forward must never run: the loss runs in its call instead."""

    def forward(self, x):
        raise AssertionError("the head's own forward ran")


@pytest.mark.parametrize("family", ["linear_cross_entropy", "linear_log_probs",
                                    "linear_distillation_loss"])
def test_every_family_runs_inside_a_hooked_head(family):
    """One rule for every family: a head module with hooks is called (its hooks see
    the call, as FSDP's would), and the result equals the plain weight's."""
    torch.manual_seed(0)
    head = Counting(8, 30)
    seen = []
    head.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    x, y = torch.randn(5, 8), torch.randint(0, 30, (5,))
    teacher = torch.randn(30, 8)
    call = {"linear_cross_entropy": lambda w, b: ce_tvm.linear_cross_entropy(
                x, w, y, **({} if b is False else {"linear_bias": b})),
            "linear_log_probs": lambda w, b: ce_tvm.linear_log_probs(
                x, w, y, **({} if b is False else {"linear_bias": b})),
            "linear_distillation_loss": lambda w, b: ce_tvm.linear_distillation_loss(
                x, w, x, teacher, y, **({} if b is False else {"student_bias": b}))}[family]
    routed = call(head, False)
    assert seen == [(5, 8)]
    torch.testing.assert_close(routed, call(head.weight, head.bias))
