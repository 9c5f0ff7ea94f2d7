"""One rank of the DeepSpeed ZeRO-3 tests (launched like torchrun: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; ``DS_ACCELERATOR=cpu`` picks gloo). The modes (``CHECKS``,
comma-separated) are the first argument. Each check trains two copies of one tiny model
under ZeRO-3 (every parameter partitioned: no persistence threshold) for ``STEPS``
SGD steps, each rank its own rows: ce_tvm against the stock path (the head's logits,
PyTorch's loss; or TRL's own fused head), comparing the losses of every step and every
parameter after the steps (gathered). Each mode prints one JSON line
``ZERO3 {"rank", "mode", "checked", "worst"}`` (``worst``: the largest difference seen)."""

import copy
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import ce_tvm  # noqa: E402

V, H = 5003, 16
ROWS = 12  # per rank
STEPS = 2
LR = 0.5
CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
worst = 0.0


def close(actual, expected, what, rtol=1e-4, atol=1e-5):
    global worst
    actual, expected = actual.detach().float(), expected.detach().float()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")
    if actual.numel():
        worst = max(worst, float((actual - expected).abs().max()))


def engine(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    eng, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    return eng


def same_parameters(a, b, what):
    """Every parameter of the engines ``a`` and ``b``, gathered, equal."""
    pa, pb = list(a.module.parameters()), list(b.module.parameters())
    assert pa and all(p.ds_status is not None for p in pa)
    with deepspeed.zero.GatheredParameters(pa), deepspeed.zero.GatheredParameters(pb):
        for (name, p), q in zip(a.module.named_parameters(), pb):
            assert p.dim() and p.numel(), f"{what}: {name} not gathered"
            close(p, q, f"{what}: {name} after {STEPS} steps", atol=1e-6)


class Tiny(nn.Module):
    """A body and an LM head with a bias; ``forward`` computes the loss inside the
    model's call (as a training model does): ``how`` names the path."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(V, H), nn.Linear(H, H), nn.Tanh())
        self.lm_head = nn.Linear(H, V)

    def forward(self, tokens, targets, how):
        hidden = self.body(tokens)
        if how == "ce_tvm":
            return ce_tvm.linear_cross_entropy(hidden, self.lm_head, targets,
                                               label_smoothing=0.1)
        if how == "stock":
            return F.cross_entropy(self.lm_head(hidden), targets, label_smoothing=0.1)
        kept = targets != -100
        index = targets.clamp_min(0)
        with_entropy = not how.endswith("_no_entropy")
        if how.startswith("ce_tvm_log_probs"):
            out = ce_tvm.linear_log_probs(hidden, self.lm_head, index, temperature=0.7,
                                          return_entropy=with_entropy)
            logp, entropy = out if with_entropy else (out, None)
        else:
            z = torch.log_softmax(self.lm_head(hidden) / 0.7, -1)
            logp = z.gather(-1, index[:, None])[:, 0]
            entropy = -(z.exp() * z).sum(-1)
        loss = -(logp * kept).sum() / kept.sum()
        return loss + 0.1 * entropy.mean() if with_entropy else loss


def batch(rank, step):
    gen = torch.Generator().manual_seed(100 + 10 * rank + step)
    tokens = torch.randint(0, V, (ROWS,), generator=gen)
    targets = torch.randint(0, V, (ROWS,), generator=gen)
    targets[::5] = -100
    return tokens, targets


def train_pair(fused, stock, step_loss, what):
    """``STEPS`` steps of both engines; the losses of each step and the parameters
    after them equal. ``step_loss(engine, fused: bool, step)`` is a step's loss."""
    for step in range(STEPS):
        losses = []
        for eng, is_fused in ((fused, True), (stock, False)):
            loss = step_loss(eng, is_fused, step)
            eng.backward(loss)
            eng.step()
            losses.append(loss)
        close(losses[0], losses[1], f"{what}: loss of step {step}")
    same_parameters(fused, stock, what)


def check_module(rank, world):
    """The head module under ZeRO-3: the loss (smoothing) and the log-probs with
    and without the entropy (temperature), each against the stock path."""
    checked = 0
    for fused_how, stock_how in (("ce_tvm", "stock"), ("ce_tvm_log_probs", "stock_log_probs"),
                                 ("ce_tvm_log_probs_no_entropy", "stock_log_probs_no_entropy")):
        torch.manual_seed(0)
        model = Tiny()
        copied = copy.deepcopy(model)  # before ZeRO-3 partitions model's parameters
        fused, stock = engine(model), engine(copied)

        def step_loss(eng, is_fused, step, fused_how=fused_how, stock_how=stock_how):
            return eng(*batch(rank, step), fused_how if is_fused else stock_how)

        train_pair(fused, stock, step_loss, fused_how)
        checked += 1
    return checked


def check_error(rank, world):
    """The bare weight outside the head's call (partitioned, shape (0,)) is refused
    with an error that names ZeRO-3 and the fix."""
    torch.manual_seed(0)
    eng = engine(Tiny())
    weight = eng.module.lm_head.weight
    assert weight.dim() == 1 and weight.numel() == 0, tuple(weight.shape)
    try:
        ce_tvm.linear_cross_entropy(torch.randn(4, H), weight, torch.zeros(4, dtype=torch.long))
    except ValueError as err:
        assert "ZeRO-3" in str(err) and "model.lm_head" in str(err), str(err)
        assert "FSDP" not in str(err), str(err)
    else:
        raise AssertionError("a partitioned ZeRO-3 weight was taken for a head")
    return 1


def tiny_llama(tied):
    import transformers

    config = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=8,
                                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def llama_batch(rank, step):
    gen = torch.Generator().manual_seed(200 + 10 * rank + step)
    ids = torch.randint(0, V, (2, 7), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def check_transformers(rank, world):
    """``apply(model, fused_linear=True)`` on a tiny Llama under ZeRO-3, untied,
    tied, built under ``zero.Init`` (``HfDeepSpeedConfig`` alive while the model is
    made) untied and tied: the stock model's loss and parameters."""
    from transformers.integrations import HfDeepSpeedConfig

    from ce_tvm.integrations import transformers as cehf

    checked = 0
    for tied, zero_init in ((False, False), (True, False), (False, True), (True, True)):
        what = f"transformers tied={tied} zero.Init={zero_init}"
        if zero_init:
            hf_config = HfDeepSpeedConfig(CONFIG)  # noqa: F841 (alive: from_config's zero.Init)
            models = [tiny_llama(tied), tiny_llama(tied)]
        else:
            model = tiny_llama(tied)
            models = [model, copy.deepcopy(model)]
            hf_config = HfDeepSpeedConfig(CONFIG)  # noqa: F841
        assert (models[0].lm_head.weight is models[0].model.embed_tokens.weight) == tied
        assert all(hasattr(m.lm_head.weight, "ds_id") == zero_init for m in models)
        cehf.apply(models[0], fused_linear=True)
        fused, stock = engine(models[0]), engine(models[1])

        def step_loss(eng, is_fused, step):
            ids, labels = llama_batch(rank, step)
            return eng(input_ids=ids, labels=labels).loss

        train_pair(fused, stock, step_loss, what)
        del hf_config
        checked += 1
    return checked


def check_trl(rank, world):
    """TRL's fused head (``add_fused_lm_head``, log-probs and entropy) under ZeRO-3:
    ``ce_tvm.integrations.trl.apply()`` computes it (counted) and equals TRL's own
    function (losses, parameters after the steps), untied and tied."""
    from transformers.integrations import HfDeepSpeedConfig
    from trl.trainer.utils import add_fused_lm_head

    from ce_tvm.integrations import trl as cetrl

    calls = [0]
    own = cetrl.linear_log_probs

    def counted(*args, **kwargs):
        calls[0] += 1
        return own(*args, **kwargs)

    cetrl.linear_log_probs = counted
    checked = 0
    try:
        for tied in (False, True):
            what = f"trl tied={tied}"
            model = tiny_llama(tied)
            models = [model, copy.deepcopy(model)]
            hf_config = HfDeepSpeedConfig(CONFIG)  # noqa: F841 (TRL reads ZeRO-3 from it)
            for m in models:
                add_fused_lm_head(m, temperature=0.7, outputs=("log_probs", "entropy"))
            fused, stock = engine(models[0]), engine(models[1])

            def step_loss(eng, is_fused, step):
                ids, labels = llama_batch(rank, step)
                (cetrl.apply if is_fused else cetrl.remove)()
                out = eng(input_ids=ids, labels=labels, fused_lm_head=True)
                return out.loss + 0.1 * out.entropy.mean()

            before = calls[0]
            train_pair(fused, stock, step_loss, what)
            # forward and the backward's recomputation of each fused step
            assert calls[0] - before == 2 * STEPS, calls[0] - before
            del hf_config
            checked += 1
    finally:
        cetrl.remove()
        cetrl.linear_log_probs = own
    return checked


class Distill(nn.Module):
    """A student (body, head with a bias) and a frozen teacher head on the student's
    hidden states, scaled; ``forward`` is TRL's divergence of the two heads
    (``fn.apply``: ce_tvm's ``ChunkedDivergence`` or TRL's own), inside the model's call."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(V, H), nn.Linear(H, H), nn.Tanh())
        self.lm_head = nn.Linear(H, V)
        self.teacher_head = nn.Linear(H, V).requires_grad_(False)

    def forward(self, tokens, fn):
        hidden = self.body(tokens)
        divergence, entropy = fn.apply(
            hidden, self.lm_head.weight, self.lm_head.bias, 0.5 * hidden.detach(),
            self.teacher_head.weight, self.teacher_head.bias, 0.5, 0.7)
        return divergence.mean(), entropy


def check_distill(rank, world):
    """TRL's distillation divergence under ZeRO-3: ce_tvm's (``ChunkedDivergence``)
    equals TRL's own ``ChunkedDivergenceFunction`` (losses, entropy, parameters after
    the steps)."""
    from transformers.integrations import HfDeepSpeedConfig

    from ce_tvm.integrations import trl as cetrl

    torch.manual_seed(0)
    model = Distill()
    copied = copy.deepcopy(model)
    hf_config = HfDeepSpeedConfig(CONFIG)  # noqa: F841 (ZeRO-3 read from it)
    fused, stock = engine(model), engine(copied)
    entropies = {}

    def step_loss(eng, is_fused, step):
        fn = cetrl.ChunkedDivergence if is_fused else cetrl._TRLS_DIVERGENCE
        loss, entropies[is_fused] = eng(batch(rank, step)[0], fn)
        return loss

    train_pair(fused, stock, step_loss, "distill")
    close(entropies[True], entropies[False], "distill: student entropy of the last step")
    assert not entropies[True].requires_grad
    return 1


CHECKS = {"module": check_module, "error": check_error, "transformers": check_transformers,
          "trl": check_trl, "distill": check_distill}


def main():
    global worst
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for mode in sys.argv[1].split(","):
        worst = 0.0
        checked = CHECKS[mode](rank, world)
        dist.barrier()
        print("ZERO3 " + json.dumps(dict(rank=rank, mode=mode, checked=checked, worst=worst)),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
