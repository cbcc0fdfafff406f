"""fairseq.checkpoint.writer: the mode it owns, one background write at a time (bytes, then publication), its time
and its error reported to the loop, the advice when saves wait for writes, and the host memory asynchronous saves
need (for the memory planner). The staging itself: tests/unit/test_checkpoint_staging.py."""

import logging
import threading
import time

import pytest
import torch

from fairseq.checkpoint.io import CheckpointSaveError
from fairseq.checkpoint.writer import (
    SLOW_WRITE_ENV,
    AsyncMode,
    CheckpointWriter,
    Write,
    async_save_host_bytes,
    wait_advice,
)

GIB = 2**30


def nothing():
    return None


def test_the_mode_comes_from_the_flag_and_the_device():
    assert AsyncMode.for_run(False, cuda=True) is AsyncMode.DISABLED
    assert AsyncMode.for_run(True, cuda=False) is AsyncMode.ASYNC
    # pinned memory needs CUDA: without it (this machine) the asynchronous mode is the pageable one
    expected = AsyncMode.ASYNC_WITH_PINNED_MEM if torch.cuda.is_available() else AsyncMode.ASYNC
    assert AsyncMode.for_run(True, cuda=True) is expected


def test_a_synchronous_write_runs_now_and_returns_its_seconds():
    writer = CheckpointWriter(AsyncMode.DISABLED)
    done = []
    write = Write(
        lambda: done.append(("bytes", threading.current_thread())),
        lambda: done.append(("publish", threading.current_thread())),
    )
    seconds = writer.run(write, "c.pt", time.perf_counter())
    assert done == [("bytes", threading.main_thread()), ("publish", threading.main_thread())]
    assert seconds >= 0 and writer.in_flight is None


def test_a_background_write_is_polled_then_waited_for_and_logged(caplog):
    writer = CheckpointWriter(AsyncMode.ASYNC)
    release = threading.Event()
    threads = []

    def write_bytes():
        threads.append(threading.current_thread())
        release.wait(5)

    started = time.perf_counter()
    assert writer.run(Write(write_bytes, nothing), "ck/checkpoint_1_2.pt", started) is None
    assert writer.in_flight == "ck/checkpoint_1_2.pt" and writer.poll() is None  # still writing: nothing yet
    with pytest.raises(RuntimeError, match="in flight"):  # one write at a time
        writer.run(Write(nothing, nothing), "ck/checkpoint_1_3.pt", started)
    threading.Timer(0.2, release.set).start()
    with caplog.at_level(logging.INFO, logger="fairseq.checkpoint.writer"):
        seconds = writer.wait("before the next save")
    assert threads[0] is not threading.main_thread()
    # The waiter wakes after the write thread's last timestamp (thread hand-off, ms under load): 0.1 s of slack.
    assert seconds >= 0.2 and writer.in_flight is None and 0.1 < writer.waited <= seconds + 0.1
    [line] = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert line.startswith("waited 0.") and line.endswith(
        "for the background write of ck/checkpoint_1_2.pt before the next save"
    )
    assert writer.wait("at the end of training") is None and writer.waited == 0  # nothing in flight: no wait
    # `now` (the preemption checkpoint) writes in the loop whatever the mode
    order = []
    assert writer.run(Write(lambda: order.append(threading.current_thread()), nothing), "c.pt", started, now=True) > 0
    assert order == [threading.main_thread()]
    writer.close()


def test_the_seam_pauses_a_background_write_between_its_bytes_and_its_publication(monkeypatch):
    monkeypatch.setenv(SLOW_WRITE_ENV, "0.3")
    writer = CheckpointWriter(AsyncMode.ASYNC)
    times = {}
    writer.run(
        Write(
            lambda: times.setdefault("bytes", time.perf_counter()),
            lambda: times.setdefault("publish", time.perf_counter()),
        ),
        "c.pt",
        time.perf_counter(),
    )
    writer.wait("at the end of training")
    assert times["publish"] - times["bytes"] >= 0.3
    writer.close()


def test_a_failed_background_write_is_raised_by_the_next_poll(tmp_path):
    writer = CheckpointWriter(AsyncMode.ASYNC)
    error = CheckpointSaveError(f"cannot write checkpoint {tmp_path}/c.pt: File too large (EFBIG)")
    published = []

    def write_bytes():
        raise error

    writer.run(Write(write_bytes, lambda: published.append(1)), "c.pt", time.perf_counter())
    deadline = time.time() + 10
    with pytest.raises(CheckpointSaveError) as raised:
        while time.time() < deadline:
            writer.poll()
            time.sleep(0.001)
    assert raised.value is error and writer.in_flight is None and not published  # no rename for failed bytes
    writer.close()


def test_close_waits_for_the_write_and_logs_its_error_instead_of_raising(caplog):
    writer = CheckpointWriter(AsyncMode.ASYNC)

    def write_bytes():
        time.sleep(0.1)
        raise CheckpointSaveError("cannot write checkpoint c.pt: No space left on device (ENOSPC)")

    writer.run(Write(write_bytes, nothing), "c.pt", time.perf_counter())
    with caplog.at_level(logging.INFO, logger="fairseq.checkpoint.writer"):
        writer.close()  # after another error: the run ends with that one
    assert any("ENOSPC" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


def test_a_synchronous_writer_stages_a_sharded_state_as_it_is_and_a_single_file_without_copying_host_tensors():
    state = {"model": {"w": torch.ones(3)}}
    writer = CheckpointWriter(AsyncMode.DISABLED)
    assert writer.stage(state, single_file=False).state is state  # DCP writes it before training goes on
    staged = writer.stage(state, single_file=True).state
    assert staged is not state and staged["model"]["w"].data_ptr() == state["model"]["w"].data_ptr()
    asynchronous = CheckpointWriter(AsyncMode.ASYNC).stage(state, single_file=True).state
    assert torch.equal(asynchronous["model"]["w"], state["model"]["w"])
    assert asynchronous["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()


def test_wait_advice_names_the_write_time_and_an_interval_that_would_not_wait():
    assert wait_advice(18.0, 7, 9.0, interval_flag=True) == (
        "checkpoint write took 18.0 s; saves every 7 updates (~9 s) wait for it; --save-interval-updates >= 15 "
        "would not"
    )
    assert wait_advice(2.0, 1, 0.5, interval_flag=False).endswith("saves at least 5 updates apart would not")


def test_async_save_host_bytes():
    # 175B parameters, fp32 weights and Adam's two moments: 0.7 TB + 1.4 TB
    model, optimizer = 175 * 10**9 * 4, 175 * 10**9 * 8
    # sharded over 1,024 ranks (FSDP 1,024, or FSDP 128 x TP 8): 2.05 GB of host memory per rank
    per_rank = async_save_host_bytes(model, optimizer, sharded=True, state_shards=1024)
    assert per_rank == -(-(model + optimizer) // 1024) and round(per_rank / GIB, 2) == 1.91
    assert async_save_host_bytes(model, optimizer, sharded=True, state_shards=128 * 8) == per_rank
    # single file on rank 0: the whole state, once (gathered one tensor at a time into the kept buffers)
    small_model, small_optimizer = 125 * 10**6 * 4, 125 * 10**6 * 8
    assert async_save_host_bytes(small_model, small_optimizer, sharded=False) == 1.5 * 10**9
    with pytest.raises(ValueError):
        async_save_host_bytes(1, 1, sharded=True, state_shards=0)
