"""GPU memory statistics for log lines: what was allocated, what the caching allocator reserved, and
what was really free at the peak.

Once per log interval `CudaMemoryStats.interval_stats()` reads the allocator's counters, resets its peak
statistics (peaks therefore cover exactly one log interval, and nothing else may reset them), takes the
maximum over ranks with one small all-reduce, and returns, in GiB rounded to 0.1:

    max_cuda_gb_allocated      peak bytes held by tensors in the interval
    max_cuda_gb_reserved       peak bytes the caching allocator held from the device in the interval
    current_cuda_gb_allocated  at the log boundary
    current_cuda_gb_reserved   at the log boundary
    cuda_gb_free               device total - peak reserved: the headroom left at the interval's peak
    gb_free                    upstream fairseq's key, with the same meaning (upstream used
                               total - peak allocated, which hides memory the allocator keeps cached)
    cuda_alloc_retries         allocations in the interval that failed, flushed the cache and retried
                               (each retry synchronizes the device)

Across ranks every value is the maximum, except the two free values, which are the minimum (the rank
with the least headroom), i.e. still total - the largest peak reserved on GPUs of one size.

The raw counters come from a reader object (`TorchCudaMemoryReader` for a CUDA device); any object with
`read() -> RawMemoryCounters` and `reset_peaks()` can stand in, which is how the numbers are tested
without a GPU.
"""

import logging
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

GIB = 1024**3


@dataclass(frozen=True)
class RawMemoryCounters:
    """The allocator's counters, in bytes (retries: cumulative count since the process started)."""

    peak_allocated: int
    peak_reserved: int
    allocated: int
    reserved: int
    total: int
    alloc_retries: int


class TorchCudaMemoryReader:
    """Counters of PyTorch's CUDA caching allocator for one device."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._total = torch.cuda.get_device_properties(self.device).total_memory

    def read(self) -> RawMemoryCounters:
        stats = torch.cuda.memory_stats(self.device)  # one call; empty before the first allocation
        return RawMemoryCounters(
            peak_allocated=stats.get("allocated_bytes.all.peak", 0),
            peak_reserved=stats.get("reserved_bytes.all.peak", 0),
            allocated=stats.get("allocated_bytes.all.current", 0),
            reserved=stats.get("reserved_bytes.all.current", 0),
            total=self._total,
            alloc_retries=stats.get("num_alloc_retries", 0),
        )

    def reset_peaks(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def _gib(num_bytes: float) -> float:
    return round(num_bytes / GIB, 1)


class CudaMemoryStats:
    """Memory statistics per log interval (see the module docstring).

    `reader=None` means there is no GPU to measure: `interval_stats()` returns {} and no collective runs
    (every rank of a job is expected to agree on that). `interval_stats()` is a collective when
    torch.distributed is initialized: call it on every rank of `group` at the same log boundary.

    Warnings (each once per process, on rank 0): allocation retries, or peak reserved above
    `fragmentation_ratio` x peak allocated with at least `min_excess_gib` GiB in between (the floor keeps
    small models, whose caches dwarf their tensors, from warning).
    """

    def __init__(
        self,
        reader=None,
        group: Optional[dist.ProcessGroup] = None,
        fragmentation_ratio: float = 1.5,
        min_excess_gib: float = 1.0,
    ):
        self.reader = reader
        self.group = group
        self.fragmentation_ratio = fragmentation_ratio
        self.min_excess_gib = min_excess_gib
        self._retries_at_last_boundary = 0
        self._warned_retries = False
        self._warned_fragmentation = False

    @classmethod
    def for_device(cls, device, group: Optional[dist.ProcessGroup] = None, **kwargs) -> "CudaMemoryStats":
        """Statistics of `device` when it is a CUDA device and CUDA works; otherwise an empty source."""
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.is_available():
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return cls(TorchCudaMemoryReader(device), group=group, **kwargs)
        return cls(None, group=group, **kwargs)

    @property
    def available(self) -> bool:
        return self.reader is not None

    def interval_stats(self, start_next_interval: bool = True) -> Dict[str, float]:
        """Read this interval's numbers, start the next interval, reduce over ranks, warn if needed.

        With `start_next_interval=False` (a validation line in the middle of a log interval) the numbers so
        far are reported and the interval goes on: peaks are reset only at log boundaries."""
        if self.reader is None:
            return {}
        raw = self.reader.read()
        retries = raw.alloc_retries - self._retries_at_last_boundary
        if start_next_interval:
            self.reader.reset_peaks()
            self._retries_at_last_boundary = raw.alloc_retries
        free_at_peak = raw.total - raw.peak_reserved
        # negated free: one MAX reduction yields the minimum free memory over ranks
        values = [raw.peak_allocated, raw.peak_reserved, raw.allocated, raw.reserved, -free_at_peak, retries, raw.total]
        peak_alloc, peak_res, alloc, res, neg_free, retries, total = self._max_over_ranks(values)
        stats = {
            "max_cuda_gb_allocated": _gib(peak_alloc),
            "max_cuda_gb_reserved": _gib(peak_res),
            "current_cuda_gb_allocated": _gib(alloc),
            "current_cuda_gb_reserved": _gib(res),
            "cuda_gb_free": _gib(-neg_free),
            "gb_free": _gib(-neg_free),
            "cuda_alloc_retries": int(retries),
        }
        if self._is_rank_zero():
            self._warn_once(peak_alloc, peak_res, retries, total, stats)
        return stats

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _is_rank_zero(self) -> bool:
        return not self._distributed() or dist.get_rank(self.group) == 0

    def _max_over_ranks(self, values):
        if not self._distributed():
            return values
        backend = dist.get_backend(self.group)
        device = getattr(self.reader, "device", None) if "nccl" in str(backend) else None
        packed = torch.tensor(values, dtype=torch.int64, device=device or "cpu")
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.group)
        return packed.tolist()

    def _warn_once(self, peak_alloc: int, peak_res: int, retries: int, total: int, stats: Dict[str, float]) -> None:
        levers = (
            "Levers: a smaller batch size (--batch-size / --max-tokens) or --checkpoint-activations lowers the "
            "peak; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces fragmentation; --fsdp-sync-free (with "
            "--ddp-backend fully_sharded) bounds how far the CPU runs ahead of the GPU, which matters where freed "
            "buffers wait on the GPU before reuse (on FSDP2 it changed neither reserved memory nor the retries in "
            "the runs of docs/fsdp.md)."
        )
        numbers = (
            f"peak allocated {stats['max_cuda_gb_allocated']} GiB, peak reserved {stats['max_cuda_gb_reserved']} GiB, "
            f"device total {_gib(total)} GiB, free at peak {stats['cuda_gb_free']} GiB"
        )
        if retries > 0 and not self._warned_retries:
            self._warned_retries = True
            logger.warning(
                f"CUDA caching allocator retried {retries} allocations in the last log interval after running "
                f"out of memory ({numbers}); each retry empties the cache and synchronizes the device, which "
                f"slows training. {levers}"
            )
        excess = peak_res - peak_alloc
        if (
            not self._warned_fragmentation
            and peak_res > self.fragmentation_ratio * peak_alloc
            and excess >= self.min_excess_gib * GIB
        ):
            self._warned_fragmentation = True
            logger.warning(
                f"CUDA memory reserved by the caching allocator exceeds what tensors use by more than "
                f"{round((self.fragmentation_ratio - 1) * 100)}% ({numbers}): {_gib(excess)} GiB is cached "
                f"but not in use. {levers}"
            )
