"""The drop-in's signature is PyTorch's (SPEC section 5): positional order,
defaults, the deprecated ``size_average``/``reduce``; ce_tvm's additions are
keyword-only."""

import inspect
import itertools

import pytest
import torch
import torch.nn.functional as F

import ce_tvm

P = inspect.Parameter


def _leading(signature, count):
    return [(p.name, p.default, p.kind) for p in list(signature.parameters.values())[:count]]


@pytest.mark.parametrize("ours,theirs", [
    (ce_tvm.cross_entropy, F.cross_entropy),
    (ce_tvm.CrossEntropyLoss.__init__, torch.nn.CrossEntropyLoss.__init__),
], ids=["function", "module"])
def test_signature_is_torchs_then_keyword_only_additions(ours, theirs):
    mine, torchs = inspect.signature(ours), inspect.signature(theirs)
    count = len(torchs.parameters)
    assert _leading(mine, count) == _leading(torchs, count)
    extra = list(mine.parameters.values())[count:]
    assert extra and all(p.kind is P.KEYWORD_ONLY for p in extra)
    assert {"lse_square_scale", "return_zloss"} <= {p.name for p in extra}


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=gen)
    y = torch.tensor([0, 1, 4, 1, 3, 2])
    w = torch.rand(5, generator=gen) + 0.5
    return x, y, w


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_positional_calls_match_torch(reduction):
    x, y, w = _inputs()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = ce_tvm.cross_entropy(xa, y, w, None, 1, None, reduction, 0.1)
    ref = F.cross_entropy(xb, y, w, None, 1, None, reduction, 0.1)
    torch.testing.assert_close(ours, ref)
    g = torch.rand(ref.shape) + 0.5
    ours.backward(g)
    ref.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad)
    module = ce_tvm.CrossEntropyLoss(w, None, 1, None, reduction, 0.1)
    torch.testing.assert_close(module(x, y),
                               torch.nn.CrossEntropyLoss(w, None, 1, None, reduction, 0.1)(x, y))


LEGACY = [pair for pair in itertools.product((None, True, False), repeat=2) if pair != (None, None)]


@pytest.mark.parametrize("size_average,reduce", LEGACY)
def test_size_average_and_reduce_as_pytorch_reads_them(size_average, reduce):
    """Both override ``reduction``, with PyTorch's deprecation warning."""
    x, y, w = _inputs()
    legacy = dict(size_average=size_average, reduce=reduce, reduction="sum")
    with pytest.warns(UserWarning, match="size_average and reduce args will be deprecated"):
        ours = ce_tvm.cross_entropy(x, y, w, **legacy)
    with pytest.warns(UserWarning, match="size_average and reduce args will be deprecated"):
        module = ce_tvm.CrossEntropyLoss(w, **legacy)
    with pytest.warns(UserWarning):  # PyTorch's own, the same
        ref = F.cross_entropy(x, y, w, **legacy)
        ref_module = torch.nn.CrossEntropyLoss(w, **legacy)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(module(x, y), ref)
    assert module.reduction == ref_module.reduction
