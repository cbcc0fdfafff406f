"""Weight-only int8 matmul: `x @ (qweight * scale[:, None]).T (+ bias)` without a dequantized weight in memory.

`int8_linear(x [..., K], qweight [N, K] int8, scale [N] fp32, bias [N] or None) -> [..., N]` in x's dtype:

- CUDA with Triton (or anywhere under TRITON_INTERPRET=1), decode-sized inputs (at most MAX_KERNEL_ROWS rows):
  Triton kernels that read each int8 weight tile once, convert it in registers, accumulate in fp32 and apply the
  row scale and the bias at the end: the weight bytes read are the int8 ones, half of bf16's, which is what
  decoding a few rows, bound by memory bandwidth, gains. The launch shape (a `Config`) is chosen per (row
  bucket, N, K) at first use by timing a few candidates (fairseq.kernels.int8_tuning);
- inside a compiled decode step (torch.compile) the same kernels as one opaque op (fairseq::int8_matmul), or,
  with FAIRSEQ_INT8_MATMUL=inductor, plain tensor code that inductor fuses (`inductor_int8_linear`);
- elsewhere, or more rows (a prompt's forward, bound by arithmetic): `torch._weight_int8pack_mm` where it is
  safe (the CPU, the reduction length a multiple of 16: torch 2.13's CPU kernel returns NaN or crashes for
  others, unchecked), else the weight dequantized to x's dtype for one F.linear.

The kernel (one program per BLOCK_N output columns x BLOCK_M rows x one of SPLIT_K slices of the reduction):
- one row (batch-1 greedy): the GEMV form, BLOCK_M = 1, no tensor-core dot (tl.dot needs 16 rows: 15 of them
  would be padding), products summed elementwise in an fp32 [BLOCK_N, BLOCK_K] tile reduced once at the end;
- more rows: tl.dot over [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles in x's dtype (int8 values are exact in
  bf16 and fp16) with fp32 accumulation; in Triton's interpreter in fp32 (it computes bf16 dots wrongly);
- split-K: a 2048 x 2048 weight at batch 1 is 64 tiles of 32 columns, too few programs in flight on a 132-SM
  GPU to reach its bandwidth; with SPLIT_K > 1 each program sums one slice of K and writes its fp32 partial
  sums to a [SPLIT_K, M, N] workspace, then takes a ticket from its tile's counter (an atomic add): the tile's
  last program adds the slices in order 0, 1, ..., applies scale and bias, casts, and resets the counter. One
  launch, and the same result on every run (eager or replayed from a CUDA graph), whichever program finishes
  last. Not fp32 atomic adds into the output: those need a zeroed buffer and a cast kernel (three launches),
  and their order, so the result, changes from run to run. Where the counters cannot be had (first needed
  under CUDA-graph capture) a second small kernel adds the slices instead (`sum_in_kernel=False`, the same sum).

torch._weight_int8pack_mm also has a CUDA kernel since torch 2.9 (one thread per output value looping over
the whole reduction, x converted to fp32 first): not used on CUDA here (the benchmark times it).
"""

import os
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fairseq.kernels import built_with_triton, constant_result, triton_interpreted
from fairseq.kernels.int8_tuning import MAX_KERNEL_ROWS, Config, config_for, row_block


PATHS = ("triton", "inductor")  # FAIRSEQ_INT8_MATMUL: what a compiled decode step runs


_path: List[str] = [os.environ.get("FAIRSEQ_INT8_MATMUL", "triton")]


def check_int8_matmul_path() -> str:
    """The path set by FAIRSEQ_INT8_MATMUL or set_int8_matmul; ValueError, one line, for one not in PATHS."""
    if _path[0] not in PATHS:
        raise ValueError(
            f"FAIRSEQ_INT8_MATMUL={_path[0]!r} is not an int8 matmul path: use one of {', '.join(PATHS)} "
            "(or unset it: triton)"
        )
    return _path[0]


def set_int8_matmul(path: str) -> str:
    """Make compiled steps traced from now on use `path` (one of PATHS); returns the previous one."""
    previous, _path[0] = _path[0], path
    try:
        check_int8_matmul_path()
    except ValueError:
        _path[0] = previous
        raise
    return previous


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
    return _kernels() is not None


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """x [..., K] times the int8 weight [N, K] with fp32 row scales [N], plus bias [N]: [..., N] in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if torch.compiler.is_compiling() and _path[0] == "inductor":
        out = inductor_int8_linear(x2, qweight, scale, bias)
    elif statically_known_true(x2.size(0) <= MAX_KERNEL_ROWS) and int8_kernel_available(x):
        # a dynamic row count (the compiled prefill: many rows) takes the GEMM below, without a guard on it
        # in a compiled decode step (torch.compile) one opaque op, as the decode attention kernel
        matmul = _int8_matmul_op if torch.compiler.is_compiling() else int8_matmul_kernel
        out = matmul(x2, qweight, scale, bias)
    elif x.device.type == "cpu" and x2.size(1) % 16 == 0 and x2.size(0) > 0:
        out = torch._weight_int8pack_mm(x2.contiguous(), qweight, scale.to(x.dtype))
        out = out if bias is None else out + bias
    else:
        out = F.linear(x2, qweight.to(x.dtype) * scale.to(x.dtype).unsqueeze(1), bias)
    return out.reshape(*shape[:-1], qweight.size(0))


def inductor_int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """x [M, K] times the int8 weight as tensor code for inductor to fuse (eagerly it would materialize what
    inductor fuses away: compiled code only). One row: the products in fp32 summed over K, one reduction kernel
    that reads the int8 weight (what inductor's own decomposition of a one-row mm makes, which it applies only
    with coordinate-descent tuning on); more rows: F.linear on the weight converted to x's dtype, a conversion
    inductor fuses into its Triton matmul templates (max-autotune modes; the default mode's cuBLAS call reads a
    converted bf16 copy instead). Then the row scales and the bias in fp32."""
    if x.size(0) == 1:
        out = (x.float() * qweight.float()).sum(dim=1).unsqueeze(0)
    else:
        out = F.linear(x, qweight.to(x.dtype)).float()
    out = out * scale
    return (out if bias is None else out + bias.float()).to(x.dtype)


@torch.library.custom_op("fairseq::int8_matmul", mutates_args=())
def _int8_matmul_op(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    return int8_matmul_kernel(x, qweight, scale, bias)


@_int8_matmul_op.register_fake
def _int8_matmul_shape(x, qweight, scale, bias):
    return x.new_empty(x.size(0), qweight.size(0))


def int8_matmul_kernel(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[Config] = None,
) -> torch.Tensor:
    """The Triton path for x [M, K] (any M; int8_linear sends it the small ones). `config`: the launch shape;
    None: the one chosen for this shape (int8_tuning.config_for: timed at first use on CUDA)."""
    if qweight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("int8 matmul: x and the int8 weight must be contiguous in their last dim")
    config = config or config_for(x, qweight, bias, lambda c: launch(x, qweight, scale, bias, c))
    return launch(x, qweight, scale, bias, config)


def launch(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], config: Config
) -> torch.Tensor:
    """Run `config`'s kernel(s) on x [M, K] (contiguous last dims): [M, N] in x's dtype."""
    matmul, split_k_sum = _kernels()
    rows, depth = x.shape
    columns = qweight.size(0)
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if config.gemv and rows != 1:
        raise ValueError(f"int8 matmul: the GEMV launch shape takes one row, not {rows}")
    block_m = row_block(rows, config)
    # each slice of K a whole number of BLOCK_K; no more slices than that allows
    blocks = -(-depth // config.block_k)
    split = max(1, min(config.split_k, blocks))
    k_per_split = -(-blocks // split) * config.block_k
    split = -(-depth // k_per_split)
    partial = out if split == 1 else torch.empty(split, rows, columns, dtype=torch.float32, device=x.device)
    grid = (-(-columns // config.block_n), -(-rows // block_m), split)
    counters = _tile_counters(x.device, grid[0] * grid[1]) if split > 1 and config.sum_in_kernel else None
    bias_arg = bias if bias is not None else scale
    matmul[grid](
        x,
        qweight,
        scale,
        bias_arg,
        partial,
        out,
        counters if counters is not None else scale,
        rows,
        columns,
        depth,
        x.stride(0),
        qweight.stride(0),
        k_per_split,
        HAS_BIAS=bias is not None,
        PARTIAL=split > 1,
        SUM_HERE=counters is not None,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT_FP32=triton_interpreted(),
        num_warps=config.num_warps,
    )
    if split > 1 and counters is None:
        _sum_slices(split_k_sum, partial, scale, bias, out)
    return out


def _sum_slices(split_k_sum, partial: torch.Tensor, scale, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """out = the sum of partial's slices [S, M, N] x scale (+ bias): split-K's second launch."""
    split, rows, columns = partial.shape
    block = 256  # several programs even at one row: the sum is latency, not bandwidth
    split_k_sum[(-(-(rows * columns) // block),)](
        partial,
        scale,
        bias if bias is not None else scale,
        out,
        rows * columns,
        columns,
        HAS_BIAS=bias is not None,
        SPLIT_K=split,
        SPLIT_BLOCK=1 << (split - 1).bit_length(),
        BLOCK=block,
        num_warps=4,
    )


# Split-K summed in the kernel: one int32 counter per output tile, per device, allocated once (zeros) outside
# CUDA-graph capture and never freed (graphs hold its address); the last program of a tile resets its counter.
# Launches on one device are assumed not to run concurrently on two streams (the decode loops use one).
TILE_COUNTERS = 1 << 20
_counters = {}


def _tile_counters(device: torch.device, tiles: int) -> Optional[torch.Tensor]:
    """The device's tile counters, or None (the two-kernel sum) when more tiles than TILE_COUNTERS, or first
    needed under CUDA-graph capture."""
    counters = _counters.get(device)
    if counters is None and tiles <= TILE_COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _counters[device] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)
    return counters if tiles <= TILE_COUNTERS else None


def _kernels():
    """(the matmul kernel, the split-K sum kernel), jitted on first use; None without Triton."""
    global _GEMV_SUMS, _DOT_SUMS, _FINISH
    helpers = _sums()
    if helpers is None:
        return None
    _GEMV_SUMS, _DOT_SUMS = helpers
    _FINISH = _epilogue()
    return _matmul(), _split_k_sum()


# The matmul kernel's jitted helpers, module globals set by _kernels(): the kernel finds its callees in the
# module's globals (Triton's interpreter, which the CPU tests use, sees no closure).
_GEMV_SUMS = _DOT_SUMS = _FINISH = None


@built_with_triton
def _sums(triton, tl):
    """The matmul kernel's helpers: its loops over its slice of K (GEMV form, tl.dot form), each the fp32 sums
    [BLOCK_M, BLOCK_N] of the products, unscaled."""

    @triton.jit
    def gemv_sums(
        x_ptr, w_ptr, m, n, m_ok, n_ok, first, end, x_stride, w_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        tile = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # elementwise products, reduced over K once
        for start in range(first, end, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            k_ok = k < end
            x = tl.load(x_ptr + m.to(tl.int64) * x_stride + k, mask=k_ok & m_ok, other=0.0)
            w = tl.load(
                w_ptr + n[:, None].to(tl.int64) * w_stride + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0
            )
            tile += w.to(tl.float32) * x.to(tl.float32)[None, :]
        return tl.sum(tile, axis=1)[None, :]

    @triton.jit
    def dot_sums(
        x_ptr,
        w_ptr,
        m,
        n,
        m_ok,
        n_ok,
        first,
        end,
        x_stride,
        w_stride,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(first, end, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            k_ok = k < end
            x = tl.load(
                x_ptr + m[:, None].to(tl.int64) * x_stride + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            w = tl.load(
                w_ptr + n[None, :].to(tl.int64) * w_stride + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0
            )
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
            else:  # int8 values are exact in bf16 / fp16: the products are, and the sums are fp32
                acc += tl.dot(x, w.to(x.dtype))
        return acc

    return gemv_sums, dot_sums


@built_with_triton
def _epilogue(triton, tl):
    @triton.jit
    def finish(acc, scale_ptr, bias_ptr, out_ptr, n, n_ok, offsets, mask, HAS_BIAS: tl.constexpr):
        """out = the sums x the row scales (+ bias), in out's dtype."""
        acc = acc * tl.load(scale_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return finish


@built_with_triton
def _matmul(triton, tl):
    @triton.jit
    def int8_matmul(
        x_ptr,
        w_ptr,
        scale_ptr,
        bias_ptr,
        partial_ptr,
        out_ptr,
        counter_ptr,
        rows,
        columns,
        depth,
        x_stride,
        w_stride,
        k_per_split,
        HAS_BIAS: tl.constexpr,
        PARTIAL: tl.constexpr,
        SUM_HERE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = m < rows, n < columns
        first = tl.program_id(2) * k_per_split
        end = tl.minimum(first + k_per_split, depth)
        if BLOCK_M == 1:
            acc = _GEMV_SUMS(x_ptr, w_ptr, m, n, m_ok, n_ok, first, end, x_stride, w_stride, BLOCK_N, BLOCK_K)
        else:
            acc = _DOT_SUMS(
                x_ptr, w_ptr, m, n, m_ok, n_ok, first, end, x_stride, w_stride, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32
            )
        mask = m_ok[:, None] & n_ok[None, :]
        offsets = m[:, None].to(tl.int64) * columns + n[None, :]
        if PARTIAL:  # one slice's fp32 sums, unscaled: the tile's last program (or split_k_sum) adds the slices
            slice_size = rows.to(tl.int64) * columns
            tl.store(partial_ptr + tl.program_id(2) * slice_size + offsets, acc, mask=mask)
            if SUM_HERE:
                tl.debug_barrier()  # every thread's partial sums stored before the tile's counter says so
                tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
                if tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel") == tl.num_programs(2) - 1:
                    # the last of the tile's programs: the slices in order 0, 1, ... (the same sum on every run),
                    # read from L2 (.cg), where the other programs' stores are
                    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                    for part in range(0, tl.num_programs(2)):
                        acc += tl.load(partial_ptr + part * slice_size + offsets, mask=mask, cache_modifier=".cg")
                    tl.store(counter_ptr + tile, 0)  # ready for the next launch
                    _FINISH(acc, scale_ptr, bias_ptr, out_ptr, n, n_ok, offsets, mask, HAS_BIAS)
        else:
            _FINISH(acc, scale_ptr, bias_ptr, out_ptr, n, n_ok, offsets, mask, HAS_BIAS)

    return int8_matmul


@built_with_triton
def _split_k_sum(triton, tl):
    @triton.jit
    def split_k_sum(
        partial_ptr,
        scale_ptr,
        bias_ptr,
        out_ptr,
        size,
        columns,
        HAS_BIAS: tl.constexpr,
        SPLIT_K: tl.constexpr,
        SPLIT_BLOCK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """out = (the sum of SPLIT_K partial sums [SPLIT_K, size]) x scale (+ bias), in out's dtype."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        s = tl.arange(0, SPLIT_BLOCK)
        ok = i < size
        parts = tl.load(
            partial_ptr + s[:, None].to(tl.int64) * size + i[None, :],
            mask=(s[:, None] < SPLIT_K) & ok[None, :],
            other=0.0,
        )
        n = i % columns
        acc = tl.sum(parts, axis=0) * tl.load(scale_ptr + n, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)

    return split_k_sum
