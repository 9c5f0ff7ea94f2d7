"""Every bad input of SPEC section 3 raises a clear TypeError / ValueError."""

import os
import sys

import pytest
import torch

import ce_tvm

X = torch.randn(4, 5)
Y = torch.tensor([0, 1, 4, -100])
LP = torch.log_softmax(X, 1)


def fwd(**kw):
    args = dict(input=X, target=Y)
    args.update(kw)
    return ce_tvm.cross_entropy_loss(**args)


def bwd(**kw):
    args = dict(grad_loss=torch.ones(1), log_prob=LP, target=Y)
    args.update(kw)
    return ce_tvm.cross_entropy_loss_grad(**args)


FORWARD_CASES = [
    ("integer logits", dict(input=torch.ones(4, 5, dtype=torch.int64)), TypeError, "float32"),
    ("logits not a tensor", dict(input=[[1.0]]), TypeError, "torch.Tensor"),
    ("1-D logits", dict(input=torch.randn(5)), ValueError, "2-D"),
    ("3-D logits", dict(input=torch.randn(4, 5, 1)), ValueError, "2-D"),
    ("zero classes", dict(input=torch.randn(4, 0)), ValueError, "C >= 1"),
    ("float targets", dict(target=torch.zeros(4)), TypeError, "int64 or int32"),
    ("targets not a tensor", dict(target=[0, 1, 2, 3]), TypeError, "torch.Tensor"),
    ("target too long", dict(target=torch.zeros(5, dtype=torch.long)), ValueError, r"shape \[N\]"),
    ("2-D target", dict(target=torch.zeros(4, 1, dtype=torch.long)), ValueError, r"shape \[N\]"),
    ("target = C", dict(target=torch.tensor([0, 5, 1, 1])), ValueError, r"target\[1\] = 5"),
    ("negative target", dict(target=torch.tensor([0, 1, -3, 1])), ValueError,
     r"target\[2\] = -3"),
    ("huge target", dict(target=torch.tensor([0, 1, 2, 2**40])), ValueError,
     r"target\[3\] = 1099511627776"),
    ("weight wrong length", dict(weight=torch.ones(4)), ValueError, r"shape \[C\]"),
    ("integer weight", dict(weight=torch.ones(5, dtype=torch.long)), TypeError, "floating"),
    ("weight not a tensor", dict(weight=[1.0] * 5), TypeError, "torch.Tensor"),
    ("bad reduction", dict(reduction="avg"), ValueError, "reduction must be one of"),
    ("smoothing 1", dict(label_smoothing=1.0), ValueError, r"\[0, 1\)"),
    ("smoothing < 0", dict(label_smoothing=-0.1), ValueError, r"\[0, 1\)"),
    ("smoothing NaN", dict(label_smoothing=float("nan")), ValueError, "NaN"),
    ("smoothing str", dict(label_smoothing="0.1"), TypeError, "real number"),
    ("zloss < 0", dict(lse_square_scale_for_zloss=-1e-4), ValueError, ">= 0"),
    ("zloss NaN", dict(lse_square_scale_for_zloss=float("nan")), ValueError, "NaN"),
    ("zloss inf", dict(lse_square_scale_for_zloss=float("inf")), ValueError, "finite"),
    ("ignore_index float", dict(ignore_index=-100.0), TypeError, "ignore_index must be an int"),
    ("ignore_index bool", dict(ignore_index=True), TypeError, "ignore_index must be an int"),
    ("meta device", dict(input=torch.randn(4, 5, device="meta"),
                         target=torch.zeros(4, dtype=torch.long, device="meta")),
     ValueError, "no kernels for device"),
    ("target on another device", dict(target=torch.zeros(4, dtype=torch.long, device="meta")),
     ValueError, "target is on meta"),
    ("weight on another device", dict(weight=torch.ones(5, device="meta")), ValueError,
     "weight is on meta"),
]


@pytest.mark.parametrize("kw,error,message", [c[1:] for c in FORWARD_CASES],
                         ids=[c[0] for c in FORWARD_CASES])
def test_forward_rejects(kw, error, message):
    with pytest.raises(error, match=message):
        fwd(**kw)


BACKWARD_CASES = [
    ("zloss without lse", dict(lse_square_scale_for_zloss=1e-3), ValueError,
     "lse_for_zloss is required"),
    ("grad_loss has N values for mean", dict(grad_loss=torch.ones(4)), ValueError,
     "one value"),
    ("grad_loss scalar for none", dict(grad_loss=torch.ones(1), reduction="none"), ValueError,
     r"shape \[N\]"),
    ("grad_zloss wrong shape", dict(grad_zloss=torch.ones(3)), ValueError, "grad_zloss"),
    ("grad_loss integer", dict(grad_loss=torch.ones(1, dtype=torch.long)), TypeError,
     "floating"),
    ("lse wrong shape", dict(lse_for_zloss=torch.ones(3), lse_square_scale_for_zloss=1e-3),
     ValueError, "lse_for_zloss must have shape"),
    ("log_prob 1-D", dict(log_prob=torch.randn(5)), ValueError, "2-D"),
    ("target out of range", dict(target=torch.tensor([0, 1, 7, 1])), ValueError,
     r"target\[2\] = 7"),
    ("bad reduction", dict(reduction="batchmean"), ValueError, "reduction"),
    ("smoothing out of range", dict(label_smoothing=2.0), ValueError, r"\[0, 1\)"),
    ("grad_loss float64, log_prob float32", dict(grad_loss=torch.ones(1, dtype=torch.float64)),
     TypeError, r"grad_loss \(torch.float64\), log_prob \(torch.float32\) must share one dtype"),
    ("grad_zloss bfloat16", dict(grad_zloss=torch.ones(1, dtype=torch.bfloat16)), TypeError,
     r"grad_zloss \(torch.bfloat16\) must share one dtype"),
    ("lse_for_zloss float16", dict(lse_for_zloss=torch.ones(4, dtype=torch.float16),
                                   lse_square_scale_for_zloss=1e-3), TypeError,
     r"lse_for_zloss \(torch.float16\) must share one dtype"),
]


@pytest.mark.parametrize("kw,error,message", [c[1:] for c in BACKWARD_CASES],
                         ids=[c[0] for c in BACKWARD_CASES])
def test_backward_rejects(kw, error, message):
    with pytest.raises(error, match=message):
        bwd(**kw)


def test_scalar_grad_loss_is_accepted():
    """A 0-d grad (what autograd passes for a scalar loss) counts as one value."""
    g = bwd(grad_loss=torch.tensor(1.0))
    assert g.shape == X.shape


def test_seed_backward_takes_one_dtype_in_half_precision():
    """bfloat16 everywhere is accepted; a float32 upstream gradient is not."""
    lp = LP.to(torch.bfloat16)
    grad = bwd(grad_loss=torch.ones(1, dtype=torch.bfloat16), log_prob=lp)
    assert grad.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="must share one dtype"):
        bwd(grad_loss=torch.ones(1), log_prob=lp)


H = torch.randn(4, 3)
LINEAR = torch.randn(5, 3)
ENTRY_POINTS = {
    "cross_entropy": lambda y: ce_tvm.cross_entropy(X, y),
    "CrossEntropyLoss": lambda y: ce_tvm.CrossEntropyLoss()(X, y),
    "cross_entropy_loss": lambda y: ce_tvm.cross_entropy_loss(X, y),
    "cross_entropy_loss_grad": lambda y: ce_tvm.cross_entropy_loss_grad(torch.ones(1), LP, y),
    "linear_cross_entropy": lambda y: ce_tvm.linear_cross_entropy(H, LINEAR, y),
    "linear_cross_entropy training": lambda y: ce_tvm.linear_cross_entropy(
        H.clone().requires_grad_(), LINEAR, y),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_out_of_range_target_is_an_index_error_and_a_value_error(entry):
    """PyTorch raises IndexError, SPEC section 3 ValueError: one class is both
    (the vocab-parallel loss: ``test_distributed.py``)."""
    with pytest.raises(ce_tvm.TargetOutOfRangeError, match=r"target\[1\] = 5 is out of range"
                       ) as raised:
        ENTRY_POINTS[entry](torch.tensor([0, 5, 1, -100]))
    assert isinstance(raised.value, IndexError) and isinstance(raised.value, ValueError)


def test_class_last_logits_name_the_class_dimension():
    """``[B, T, V]`` logits with ``[B, T]`` targets (the causal-LM layout): the error
    says the class dimension is 1 and how to pass them; ``log_probs`` takes that layout."""
    logits, target = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    with pytest.raises(ValueError, match=r"class dimension is dimension 1.*transpose\(1, -1\)"):
        ce_tvm.cross_entropy(logits, target)
    torch.testing.assert_close(ce_tvm.cross_entropy(logits.transpose(1, -1), target),
                               torch.nn.functional.cross_entropy(logits.reshape(-1, 5),
                                                                 target.reshape(-1)))


def test_a_bare_1d_head_weight_names_the_sharding_that_made_it(monkeypatch):
    """A 1-D weight: FSDP's flat shard by default; a DeepSpeed ZeRO-3 parameter
    (``ds_id``, ``ds_status``, with deepspeed imported) is named as one. The real
    ZeRO-3 parameter: tests/distributed/test_zero3.py."""
    hidden, target = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
    flat = torch.nn.Parameter(torch.empty(0))
    with pytest.raises(ValueError, match=r"FSDP's flat shard.*model\.lm_head"):
        ce_tvm.linear_cross_entropy(hidden, flat, target)
    flat.ds_id, flat.ds_status = 3, "ZeroParamStatus.NOT_AVAILABLE"
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    with pytest.raises(ValueError, match="FSDP's flat shard"):  # no deepspeed: not ZeRO-3's
        ce_tvm.linear_cross_entropy(hidden, flat, target)
    monkeypatch.setitem(sys.modules, "deepspeed", object())
    with pytest.raises(ValueError, match=r"DeepSpeed ZeRO-3 parameter, ZeroParamStatus\."
                                         r"NOT_AVAILABLE, outside its module's forward.*"
                                         r"model\.lm_head") as raised:
        ce_tvm.linear_cross_entropy(hidden, flat, target)
    assert "FSDP" not in str(raised.value)


def test_an_unknown_cuda_target_check_mode_is_refused_when_the_losses_load():
    """``CE_TVM_CUDA_TARGET_CHECK`` is ``async`` (the default) or ``sync``."""
    import subprocess

    env = {**os.environ, "CE_TVM_CUDA_TARGET_CHECK": "later"}
    done = subprocess.run([sys.executable, "-c", "import ce_tvm; ce_tvm.cross_entropy"], env=env,
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "CE_TVM_CUDA_TARGET_CHECK must be sync or async, got 'later'" in done.stderr


def test_cpu_targets_are_checked_on_the_host_in_either_mode(monkeypatch):
    """The device-side assertion is for CUDA tensors only: a CPU target out of range
    is the clear error in both modes."""
    from ce_tvm.losses import checks

    monkeypatch.setattr(checks, "CUDA_TARGET_CHECK", "async")
    with pytest.raises(ce_tvm.TargetOutOfRangeError, match=r"target\[1\] = 7"):
        ce_tvm.cross_entropy(torch.randn(2, 5), torch.tensor([0, 7]))
