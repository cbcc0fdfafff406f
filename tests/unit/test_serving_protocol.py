"""fairseq-serve's request checks and admission, without a server: OpenAI's parameters parsed or refused naming
the parameter, and the scheduler's queue bound and oldest-first admission within --max-running and
--max-batch-tokens."""

import json

import pytest

from fairseq.serving.protocol import APIError, parse_completion
from fairseq.serving.scheduler import Choice, QueueFull, Scheduler, Work


def parse(body, vocab=100):
    return parse_completion(json.dumps(body).encode(), vocab)


def test_prompt_forms_and_defaults():
    assert parse({"prompt": "a b"}).prompts == ["a b"]
    assert parse({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse({"prompt": [5, 6]}).prompts == [[5, 6]]
    assert parse({"prompt": [[5], [6, 7]]}).prompts == [[5], [6, 7]]
    request = parse(
        {"prompt": "x", "stop": "\n", "top_k": 0, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert (
        request.max_tokens,
        request.temperature,
        request.n,
        request.stop,
        request.top_k,
        request.beam,
        request.include_usage,
    ) == (None, 1.0, 1, ["\n"], -1, 1, True)
    assert parse({"prompt": "x", "best_of": 3, "n": 2}).beam == 3


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], [100]]}, "prompt"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "user": 5}, "user"),
    ],
)
def test_bad_values_name_their_parameter(body, param):
    with pytest.raises(APIError) as info:
        parse(body)  # json.dumps writes nan as NaN, which json.loads reads back
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def choice(name, prompt_len=3, max_new=5):
    return Choice(name, 0, [4] * prompt_len, max_new, 0.0, 1.0, -1, 0, 0)


def test_queue_bound_and_oldest_first_admission():
    scheduler = Scheduler(model=None, backend=None, max_running=3, max_batch_tokens=30, max_queue=3)
    works = [
        Work([choice(f"{i}-{j}") for j in range(rows)], lambda event: None, reserved)
        for i, (rows, reserved) in enumerate([(2, 18), (2, 18), (1, 9)])
    ]
    for work in works:
        scheduler.submit(work)
    with pytest.raises(QueueFull):
        scheduler.submit(Work([choice("x")], lambda event: None, 9))
    assert scheduler._admit() == [works[0]]  # the second does not fit (4 rows > 3) and the third may not pass it
    scheduler._release(works[0])
    assert scheduler._admit() == [works[1], works[2]] and (scheduler.rows, scheduler.reserved) == (3, 27)
    scheduler.cancel(works[1])  # running: its rows are freed at the next chunk
    assert scheduler.cancels == [(works[1], None)] and works[1].cancelled
    waiting = Work([choice("w")], lambda event: None, 9)
    scheduler.submit(waiting)
    scheduler.cancel(waiting)  # waiting: its place in the queue is free at once
    assert not scheduler.waiting and scheduler.cancels == [(works[1], None)]
