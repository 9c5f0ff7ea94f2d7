"""What the tests share: one module, imported as ``support`` from every folder
(``pythonpath`` in pyproject.toml). Test modules import this, never each other.

- The comparison every operator test goes through: ce_tvm against the float64
  reference (``ce_tvm.testing.reference``): ``TOL``, ``assert_close``, ``Case``
  and ``check_once``; the training step's, ``check_training_step``.
- A CPU build's TIR after one of its passes: ``lowered_after``.
- Fresh processes (cache behaviour is only visible across processes):
  ``Forked``, ``run`` (the ``ce-tvm`` command and other programs), the probes.
- The distillation losses' float64 reference from whole logits
  (``logits_reference``, torch autograd) and its tolerances.
- TRL's trainers on a tiny model: ``tokenizer``, ``tiny_llama``, ``sentence``,
  ``common``, ``logged`` and ``assert_same_logs`` (transformers, tokenizers
  imported when called).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ce_tvm
from ce_tvm.testing import reference

# --- ce_tvm against the float64 reference -----------------------------------

# Per-dtype tolerance (relative, and absolute against the largest reference
# magnitude): float32 to 1e-5 as the issue asks; half types to about one unit
# of their last stored bit.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-10}
# Rows compared at a time: float64 blocks of at most 16 MB stay under glibc's
# mmap threshold, so the reference reuses memory instead of page-faulting.
BLOCK_ELEMS = 1 << 21
# Tests holding gigabytes run one after another on one ``pytest -n`` worker
# (``--dist loadgroup``), so that two of them never meet in memory.
MEMORY = pytest.mark.xdist_group("memory")


@dataclass
class Case:
    n: int
    c: int
    dtype: torch.dtype = torch.float32
    reduction: str = "mean"
    weighted: bool = False
    ignore: bool = False
    label_smoothing: float = 0.0
    zloss_scale: float = 0.0
    ignore_index: int = -100
    seed: int = 0
    scale: float = 3.0
    extra: dict = field(default_factory=dict)

    def inputs(self):
        gen = torch.Generator().manual_seed(self.seed)
        x = (torch.randn(self.n, self.c, generator=gen) * self.scale).to(self.dtype)
        y = torch.randint(0, self.c, (self.n,), generator=gen)
        if self.ignore:
            y[::3] = self.ignore_index
        w = torch.rand(self.c, generator=gen) + 0.5 if self.weighted else None
        return x, y, w

    def options(self):
        return dict(reduction=self.reduction, ignore_index=self.ignore_index,
                    label_smoothing=self.label_smoothing,
                    lse_square_scale_for_zloss=self.zloss_scale)


def assert_close(actual: torch.Tensor, expected, tol: float, what: str) -> None:
    """``|actual - expected| <= tol * (|expected| + max(1, max |expected|))`` elementwise,
    with NaN and infinities in the same places."""
    a = actual.detach().double()
    e = torch.as_tensor(np.asarray(expected, dtype=np.float64))
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != reference {tuple(e.shape)}"
    finite = e.isfinite()
    if bool(finite.all()):  # the common case, without masked copies of the block
        assert bool(a.isfinite().all()), f"{what}: NaN/Inf in different places"
        if e.numel() == 0:
            return
        scale = max(1.0, float(e.abs().max()))
        excess = (a - e).abs_().sub_(e.abs().add_(scale).mul_(tol))
    else:
        assert torch.equal(finite, a.isfinite()), f"{what}: NaN/Inf in different places"
        assert torch.equal(a[~finite].nan_to_num(), e[~finite].nan_to_num()), (
            f"{what}: wrong Inf")
        if not bool(finite.any()):
            return
        scale = max(1.0, float(e[finite].abs().max()))
        excess = torch.where(finite, (a - e).abs() - tol * (e.abs() + scale), 0.0)
    worst = int(excess.argmax())
    if float(excess.reshape(-1)[worst]) > 0:
        idx = np.unravel_index(worst, tuple(e.shape))
        raise AssertionError(
            f"{what}: at {idx} got {float(a[idx])}, expected {float(e[idx])} "
            f"(tol {tol}, scale {scale})")


def _blocks(n, c):
    step = max(1, BLOCK_ELEMS // c)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)] or [slice(0, 0)]


def check_once(case: Case) -> None:
    """Forward and backward of ``case`` against the float64 reference."""
    x, y, w = case.inputs()
    opts = case.options()
    tol = TOL[case.dtype]
    loss, log_prob, zloss, lse = ce_tvm.cross_entropy_loss(x, y, w, return_zloss=True, **opts)
    assert loss.dtype == log_prob.dtype == zloss.dtype == lse.dtype == case.dtype
    wn = None if w is None else w.double().numpy()
    ref_args = (wn, case.ignore_index, case.label_smoothing, case.zloss_scale)

    blocks = []
    for rows in _blocks(case.n, case.c):
        terms = reference.row_terms(x[rows].double().numpy(), y[rows].numpy(), *ref_args)
        assert_close(log_prob[rows], terms.log_prob, tol, f"log_prob rows {rows}")
        assert_close(lse[rows], terms.lse, tol, f"lse rows {rows}")
        terms.log_prob = None
        blocks.append(terms)
    ref_loss, ref_zloss = reference.reduce(reference.concat(blocks), case.reduction)
    assert_close(loss, ref_loss, tol, "loss")
    assert_close(zloss, ref_zloss, tol, "zloss")

    g_rows = case.n if case.reduction == "none" else 1
    gen = torch.Generator().manual_seed(case.seed + 1)
    # the seed pair takes its upstream gradients in log_prob's dtype
    g = (torch.rand(g_rows, generator=gen) + 0.5).to(case.dtype)
    gz = torch.rand(g_rows, generator=gen).to(case.dtype)
    x_grad = ce_tvm.cross_entropy_loss_grad(
        g, log_prob, y, w, grad_zloss=gz,
        lse_for_zloss=lse if case.zloss_scale else None, **opts)
    assert x_grad.dtype == case.dtype and x_grad.shape == x.shape
    row_totals = reference.totals(y.numpy(), wn, case.ignore_index, case.c)
    for rows in _blocks(case.n, case.c):
        per_row = (lambda t: t[rows]) if case.reduction == "none" else (lambda t: t)
        ref = reference.backward(
            per_row(g).double().numpy(), log_prob[rows].double().numpy(), y[rows].numpy(), wn,
            per_row(gz).double().numpy(), lse[rows].double().numpy(), case.reduction,
            case.ignore_index, case.label_smoothing, case.zloss_scale, row_totals=row_totals)
        assert_close(x_grad[rows], ref, tol, f"x_grad rows {rows}")


def training_inputs(n, c, dtype, weighted, ignore, seed=0, scale=3.0):
    """Seeded logits ``[n, c]`` (``dtype``), targets (every third ignored with
    ``ignore``) and class weights (or ``None``)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c, generator=gen) * scale).to(dtype)
    y = torch.randint(0, c, (n,), generator=gen)
    if ignore:
        y[::3] = -100
    w = torch.rand(c, generator=gen) + 0.5 if weighted else None
    return x, y, w


def check_training_step(n, c, dtype, reduction, weighted, ignore, eps, zloss, upstream,
                        seed=0) -> None:
    """Loss and autograd gradient of ``ce_tvm.cross_entropy`` (the one-pass training
    path under autograd) against the float64 reference; the caller's logits unwritten."""
    x, y, w = training_inputs(n, c, dtype, weighted, ignore, seed)
    xg = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xg, y, w, reduction=reduction, label_smoothing=eps,
                                lse_square_scale=zloss)
    (loss * upstream).backward() if upstream != 1.0 else loss.backward()
    wn = None if w is None else w.double().numpy()
    ref_loss, log_prob, _, lse = reference.forward(
        x.double().numpy(), y.numpy(), wn, reduction, -100, eps, zloss)
    ref_grad = reference.backward(
        np.array([upstream]), log_prob, y.numpy(), wn, None, lse, reduction, -100, eps, zloss)
    tol = TOL[dtype]
    assert_close(loss.reshape(1), ref_loss, tol, "loss")
    assert xg.grad.dtype == dtype and xg.grad.shape == x.shape
    assert_close(xg.grad, ref_grad, tol, "x grad")
    assert torch.equal(xg.detach(), x)  # the caller's logits are never written


def lowered_after(spec, after: str, scheduled=None):
    """The PrimFunc of ``spec``'s CPU build (``scheduled``: this scheduled PrimFunc of
    it, else the runtime's) right after the pass named ``after``."""
    import tvm

    from ce_tvm.compiler.build import scheduled_func
    from ce_tvm.schedules import cpu

    seen = []

    @tvm.instrument.pass_instrument
    class Capture:
        def run_after_pass(self, mod, info):
            if info.name == after:
                seen.append(mod["main"])

    with tvm.transform.PassContext(opt_level=3, instruments=[Capture()], config=cpu.PASS_CONFIG):
        tvm.compile(scheduled or scheduled_func(spec), target=spec.tvm_target(),
                    tir_pipeline=cpu.TIR_PIPELINE)
    assert seen, f"the build ran no pass {after}"
    return seen[-1]


# --- Fresh processes ----------------------------------------------------------
#
# ``Forked`` starts a process forked from a server that has imported torch, ce_tvm
# and TVM and called nothing (multiprocessing's forkserver): no state of ce_tvm's
# crosses processes, and a process costs its own work, not the 5-7 s of imports a
# new interpreter pays. Tests that check what a new interpreter imports use
# ``subprocess`` instead.

# Runs the seed pair on C classes in a fresh process and checks it against torch.
# With FORBID_COMPILE set, any compilation (and importing the compiler) is an error:
# modules must come from disk.
PROBE = textwrap.dedent("""
    import os, sys, torch, torch.nn.functional as F
    import ce_tvm, ce_tvm.runtime.cache as cache
    write_module = cache.write_module
    def reporting_write(spec, directory):
        if os.environ.get("FORBID_COMPILE"):
            raise AssertionError(f"recompiled {spec}")
        print("BUILT", spec.file_name(), flush=True)
        return write_module(spec, directory)
    cache.write_module = reporting_write
    c = int(sys.argv[1])
    x = torch.randn(8, c); y = torch.randint(0, c, (8,))
    loss, log_prob, _, _ = ce_tvm.cross_entropy_loss(x, y, label_smoothing=0.1)
    grad = ce_tvm.cross_entropy_loss_grad(torch.ones(1), log_prob, y, label_smoothing=0.1)
    xr = x.clone().requires_grad_(); ref = F.cross_entropy(xr, y, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss[0], ref); torch.testing.assert_close(grad, xr.grad)
    xt = x.clone().requires_grad_()
    ce_tvm.cross_entropy(xt, y, label_smoothing=0.1).backward()  # the one-pass training kernel
    torch.testing.assert_close(xt.grad, xr.grad)
    if os.environ.get("FORBID_COMPILE"):  # served from disk: the compiler was never imported
        assert "ce_tvm.compiler.build" not in sys.modules
    print("probe ok")
""")


# Both distillation losses in every direction, with and without the gradient
# (``none``'s backward launches the gradient variant), on C = argv[1] classes;
# a kernel that is not on disk is an error.
DISTILL_PROBE = textwrap.dedent("""
    import sys, torch
    import ce_tvm, ce_tvm.runtime.cache as cache
    def refuse(spec, directory):
        raise AssertionError(f"compiled {spec.file_name()}")
    cache.write_module = refuse
    c = int(sys.argv[1])
    torch.manual_seed(0)
    for beta in (0.0, 0.5, 1.0):
        for reduction in ("mean", "none"):
            h, W = torch.randn(6, 8, requires_grad=True), torch.randn(c, 8, requires_grad=True)
            loss = ce_tvm.linear_distillation_loss(h, W, torch.randn(6, 4), torch.randn(c, 4),
                                                   beta=beta, reduction=reduction)
            s = torch.randn(6, c, requires_grad=True)
            loss = loss.sum() + ce_tvm.distillation_loss(s, torch.randn(6, c), beta=beta,
                                                         reduction=reduction).sum()
            loss.backward()
            assert loss.isfinite() and W.grad.isfinite().all() and s.grad.isfinite().all()
    assert "ce_tvm.compiler.build" not in sys.modules
    print("distill probe ok")
""")


# The installed console script, beside the interpreter running the tests.
CLI = str(Path(sys.executable).with_name("ce-tvm"))


_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["torch", "ce_tvm", "tvm"])


def _main(program: str, argv: list[str], env: dict, out: str, err: str) -> None:
    """The forked process: output to the files ``out``/``err``, ``env`` as its
    environment, then ``program`` (code, or a script's path) run as ``__main__``."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR as the process's environment sets it
    if Path(program).suffix == ".py":
        sys.argv = [program, *argv]
        runpy.run_path(program, run_name="__main__")
    else:
        sys.argv = ["-c", *argv]
        exec(compile(program, "<string>", "exec"), {"__name__": "__main__"})


class Forked:
    """One forked process running ``program`` (code, or a ``.py`` script) with
    ``argv``, in this process's environment with ``env`` added (as ``subprocess``
    would: the server's own environment is not used); ``result`` waits for it."""

    def __init__(self, program: str, *argv, **env):
        self.args = [program, *map(str, argv)]
        self.logs = [tempfile.NamedTemporaryFile(prefix="ce_tvm_forked_", delete=False).name
                     for _ in range(2)]
        env = {**os.environ, **{k: str(v) for k, v in env.items()}}
        self.proc = _context.Process(target=_main, args=(program, self.args[1:], env, *self.logs))
        self.proc.start()

    def result(self, timeout: float = 600) -> subprocess.CompletedProcess:
        """``returncode`` (``-signal`` for a signal), ``stdout``, ``stderr``."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        out, err = (Path(log).read_text() for log in self.logs)
        for log in self.logs:
            os.unlink(log)
        return subprocess.CompletedProcess(self.args, self.proc.exitcode, out, err)


CLI_MAIN = textwrap.dedent("""
    import sys
    from ce_tvm.tools.cli import main
    sys.argv[0] = "ce-tvm"
    sys.exit(main(sys.argv[1:]))
""")


def run(args, **env):
    """``args`` run with ``env`` added to the environment (``ce-tvm`` commands
    forked, other programs in a new process); their output, they must pass."""
    if args[0] == CLI:
        return _passed(Forked(CLI_MAIN, *args[1:], **env).result())
    return _passed(subprocess.run(args, env={**os.environ, **{k: str(v) for k, v in env.items()}},
                                  capture_output=True, text=True, timeout=600))


def probe(c, **env):
    """The probe's output; it must have passed."""
    return _passed(Forked(PROBE, c, **env).result())


def _passed(done: subprocess.CompletedProcess) -> str:
    """The process's output (stdout, then stderr); it must have exited with 0."""
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def failing_probe(c, **env):
    """The probe's standard error; it must have failed."""
    done = Forked(PROBE, c, **env).result()
    assert done.returncode != 0, done.stdout
    return done.stderr


# --- The distillation losses' reference ---------------------------------------

# Tolerances against ``logits_reference`` (torch.testing.assert_close's rtol/atol).
DISTILL_TOL = {torch.float32: dict(rtol=2e-5, atol=2e-6),
               torch.bfloat16: dict(rtol=3e-2, atol=3e-3)}


def logits_reference(student, teacher, kept, *, beta, temperature=1.0, student_softcap=0.0,
                     teacher_softcap=0.0):
    """``(per-row divergence, per-row entropy)`` in float64 from the two sides'
    logits (differentiable), as TRL's ``generalized_jsd_loss`` defines them (0
    where not ``kept``)."""
    def log_probs(logits, cap):
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return F.log_softmax(logits / temperature, -1)

    lp = log_probs(student.double(), student_softcap)
    lq = log_probs(teacher.double(), teacher_softcap)
    if beta == 0:
        div = (lq.exp() * (lq - lp)).sum(-1)
    elif beta == 1:
        div = (lp.exp() * (lp - lq)).sum(-1)
    else:
        lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
        div = beta * (lq.exp() * (lq - lm)).sum(-1) + (1 - beta) * (lp.exp() * (lp - lm)).sum(-1)
    return div * kept, -(lp.exp() * lp).sum(-1) * kept


# --- TRL's trainers on a tiny model ---------------------------------------------

WORDS = [f"w{i}" for i in range(60)]
SPECIALS = ["<pad>", "<eos>", "<bos>"]


def tokenizer():
    """A word-level tokenizer over ``WORDS``, built in the process (no downloads)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>", bos_token="<bos>")
    fast.chat_template = None
    return fast


def tiny_llama(tok):
    """A 2-layer Llama for ``tok``, from a config, seeded."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id)
    return transformers.LlamaForCausalLM(config)


def sentence(gen, n):
    """``n`` random words of ``WORDS``."""
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=gen))


def common(tmp_path):
    """The trainers' shared arguments: 3 SGD steps on the CPU, each logged."""
    # SGD: Adam's first steps move every weight by about the learning rate whatever
    # its gradient's size, so rounding-level differences in tiny gradients would grow
    return dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3,
                logging_steps=1, save_strategy="no", seed=0, per_device_train_batch_size=4,
                optim="sgd", learning_rate=1e-2)


def logged(make, tmp_path) -> list[dict]:
    """Train the trainer ``make(tmp_path)`` builds; the floats it logged per step
    (times and rates left out)."""
    trainer = make(tmp_path)
    trainer.train()
    return [{k: v for k, v in entry.items() if isinstance(v, float) and "time" not in k
             and "per_second" not in k} for entry in trainer.state.log_history]


def assert_same_logs(got: list[dict], expected: list[dict]) -> None:
    """The same steps logged, each metric within 1e-3 relative or 1e-4 absolute."""
    assert len(got) == len(expected) and any("loss" in e for e in expected), expected
    for mine, theirs in zip(got, expected):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert math.isclose(mine[key], value, rel_tol=1e-3, abs_tol=1e-4), (
                key, mine[key], value)
