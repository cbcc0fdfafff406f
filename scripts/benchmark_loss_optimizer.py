#!/usr/bin/env python3
"""Two per-update costs outside the layers, on one CUDA GPU, at 32 x 2560's shapes (docs/benchmarks_h200.md,
"Compiled loss"):

1. the optimizer step: fused AdamW against foreach AdamW, eager and under torch.compile, on the parameter
   shapes of a 32-layer, 2560-wide decoder with a 50272-word embedding (2.65B fp32 parameters), and gradient
   clipping before the fused step (multiplying the gradients, or the coefficient inside the step);
2. the loss, forward and backward, of 16384 x 50272 bf16 logits: fairseq's cross-entropy on CUDA (the fused
   Triton kernels) and its chunked eager path (where Triton is missing), the fp32 F.cross_entropy a plain loop
   uses, and that one compiled (compiled_fp32_cross_entropy: what `--compile` runs where Triton does not).

    python scripts/benchmark_loss_optimizer.py [--only loss|optimizer|clip]

Prints milliseconds per call (the mean of 10 after 3 warm-up calls) and, for the losses, the peak memory
beyond the logits.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fairseq.criterions.cross_entropy import (  # noqa: E402
    chunked_token_cross_entropy,
    compiled_fp32_cross_entropy,
    token_cross_entropy,
)
from fairseq.distributed.parallelize import clip_coefficient, scale_grads_, total_grad_norm  # noqa: E402
from fairseq.training.train_step import step_with_grad_factor  # noqa: E402

DIM, LAYERS, VOCAB, TOKENS = 2560, 32, 50272, 16384


def mean_ms(fn, calls=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def decoder_parameters(device):
    d = DIM
    per_layer = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in [(VOCAB, d)] + per_layer * LAYERS]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def clip_rows(params):
    """Clipping to norm 1.0 and a fused AdamW step: the gradients multiplied by the clip coefficient first
    (torch's clip_grad_norm_, what the plain loop does), against the coefficient handed to the fused kernel
    (fairseq.training.train_step)."""
    fused = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def multiplied_then_step():
        scale_grads_(params, clip_coefficient(total_grad_norm(params), 1.0))
        fused.step()

    def folded_into_step():
        step_with_grad_factor(fused, params, clip_coefficient(total_grad_norm(params), 1.0))

    print(f"clip, then fused AdamW step: {mean_ms(multiplied_then_step):.2f} ms")
    print(f"clip coefficient inside the fused AdamW step (fairseq): {mean_ms(folded_into_step):.2f} ms")


def optimizer_rows(device, only_clip: bool):
    params = decoder_parameters(device)
    print(f"parameters: {sum(p.numel() for p in params) / 1e9:.2f}B")
    fused = torch.optim.AdamW(params, lr=1e-4, fused=True)
    print(f"fused AdamW step: {mean_ms(fused.step):.2f} ms")
    del fused
    clip_rows(params)
    if only_clip:
        return
    foreach = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    print(f"foreach AdamW step: {mean_ms(foreach.step):.2f} ms")
    start = time.time()
    compiled_step = torch.compile(foreach.step)
    print(
        f"compiled foreach AdamW step: {mean_ms(compiled_step):.2f} ms (compile and warm-up {time.time() - start:.0f} s)"
    )


def loss_rows(device):
    logits = (torch.randn(TOKENS, VOCAB, device=device) * 2).bfloat16().requires_grad_()
    target = torch.randint(0, VOCAB, (TOKENS,), device=device)
    losses = {
        "fused Triton kernels (fairseq on CUDA, without --compile)": lambda x, t: token_cross_entropy(x, t, -100),
        "chunked eager (fairseq without Triton)": lambda x, t: chunked_token_cross_entropy(x, t, -100),
        "F.cross_entropy of fp32 logits (the plain loop)": lambda x, t: F.cross_entropy(x.float(), t, reduction="none"),
        "compiled fp32 cross-entropy (inductor)": lambda x, t, fn=compiled_fp32_cross_entropy(): fn(x, t, -100),
    }
    for name, loss_fn in losses.items():

        def step():
            loss_fn(logits, target).sum().backward()
            logits.grad = None

        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = mean_ms(step)
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"loss, {name}: {ms:.2f} ms forward and backward, {extra:.2f} GiB beyond the logits")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        choices=("loss", "optimizer", "clip"),
        help="run one part (the compiled optimizer step alone takes about two minutes to compile; "
        "clip: the fused step and the clipping rows only)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmark_loss_optimizer.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    if args.only != "loss":
        optimizer_rows(device, only_clip=args.only == "clip")
        torch.cuda.empty_cache()
    if args.only in (None, "loss"):
        loss_rows(device)


if __name__ == "__main__":
    main()
