"""Run ce_tvm in fresh processes (cache behaviour is only visible across processes)."""

import os
import subprocess
import sys
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
        assert "tvm" not in sys.modules
    print("probe ok")
""")


# The installed console script, beside the interpreter running the tests.
CLI = str(Path(sys.executable).with_name("ce-tvm"))


def run(args, **env):
    full_env = {**os.environ, **{k: str(v) for k, v in env.items()}}
    done = subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def probe(c, **env):
    return run([sys.executable, "-c", PROBE, str(c)], **env)


