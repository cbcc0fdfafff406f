"""fairseq-serve --model-parallel-size 2 on 2 gloo ranks (the project's launcher) when a rank stalls: rank 1 is
stopped (SIGSTOP, as a rank whose host or GPU hangs), so that rank 0's best_of call waits for it in its
collectives. A drain whose timeout ends while that call runs (longer than the 10 s rank 0 once waited for its
decode thread), and a second SIGTERM while rank 0 waits for it, still tell rank 1 to stop once the call is done,
and every rank exits 0; a rank that does not take the next operation within the process group's timeout
(--heartbeat-timeout 6) stops the server with one line naming the rank and the cause, its client answered with
that line (rank 0 once answered 500 and served on with its ranks out of step). tests/unit/test_serve_agreement.py
has the ranks' agreement on a failure inside an operation."""

import concurrent.futures
import contextlib
import os
import re
import signal
import threading
import time

import pytest

from tests.integration.test_serve import request, start_server

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(120)]

TP = ("--model-parallel-size", 2, "--distributed-world-size", 2)
BEST_OF = {"prompt": "w4 w2", "max_tokens": 6, "best_of": 3, "n": 2, "temperature": 0}


class Output:
    """The job's output, read on a thread as it comes (so that its pipe never fills)."""

    def __init__(self, job):
        self.lines = list(job.log)
        self.thread = threading.Thread(target=self._read, args=(job,), daemon=True)
        self.thread.start()

    def _read(self, job):
        for line in job.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text())
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the output:\n{self.text()}")


def follower_pid(output: Output) -> int:
    return int(output.wait_for(r"rank 1 of 2 \(pid (\d+)\): loaded").group(1))


def post_async(pool, url, body):
    return pool.submit(request, url, "POST", "/v1/completions", body)


def stop_job(job):
    if job.poll() is None:
        job.kill()
        job.wait()


def test_a_drain_that_ends_while_a_long_best_of_call_runs_still_stops_every_rank(tiny_lm_checkpoint, tiny_data):
    job, url = start_server(tiny_lm_checkpoint, tiny_data, *TP, "--drain-timeout", 1)
    output = Output(job)
    follower = follower_pid(output)
    try:
        os.kill(follower, signal.SIGSTOP)  # rank 0's next call waits for rank 1 in its collectives
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = post_async(pool, url, BEST_OF)
            time.sleep(1.0)
            job.send_signal(signal.SIGTERM)  # the launcher passes it to both ranks
            time.sleep(3)  # the drain's 1 s ends; rank 0 waits for the call
            job.send_signal(signal.SIGTERM)  # a second one (it killed rank 0, its HTTP side gone, before)
            time.sleep(9)  # the call runs on past the 10 s rank 0 gave its decode thread after the drain before
            os.kill(follower, signal.SIGCONT)
            with contextlib.suppress(ConnectionError):  # cut by the drain's timeout, or answered
                running.result(timeout=60)
        assert job.wait(timeout=60) == 0, output.text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(follower, signal.SIGCONT)
        stop_job(job)
    output.thread.join(timeout=10)
    assert "rank 1: rank 0 stopped serving" in output.text()


def test_a_rank_that_stalls_stops_the_server_with_one_line_naming_it(tiny_lm_checkpoint, tiny_data):
    # --heartbeat-timeout 6: rank 0 waits 6 s for rank 1 to take the next operation (3 s within one)
    job, url = start_server(tiny_lm_checkpoint, tiny_data, *TP, "--heartbeat-timeout", 6)
    output = Output(job)
    follower = follower_pid(output)
    try:
        status, payload, _ = request(url, "POST", "/v1/completions", BEST_OF)
        assert status == 200, payload  # both ranks ran it
        os.kill(follower, signal.SIGSTOP)
        started = time.monotonic()
        status, payload, _ = request(url, "POST", "/v1/completions", BEST_OF)
        answered = time.monotonic() - started
        assert job.wait(timeout=30) != 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(follower, signal.SIGCONT)
        stop_job(job)
    output.thread.join(timeout=10)
    line = "rank 0: the other ranks did not take the next operation (RuntimeError: "
    assert status == 500 and line in payload.decode(), payload
    assert 6 <= answered < 15, answered  # the control group's timeout, --heartbeat-timeout
    log = output.text()
    assert re.search(r"rank 0 of 2 failed.*: rank 0: the other ranks did not take the next operation", log), log
    assert "Timed out waiting 6000ms" in log and "Traceback" not in log, log
