"""One rank of the data-parallel sharding tests (launched like torchrun, as
``dist_worker.py``): FSDP2 ``fully_shard`` on a tiny model, alone and with a
tensor-parallel LM head on a 2 x 2 mesh. The modes (``CHECKS``) are the first
argument. Each check compares ce_tvm with the stock path (the head's logits,
then PyTorch's loss) run through the same sharding, or with the single-process
model: losses, log-probs and every parameter's gradient."""

import copy
import re
import sys

import dist_worker
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import ce_tvm
from ce_tvm.distributed import dtensors as sharding

V, H = 5003, 16  # dist_worker's head: the same kernels
ROWS = 12  # per data-parallel rank


class Tiny(nn.Module):
    """A body (embedding, a layer) and an LM head with a bias; ``forward`` gives
    the hidden states, as a model's body does before its head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(V, H), nn.Linear(H, H), nn.Tanh())
        self.lm_head = nn.Linear(H, V)

    def forward(self, tokens):
        return self.body(tokens)


def batch(dp_rank: int):
    """``(tokens [ROWS], targets [ROWS])`` of one data-parallel rank, some ignored."""
    gen = torch.Generator().manual_seed(100 + dp_rank)
    tokens = torch.randint(0, V, (ROWS,), generator=gen)
    targets = torch.randint(0, V, (ROWS,), generator=gen)
    targets[::5] = -100
    return tokens, targets


OPTIONS = [dict(), dict(label_smoothing=0.1, lse_square_scale=1e-2),
           dict(softcap=5.0, temperature=0.7, label_smoothing=0.1)]


def stock_loss(logits, target, label_smoothing=0.0, lse_square_scale=0.0, softcap=0.0,
               temperature=1.0):
    """PyTorch's loss of the head's logits with ce_tvm's options written out."""
    z = softcap * torch.tanh(logits / softcap) if softcap else logits
    z = z / temperature
    loss = F.cross_entropy(z, target, label_smoothing=label_smoothing)
    kept = target != -100
    return loss + lse_square_scale * (torch.logsumexp(z[kept], 1) ** 2).mean()


def stock_log_probs(logits, index, softcap=0.0, temperature=1.0):
    z = softcap * torch.tanh(logits / softcap) if softcap else logits
    logp = torch.log_softmax(z / temperature, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    picked = logp.gather(-1, index if index.dim() == 2 else index[:, None])
    return (picked if index.dim() == 2 else picked[:, 0]), entropy


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def full(t):
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def same_grads(model, stock, what):
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):
        close(full(p.grad), full(q.grad), f"{what}: {name}.grad")


def zero(*models):
    for m in models:
        m.zero_grad(set_to_none=True)


def sharded_pair(mesh=None):
    """Two copies of one ``Tiny`` (same seed on every rank), each under FSDP2 (the
    body, the head and the root) on ``mesh``: one for ce_tvm, one for the stock path."""
    torch.manual_seed(0)
    model = Tiny()
    stock = copy.deepcopy(model)
    for m in (model, stock):
        fully_shard(m.body, mesh=mesh)
        fully_shard(m.lm_head, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return model, stock


def refuses(call, *patterns) -> int:
    try:
        call()
    except ValueError as err:
        for pattern in patterns:
            assert re.search(pattern, str(err)), str(err)
        return 1
    raise AssertionError("no ValueError")


def check_fsdp2(rank, world):
    """FSDP2 over ``world`` ranks, each its own rows: the bare sharded weight is a
    ValueError naming both readings (eager and compiled); the head module gives
    each rank's stock loss and log-probs, and the stock gradients (the mean over
    ranks). Returns how many checks ran."""
    model, stock = sharded_pair()
    tokens, target = batch(rank)
    checked = 0
    weight = model.lm_head.weight
    assert isinstance(weight, torch.distributed.tensor.DTensor)  # outside the head's forward
    for fn in (ce_tvm.linear_cross_entropy, ce_tvm.linear_log_probs):
        checked += refuses(lambda: fn(model(tokens), weight, target.clamp(min=0)),
                           "two readings", "model.lm_head", "Replicate")
        checked += refuses(lambda: torch.compile(fn)(model(tokens), weight, target.clamp(min=0)),
                           "two readings")
    for options in OPTIONS:
        zero(model, stock)
        loss = ce_tvm.linear_cross_entropy(model(tokens), model.lm_head, target, **options)
        expected = stock_loss(stock.lm_head(stock(tokens)), target, **options)
        close(loss, expected.detach(), f"loss {options}")
        loss.backward()
        expected.backward()
        same_grads(model, stock, f"loss {options}")
        checked += 1
    index = target.clamp(min=0)
    for k, options, with_entropy in ((None, dict(), True),
                                     (3, dict(softcap=5.0, temperature=0.7), True),
                                     (None, dict(temperature=0.7), False)):
        idx = index if k is None else torch.stack([index, index.flip(0), index // 2], 1)
        a = torch.randn(idx.shape, generator=torch.Generator().manual_seed(rank))
        zero(model, stock)
        out = ce_tvm.linear_log_probs(model(tokens), model.lm_head, idx,
                                      return_entropy=with_entropy, **options)
        logp, entropy = out if with_entropy else (out, torch.zeros(()))
        ref_logp, ref_entropy = stock_log_probs(stock.lm_head(stock(tokens)), idx, **options)
        close(logp, ref_logp.detach(), "logp")
        if with_entropy:
            close(entropy, ref_entropy.detach(), "entropy")
        else:
            ref_entropy = torch.zeros(())
        ((logp * a).sum() - 0.1 * entropy.sum()).backward()
        ((ref_logp * a).sum() - 0.1 * ref_entropy.sum()).backward()
        same_grads(model, stock, f"log_probs K={k} entropy={with_entropy}")
        checked += 1
    # The module form and torch.compile: the same values and gradients.
    zero(model, stock)
    criterion = ce_tvm.LinearCrossEntropyLoss(label_smoothing=0.1)
    loss = torch.compile(lambda h: criterion(h, model.lm_head, target))(model(tokens))
    expected = stock_loss(stock.lm_head(stock(tokens)), target, label_smoothing=0.1)
    close(loss, expected.detach(), "compiled loss")
    loss.backward()
    expected.backward()
    same_grads(model, stock, "compiled loss")
    return checked + 1


def check_fsdp1(rank, world):
    """FSDP1 (``FullyShardedDataParallel``, the head and the root wrapped), each rank
    its own rows: the wrapped head module gives the stock loss and gradients;
    the bare flat shard outside the forward is refused (not 2-D). Returns how
    many checks ran."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def wrap(m):
        m.lm_head = FSDP(m.lm_head, device_id=torch.device("cpu"), use_orig_params=True)
        return FSDP(m, device_id=torch.device("cpu"), use_orig_params=True)

    torch.manual_seed(0)
    model = Tiny()
    stock = wrap(copy.deepcopy(model))
    model = wrap(model)
    tokens, target = batch(rank)
    head = model.module.lm_head
    try:
        ce_tvm.linear_cross_entropy(model(tokens), head.weight, target)
        raise AssertionError("a flat shard was taken for a weight")
    except ValueError as err:
        assert "2-D" in str(err), str(err)
    loss = ce_tvm.linear_cross_entropy(model(tokens), head, target, label_smoothing=0.1)
    expected = stock_loss(stock.module.lm_head(stock(tokens)), target, label_smoothing=0.1)
    close(loss, expected.detach(), "fsdp1 loss")
    loss.backward()
    expected.backward()
    with FSDP.summon_full_params(model, with_grads=True), \
            FSDP.summon_full_params(stock, with_grads=True):
        same_grads(model, stock, "fsdp1")
    return 2


def check_fsdp_tp(rank, world):
    """FSDP over the ``dp`` dimension of a 2 x 2 mesh and a column-wise parallel
    head over ``tp``: the head module gives the single-process model's loss on
    this rank's data-parallel rows, and the gradients of the mean of those
    losses over the global batch. Returns how many checks ran."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    assert world == 4
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    model = Tiny()
    single = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel()})
    fully_shard(model.body, mesh=mesh["dp"])
    fully_shard(model.lm_head, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    checked = refuses(lambda: ce_tvm.linear_cross_entropy(
        model(batch(dp_rank)[0]), model.lm_head.weight, batch(dp_rank)[1]), "2-D mesh",
        "model.lm_head")
    calls = []  # inside the head's call the vocabulary-parallel head runs
    vocab_parallel = sharding.vocab_parallel_linear_cross_entropy
    sharding.vocab_parallel_linear_cross_entropy = lambda *a, **k: (
        calls.append(k["group"]) or vocab_parallel(*a, **k))
    for options in OPTIONS[:2]:
        zero(model, single)
        tokens, target = batch(dp_rank)
        loss = ce_tvm.linear_cross_entropy(model(tokens), model.lm_head, target, **options)
        losses = [stock_loss(single.lm_head(single(t)), y, **options)
                  for t, y in map(batch, range(2))]
        close(loss, losses[dp_rank].detach(), f"fsdp x tp loss {options}")
        loss.backward()
        (sum(losses) / 2).backward()
        same_grads(model, single, f"fsdp x tp {options}")
        checked += 1
    sharding.vocab_parallel_linear_cross_entropy = vocab_parallel
    assert len(calls) == 2 and calls[0] is mesh["tp"].get_group(), calls
    # Last (the refusal leaves the head's call unfinished): inside it the student's
    # weight is the vocabulary shard, which the distillation losses do not take.
    tokens, target = batch(dp_rank)
    teacher = single.lm_head
    checked += refuses(lambda: ce_tvm.linear_distillation_loss(
        model(tokens), model.lm_head, single(tokens), teacher, target), "Tensor parallel",
        "full_tensor")
    return checked


def check_transformers(rank, world):
    """A tiny Llama under FSDP2 (each decoder layer, the head and the root), each
    rank its own rows: ``apply(model, fused_linear=True)`` gives the stock model's
    loss and gradients; ``token_log_probs`` its log-probs and entropy, and their
    gradients. Returns how many checks ran."""
    import transformers

    from ce_tvm.integrations import transformers as cehf

    config = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    stock = copy.deepcopy(model)
    for m in (model, stock):
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m.lm_head)
        fully_shard(m)
    cehf.apply(model, fused_linear=True, label_smoothing=0.1)
    gen = torch.Generator().manual_seed(200 + rank)
    ids = torch.randint(0, V, (2, 7), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    loss = model(input_ids=ids, labels=labels).loss
    logits = stock(input_ids=ids).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                               label_smoothing=0.1)
    close(loss, expected.detach(), "transformers loss")
    loss.backward()
    expected.backward()
    same_grads(model, stock, "transformers loss")
    zero(model, stock)
    logp, entropy = cehf.token_log_probs(model, ids, temperature=0.7, return_entropy=True)
    ref = torch.log_softmax(stock(input_ids=ids).logits / 0.7, -1)
    ref_logp = ref[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ref_entropy = -(ref.exp() * ref).sum(-1)
    close(logp[:, :-1], ref_logp.detach(), "token_log_probs")
    close(entropy, ref_entropy.detach(), "token entropy")
    (logp[:, :-1].sum() + entropy.sum()).backward()
    (ref_logp.sum() + ref_entropy.sum()).backward()
    same_grads(model, stock, "token_log_probs")
    return 2


def check_distill(rank, world):
    """Distillation under FSDP2, each rank its own rows, the student and the
    teacher each fully sharded: the bare sharded student weight is refused (two
    readings); the head modules give the stock divergence of the two heads'
    logits (beta 0, 0.5, 1; temperature, softcap) and FSDP2's stock gradients of
    the student; a bare sharded teacher weight and bias are gathered (it takes no
    gradient: one reading). Returns how many checks ran."""
    from support import logits_reference

    model, stock = sharded_pair()
    torch.manual_seed(1)
    teacher = Tiny()
    for m in (teacher.body, teacher.lm_head, teacher):
        fully_shard(m)
    teacher.requires_grad_(False)
    tokens, target = batch(rank)
    kept = (target != -100).double()
    with torch.no_grad():
        hidden_t = teacher(tokens)
        logits_t = teacher.lm_head(hidden_t)
    checked = refuses(lambda: ce_tvm.linear_distillation_loss(
        model(tokens), model.lm_head.weight, hidden_t, teacher.lm_head, target),
        "two readings", "model.lm_head")
    cases = [(0.0, dict()), (0.5, dict(temperature=2.0)), (1.0, dict(student_softcap=5.0))]
    for beta, options in cases:
        zero(model, stock)
        loss = ce_tvm.linear_distillation_loss(model(tokens), model.lm_head, hidden_t,
                                               teacher.lm_head, target, beta=beta, **options)
        div, _ = logits_reference(stock.lm_head(stock(tokens)), logits_t, kept, beta=beta,
                                  **options)
        expected = (div.sum() / kept.sum()).float()
        close(loss, expected.detach(), f"distillation beta={beta} {options}")
        loss.backward()
        expected.backward()
        same_grads(model, stock, f"distillation beta={beta} {options}")
        checked += 1
    zero(model, stock)
    loss = ce_tvm.linear_distillation_loss(model(tokens), model.lm_head, hidden_t,
                                           teacher.lm_head.weight, target,
                                           teacher_bias=teacher.lm_head.bias)
    div, _ = logits_reference(stock.lm_head(stock(tokens)), logits_t, kept, beta=0.5)
    expected = (div.sum() / kept.sum()).float()
    close(loss, expected.detach(), "distillation, the teacher's bare sharded weight")
    loss.backward()
    expected.backward()
    same_grads(model, stock, "distillation, the teacher's bare sharded weight")
    return checked + 1


CHECKS = {"fsdp2": check_fsdp2, "fsdp1": check_fsdp1, "fsdp_tp": check_fsdp_tp,
          "transformers": check_transformers, "distill": check_distill}


if __name__ == "__main__":
    sys.exit(dist_worker.main(CHECKS))
