"""Weight-only int8 matmul: `x @ (qweight * scale[:, None]).T (+ bias)` without a dequantized weight in memory.

`int8_linear(x [..., K], qweight [N, K] int8, scale [N] fp32, bias [N] or None) -> [..., N]` in x's dtype:

- CUDA with Triton (or anywhere under TRITON_INTERPRET=1), decode-sized inputs (at most MAX_KERNEL_ROWS rows):
  one Triton kernel reads each int8 weight tile once, converts it to x's dtype in registers, accumulates the
  products in fp32 (tl.dot), and applies the row scale and the bias at the end; the weight bytes read are the
  int8 ones, half of bf16's: what decoding a few rows, bound by memory bandwidth, gains;
- elsewhere, or more rows (a prompt's forward, bound by arithmetic): `torch._weight_int8pack_mm` where it is
  safe (the CPU, the reduction length a multiple of 16: torch 2.13's CPU kernel returns NaN or crashes for
  others, unchecked), else the weight dequantized to x's dtype for one F.linear.

torch._weight_int8pack_mm also has a CUDA kernel since torch 2.9 (one thread per output value looping over
the whole reduction, x converted to fp32 first): not used on CUDA here, this kernel is.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from fairseq.kernels import built_with_triton, constant_result, triton_interpreted

MAX_KERNEL_ROWS = 256  # decode steps: batch x beam rows; more rows (prefill) take the dequantized GEMM
BLOCK_N = 32
BLOCK_K = 128


def int8_kernel_available(x: torch.Tensor) -> bool:
    """Whether `x` can take the Triton kernel (a host check)."""
    return (
        type(x) is torch.Tensor
        and (x.is_cuda or triton_interpreted())
        and x.dtype in (torch.bfloat16, torch.float16)
        and _triton_ready()
    )


@constant_result  # a constant to a compiled decode step: Triton's import is not traced
def _triton_ready() -> bool:
    return _kernel() is not None


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """x [..., K] times the int8 weight [N, K] with fp32 row scales [N], plus bias [N]: [..., N] in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.size(0) <= MAX_KERNEL_ROWS and int8_kernel_available(x):
        # in a compiled decode step (torch.compile) one opaque op, as the decode attention kernel
        matmul = _int8_matmul_op if torch.compiler.is_compiling() else int8_matmul_kernel
        out = matmul(x2, qweight, scale, bias)
    elif x.device.type == "cpu" and x2.size(1) % 16 == 0 and x2.size(0) > 0:
        out = torch._weight_int8pack_mm(x2.contiguous(), qweight, scale.to(x.dtype))
        out = out if bias is None else out + bias
    else:
        out = F.linear(x2, qweight.to(x.dtype) * scale.to(x.dtype).unsqueeze(1), bias)
    return out.reshape(*shape[:-1], qweight.size(0))


@torch.library.custom_op("fairseq::int8_matmul", mutates_args=())
def _int8_matmul_op(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    return int8_matmul_kernel(x, qweight, scale, bias)


@_int8_matmul_op.register_fake
def _int8_matmul_shape(x, qweight, scale, bias):
    return x.new_empty(x.size(0), qweight.size(0))


def int8_matmul_kernel(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The Triton path for x [M, K] (any M; int8_linear sends it the small ones)."""
    kernel = _kernel()
    rows, depth = x.shape
    columns = qweight.size(0)
    if qweight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("int8 matmul: x and the int8 weight must be contiguous in their last dim")
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m = max(16, min(64, 1 << (rows - 1).bit_length()))  # tl.dot takes 16 rows at least
    grid = (-(-columns // BLOCK_N), -(-rows // block_m))
    kernel[grid](
        x,
        qweight,
        scale,
        bias if bias is not None else scale,
        out,
        rows,
        columns,
        depth,
        x.stride(0),
        qweight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )
    return out


@built_with_triton
def _kernel(triton, tl):
    """The jitted kernel, built on first use; None without Triton."""

    @triton.jit
    def int8_matmul(
        x_ptr,
        w_ptr,
        scale_ptr,
        bias_ptr,
        out_ptr,
        rows,
        columns,
        depth,
        x_stride,
        w_stride,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = m < rows, n < columns
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for first in range(0, depth, BLOCK_K):
            k = first + tl.arange(0, BLOCK_K)
            k_ok = k < depth
            x = tl.load(
                x_ptr + m[:, None].to(tl.int64) * x_stride + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            w = tl.load(
                w_ptr + n[None, :].to(tl.int64) * w_stride + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0
            )
            # In fp32 (on the GPU tf32, whose 10-bit mantissa holds int8 values and bf16 ones exactly): the same
            # products as a bf16 dot, and Triton's interpreter (the CPU tests) computes bf16 dots wrongly.
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
        acc = acc * tl.load(scale_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + m[:, None].to(tl.int64) * columns + n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=m_ok[:, None] & n_ok[None, :],
        )

    return int8_matmul
