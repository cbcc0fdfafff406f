"""Two gloo processes: memory statistics and logging-output sums are reduced across ranks in one
collective per log interval."""

import json
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fairseq.logging.logging_outputs import LoggingOutputSums
from fairseq.logging.memory import GIB, CudaMemoryStats, RawMemoryCounters
from tests.train_fixtures import spawn_ranks

WORLD_SIZE = 2
# per rank: (peak allocated, peak reserved, allocated, reserved, total) in GiB, and retries
RANK_MEMORY = [((10.0, 30.0, 8.0, 30.0, 80.0), 0), ((12.0, 20.0, 9.5, 18.0, 40.0), 4)]


class FixedReader:
    def __init__(self, gib, retries):
        peak_allocated, peak_reserved, allocated, reserved, total = (int(x * GIB) for x in gib)
        self.counters = RawMemoryCounters(peak_allocated, peak_reserved, allocated, reserved, total, retries)
        self.reset_calls = 0

    def read(self):
        return self.counters

    def reset_peaks(self):
        self.reset_calls += 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, port, out_dir):
    """One log boundary on each rank: memory statistics, then the interval's logging-output sums."""
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=30),
    )
    try:
        gib, retries = RANK_MEMORY[rank]
        reader = FixedReader(gib, retries)
        memory = CudaMemoryStats(reader, min_excess_gib=1000.0).interval_stats()
        sums = LoggingOutputSums()
        for step in range(3):
            sums.add({"loss": torch.tensor(1.5 * (rank + 1)), "ntokens": 100 * (rank + 1) + step})
        result = {"memory": memory, "reset_calls": reader.reset_calls, "sums": sums.reduce(all_reduce=True)}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    """Both ranks' results; the processes are started once for the module (starting one costs seconds)."""
    out_dir = tmp_path_factory.mktemp("ranks")
    spawn_ranks(worker, WORLD_SIZE, free_port(), str(out_dir))
    results = []
    for rank in range(WORLD_SIZE):
        with open(out_dir / f"rank{rank}.json") as f:
            results.append(json.load(f))
    return results


def test_memory_stats_are_the_maximum_over_ranks_and_free_the_minimum(rank_results):
    expected = {
        "max_cuda_gb_allocated": 12.0,
        "max_cuda_gb_reserved": 30.0,
        "current_cuda_gb_allocated": 9.5,
        "current_cuda_gb_reserved": 30.0,
        "cuda_gb_free": 20.0,  # rank 1: 40 - 20; rank 0 had 50 free
        "gb_free": 20.0,
        "cuda_alloc_retries": 4,
    }
    assert [(r["memory"], r["reset_calls"]) for r in rank_results] == [(expected, 1)] * WORLD_SIZE


def test_logging_output_sums_are_added_across_ranks(rank_results):
    # loss: 3 steps x (1.5 + 3.0); ntokens: (100 + 101 + 102) + (200 + 201 + 202)
    assert [r["sums"] for r in rank_results] == [{"loss": 13.5, "ntokens": 906}] * WORLD_SIZE
