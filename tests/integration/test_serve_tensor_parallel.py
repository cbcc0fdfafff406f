"""fairseq-serve with --model-parallel-size 2 on 2 gloo ranks (the project's launcher, --distributed-world-size 2:
rank 0 serves HTTP, rank 1 follows it) against the same checkpoint served by one process, through the real `openai`
client: greedy, seeded sampling (top-p, top-k, n), best_of's beam search and scoring give the same texts (log
probabilities within 1e-5), also when the requests run together in one batch, and after rank 0 was idle past the
process group's timeout; SIGTERM drains rank 0, rank 1 is told to stop, and the job exits 0, also when it comes
while the model is still loading."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.test_serve import ROOT, start_server

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(180)]

REQUESTS = [
    {"prompt": ["w1 w2 w3", "w4 w5", "w9 w0 w0 w3"], "max_tokens": 12, "temperature": 0},
    {"prompt": "w1 w2 w3", "max_tokens": 12, "temperature": 0.9, "seed": 4, "n": 3},
    {"prompt": "w7 w2", "max_tokens": 10, "temperature": 1.0, "top_p": 0.8, "top_k": 20, "seed": 11, "logprobs": 2},
    {"prompt": "w4 w2", "max_tokens": 6, "best_of": 3, "n": 2, "temperature": 0},
    {"prompt": "w1 w2 w3 w4", "max_tokens": 0, "echo": True, "logprobs": 2},
]


def client_of(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def answer(client, request) -> list:
    """[(text, finish reason, token log-probabilities or None)] of each choice."""
    request = dict(request)
    extra = {"top_k": request.pop("top_k")} if "top_k" in request else None  # not among OpenAI's parameters
    choices = sorted(client.completions.create(model="x", extra_body=extra, **request).choices, key=lambda c: c.index)
    return [(c.text, c.finish_reason, c.logprobs.token_logprobs if c.logprobs else None) for c in choices]


def assert_same(got, expected):
    for request, choices, wanted in zip(REQUESTS, got, expected):
        assert [c[:2] for c in choices] == [w[:2] for w in wanted], request
        for (_, _, logprobs), (_, _, wanted_logprobs) in zip(choices, wanted):
            assert (logprobs is None) == (wanted_logprobs is None), request
            assert logprobs is None or logprobs == pytest.approx(wanted_logprobs, abs=1e-5), request


def test_tensor_parallel_2_serves_what_one_process_serves_and_drains_on_sigterm(tiny_lm_checkpoint, tiny_data):
    one, url = start_server(tiny_lm_checkpoint, tiny_data)
    try:
        expected = [answer(client_of(url), request) for request in REQUESTS]
    finally:
        one.kill()
        one.wait()
    # a process group timeout of 6 s: rank 1 waits longer than that while rank 0 is idle (its beats keep it alive)
    tp = ["--model-parallel-size", 2, "--distributed-world-size", 2, "--heartbeat-timeout", 6]
    job, url = start_server(tiny_lm_checkpoint, tiny_data, *tp)
    try:
        client = client_of(url)
        alone = [answer(client, request) for request in REQUESTS[:2]]
        time.sleep(7)
        alone += [answer(client, request) for request in REQUESTS[2:]]
        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:  # rows join and leave one batch
            together = list(pool.map(lambda request: answer(client, request), REQUESTS))
        stream = client.completions.create(model="x", stream=True, **REQUESTS[1])  # no top_k
        streamed = {}
        for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(answer, client, dict(REQUESTS[1], n=8, max_tokens=25))
            time.sleep(0.3)
            job.send_signal(signal.SIGTERM)  # the launcher passes it to both ranks
            drained = running.result(timeout=60)
        assert job.wait(timeout=60) == 0
        log = "".join(job.log) + job.stdout.read()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert_same(alone, expected)
    assert_same(together, expected)
    assert [streamed[i] for i in range(3)] == [text for text, _, _ in expected[1]]
    assert len(drained) == 8 and "rank 1: rank 0 stopped serving" in log
    assert "tensor-parallel decoding over 2 ranks: 1 of 2 heads" in log


def test_sigterm_while_the_model_loads_lets_it_load_then_stops_every_rank(tiny_lm_checkpoint, tiny_data):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "fairseq_cli.serve", str(tiny_data), "--path", str(tiny_lm_checkpoint), "--cpu"]
    argv += ["--port", "0", "--model-parallel-size", "2", "--distributed-world-size", "2"]
    job = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = []
        while not any("listening on" in line for line in log):  # the port opens before the model is loaded
            log.append(job.stdout.readline())
            assert log[-1], "".join(log)
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=60) == 0, "".join(log) + job.stdout.read()
        log = "".join(log) + job.stdout.read()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert "rank 1: rank 0 stopped serving" in log
