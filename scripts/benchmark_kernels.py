#!/usr/bin/env python3
"""Two kernel choices inside a decoder layer, on one CUDA GPU, at a layer's training shapes:

1. attention: `F.scaled_dot_product_attention` (causal, bf16, forward and backward) under each SDPA backend
   torch offers here (flash, cuDNN, memory-efficient); the default is what fairseq-train and the plain loop run;
2. the q/k/v projections: three [d, d] Linear layers (fairseq's parameters, q_proj/k_proj/v_proj) against one
   [3d, d] Linear of the same weights, forward and backward;
3. with --autotune, the FFN's first projection ([4d, d]) in eager mode (cuBLAS) against
   torch.compile(mode="max-autotune-no-cudagraphs"), which benchmarks inductor's triton matmul templates against
   cuBLAS and keeps the faster.

    python scripts/benchmark_kernels.py --embed-dim 2560 --heads 32 --batch 8 --seq 2048

Prints milliseconds per call (the mean of 20 after 5 warm-up calls), for one layer; multiply by the number of
layers for an update's share.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmark_loss_optimizer import mean_ms as timed_mean_ms  # this directory is on sys.path when run as a script


def mean_ms(fn):
    return timed_mean_ms(fn, calls=20, warmup=5)


def attention_rows(batch, heads, seq, head_dim):
    shape = (batch, seq, heads, head_dim)  # the layer's [B, T, H, D] view, transposed as the model does
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3)
    )
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    rows = [
        ("default (what training runs)", None),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cuDNN", SDPBackend.CUDNN_ATTENTION),
        ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION),
    ]
    for name, backend in rows:
        try:
            if backend is None:
                ms = mean_ms(step)
            else:
                with sdpa_kernel([backend]):
                    ms = mean_ms(step)
            print(f"| attention, {name} | {ms:.2f} |")
        except RuntimeError as error:  # a backend that does not take these shapes
            print(f"| attention, {name} | not available: {str(error).splitlines()[0][:80]} |")


def projection_rows(batch, seq, dim):
    x = torch.randn(batch * seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights = [torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    biases = [torch.zeros(dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    grad = torch.randn(batch * seq, dim, device="cuda", dtype=torch.bfloat16)

    def separate():
        outs = [F.linear(x, w, b) for w, b in zip(weights, biases)]
        torch.autograd.backward(outs, [grad] * 3)

    def fused():
        out = F.linear(x, torch.cat(weights), torch.cat(biases))
        out.backward(torch.cat([grad] * 3, dim=1))

    print(f"| q/k/v projections, three [d, d] Linear | {mean_ms(separate):.2f} |")
    print(f"| q/k/v projections, one [3d, d] Linear (incl. the weights' cat) | {mean_ms(fused):.2f} |")


def autotune_rows(batch, seq, dim):
    x = torch.randn(batch * seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(4 * dim, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch * seq, 4 * dim, device="cuda", dtype=torch.bfloat16)

    def fc1(inp, w):
        return F.linear(inp, w)

    for name, fn in (("eager (cuBLAS)", fc1), ("max-autotune", torch.compile(fc1, mode="max-autotune-no-cudagraphs"))):
        start = time.time()
        fn(x, weight).backward(grad)  # compiles (and autotunes) once
        compile_s = time.time() - start
        ms = mean_ms(lambda: fn(x, weight).backward(grad))
        print(f"| FFN fc1 [4d, d], {name} | {ms:.2f} | (first call {compile_s:.0f} s)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embed-dim", type=int, default=2560)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--autotune", action="store_true", help="also time fc1 under max-autotune (minutes)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_kernels.py measures CUDA kernels; no CUDA device is visible")
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; d={args.embed_dim}, heads={args.heads}, "
        f"batch={args.batch}, seq={args.seq}"
    )
    print("| what (one layer, forward and backward) | ms per call |\n|---|---:|")
    attention_rows(args.batch, args.heads, args.seq, args.embed_dim // args.heads)
    projection_rows(args.batch, args.seq, args.embed_dim)
    if args.autotune:
        autotune_rows(args.batch, args.seq, args.embed_dim)


if __name__ == "__main__":
    main()
