import logging

import pytest
import torch

from fairseq.logging import metrics
from fairseq.logging.log_line import log_memory_stats
from fairseq.logging.memory import GIB, CudaMemoryStats, RawMemoryCounters


class SimulatedAllocator:
    """A memory reader fed with chosen numbers, keeping peaks the way PyTorch's allocator does: a peak
    is the largest value since the last reset_peaks(), which sets it back to the current value."""

    def __init__(self, total_gib=80.0):
        self.total = int(total_gib * GIB)
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.alloc_retries = 0
        self.reset_calls = 0

    def step(self, allocated_gib, reserved_gib, retries=0):
        self.allocated, self.reserved = int(allocated_gib * GIB), int(reserved_gib * GIB)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.alloc_retries += retries

    def read(self):
        return RawMemoryCounters(
            peak_allocated=self.peak_allocated,
            peak_reserved=self.peak_reserved,
            allocated=self.allocated,
            reserved=self.reserved,
            total=self.total,
            alloc_retries=self.alloc_retries,
        )

    def reset_peaks(self):
        self.reset_calls += 1
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


@pytest.fixture
def memory_warnings(caplog):
    caplog.set_level(logging.WARNING, logger="fairseq.logging.memory")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "fairseq.logging.memory"]


def test_peaks_cover_the_whole_interval_and_free_is_total_minus_peak_reserved():
    allocator = SimulatedAllocator(total_gib=80.0)
    stats = CudaMemoryStats(allocator)
    allocator.step(2.0, 4.0)
    allocator.step(10.0, 12.0)
    allocator.step(3.0, 12.0)
    assert stats.interval_stats() == {
        "max_cuda_gb_allocated": 10.0,
        "max_cuda_gb_reserved": 12.0,
        "current_cuda_gb_allocated": 3.0,
        "current_cuda_gb_reserved": 12.0,
        "cuda_gb_free": 68.0,
        "gb_free": 68.0,
        "cuda_alloc_retries": 0,
    }


def test_peaks_reset_only_at_log_boundaries():
    allocator = SimulatedAllocator()
    allocator.step(10.0, 12.0)
    stats = CudaMemoryStats(allocator)
    assert allocator.reset_calls == 0  # building it starts nothing: the first interval includes start-up
    allocator.step(4.0, 6.0)
    first = stats.interval_stats()
    assert allocator.reset_calls == 1
    assert (first["max_cuda_gb_allocated"], first["max_cuda_gb_reserved"]) == (10.0, 12.0)
    allocator.step(5.0, 6.0)
    allocator.step(4.5, 6.0)
    second = stats.interval_stats()
    assert allocator.reset_calls == 2
    assert (second["max_cuda_gb_allocated"], second["max_cuda_gb_reserved"]) == (5.0, 6.0)
    assert second["current_cuda_gb_allocated"] == 4.5


def test_retries_are_counted_per_interval():
    allocator = SimulatedAllocator()
    stats = CudaMemoryStats(allocator)
    retries_seen = []
    for new_retries in (3, 2, 0):
        allocator.step(1.0, 1.0, retries=new_retries)
        retries_seen.append(stats.interval_stats()["cuda_alloc_retries"])
    assert retries_seen == [3, 2, 0]


def test_values_are_gib_rounded_to_a_tenth():
    allocator = SimulatedAllocator(total_gib=79.35)
    stats = CudaMemoryStats(allocator)
    allocator.step(13.44, 13.46)
    allocator.step(0.04, 13.46)
    out = stats.interval_stats()
    assert out["max_cuda_gb_allocated"] == 13.4
    assert out["max_cuda_gb_reserved"] == 13.5
    assert out["current_cuda_gb_allocated"] == 0.0
    assert out["cuda_gb_free"] == 65.9  # 79.35 - 13.46 = 65.89


def test_free_memory_follows_reserved_not_allocated():
    """The seed's runs before and after the fix: 13.4 GiB allocated on a 79.3 GiB card, 75.4 then 22.1
    reserved. Upstream reported 65.9 free both times; the free memory really left was 3.9 and 57.2."""
    free = []
    for reserved in (75.4, 22.1):
        allocator = SimulatedAllocator(total_gib=79.3)
        allocator.step(13.4, reserved)
        out = CudaMemoryStats(allocator, min_excess_gib=1000.0).interval_stats()  # no warning wanted here
        free.append((out["cuda_gb_free"], out["gb_free"]))
    assert free == [(3.9, 3.9), (57.2, 57.2)]


def test_retries_warn_once_with_the_numbers_and_the_levers(memory_warnings):
    allocator = SimulatedAllocator(total_gib=79.3)
    stats = CudaMemoryStats(allocator)
    allocator.step(13.4, 14.0, retries=2)
    stats.interval_stats()
    allocator.step(13.4, 14.0, retries=5)
    stats.interval_stats()
    messages = memory_warnings()
    assert len(messages) == 1
    message = messages[0]
    assert "retried 2 allocations" in message
    assert "peak allocated 13.4 GiB, peak reserved 14.0 GiB, device total 79.3 GiB, free at peak 65.3 GiB" in message
    assert "--fsdp-sync-free" in message and "batch size" in message


def test_reserved_far_above_allocated_warns_once(memory_warnings):
    allocator = SimulatedAllocator(total_gib=80.0)
    stats = CudaMemoryStats(allocator)
    allocator.step(10.0, 14.9)  # 1.49x: fine
    stats.interval_stats()
    assert memory_warnings() == []
    allocator.step(10.0, 15.2)  # 1.52x
    stats.interval_stats()
    allocator.step(10.0, 30.0)
    stats.interval_stats()
    messages = memory_warnings()
    assert len(messages) == 1
    assert "peak allocated 10.0 GiB, peak reserved 15.2 GiB" in messages[0]
    assert "5.2 GiB is cached but not in use" in messages[0]
    assert "--fsdp-sync-free" in messages[0] and "batch size" in messages[0]


def test_small_caches_do_not_warn(memory_warnings):
    allocator = SimulatedAllocator()
    stats = CudaMemoryStats(allocator)
    allocator.step(0.05, 0.5)  # 10x, but under 1 GiB of difference
    stats.interval_stats()
    assert memory_warnings() == []


def test_no_cuda_means_no_stats():
    stats = CudaMemoryStats.for_device("cpu")
    assert not stats.available
    assert stats.interval_stats() == {}


def test_logged_into_metrics_interval_values_and_epoch_extremes():
    metrics.reset()
    allocator = SimulatedAllocator(total_gib=80.0)
    stats = CudaMemoryStats(allocator)
    intervals = [(10.0, 12.0, 1), (20.0, 22.0, 0), (5.0, 8.0, 2)]
    try:
        with metrics.aggregate("train"), metrics.aggregate("train_inner"):
            for allocated, reserved, retries in intervals:
                metrics.reset_meters("train_inner")
                allocator.step(allocated, reserved, retries)
                allocator.reset_peaks()  # only the interval's own step counts in this test
                allocator.step(allocated, reserved)
                log_memory_stats(stats.interval_stats())
        inner = metrics.get_smoothed_values("train_inner")
        epoch = metrics.get_smoothed_values("train")
    finally:
        metrics.reset()
    assert inner == {
        "max_cuda_gb_allocated": 5.0,
        "max_cuda_gb_reserved": 8.0,
        "current_cuda_gb_allocated": 5.0,
        "current_cuda_gb_reserved": 8.0,
        "cuda_gb_free": 72.0,
        "gb_free": 72.0,
        "cuda_alloc_retries": 2,
    }
    assert epoch == {
        "max_cuda_gb_allocated": 20.0,
        "max_cuda_gb_reserved": 22.0,
        "current_cuda_gb_allocated": 5.0,
        "current_cuda_gb_reserved": 8.0,
        "cuda_gb_free": 58.0,
        "gb_free": 58.0,
        "cuda_alloc_retries": 3,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_numbers_equal_what_torch_cuda_reports():
    device = torch.device("cuda", torch.cuda.current_device())
    stats = CudaMemoryStats.for_device(device)
    stats.interval_stats()  # start a fresh interval
    big = torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device=device)
    del big
    keep = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
    expected_peak_allocated = torch.cuda.max_memory_allocated(device)
    expected_peak_reserved = torch.cuda.max_memory_reserved(device)
    expected_allocated = torch.cuda.memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    out = stats.interval_stats()
    assert out["max_cuda_gb_allocated"] == round(expected_peak_allocated / GIB, 1)
    assert out["max_cuda_gb_reserved"] == round(expected_peak_reserved / GIB, 1)
    assert out["current_cuda_gb_allocated"] == round(expected_allocated / GIB, 1)
    assert out["cuda_gb_free"] == round((total - expected_peak_reserved) / GIB, 1)
    assert out["cuda_alloc_retries"] == 0
    # the boundary reset the peaks: the 0.5 GiB tensor no longer counts
    assert torch.cuda.max_memory_allocated(device) == torch.cuda.memory_allocated(device)
    del keep
