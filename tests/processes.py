"""Run ce_tvm in fresh processes (cache behaviour is only visible across processes).

``Forked`` starts a process forked from a server that has imported torch, ce_tvm
and TVM and called nothing (multiprocessing's forkserver): no state of ce_tvm's
crosses processes, and a process costs its own work, not the 5-7 s of imports a
new interpreter pays. Tests that check what a new interpreter imports use
``subprocess`` instead.
"""

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

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


