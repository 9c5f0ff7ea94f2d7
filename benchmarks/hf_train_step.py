"""One training step of a tiny Llama: stock transformers vs ce_tvm's ``apply``.

Methods: ``stock`` (transformers' own loss), ``apply`` (``apply(model)``: the
loss on ``ce_tvm.cross_entropy``) and ``fused_linear``
(``apply(model, fused_linear=True)``: no logits). For each method, in a fresh
process: the extra peak RSS of one step (forward + backward) beyond what was
resident before it and the parameters' gradients (``ce_tvm.tools.measure``).
Then, in one process, the step's time, methods interleaved rep by rep, min of
``--reps``. Prints a table and, last, one JSON line.

    .venv/bin/python benchmarks/hf_train_step.py --vocab 128256 --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

METHODS = ("stock", "apply", "fused_linear")


def build(method: str, vocab: int, hidden: int, layers: int):
    import torch
    import transformers

    from ce_tvm.integrations.transformers import apply

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).train()
    if method != "stock":
        apply(model, fused_linear=method == "fused_linear")
    return model


def batch(vocab: int, tokens: int):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, tokens // 2), generator=g)
    labels = ids.clone()
    labels[:, : tokens // 16] = -100  # a prompt
    return {"input_ids": ids, "labels": labels}


def step(model, inputs) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.item()


def peak_child(method: str, vocab: int, hidden: int, layers: int, tokens: int) -> dict:
    """``{"extra_peak_mb", "loss"}`` of one step of ``method`` in this process."""
    from ce_tvm.tools.measure import PeakRSS

    model, inputs = build(method, vocab, hidden, layers), batch(vocab, tokens)
    step(model, inputs)  # warm up: kernels loaded
    model.zero_grad(set_to_none=True)
    with PeakRSS() as peak:
        loss = model(**inputs).loss
        loss.backward()
    grads_mb = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()) / 2**20
    return {"extra_peak_mb": peak.mb - grads_mb, "loss": loss.item()}


def measure_peaks(methods, vocab, hidden, layers, tokens) -> dict:
    """``{method: peak_child's result}``, each from a fresh process."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "CE_TVM_POOL_BYTES": "0"}
    peaks = {}
    for method in methods:
        args = [sys.executable, __file__, "--child", method, "--vocab", str(vocab),
                "--hidden", str(hidden), "--layers", str(layers), "--tokens", str(tokens)]
        done = subprocess.run(args, capture_output=True, text=True, env=env)
        if done.returncode:
            raise RuntimeError(f"{method}: {done.stderr[-2000:]}")
        peaks[method] = json.loads(done.stdout.splitlines()[-1])
    return peaks


def measure_times(methods, vocab, hidden, layers, tokens, reps: int) -> dict:
    """``{method: min ms of a step}``, methods interleaved rep by rep."""
    models = {m: build(m, vocab, hidden, layers) for m in methods}
    inputs = batch(vocab, tokens)
    best = {m: float("inf") for m in methods}
    for m in methods:
        step(models[m], inputs)  # warm up
    for _ in range(reps):
        for m in methods:
            start = time.perf_counter()
            step(models[m], inputs)
            best[m] = min(best[m], (time.perf_counter() - start) * 1e3)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2048, help="per step (2 rows)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--reps", type=int, default=5, help="0: memory only")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = (args.vocab, args.hidden, args.layers, args.tokens)
    if args.child:
        print(json.dumps(peak_child(args.child, *shape)))
        return
    methods = args.methods.split(",")
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    peaks = measure_peaks(methods, *shape)
    times = measure_times(methods, *shape, args.reps) if args.reps else {}
    print(f"tiny Llama, vocab {args.vocab}, hidden {args.hidden}, {args.layers} layer(s), "
          f"{args.tokens} tokens, float32")
    print("| method | step ms (min) | extra peak MB | loss |\n|---|---|---|---|")
    for m in methods:
        ms = f"{times[m]:.0f}" if m in times else "-"
        print(f"| {m} | {ms} | {peaks[m]['extra_peak_mb']:.0f} | {peaks[m]['loss']:.6f} |")
    print(json.dumps({"shape": dict(zip(("vocab", "hidden", "layers", "tokens"), shape)),
                      "peaks": peaks, "ms": times}))


if __name__ == "__main__":
    main()
