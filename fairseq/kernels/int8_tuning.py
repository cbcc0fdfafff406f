"""Launch shapes of the weight-only int8 matmul kernels (fairseq.kernels.int8_matmul): the candidates, an
untimed heuristic, and the choice per (row bucket, N, K, dtype, bias, device) made by timing the candidates at the
first call of a shape on CUDA (outside CUDA-graph capture: a graph captures what its warm-up chose)."""

import logging
from typing import Callable, NamedTuple, Optional

import torch

logger = logging.getLogger(__name__)

MAX_KERNEL_ROWS = 256  # decode steps: batch x beam rows; more rows (prefill) take the dequantized GEMM


class Config(NamedTuple):
    """A launch shape of the kernel. `gemv`: the one-row form (BLOCK_M = 1, no tl.dot); else tl.dot with BLOCK_M
    rows (16, 32 or 64, from the row count). `sum_in_kernel` (split-K): the last program of a tile adds the slices
    (one launch), else the split-K sum kernel does (two)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    gemv: bool = False
    sum_in_kernel: bool = True


LEGACY = Config(32, 128)  # the one launch shape before tuning (0.87x bf16 at batch 1, H100): the benchmark's baseline


def row_block(rows: int, config: Config) -> int:
    """BLOCK_M: 1 for the GEMV form, else the rows rounded up to a power of two within [16, 64] (tl.dot takes
    16 rows at least)."""
    return 1 if config.gemv else max(16, min(64, 1 << (rows - 1).bit_length()))


# Launch shapes timed at first use of a shape (every one also gets LEGACY and the heuristic's). One row: GEMV
# tiles of 8-64 columns, K slices of 128-512, split-K 1-8; more rows: tl.dot tiles.
GEMV_CANDIDATES = tuple(
    Config(n, k, split, warps, gemv=True)
    for n, k, split, warps in (
        (8, 512, 1, 4),
        (8, 512, 2, 4),
        (16, 256, 1, 4),
        (16, 256, 2, 4),
        (16, 256, 4, 4),
        (16, 512, 4, 4),
        (32, 256, 1, 4),
        (32, 256, 2, 4),
        (32, 256, 4, 4),
        (32, 256, 8, 8),
        (64, 128, 2, 4),
        (64, 128, 4, 8),
    )
)
DOT_CANDIDATES = tuple(
    Config(n, k, split, warps)
    for n, k, split, warps in (
        (16, 128, 4, 4),
        (32, 128, 2, 4),
        (32, 128, 4, 4),
        (32, 256, 2, 4),
        (32, 256, 4, 8),
        (64, 64, 1, 4),
        (64, 128, 1, 4),
        (64, 128, 2, 4),
        (64, 128, 4, 4),
        (64, 256, 2, 8),
        (128, 64, 1, 4),
        (128, 128, 1, 8),
    )
)
PROGRAMS = 512  # the programs the heuristic aims for: ~4 per SM of a 132-SM H100
TIMED_CALLS = 10  # per candidate, after 2 warm-up calls, each after a flush of the L2 cache
_chosen = {}  # (row bucket, N, K, dtype, bias?, device) -> the Config timed fastest


def row_bucket(rows: int) -> int:
    """The rows a chosen launch shape is shared by: 1 (GEMV), then up to 16, 32, 64, MAX_KERNEL_ROWS."""
    return next(b for b in (1, 16, 32, 64, MAX_KERNEL_ROWS) if rows <= b) if rows <= MAX_KERNEL_ROWS else rows


def heuristic(rows: int, columns: int, depth: int) -> Config:
    """An untimed launch shape (Triton's interpreter, under CUDA-graph capture): tiles of 16 columns (GEMV) or
    32, K slices of 256 or 128, split-K doubled up to 8 while there are fewer than PROGRAMS programs and each
    slice keeps two K blocks."""
    config = Config(16, 256, gemv=True) if rows == 1 else Config(32, 128)
    programs = -(-columns // config.block_n) * -(-rows // row_block(rows, config))
    split = 1
    while split < 8 and programs * split < PROGRAMS and depth >= 4 * split * config.block_k:
        split *= 2
    return config._replace(split_k=split)


def candidates(rows: int, columns: int, depth: int) -> list:
    """The launch shapes timed for this shape: those whose tiles and K slices are not mostly padding."""
    fits = [
        c
        for c in (GEMV_CANDIDATES if rows == 1 else DOT_CANDIDATES)
        if c.block_n <= max(16, 2 * columns) and c.block_k <= max(64, 2 * depth) and depth >= c.split_k * c.block_k
    ]
    return list(dict.fromkeys([LEGACY, heuristic(rows, columns, depth)] + fits))


def config_for(x: torch.Tensor, qweight: torch.Tensor, bias: Optional[torch.Tensor], run: Callable) -> Config:
    """The launch shape for x [M, K] and this weight: timed among `candidates` at the first call of its key
    (row bucket, N, K, dtype, bias, device), on CUDA and outside CUDA-graph capture; the heuristic's otherwise (and
    under capture, not kept: the next eager call times them). A CUDA graph captures what its warm-up chose."""
    rows, depth = x.shape
    key = (row_bucket(rows), qweight.size(0), depth, x.dtype, bias is not None, x.device)
    config = _chosen.get(key)
    if config is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return heuristic(rows, qweight.size(0), depth)
        config = _chosen[key] = fastest(run, candidates(rows, qweight.size(0), depth), x.device)
        logger.info("int8 matmul %s rows x %s x %s: %s", rows, qweight.size(0), depth, config)
    return config


def fastest(run: Callable, configs, device: torch.device) -> Config:
    """The config of `configs` for which `run(config)` (one matmul) has the lowest median CUDA time (weights
    re-read from memory each call, as in a decode step, where a layer's weights are long gone from L2 by the
    next step)."""
    try:
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)  # larger than any GPU's L2 cache
    except torch.cuda.OutOfMemoryError:  # a GPU filled by the KV cache: timed without the flush
        flush = torch.empty(0, dtype=torch.int8, device=device)
    times = {}
    for config in configs:
        try:
            for _ in range(2):  # compile, warm
                run(config)
        except Exception:  # a launch shape this GPU cannot run (Triton's OutOfResources): not a candidate
            continue
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(TIMED_CALLS)
        ]
        for start, end in events:
            flush.zero_()
            start.record()
            run(config)
            end.record()
        torch.cuda.synchronize(device)
        times[config] = sorted(start.elapsed_time(end) for start, end in events)[TIMED_CALLS // 2]
    return min(times, key=times.get) if times else configs[0]  # none ran: the first's launch says why


def tuned_configs() -> dict:
    """The launch shapes chosen so far, by (row bucket, N, K, dtype, bias?, device)."""
    return dict(_chosen)
