"""Attention of one new token per row over a static KV cache, reading only each row's live keys (split-KV, the
"flash-decoding" scheme): no mask, no host sync, shapes fixed by the cache (a CUDA graph captures it).

`decode_attention(q, key_cache, value_cache, lengths, block_rows=None, scale=None, max_length=None)`:

- q [B, H, 1, D], the new token of each row (bf16, fp16 or fp32);
- key_cache, value_cache [rows, H, capacity, D] (the layout of CausalSelfAttention's static cache: row b's
  keys of its first L tokens are key_cache[b, :, :L]; rows may outnumber B, strides are read, the same for
  both);
- lengths: int32 (or int64) on the device, [B] (each row's live length) or [1] (the same for every row);
  query row b attends over keys 0 .. lengths[b] - 1 of its cache row; a length of 0 gives zeros;
- block_rows: int32 [B, n] or None: a block table. Key t of query row b is slot t of cache row
  block_rows[b, t // CACHE_BLOCK] (n * CACHE_BLOCK covers the window; strides are read, so one cache row for
  all of a query row's keys is a [B, 1] column expanded to [B, n]); None reads row b. Beam search reorders its hypotheses by index through it: full blocks are
  shared by the rows that descend from one hypothesis, and a reorder copies one block per row
  (fairseq.generation.step_model.StepModel.reorder_blocks);
- scale: the softmax scale, default 1 / sqrt(D); max_length: a host bound on the lengths (the attention window
  the caller knows, default the capacity), which sizes the grid and nothing else.

On CUDA with Triton, two kernels: the first splits each (row, head)'s key range into `splits` parts of whole
BLOCK_N blocks, one program a part, which reads its live blocks once (a part past the row's length reads
nothing; through a block table, one int per block names the cache row a block is read from) and writes its running maximum, sum of exponentials and unnormalized output in fp32; the second
combines a (row, head)'s parts. With one part the first kernel writes the output itself. The number of parts
follows from the shapes alone (enough programs to fill the GPU), so a graph replays the same launches whatever
the lengths. Accumulation is fp32 throughout; the output is q's dtype.

Elsewhere (the CPU, no Triton) `decode_attention_reference`, plain PyTorch over the whole window with the
dead slots masked, computes the same values; it is the reference the kernels are tested against
(tests/unit/test_decode_attention.py in Triton's interpreter, tests/gpu/test_decode_attention_gpu.py at real
sizes).
"""

import functools
import math
import os
from typing import Optional

import torch

from fairseq.kernels import built_with_triton, constant_result, triton_interpreted

BLOCK_N = 64  # keys a program reads per iteration (it divides CACHE_BLOCK: an iteration reads one cache row)
CACHE_BLOCK = 64  # the slots of one entry of a block table
# Programs to aim for per launch: a few per SM of an H100 (132 SMs) so that short rows or small batches still
# spread the cache read over the whole GPU.
TARGET_PROGRAMS = 4 * 132
MAX_SPLITS = 64


def decode_attention_available(q: torch.Tensor) -> bool:
    """Whether `q` can take the kernels: a plain tensor of a float dtype on CUDA (or anywhere under Triton's
    interpreter, TRITON_INTERPRET=1, which the CPU tests use), with Triton importable and the kernels not
    turned off (`set_decode_attention_kernel`, FAIRSEQ_DECODE_ATTENTION_KERNEL=0). A host check: nothing is
    read from the device."""
    return (
        _enabled[0]
        and type(q) is torch.Tensor
        and (q.is_cuda or triton_interpreted())
        and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and _triton_ready()
    )


# Whether decoding may use the kernels: on unless FAIRSEQ_DECODE_ATTENTION_KERNEL=0 (read once, at import).
_enabled = [os.environ.get("FAIRSEQ_DECODE_ATTENTION_KERNEL", "1") != "0"]


def set_decode_attention_kernel(enabled: bool) -> bool:
    """Turn the kernels on or off for static decode steps built from now on (a captured CUDA graph keeps what
    it captured); returns the previous setting."""
    previous, _enabled[0] = _enabled[0], bool(enabled)
    return previous


def decode_attention_enabled() -> bool:
    """Whether the kernels are turned on (they run where `decode_attention_available` says)."""
    return _enabled[0]


@constant_result  # a constant to a compiled decode step: Triton's import is not traced
def _triton_ready() -> bool:
    return _kernels() is not None


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    lengths: torch.Tensor,
    block_rows: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    max_length: Optional[int] = None,
) -> torch.Tensor:
    """Attention output [B, H, 1, D] in q's dtype (see the module doc); the kernels where
    `decode_attention_available(q)`, else the PyTorch reference."""
    if decode_attention_available(q):
        if torch.compiler.is_compiling():  # one opaque op in inductor's graph (see _decode_attention_op)
            return _decode_attention_op(q, key_cache, value_cache, lengths, block_rows, scale, max_length)
        return decode_attention_kernel(q, key_cache, value_cache, lengths, block_rows, scale, max_length)
    return decode_attention_reference(q, key_cache, value_cache, lengths, block_rows, scale, max_length)


def decode_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    lengths: torch.Tensor,
    block_rows: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    max_length: Optional[int] = None,
) -> torch.Tensor:
    """The same values in plain PyTorch (fp32 scores and softmax over the first `max_length` slots, the slots
    at or past each row's length masked), any device, no host sync."""
    _check(q, key_cache, value_cache, lengths, block_rows)
    batch, _, _, dim = q.shape
    window = _window(key_cache, max_length)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if block_rows is not None:
        keys, values = gather_blocks(key_cache, block_rows, window), gather_blocks(value_cache, block_rows, window)
    else:
        keys, values = key_cache[:batch, :, :window], value_cache[:batch, :, :window]
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale  # [B, H, 1, window]
    dead = torch.arange(window, device=q.device) >= lengths.long().view(-1, 1, 1, 1)
    scores = scores.masked_fill(dead, -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a length of 0: every slot dead, zeros
    return torch.matmul(probs, values.float()).to(q.dtype)


def gather_blocks(cache: torch.Tensor, block_rows: torch.Tensor, window: int) -> torch.Tensor:
    """The first `window` keys (or values) of each query row, read through the block table `block_rows` ([B, n],
    see the module doc) from `cache` [rows, H, capacity, D]: [B, H, window, D], as a cache without a
    table holds them (a copy)."""
    slots = torch.arange(window, device=cache.device)
    rows = block_rows.long().index_select(1, slots // CACHE_BLOCK)  # [B, window]
    return cache.transpose(1, 2)[rows, slots].transpose(1, 2)


def splits_for(rows_heads: int, window: int, device: Optional[torch.device] = None) -> int:
    """How many parts the first kernel splits a (row, head)'s window into: enough programs to fill the GPU,
    at most one per BLOCK_N keys, a power of 2 (the combining kernel reads them as one block)."""
    programs = TARGET_PROGRAMS
    if device is not None and device.type == "cuda":
        programs = 4 * _sm_count(device)
    wanted = max(1, min(MAX_SPLITS, -(-programs // max(rows_heads, 1)), -(-window // BLOCK_N)))
    return 1 << (wanted - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _window(key_cache: torch.Tensor, max_length: Optional[int]) -> int:
    capacity = key_cache.size(2)
    return capacity if max_length is None else max(1, min(max_length, capacity))


def _check(q, key_cache, value_cache, lengths, block_rows) -> None:
    if q.dim() != 4 or q.size(2) != 1:
        raise ValueError(f"decode attention takes one query per row, q [B, H, 1, D]; got {tuple(q.shape)}")
    if (
        key_cache.shape != value_cache.shape
        or key_cache.dim() != 4
        or key_cache.shape[1] != q.shape[1]
        or key_cache.shape[3] != q.shape[3]
    ):
        raise ValueError(
            f"decode attention: caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} do not "
            f"match q {tuple(q.shape)} (expected [rows, H, capacity, D])"
        )
    if lengths.numel() not in (1, q.size(0)) or lengths.is_floating_point():
        raise ValueError(
            f"decode attention: lengths must be integers, [B] or [1]; got {lengths.dtype} "
            f"{tuple(lengths.shape)} for B = {q.size(0)}"
        )
    if block_rows is not None and (
        block_rows.dim() != 2
        or block_rows.size(0) != q.size(0)
        or block_rows.size(1) * CACHE_BLOCK < _window(key_cache, None)
    ):
        raise ValueError(
            f"decode attention: block_rows must be [B, n] with n * {CACHE_BLOCK} >= the capacity "
            f"{key_cache.size(2)}, B = {q.size(0)}; got {tuple(block_rows.shape)}"
        )
    if q.stride(-1) != 1 or key_cache.stride(-1) != 1 or key_cache.stride() != value_cache.stride():
        raise ValueError(
            "decode attention: q and the caches must be contiguous in their last (head) dim, and the key and "
            f"value caches laid out alike (strides {key_cache.stride()} and {value_cache.stride()})"
        )
    if block_rows is None and key_cache.size(0) < q.size(0):
        raise ValueError(f"decode attention: {q.size(0)} query rows but the caches hold {key_cache.size(0)}")


def decode_attention_kernel(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    lengths: torch.Tensor,
    block_rows: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    max_length: Optional[int] = None,
    splits: Optional[int] = None,
) -> torch.Tensor:
    """The Triton path (CUDA, or the interpreter under TRITON_INTERPRET=1); `splits` overrides splits_for."""
    _check(q, key_cache, value_cache, lengths, block_rows)
    batch, heads, _, dim = q.shape
    window = _window(key_cache, max_length)
    if splits is None:
        splits = splits_for(batch * heads, window, q.device)
    out = torch.empty(batch, heads, 1, dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if splits == 1:  # placeholders: the one part writes the output
        parts = (out, out, out)
    else:  # per part: the unnormalized output, the running maximum, the sum of exponentials (fp32)
        parts = tuple(
            torch.empty(batch, heads, splits, *size, dtype=torch.float32, device=q.device) for size in ((dim,), (), ())
        )
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    _launch_split(q, key_cache, value_cache, lengths, block_rows, out, parts, scale, window, splits)
    if splits > 1:
        _, combine_kernel = _kernels()
        block_d = 1 << (dim - 1).bit_length()
        combine_kernel[(batch * heads,)](*parts, out, DIM=dim, BLOCK_D=block_d, SPLITS=splits, num_warps=4)
    return out


def _launch_split(q, key_cache, value_cache, lengths, block_rows, out, parts, scale, window, splits) -> None:
    """The first kernel over (row, head) x part; each part covers whole blocks (the last ones may lie past the
    window: they read nothing)."""
    split_kernel, _ = _kernels()
    batch, heads, _, dim = q.shape
    split_size = -(-(-(-window // splits)) // BLOCK_N) * BLOCK_N
    assert CACHE_BLOCK % BLOCK_N == 0, (CACHE_BLOCK, BLOCK_N)  # an iteration's keys lie in one cache row
    rows, rows_strides = lengths, (0, 0)  # a placeholder pointer when there is no block table
    if block_rows is not None:
        rows, rows_strides = block_rows, block_rows.stride()
    if q.stride(-1) != 1:
        q = q.contiguous()
    split_kernel[(batch * heads, splits)](
        q,  # read through its strides: fused q/k/v make q a strided view of one projection at batch > 1
        key_cache,
        value_cache,
        lengths,
        rows,
        out,
        *parts,
        *key_cache.stride()[:3],  # the value cache's too (checked)
        0 if lengths.numel() == 1 else lengths.stride(0),
        rows_strides,
        (q.stride(0), q.stride(1)),
        scale * 1.4426950408889634,  # log2(e): the kernel takes exp2
        window,
        split_size,
        HEADS=heads,
        DIM=dim,
        BLOCK_D=1 << (dim - 1).bit_length(),
        BLOCK_N=BLOCK_N,
        SPLITS=splits,
        CACHE_BLOCK=CACHE_BLOCK,
        HAS_BLOCK_ROWS=block_rows is not None,
        DIRECT=splits == 1,
        num_warps=4,
    )


# In a compiled decode step (torch.compile), the kernels are one opaque op: inductor schedules around it and
# neither traces nor re-generates them (the cache writes before it stay in place, see fairseq.generation
# .compiled_step).
@torch.library.custom_op("fairseq::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    lengths: torch.Tensor,
    block_rows: Optional[torch.Tensor],
    scale: Optional[float],
    max_length: Optional[int],
) -> torch.Tensor:
    return decode_attention_kernel(q, key_cache, value_cache, lengths, block_rows, scale, max_length)


@_decode_attention_op.register_fake
def _decode_attention_shape(q, key_cache, value_cache, lengths, block_rows, scale, max_length):
    return q.new_empty(q.shape)


def _kernels():
    """The two jitted kernels (split, combine), built on first use; None without Triton."""
    global _ATTEND_PART
    _ATTEND_PART = _attend_part()
    split_kernel = _split_kernel()
    return None if split_kernel is None else (split_kernel, _combine_kernel())


@built_with_triton
def _attend_part(triton, tl):
    """The split kernel's loop over a part's blocks (a jitted function it calls)."""

    @triton.jit
    def attend_part(
        q,
        heads,
        strides,
        table,
        keys,
        DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        CACHE_BLOCK: tl.constexpr,
        HAS_BLOCK_ROWS: tl.constexpr,
    ):
        """A part's keys `keys` = (start, end) (live blocks only: none past the length) of one head's caches
        (`heads`: the key and value pointers at the head, `strides`: a row's and a slot's, the same for keys and
        values): its unnormalized output, running maximum and sum of exponentials (exp2 of scores pre-multiplied
        by log2(e)). The keys of an iteration lie in one cache block: `table` = (the block table's row, its
        stride, the cache row read without one)."""
        k_head, v_head = heads
        stride_b, stride_n = strides
        rows, rows_stride, row = table
        start, end = keys
        d = tl.arange(0, BLOCK_D)
        d_ok = d < DIM
        running_max = float("-inf")
        running_sum = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for first in range(start, end, BLOCK_N):
            if HAS_BLOCK_ROWS:
                row = tl.load(rows + (first // CACHE_BLOCK) * rows_stride).to(tl.int64)
            n = first + tl.arange(0, BLOCK_N)
            live = n < end
            mask = live[:, None] & d_ok[None, :]
            offsets = row * stride_b + n[:, None].to(tl.int64) * stride_n + d[None, :]
            k = tl.load(k_head + offsets, mask=mask, other=0.0)
            scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
            scores = tl.where(live, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))  # finite: the block has a live key
            p = tl.exp2(scores - new_max)
            alpha = tl.exp2(running_max - new_max)
            v = tl.load(v_head + offsets, mask=mask, other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
            running_sum = running_sum * alpha + tl.sum(p, axis=0)
            running_max = new_max
        return acc, running_max, running_sum

    return attend_part


# The split kernel's jitted helper, a module global set by _kernels(): the kernel finds its callees in
# the module's globals (Triton's interpreter, which the CPU tests use, sees no closure).
_ATTEND_PART = None


@built_with_triton
def _split_kernel(triton, tl):

    @triton.jit
    def split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        lengths_ptr,
        block_rows_ptr,
        out_ptr,
        part_out_ptr,
        part_max_ptr,
        part_sum_ptr,
        stride_b,
        stride_h,
        stride_n,
        length_stride,
        rows_strides,
        q_strides,
        scale_log2,
        window,
        split_size,
        HEADS: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
        CACHE_BLOCK: tl.constexpr,
        HAS_BLOCK_ROWS: tl.constexpr,
        DIRECT: tl.constexpr,
    ):
        pid, split = tl.program_id(0), tl.program_id(1)
        b, h = pid // HEADS, pid % HEADS
        length = tl.minimum(tl.load(lengths_ptr + b * length_stride).to(tl.int32), window)
        start = split * split_size
        d = tl.arange(0, BLOCK_D)
        d_ok = d < DIM
        q = tl.load(q_ptr + b.to(tl.int64) * q_strides[0] + h * q_strides[1] + d, mask=d_ok, other=0.0).to(tl.float32)
        acc, running_max, running_sum = _ATTEND_PART(
            q * scale_log2,
            (k_ptr + h * stride_h, v_ptr + h * stride_h),
            (stride_b, stride_n),
            (block_rows_ptr + b.to(tl.int64) * rows_strides[0], rows_strides[1], b.to(tl.int64)),
            (start, tl.minimum(start + split_size, length)),
            DIM,
            BLOCK_N,
            BLOCK_D,
            CACHE_BLOCK,
            HAS_BLOCK_ROWS,
        )
        if DIRECT:
            result = tl.where(running_sum > 0, acc / running_sum, 0.0)
            tl.store(out_ptr + pid.to(tl.int64) * DIM + d, result.to(out_ptr.dtype.element_ty), mask=d_ok)
        else:
            part = pid.to(tl.int64) * SPLITS + split
            tl.store(part_out_ptr + part * DIM + d, acc, mask=d_ok)
            tl.store(part_max_ptr + part, running_max)
            tl.store(part_sum_ptr + part, running_sum)

    return split_kernel


@built_with_triton
def _combine_kernel(triton, tl):
    @triton.jit
    def combine_kernel(
        part_out_ptr,
        part_max_ptr,
        part_sum_ptr,
        out_ptr,
        DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < DIM
        maxima = tl.load(part_max_ptr + pid * SPLITS + s)
        sums = tl.load(part_sum_ptr + pid * SPLITS + s)
        overall = tl.max(maxima, axis=0)
        # parts that read nothing have max -inf: weight 0 (and every part empty, a length of 0, gives zeros)
        weights = tl.where(maxima > float("-inf"), tl.exp2(maxima - overall), 0.0)
        total = tl.sum(sums * weights, axis=0)
        parts = tl.load(part_out_ptr + (pid * SPLITS + s[:, None]) * DIM + d[None, :], mask=d_ok[None, :], other=0.0)
        result = tl.sum(parts * weights[:, None], axis=0)
        result = tl.where(total > 0, result / total, 0.0)
        tl.store(out_ptr + pid * DIM + d, result.to(out_ptr.dtype.element_ty), mask=d_ok)

    return combine_kernel
