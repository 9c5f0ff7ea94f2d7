"""torchtitan 0.3's LM-head loss computed by ce_tvm (``ce_tvm.integrations.torchtitan``).

At the loss-wrapper level, as torchtitan's trainer calls it: ``set_lm_head(head)``,
then ``loss_fn(hidden [B, L, D], labels [B, L], global_valid_tokens)`` and
``loss.backward()``, once with torchtitan's own ``ChunkedLossWrapper`` (around its
``CrossEntropyLoss``) and once with ``LinearCrossEntropyLoss``: the loss and the
gradients of the hidden states and of the head's weight, in float32 and bfloat16
(the loss float32 in both), with ignored tokens (a whole chunk of them too), with
and without ``global_valid_tokens``; both against an independent float64
reference (``F.cross_entropy`` of ``hidden @ W.T``); under FSDP2 on a one-rank
gloo world (``fully_shard([norm, lm_head])``, as torchtitan shards them).
The whole training run is benchmarks/torchtitan_run.py.
"""

import types

import pytest
import torch
import torch.nn.functional as F

titan_loss = pytest.importorskip("torchtitan.components.loss")

from ce_tvm.integrations import torchtitan as cetitan  # noqa: E402

ChunkedLossWrapper, CrossEntropyLoss = titan_loss.ChunkedLossWrapper, titan_loss.CrossEntropyLoss
B, L, D, V = 2, 8, 32, 96
CHUNKS = 4  # torchtitan's chunks of 2 positions; the first chunk of row 1 all ignored
# bfloat16's relative spacing (8 significant bits): one unit in the last place of x is
# at most 2**-7 * |x|, a rounding to nearest moves x by at most half of that
BF16_ULP = 2.0 ** -7


def inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, L, D, generator=gen)
    weight = torch.randn(V, D, generator=gen) * 0.3
    labels = torch.randint(0, V, (B, L), generator=gen)
    labels[0, 5] = labels[1, :2] = -100  # ignored: one token, and the first chunk of row 1
    return hidden, weight, labels


def step(config, hidden, weight, labels, global_valid_tokens, dtype):
    """``(loss, metrics, hidden's gradient, weight's gradient)`` of the loss
    ``config`` builds, called as torchtitan's trainer calls it."""
    head = torch.nn.Linear(D, V, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    h = hidden.to(dtype, copy=True).requires_grad_()
    loss_fn = config.build()
    loss_fn.set_lm_head(head)
    loss, metrics = loss_fn(h, labels, global_valid_tokens)
    loss.backward()
    return loss, metrics, h.grad, head.weight.grad


def reference(hidden, weight, labels, global_valid_tokens):
    """Independent float64 loss and gradients of ``hidden @ weight.T`` (the inputs
    as given, upcast exactly)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    loss = F.cross_entropy((h @ w.T).flatten(0, 1), labels.flatten(), reduction="sum",
                           ignore_index=-100)
    if global_valid_tokens is not None:
        loss = loss / global_valid_tokens
    loss.backward()
    return loss.detach(), h.grad, w.grad


def stock():
    return ChunkedLossWrapper.Config(num_chunks=CHUNKS)


def ours():
    return cetitan.LinearCrossEntropyLoss.Config(num_chunks=CHUNKS)


# global_valid_tokens: this rank's 13 kept tokens and 7 of another rank's; None: the
# validator's call (the sum)
@pytest.mark.parametrize("global_valid_tokens", [torch.tensor(20), None], ids=["gvt", "sum"])
def test_float32_equals_torchtitans_loss(global_valid_tokens):
    hidden, weight, labels = inputs()
    expected = step(stock(), hidden, weight, labels, global_valid_tokens, torch.float32)
    with torch.profiler.profile() as trace:
        loss, metrics, grad_h, grad_w = step(ours(), hidden, weight, labels,
                                             global_valid_tokens, torch.float32)
    assert "ce_tvm::linear_cross_entropy" in {e.key for e in trace.key_averages()}
    assert loss.dtype == torch.float32 and loss.shape == () and metrics == expected[1] == {}
    torch.testing.assert_close(loss, expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_h, expected[2], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_w, expected[3], rtol=1e-5, atol=1e-7)
    ref_loss, ref_h, ref_w = reference(hidden, weight, labels, global_valid_tokens)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_h.double(), ref_h, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_w.double(), ref_w, rtol=1e-5, atol=1e-7)
    assert (grad_h[0, 5] == 0).all() and (grad_h[1, :2] == 0).all()  # ignored positions


def test_bfloat16_loss_is_float32_and_equals_torchtitans():
    """bfloat16 hidden states and head: both losses are float32 sums of the
    cross-entropy of bfloat16 logits (torchtitan casts its bfloat16 logits to
    float32; ce_tvm rounds its float32-accumulated logits to bfloat16 as a
    bfloat16 matmul does). The two logits can differ only where the order of the
    float32 accumulation tips a rounding to the neighbouring bfloat16 value: one
    ulp of a logit moves one token's loss by at most 2 ulps (its log-sum-exp and
    its target's logit), so the losses agree to ``2 * BF16_ULP * max|logit| / gvt``
    per such token; one is allowed. Against the float64 reference of the
    bfloat16 inputs, the rounding of every logit (half an ulp) bounds each token's
    loss by ``BF16_ULP * max|logit|``, and the mean by the same. Gradients are
    bfloat16 (the inputs' dtype) in both: one rounding of a float32 value,
    half an ulp of the largest entry, for ce_tvm and for the hidden states of
    torchtitan's; torchtitan's weight gradient is summed over its chunks in
    bfloat16 (one rounding per chunk)."""
    hidden, weight, labels = inputs()
    gvt = torch.tensor(20)
    hb, wb = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    max_logit = float((hb.double() @ wb.double().T).abs().max())
    expected = step(stock(), hidden, weight, labels, gvt, torch.bfloat16)
    loss, _, grad_h, grad_w = step(ours(), hidden, weight, labels, gvt, torch.bfloat16)
    assert loss.dtype == expected[0].dtype == torch.float32
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected[0], rtol=1e-6,
                               atol=2 * BF16_ULP * max_logit / gvt.item())
    ref_loss, ref_h, ref_w = reference(hb, wb, labels, gvt)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=0, atol=BF16_ULP * max_logit)
    # the logits' rounding moves the gradient of a logit (softmax - one-hot) by at most
    # BF16_ULP * max|logit| * its softmax; through W (|w| <= max|W|, D terms) or h
    for grad, ref, other in ((grad_h, ref_h, wb), (grad_w, ref_w, hb)):
        bound = (BF16_ULP * ref.abs().max()
                 + BF16_ULP * max_logit * other.double().abs().max() * D / gvt.item())
        torch.testing.assert_close(grad.double(), ref, rtol=0, atol=float(bound))
    torch.testing.assert_close(grad_h, expected[2], rtol=0,
                               atol=BF16_ULP * float(ref_h.abs().max()))
    torch.testing.assert_close(grad_w, expected[3], rtol=0,
                               atol=CHUNKS * BF16_ULP * float(ref_w.abs().max()))


def test_the_trainer_takes_it_for_a_chunked_loss():
    """torchtitan's trainer hands the head to, and skips it for, a
    ``ChunkedLossWrapper``; ``apply`` swaps a trainer config's cross-entropy loss
    (here a stand-in with llama3 debugmodel's ``loss``: ``torchtitan.trainer``
    imports triton, which a CPU torch lacks; benchmarks/torchtitan_run.py runs the
    trainer) and keeps its inner settings; other losses are refused."""
    built = ours().build()
    assert isinstance(built, ChunkedLossWrapper)
    with pytest.raises(RuntimeError, match="set_lm_head"):
        built(torch.zeros(1, 2, D), torch.zeros(1, 2, dtype=torch.long))
    config = types.SimpleNamespace(loss=ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=2048)))
    assert cetitan.apply(config) is config
    assert type(config.loss) is cetitan.LinearCrossEntropyLoss.Config
    assert type(config.loss.build()) is cetitan.LinearCrossEntropyLoss
    assert config.loss.loss_fn.global_vocab_size == 2048
    assert config.loss.num_chunks == ChunkedLossWrapper.Config().num_chunks
    alone = cetitan.loss_config(CrossEntropyLoss.Config())
    assert type(alone) is cetitan.LinearCrossEntropyLoss.Config
    with pytest.raises(TypeError, match="MSELoss"):
        cetitan.loss_config(titan_loss.MSELoss.Config())
    with pytest.raises(TypeError, match="MSELoss"):
        cetitan.loss_config(ChunkedLossWrapper.Config(loss_fn=titan_loss.MSELoss.Config()))
    with pytest.raises(TypeError, match="Trainer.Config"):
        cetitan.apply(object())


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_fsdp2_head_equals_torchtitans_loss(one_rank, param_dtype):
    """The final norm and the head sharded together by ``fully_shard`` (torchtitan's
    FSDP2 grouping, its mixed precision: parameters in ``param_dtype``, gradients
    reduced in float32): the head module's own call gathers the weight for ce_tvm;
    loss and the gradients of the norm, the head and the input equal torchtitan's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    hidden, weight, labels = inputs()
    gvt = torch.tensor(20)

    class Top(torch.nn.Module):  # the model: its forward skips the head, as torchtitan's
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(D)
            self.lm_head = torch.nn.Linear(D, V, bias=False)

        def forward(self, x):
            return self.norm(x)

    def run(config):
        model = Top()
        with torch.no_grad():
            model.lm_head.weight.copy_(weight)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                      cast_forward_inputs=False)
        fully_shard([model.norm, model.lm_head], mesh=one_rank, mp_policy=policy,
                    reshard_after_forward=False)
        fully_shard(model, mesh=one_rank, mp_policy=policy)
        x = hidden.to(param_dtype, copy=True).requires_grad_()
        loss_fn = config.build()
        loss_fn.set_lm_head(model.lm_head)
        loss, _ = loss_fn(model(x), labels, gvt)
        loss.backward()
        return (loss, x.grad, model.norm.weight.grad.full_tensor(),
                model.lm_head.weight.grad.full_tensor())

    expected = run(stock())
    got = run(ours())
    assert got[0].dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-6) if param_dtype == torch.float32 else dict(
        rtol=2 * BF16_ULP, atol=1e-3)
    for name, a, e in zip(("loss", "input", "norm", "head"), got, expected):
        torch.testing.assert_close(a, e, **tol, msg=name)


def test_dtensor_hidden_states_are_refused(one_rank):
    from torch.distributed.tensor import Replicate, distribute_tensor

    hidden, weight, labels = inputs()
    loss_fn = ours().build()
    loss_fn.set_lm_head(torch.nn.Linear(D, V, bias=False))
    with pytest.raises(NotImplementedError, match="DTensor hidden states"):
        loss_fn(distribute_tensor(hidden, one_rank, [Replicate()]), labels)
