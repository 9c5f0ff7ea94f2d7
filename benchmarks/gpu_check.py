"""One prepared GPU check (under five minutes on one GPU): correctness of the
CUDA kernels against torch.nn.functional.cross_entropy on a grid of shapes and
dtypes (the one-pass training kernel too, which CUDA tensors do not use by
default yet), then forward and forward+backward timings against PyTorch eager,
torch.compile, dlight's GeneralReduction schedule of the same compute, and
Liger Kernel / flash-attn's cross entropy when importable, with achieved
bandwidth as a share of the device's measured copy bandwidth; an empty batch
and offset views timed, and the training step through the one-pass kernel
against the recompute path (forward + backward) with the copy floor.
``--sanitize`` runs only a small grid (with N = 0, offset views and the
training kernel), for compute-sanitizer.

    python benchmarks/gpu_check.py [--json gpu_check.json] [--quick] [--sanitize] [--bundle DIR]...

With ``--bundle DIR`` (made by ``ce-tvm bundle --target cuda``) the kernels and
the TVM runtime come from the bundle, so the host needs PyTorch and
apache-tvm-ffi but not apache-tvm; only the bundles' dtypes and class counts
are checked and timed (``--bundle`` repeats: one bundle per dtype), and the
dlight baseline (which needs the compiler) is left out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys

# Every GPU_CHECK_TRACE_EVERY_S seconds, every thread's stack on stderr: device
# time is short, and a run that hangs (one on an H200 printed nothing) shows where.
if int(os.environ.get("GPU_CHECK_TRACE_EVERY_S", "0")) > 0:
    faulthandler.dump_traceback_later(int(os.environ["GPU_CHECK_TRACE_EVERY_S"]), repeat=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ce_tvm  # noqa: E402
from ce_tvm.ops import scale_unit_gradient
from ce_tvm.runtime import launch
from ce_tvm.runtime.options import LossOptions

GRID = [(64, 17), (256, 1001), (512, 32000), (128, 128256), (64, 256000)]
TIMED = [(8192, 128256, torch.bfloat16), (4096, 32000, torch.float32),
         (8192, 50257, torch.bfloat16)]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(n: int, c: int, dtype):
    """Seeded logits ``[n, c]`` (dtype), targets with every 7th row ignored, weights."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, c, device="cuda", generator=gen) * 3).to(dtype)
    y = torch.randint(0, c, (n,), device="cuda", generator=gen)
    y[::7] = -100
    w = torch.rand(c, device="cuda", generator=gen) + 0.5
    return x, y, w


def _against_torch(label: str, n: int, c: int, dtype, loss_and_grad) -> dict:
    """``loss_and_grad(x, y, w)`` on the seeded inputs against F.cross_entropy
    (loss and autograd gradient, smoothing 0.1); prints and returns the row."""
    x, y, w = _inputs(n, c, dtype)
    loss, grad = loss_and_grad(x, y, w)
    xr = x.float().requires_grad_()
    ref = F.cross_entropy(xr, y, w, label_smoothing=0.1)
    ref.backward()
    loss_err = abs(loss.float().item() - ref.item()) / abs(ref.item())
    grad_err = ((grad.float() - xr.grad).abs().max() / xr.grad.abs().max()).item()
    ok = loss_err <= TOL[dtype] and grad_err <= 2 * TOL[dtype]
    print(f"  {'ok ' if ok else 'BAD'} {label}{n}x{c} {dtype}: "
          f"loss {loss_err:.1e} grad {grad_err:.1e}")
    return dict(n=n, c=c, dtype=str(dtype), loss_rel_err=loss_err, grad_rel_err=grad_err,
                ok=ok)


def _autograd(x, y, w):
    """``(loss, grad)`` of ``ce_tvm.cross_entropy`` through autograd."""
    xa = x.clone().requires_grad_()
    loss = ce_tvm.cross_entropy(xa, y, w, label_smoothing=0.1)
    loss.backward()
    return loss, xa.grad


def check_correctness(grid) -> list[dict]:
    return [_against_torch("", n, c, dtype, _autograd) for (n, c), dtype in grid]


def _train_kernel(x, y, w, reduction="mean"):
    """``(loss, grad)`` of the one-pass training kernel (``launch.train``)."""
    out, grad = launch.train(x, y, w, LossOptions(reduction=reduction, label_smoothing=0.1))
    return out.loss, grad


def check_training_kernel(grid) -> list[dict]:
    """The one-pass training kernel against F.cross_entropy (loss and autograd grad)."""
    return [_against_torch("train kernel ", n, c, dtype, _train_kernel)
            for (n, c), dtype in grid]


def time_training(shapes) -> list[dict]:
    """A training step (loss + logits gradient, mean, smoothing 0.1, every 17th row
    ignored): the one-pass kernel alone and with the scaled copy its autograd
    backward makes on CUDA (``ops.scale_unit_gradient``: the upstream gradient
    cannot be read there without a host sync), the recompute path (forward,
    then the backward from the logits), and the copy floor (one read + one
    write)."""
    rows = []
    options = LossOptions(reduction="mean", label_smoothing=0.1)
    for n, c, dtype in shapes:
        x = torch.randn(n, c, device="cuda").to(dtype)
        y = torch.randint(0, c, (n,), device="cuda")
        y[::17] = -100
        one = torch.ones(1, device="cuda")
        dst = torch.empty_like(x)

        def recompute():
            out = launch.forward(x, y, None, options, log_prob=False)
            return launch.backward(one, torch.zeros_like(one), x, out.lse, y, None, options,
                                   source_kind="logits")

        def one_pass_scaled():
            return scale_unit_gradient(launch.train(x, y, None, options)[1], one)

        row = dict(n=n, c=c, dtype=str(dtype),
                   one_pass_ms=cuda_ms(lambda: launch.train(x, y, None, options)),
                   one_pass_scaled_ms=cuda_ms(one_pass_scaled),
                   recompute_ms=cuda_ms(recompute), copy_ms=cuda_ms(lambda: dst.copy_(x)))
        rows.append(row)
        print(f"  train {n}x{c} {dtype}: one pass {row['one_pass_ms']:.3f} ms "
              f"(+ scaled copy {row['one_pass_scaled_ms']:.3f} ms), recompute "
              f"{row['recompute_ms']:.3f} ms, copy {row['copy_ms']:.3f} ms "
              f"({row['one_pass_ms'] / row['copy_ms']:.2f}x / "
              f"{row['recompute_ms'] / row['copy_ms']:.2f}x the copy)")
    return rows


def cuda_ms(fn, reps=10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


def copy_bandwidth_gbs() -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / cuda_ms(lambda: b.copy_(a)) / 1e6


def peers():
    fns = {"ce_tvm": lambda x, y: ce_tvm.cross_entropy(x, y),
           "eager": lambda x, y: F.cross_entropy(x, y)}
    compiled = torch.compile(F.cross_entropy)
    fns["compile"] = lambda x, y: compiled(x, y)
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        fns["liger"] = lambda x, y: liger_cross_entropy(x, y)
    except ImportError:
        pass
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss as fa_ce

        fns["flash_attn"] = lambda x, y: fa_ce(x, y)[0].mean()
    except ImportError:
        pass
    return fns


def dlight_forward_ms(x, y) -> float | None:
    """Our forward compute scheduled by dlight.gpu.GeneralReduction (the baseline)."""
    import tvm
    from tvm.s_tir import dlight as dl

    from ce_tvm.kernels.forward import forward_func
    from ce_tvm.kernels.kinds import Variant
    from ce_tvm.runtime.tensors import dtype_name

    n, c = x.shape
    major, minor = torch.cuda.get_device_capability()
    target = tvm.target.Target({"kind": "cuda", "arch": f"sm_{major}{minor}"})
    func = forward_func(c, dtype_name(x.dtype), Variant("mean", False, False))
    mod = tvm.IRModule({"main": func})
    with target:
        mod = dl.ApplyDefaultSchedule(dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
    fn = tvm.compile(mod, target=target)["main"]
    outs = [x.new_empty(1), x.new_empty(1), x.new_empty(n, dtype=torch.float32)]
    import tvm_ffi

    def run():
        with tvm_ffi.use_torch_stream():
            fn(x, y, -100, 0.0, 0.0, *outs)

    return cuda_ms(run)


def time_shapes(peak_gbs: float, shapes) -> list[dict]:
    rows = []
    fns = peers()
    for n, c, dtype in shapes:
        x = torch.randn(n, c, device="cuda").to(dtype)
        y = torch.randint(0, c, (n,), device="cuda")
        nbytes = x.numel() * x.element_size()
        row = dict(n=n, c=c, dtype=str(dtype), forward_ms={}, fwd_bwd_ms={})
        for name, fn in fns.items():
            with torch.no_grad():
                row["forward_ms"][name] = cuda_ms(lambda: fn(x, y))
            xg = x.clone().requires_grad_()

            def step():
                fn(xg, y).backward()
                xg.grad = None

            row["fwd_bwd_ms"][name] = cuda_ms(step)
        try:
            row["forward_ms"]["dlight"] = dlight_forward_ms(x, y)
        except Exception as err:  # noqa: BLE001 - the baseline is optional
            row["dlight_error"] = str(err)[:200]
        row["forward_gbs"] = nbytes / row["forward_ms"]["ce_tvm"] / 1e6
        row["fwd_bwd_gbs"] = 3 * nbytes / row["fwd_bwd_ms"]["ce_tvm"] / 1e6
        row["fwd_bwd_share_of_peak"] = row["fwd_bwd_gbs"] / peak_gbs
        rows.append(row)
        print(f"  {n}x{c} {dtype}: " + ", ".join(
            f"{k} fwd {row['forward_ms'].get(k, float('nan')):.3f} / f+b {v:.3f} ms"
            for k, v in row["fwd_bwd_ms"].items())
            + f"; ce_tvm f+b {row['fwd_bwd_gbs']:.0f} GB/s = "
              f"{100 * row['fwd_bwd_share_of_peak']:.0f}% of copy bandwidth")
    return rows


def _step(x, y, w):
    xa = x.detach().requires_grad_()  # shares x's memory: an offset view stays one
    loss = ce_tvm.cross_entropy(xa, y, w, label_smoothing=0.1)
    loss.backward()
    return loss, xa.grad


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values one element into a fresh buffer (not 16-byte aligned)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


def sanitize_grid() -> int:
    """A small forward+backward grid for compute-sanitizer (memcheck, racecheck):
    short and chunked rows, an empty batch, offset views. Returns failures."""
    failures = 0
    for (n, c), dtype in [((8, 1001), torch.bfloat16), ((4, 9000), torch.float32),
                          ((0, 5000), torch.bfloat16)]:
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(n, c, device="cuda", generator=gen).to(dtype)
        y = torch.randint(0, c, (n,), device="cuda", generator=gen)
        w = torch.rand(c, device="cuda", generator=gen) + 0.5
        for xs, ys, ws in [(x, y, w), (_misaligned(x), _misaligned(y), _misaligned(w))]:
            ref = F.cross_entropy(xs.float(), ys, ws, label_smoothing=0.1)
            for path, run in [("autograd", _step), ("train kernel", _train_kernel)]:
                loss, grad = run(xs, ys, ws)
                ok = (torch.isnan(loss) and torch.isnan(ref)) if n == 0 else bool(
                    torch.allclose(loss.float(), ref, rtol=TOL[dtype] * 10,
                                   atol=TOL[dtype] * 10))
                failures += not ok
                print(f"sanitize {path} n={n} c={c} {dtype} aligned={ys is y}: "
                      f"{'ok' if ok else 'FAIL'}")
    torch.cuda.synchronize()
    return failures


def time_edge_cases() -> list[dict]:
    """An empty batch (nothing may launch: about the Python overhead) and offset
    views (copied to aligned memory first: the copy's cost shows)."""
    n, c, dtype = 4096, 32000, torch.bfloat16
    x = torch.randn(n, c, device="cuda").to(dtype)
    y = torch.randint(0, c, (n,), device="cuda")
    empty = (x[:0], y[:0], None)
    xm, ym = _misaligned(x), _misaligned(y)
    rows = [{"case": "N=0 fwd+bwd", "ms": cuda_ms(lambda: _step(*empty))},
            {"case": "N=0 train kernel", "ms": cuda_ms(lambda: _train_kernel(*empty))},
            {"case": f"{n}x{c} bf16 aligned fwd+bwd", "ms": cuda_ms(lambda: _step(x, y, None))},
            {"case": f"{n}x{c} bf16 offset views fwd+bwd",
             "ms": cuda_ms(lambda: _step(xm, ym, None))},
            {"case": f"{n}x{c} bf16 offset views train kernel",
             "ms": cuda_ms(lambda: _train_kernel(xm, ym, None))}]
    for r in rows:
        print(f"{r['case']:40} {r['ms']:8.3f} ms")
    return rows


def _bundle_shapes(directories: list[str]) -> tuple[list, list]:
    """The correctness grid (256 rows of every dtype and C the bundles hold) and
    the timed shapes (those of at least 32000 classes)."""
    grid, timed = [], []
    for directory in directories:
        with open(f"{directory}/bundle.json") as f:
            bundle = json.load(f)
        dtype = getattr(torch, bundle["dtype"])
        grid += [((256, c), dtype) for c in bundle["classes"]]
        timed += [(8192 if c < 100000 else 4096, c, dtype)
                  for c in bundle["classes"] if c >= 32000]
        print(f"bundle {directory}: {bundle['dtype']}, C in {bundle['classes']}")
    return grid, timed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="gpu_check.json")
    p.add_argument("--quick", action="store_true", help="time the first shape only")
    p.add_argument("--sanitize", action="store_true",
                   help="only the small grid run under compute-sanitizer (gpu_check.sh)")
    p.add_argument("--bundle", action="append", default=[],
                   help="run the kernels of this bundle (ce-tvm bundle --target cuda); repeatable")
    args = p.parse_args(argv)
    for directory in reversed(args.bundle):
        ce_tvm.use_bundle(directory)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    if args.sanitize:
        return 1 if sanitize_grid() else 0
    print(f"device: {torch.cuda.get_device_name()}")
    grid = [(s, d) for s in GRID for d in TOL]
    timed = TIMED
    if args.bundle:
        grid, timed = _bundle_shapes(args.bundle)
    print("correctness against F.cross_entropy (weight, ignore_index, smoothing 0.1):")
    correctness = check_correctness(grid)
    print("one-pass training kernel against F.cross_entropy (weight, ignore_index, 0.1):")
    training = check_training_kernel(grid)
    peak = copy_bandwidth_gbs()
    print(f"device copy bandwidth: {peak:.0f} GB/s")
    timings = time_shapes(peak, timed[:1] if args.quick else timed)
    train_timings = time_training(timed[:1] if args.quick else timed)
    edge = time_edge_cases()
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": peak,
                   "correctness": correctness, "training_kernel": training,
                   "timings": timings, "training": train_timings, "edge_cases": edge},
                  f, indent=1)
    print(f"wrote {args.json}")
    return 0 if all(r["ok"] for r in correctness + training) else 1


if __name__ == "__main__":
    sys.exit(main())
