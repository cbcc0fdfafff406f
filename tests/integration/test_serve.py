"""fairseq-serve as a real process on 127.0.0.1 (a free port) serving the tiny model trained by the session's
fixture, called through the real `openai` client and raw HTTP: greedy text equal to fairseq-interactive's, the
stream joined equal to the whole answer, scoring equal to the hub's score(), stop strings, seeded choices, a load
of concurrent clients answered each as alone, bad requests each with its status and one message while the
server keeps serving, a client gone mid-stream, and SIGTERM finishing what runs and exiting 0."""

import concurrent.futures
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "sk-test-key-0123456789"
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(120)]


def start_server(ckpt, data, *extra, keys_file=None, env_keys=None):
    """The server process and its base URL, once it printed the port it listens on and /health is 200."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("FAIRSEQ_API_KEYS", None)
    if env_keys is not None:
        env["FAIRSEQ_API_KEYS"] = env_keys
    argv = [
        sys.executable,
        "-m",
        "fairseq_cli.serve",
        *([str(data)] if data else []),
        "--path",
        str(ckpt),
        "--cpu",
        "--port",
        "0",
        *(["--api-keys", str(keys_file)] if keys_file else []),
        *map(str, extra),
    ]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    url = None
    log = []
    while url is None:
        line = proc.stdout.readline()
        if not line or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the server did not start:\n" + "".join(log))
        log.append(line)
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        url = m.group(1) if m else None
    proc.log = log
    while get(url, "/health")[0] != 200:
        assert time.monotonic() < deadline and proc.poll() is None, "the model did not load"
        time.sleep(0.1)
    return proc, url


def request(url, method, path, body=None, headers=None, raw=None):
    host, port = url[len("http://") :].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, payload, resp


def get(url, path):
    try:
        status, payload, _ = request(url, "GET", path)
    except ConnectionError:
        return 0, b""
    return status, payload


def post(url, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    status, payload, _ = request(url, "POST", "/v1/completions", body, headers, raw)
    return status, json.loads(payload)


@pytest.fixture(scope="module")
def server(tiny_lm_checkpoint, tiny_data, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# the test's key\n{KEY}\n")
    proc, url = start_server(
        tiny_lm_checkpoint,
        tiny_data,
        "--max-queue",
        "64",
        "--request-timeout",
        "20",
        "--max-body-bytes",
        "65536",
        keys_file=keys,
    )
    yield url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_greedy_text_equals_fairseq_interactive(client, tiny_lm_checkpoint, tiny_data):
    from fairseq_cli import interactive
    from tests.train_fixtures import console_in_process
    import io

    prompts = ["w1 w2 w3", "w4 w5", "w9 w0 w0 w3"]
    answer = client.completions.create(model="x", prompt=prompts, max_tokens=12, temperature=0)
    texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    expected = []
    for prompt in prompts:  # one prompt per run: --max-len-b counts the prompt's tokens
        length = len(prompt.split()) + 12
        stdin = sys.stdin
        sys.stdin = io.StringIO(prompt + "\n")
        try:
            status, out, err = console_in_process(
                "fairseq-interactive",
                interactive.cli_main,
                [
                    str(tiny_data),
                    "--path",
                    str(tiny_lm_checkpoint),
                    "--cpu",
                    "--beam",
                    "1",
                    "--max-len-b",
                    str(length),
                    "--text-only",
                ],
            )
        finally:
            sys.stdin = stdin
        assert status == 0, err
        expected.append([line for line in out.splitlines() if not re.match(r"^\d{4}-", line)][-1])
    assert [p + t for p, t in zip(prompts, texts)] == expected
    assert answer.usage.prompt_tokens == sum(len(p.split()) for p in prompts)
    assert answer.usage.completion_tokens == sum(len(t.split()) for t in texts)
    assert {c.finish_reason for c in answer.choices} <= {"stop", "length"}
    # a word the dictionary lacks is <unk> to the model: the continuation is still the one of the decoded prompt
    prompts = ["w1 nosuchword", "nosuchword w2 w3", "w5 zz w7", "w2 qq"]
    unknown = client.completions.create(model="x", prompt=prompts, max_tokens=5, temperature=0)
    continued = [c.text for c in unknown.choices if c.text]
    assert continued and all(text.startswith(" w") for text in continued), [c.text for c in unknown.choices]


def test_stream_joined_equals_the_whole_answer(client):
    for params in ({"temperature": 0}, {"temperature": 0.9, "top_k": 20, "seed": 11}):
        extra = {"top_k": params.pop("top_k")} if "top_k" in params else {}
        whole = client.completions.create(model="x", prompt="w2 w7", max_tokens=20, extra_body=extra, **params)
        chunks = list(
            client.completions.create(model="x", prompt="w2 w7", max_tokens=20, stream=True, extra_body=extra, **params)
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_echo_logprobs_scoring_equals_the_hub_score(client, tiny_lm_checkpoint, tiny_data):
    from fairseq.hub.hub_utils import GeneratorHubInterface, from_pretrained

    text = "w1 w2 w3 w0 w5"
    answer = client.completions.create(model="x", prompt=text, max_tokens=0, echo=True, logprobs=2)
    loaded = from_pretrained(str(tiny_lm_checkpoint.parent), tiny_lm_checkpoint.name, str(tiny_data))
    hub = GeneratorHubInterface(loaded["args"], loaded["task"], loaded["models"])
    expected = hub.score(text)["positional_scores"].tolist()
    got = answer.choices[0].logprobs.token_logprobs
    assert len(got) == len(expected) == 5
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-5
    assert answer.choices[0].text == text and answer.usage.completion_tokens == 0
    assert "".join(answer.choices[0].logprobs.tokens) == text
    tops = answer.choices[0].logprobs.top_logprobs
    assert all(len(top) == 2 and max(top.values()) >= lp - 1e-5 for top, lp in zip(tops, got))


def test_stop_string_cuts_before_it(client):
    whole = client.completions.create(model="x", prompt="w1", max_tokens=20, temperature=0).choices[0].text
    words = whole.split()
    assert len(words) >= 3, whole
    stop = " " + words[2]
    cut = client.completions.create(model="x", prompt="w1", max_tokens=20, temperature=0, stop=[stop, "zz"])
    assert cut.choices[0].text == whole[: whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="x", prompt="w1", max_tokens=20, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_seeded_choices_are_reproducible(client):
    def three():
        answer = client.completions.create(model="x", prompt="w3 w1", max_tokens=10, n=3, seed=1234, temperature=1.0)
        return [c.text for c in sorted(answer.choices, key=lambda c: c.index)]

    first = three()
    assert len(first) == 3 and three() == first
    assert len(set(first)) > 1  # the three choices draw differently (choice i is sentence i of the seed)


def _mixed_request(i):
    prompts = ["w1", "w2 w3", "w4 w5 w6 w7", "w0 w1 w2 w3 w4 w5 w6 w7 w8"]
    body = {"prompt": prompts[i % 4], "max_tokens": 4 + (i * 7) % 17, "seed": i}
    if i % 3 == 0:
        body["temperature"] = 0
    elif i % 3 == 1:
        body.update(temperature=0.8, top_p=0.9)
    else:
        body.update(temperature=1.2, top_k=5, n=2)
    return body


def test_load_every_answer_equals_its_alone_answer(server):
    bodies = [_mixed_request(i) for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        loaded = list(pool.map(lambda b: post(server, b), bodies))
    for body, (status, answer) in zip(bodies, loaded):
        assert status == 200, answer
    for i in (0, 1, 2, 5, 13, 30, 47, 63):  # alone, one at a time: the same text for the same request
        status, answer = post(server, bodies[i])
        assert status == 200 and [c["text"] for c in answer["choices"]] == [
            c["text"] for c in loaded[i][1]["choices"]
        ], bodies[i]
    assert all(len(a["choices"]) == b.get("n", 1) for b, (_, a) in zip(bodies, loaded))
    metrics = get(server, "/metrics")[1].decode()
    assert 'fairseq_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    assert "fairseq_time_to_first_token_seconds_count" in metrics and "fairseq_queue_length 0" in metrics


BAD = [
    ("malformed JSON", None, b'{"prompt": "w1", ', 400, None),
    ("invalid UTF-8", None, b'{"prompt": "\xff\xfe"}', 400, None),
    ("not an object", [1, 2], None, 400, None),
    ("wrong type", {"prompt": "w1", "max_tokens": "8"}, None, 400, "max_tokens"),
    ("bool as int", {"prompt": "w1", "max_tokens": True}, None, 400, "max_tokens"),
    ("negative max_tokens", {"prompt": "w1", "max_tokens": -1}, None, 400, "max_tokens"),
    ("huge max_tokens", {"prompt": "w1", "max_tokens": 10**9}, None, 400, "max_tokens"),
    ("unknown parameter", {"prompt": "w1", "max_token": 8}, None, 400, "max_token"),
    ("temperature out of range", {"prompt": "w1", "temperature": 3}, None, 400, "temperature"),
    ("token id outside the vocabulary", {"prompt": [1, 99999]}, None, 400, "prompt"),
    ("no prompt", {"max_tokens": 3}, None, 400, "prompt"),
    ("prompt over the positions", {"prompt": " ".join(["w1"] * 40)}, None, 413, "prompt"),
    ("stream with best_of", {"prompt": "w1", "best_of": 2, "stream": True}, None, 400, "best_of"),
    ("10 MB body", None, b'{"prompt": "' + b"w" * (10 << 20) + b'"}', 413, None),
]


@pytest.mark.parametrize("name,body,raw,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_its_status_and_one_message(server, name, body, raw, status, param):
    try:
        got, answer = post(server, body, raw=raw)
    except (ConnectionError, http.client.HTTPException):  # a 10 MB body may be answered before it is all sent
        assert raw is not None and len(raw) > 1 << 20
        got, answer = status, {"error": {"message": "-", "param": None}}
    assert got == status, answer
    assert set(answer) == {"error"} and answer["error"]["message"] and "\n" not in answer["error"]["message"]
    assert answer["error"]["param"] == param
    assert post(server, {"prompt": "w1", "max_tokens": 2, "temperature": 0})[0] == 200  # still serving


def test_keys_routes_and_openai_errors(server):
    assert post(server, {"prompt": "w1"}, key=None)[0] == 401
    status, answer = post(server, {"prompt": "w1"}, key="sk-wrong")
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    status, payload, _ = request(server, "GET", "/v1/nothing")
    assert status == 404 and json.loads(payload)["error"]["message"]
    status, payload, _ = request(server, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(payload)["data"][0]["id"] == "checkpoint_last.pt"
    bad = openai.OpenAI(base_url=server + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="x", prompt="w1")


def test_slow_client_and_disconnect_do_not_block_others(server):
    host, port = server[len("http://") :].split(":")
    slow = socket.create_connection((host, int(port)))
    slow.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 100\r\n\r\n{"prompt"'
    )
    gone = socket.create_connection((host, int(port)))
    body = json.dumps({"prompt": "w1", "max_tokens": 30, "stream": True, "temperature": 0}).encode()
    gone.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )
    gone.recv(100)
    gone.close()  # mid-stream
    started = time.monotonic()
    assert post(server, {"prompt": "w2", "max_tokens": 5, "temperature": 0})[0] == 200
    assert time.monotonic() - started < 10
    slow.close()


def test_health_is_503_while_loading():
    from starlette.testclient import TestClient

    from fairseq.dataclass.serving import ServeConfig
    from fairseq.serving.app import Server, build_app

    with TestClient(build_app(Server(ServeConfig(), []))) as http:
        assert http.get("/health").status_code == 503
        answer = http.post("/v1/completions", json={"prompt": "w1"})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "loading"
        assert "<textarea" in http.get("/").text


def test_sigterm_finishes_the_running_request_and_exits_0(tiny_lm_checkpoint, tiny_data):
    proc, url = start_server(tiny_lm_checkpoint, tiny_data, env_keys=f"other,{KEY}")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(post, url, {"prompt": "w1", "max_tokens": 25, "n": 8, "temperature": 1.0, "seed": 5})
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        status, answer = running.result(timeout=60)
    assert status == 200 and len(answer["choices"]) == 8
    assert proc.wait(timeout=60) == 0


def test_a_transformers_directory_is_imported_and_served_as_the_hub_samples_it(tmp_path):
    pytest.importorskip("transformers")
    from fairseq.hub.hub_utils import GeneratorHubInterface, from_pretrained
    from tests.hf_fixtures import tiny_hf_model, write_opt_tokenizer

    ids = write_opt_tokenizer(tmp_path / "tokenizer")
    hf_dir = tiny_hf_model(tmp_path / "opt", "opt", tmp_path / "tokenizer", ids)
    proc, url = start_server(hf_dir, "", "--served-model-name", "tiny-opt", keys_file=None)
    try:
        status, answer = post(url, {"prompt": "the meaning of", "max_tokens": 8, "temperature": 0, "echo": True})
    finally:
        proc.kill()
        proc.wait()
    loaded = from_pretrained(str(hf_dir))
    hub = GeneratorHubInterface(loaded["args"], loaded["task"], loaded["models"])
    prompt_tokens = len(hub.encode("the meaning of")) - 1
    expected = hub.sample("the meaning of", beam=1, max_len_b=prompt_tokens + 8)
    assert status == 200 and answer["model"] == "tiny-opt"
    assert answer["choices"][0]["text"] == expected and answer["usage"]["prompt_tokens"] == prompt_tokens


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--api-keys", "/nonexistent/keys.txt"], "--api-keys /nonexistent/keys.txt: cannot read it"),
        (["--model-parallel-size", "2"], "--model-parallel-size 2 takes 2 rank(s), this launch has 1"),
        (
            ["--model-parallel-size", "3", "--distributed-world-size", "3"],
            "--model-parallel-size 3 does not divide --decoder-attention-heads 2: use --model-parallel-size 2",
        ),
        (
            ["--model-parallel-size", "2", "--distributed-world-size", "2", "--quantize", "int8-weight-only"],
            "--quantize int8-weight-only is not supported with --model-parallel-size 2",
        ),
        (["--max-running", "0"], "--max-running 0: must be at least 1"),
    ],
)
def test_start_up_errors_are_one_line(tiny_lm_checkpoint, tiny_data, flags, message):
    from fairseq_cli import serve
    from tests.train_fixtures import console_in_process

    status, out, err = console_in_process(
        "fairseq-serve", serve.cli_main, [str(tiny_data), "--path", str(tiny_lm_checkpoint), "--cpu", *flags]
    )
    assert status in (1, 2) and message in err and len(err.strip().splitlines()) == 1, err


def test_full_queue_is_429_and_a_request_past_its_timeout_is_504(tiny_lm_checkpoint, tiny_data):
    # one row at a time: A's 64 choices of 30 tokens (1,920 steps) take far more than the 0.2 s timeout; B waits
    # behind it, C and D find the queue (1) full
    proc, url = start_server(
        tiny_lm_checkpoint, tiny_data, "--max-running", "1", "--max-queue", "1", "--request-timeout", "0.2"
    )
    body = {"prompt": [f"w{i}" for i in range(16)], "max_tokens": 30, "n": 4, "temperature": 1.0, "seed": 1}
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            first = pool.submit(post, url, body, None)
            time.sleep(0.05)
            waiting = pool.submit(post, url, dict(body, prompt="w5", n=1), None)
            time.sleep(0.05)
            full = [pool.submit(post, url, dict(body, prompt="w6", n=1), None) for _ in range(2)]
            (status_a, answer_a), (status_b, _) = first.result(), waiting.result()
            refused = [f.result() for f in full]
        assert status_a == 504 and answer_a["error"]["code"] == "timeout"
        assert status_b in (200, 504)
        assert all(status == 429 and answer["error"]["code"] == "queue_full" for status, answer in refused)
        deadline = time.monotonic() + 10
        while "fairseq_running_batch_size 0" not in get(url, "/metrics")[1].decode():  # every row is freed
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert post(url, {"prompt": "w2", "max_tokens": 1, "temperature": 0}, key=None)[0] in (200, 504)
    finally:
        proc.kill()
        proc.wait()


def test_echo_with_generation_puts_the_prompt_scores_first(client):
    text = "w4 w1 w2"
    scored = client.completions.create(model="x", prompt=text, max_tokens=0, echo=True, logprobs=1)
    answer = client.completions.create(model="x", prompt=text, max_tokens=6, echo=True, logprobs=1, temperature=0)
    lp = answer.choices[0].logprobs
    assert answer.choices[0].text.startswith(text) and "".join(lp.tokens) == answer.choices[0].text
    assert lp.token_logprobs[:3] == scored.choices[0].logprobs.token_logprobs
    assert lp.text_offset == sorted(lp.text_offset) and len(lp.tokens) == 3 + answer.usage.completion_tokens
