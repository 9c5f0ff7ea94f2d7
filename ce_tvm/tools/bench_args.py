"""The arguments of ``ce-tvm bench``, apart from ``bench`` (which imports torch),
so that the command line parses without torch."""

from __future__ import annotations

DEFAULT_SHAPES = "4096x32000,8192x50257,2048x128256"


def add_parser(sub):
    """The ``bench`` subcommand's parser (its ``func`` is the caller's to set)."""
    b = sub.add_parser("bench", help="time ce_tvm against PyTorch eager and torch.compile")
    b.add_argument("--shapes", help=f"NxC[,NxC...] (default {DEFAULT_SHAPES}); with --linear "
                   "NxHxV[,...] (default 2048x256x32000,1024x512x128256)")
    b.add_argument("--dtypes", default="float32,bfloat16")
    b.add_argument("--modes", default="forward,fwd_bwd")
    b.add_argument("--reps", type=int, default=5)
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--threads", type=int, default=0, help="torch and TVM threads (default: all)")
    b.add_argument("--label-smoothing", type=float,
                   help="default 0.1; 0 with --linear (PyTorch's chunked path has none)")
    b.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    b.add_argument("--memory", action="store_true", help="measure extra peak memory too")
    b.add_argument("--json", help="write the results here")
    b.add_argument("--png", help="draw a bar chart here (needs matplotlib)")
    b.add_argument("--linear", action="store_true",
                   help="fused linear + cross entropy (ce_tvm.linear_cross_entropy) against "
                        "eager, torch.compile, PyTorch's chunked path and the GEMM probe")
    b.add_argument("--policy", action="store_true",
                   help="per-token log-probs and entropy (ce_tvm.log_probs, linear_log_probs) "
                        "against eager, torch.compile and TRL; shapes NxV or NxHxV "
                        "(default 4096x32000,2048x256x128256)")
    b.add_argument("--no-trl", action="store_true", help="with --policy: skip TRL")
    return b
