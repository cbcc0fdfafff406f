"""fairseq.checkpoint.writer: one background write at a time, its time and its error reported to the loop, host
snapshots in buffers reused across saves, and the host memory asynchronous saves need (for the memory planner)."""

import logging
import threading
import time

import pytest
import torch

from fairseq.checkpoint.io import CheckpointSaveError
from fairseq.checkpoint.writer import CheckpointWriter, async_save_host_bytes

GIB = 2**30


def test_a_synchronous_write_runs_now_and_returns_its_seconds():
    writer = CheckpointWriter(background=False)
    done = []
    seconds = writer.run(lambda: done.append(threading.current_thread()), "c.pt", time.perf_counter(),
                         background=False)
    assert done == [threading.main_thread()] and seconds >= 0 and writer.in_flight is None


def test_a_background_write_is_polled_then_waited_for_and_logged(caplog):
    writer = CheckpointWriter(background=True)
    release = threading.Event()
    threads = []

    def write():
        threads.append(threading.current_thread())
        release.wait(5)

    started = time.perf_counter()
    assert writer.run(write, "ck/checkpoint_1_2.pt", started, background=True) is None
    assert writer.in_flight == "ck/checkpoint_1_2.pt" and writer.poll() is None  # still writing: nothing yet
    with pytest.raises(RuntimeError, match="in flight"):  # one write at a time
        writer.run(lambda: None, "ck/checkpoint_1_3.pt", started, background=True)
    threading.Timer(0.2, release.set).start()
    with caplog.at_level(logging.INFO, logger="fairseq.checkpoint.writer"):
        seconds = writer.wait("before the next save")
    assert threads[0] is not threading.main_thread()
    assert seconds >= 0.2 and writer.in_flight is None
    [line] = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert line.startswith("waited 0.") and line.endswith("for the background write of ck/checkpoint_1_2.pt before "
                                                          "the next save")
    assert writer.wait("at the end of training") is None  # nothing in flight: no wait, no line
    writer.close()


def test_a_failed_background_write_is_raised_by_the_next_poll(tmp_path):
    writer = CheckpointWriter(background=True)
    error = CheckpointSaveError(f"cannot write checkpoint {tmp_path}/c.pt: File too large (EFBIG)")

    def write():
        raise error

    writer.run(write, "c.pt", time.perf_counter(), background=True)
    deadline = time.time() + 10
    with pytest.raises(CheckpointSaveError) as raised:
        while time.time() < deadline:
            writer.poll()
            time.sleep(0.001)
    assert raised.value is error and writer.in_flight is None
    writer.close()


def test_close_waits_for_the_write_and_logs_its_error_instead_of_raising(caplog):
    writer = CheckpointWriter(background=True)

    def write():
        time.sleep(0.1)
        raise CheckpointSaveError("cannot write checkpoint c.pt: No space left on device (ENOSPC)")

    writer.run(write, "c.pt", time.perf_counter(), background=True)
    with caplog.at_level(logging.INFO, logger="fairseq.checkpoint.writer"):
        writer.close()  # after another error: the run ends with that one
    assert any("ENOSPC" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


def test_snapshots_reuse_their_buffers_and_do_not_follow_training():
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    writer = CheckpointWriter(background=True)

    def state():
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": [1, {"i": 2}]}

    first = writer.snapshot(state())
    weight = model.weight.detach().clone()
    assert torch.equal(first["model"]["weight"], weight)
    assert first["model"]["weight"].data_ptr() != model.weight.data_ptr()
    buffers = first["model"]["weight"].data_ptr(), first["optimizer"]["state"][0]["exp_avg"].data_ptr()
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()  # training goes on: the snapshot keeps the state it was taken from
    assert torch.equal(first["model"]["weight"], weight)
    assert first["optimizer"]["state"][0]["step"].item() == 1
    del first
    second = writer.snapshot(state())
    assert (second["model"]["weight"].data_ptr(), second["optimizer"]["state"][0]["exp_avg"].data_ptr()) == buffers
    assert torch.equal(second["model"]["weight"], model.weight) and second["epoch"] == [1, {"i": 2}]
    one_off = writer.snapshot(state(), reusable=False)
    assert one_off["model"]["weight"].data_ptr() not in buffers
    writer.close()


def test_async_save_host_bytes():
    # 175B parameters, fp32 weights and Adam's two moments: 0.7 TB + 1.4 TB
    model, optimizer = 175 * 10**9 * 4, 175 * 10**9 * 8
    # sharded over 1,024 ranks (FSDP 1,024, or FSDP 128 x TP 8): 2.05 GB of host memory per rank
    per_rank = async_save_host_bytes(model, optimizer, sharded=True, state_shards=1024)
    assert per_rank == -(-(model + optimizer) // 1024) and round(per_rank / GIB, 2) == 1.91
    assert async_save_host_bytes(model, optimizer, sharded=True, state_shards=128 * 8) == per_rank
    # single file on rank 0: the whole state; gathered by FSDP: twice that while the snapshot is taken
    small_model, small_optimizer = 125 * 10**6 * 4, 125 * 10**6 * 8
    assert async_save_host_bytes(small_model, small_optimizer, sharded=False) == 1.5 * 10**9
    assert async_save_host_bytes(small_model, small_optimizer, sharded=False, gathered=True) == 3 * 10**9
    with pytest.raises(ValueError):
        async_save_host_bytes(1, 1, sharded=True, state_shards=0)
