"""OpenAI's completions format: a request body checked into a `CompletionRequest`, errors as OpenAI's error body.

Every check names the parameter (`param`) and what to send instead. Parameters this server does not know are
refused (400), as OpenAI's own API refuses them: a misspelt `max_token` must not silently become the default.
OpenAI parameters that are accepted only at their neutral value (`presence_penalty`, `frequency_penalty`,
`logit_bias`, `suffix`) are refused when set to anything else.
"""

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP = 4

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An answer other than 200: its HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> Dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class CompletionRequest:
    """A checked /v1/completions body. `prompts`: each prompt as text (str) or as token ids (list of int)."""

    prompts: List[Union[str, List[int]]]
    model: Optional[str] = None
    max_tokens: Optional[int] = None  # None: DEFAULT_MAX_TOKENS, cut to what the model's positions allow
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    best_of: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    logprobs: Optional[int] = None
    echo: bool = False
    seed: Optional[int] = None
    stream: bool = False
    include_usage: bool = False
    user: Optional[str] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def beam(self) -> int:
        """best_of > 1: beam search of that width (the generator's, not the running batch); 1 otherwise."""
        return self.best_of if self.best_of is not None and self.best_of > 1 else 1


def _integer(body: dict, name: str, low: Optional[int] = None, high: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name}: {json.dumps(value)} is not an integer", name, "invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"from {low} to {high}"
        raise APIError(400, f"{name}: {value} is out of range; send an integer {bounds}", name, "invalid_value")
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(400, f"{name}: {json.dumps(value)} is not a number", name, "invalid_type")
    if value > high or value < low or (low_open and value == low):
        bound = f"more than {low}" if low_open else f"at least {low}"
        raise APIError(
            400, f"{name}: {value} is out of range; send a number {bound} and at most {high}", name, "invalid_value"
        )
    return float(value)


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{name}: {json.dumps(value)} is not true or false", name, "invalid_type")
    return value


def _prompts(value: Any, vocab: int) -> List[Union[str, List[int]]]:
    """str, [str], [int] or [[int]] as a list of prompts."""

    def ids(item: list, where: str) -> List[int]:
        for token in item:
            if isinstance(token, bool) or not isinstance(token, int):
                raise APIError(
                    400, f"prompt{where}: token ids must be integers, got {json.dumps(token)}", "prompt", "invalid_type"
                )
            if not 0 <= token < vocab:
                raise APIError(
                    400,
                    f"prompt{where}: token id {token} is outside the vocabulary (0 to {vocab - 1})",
                    "prompt",
                    "invalid_value",
                )
        return list(item)

    if value is None:
        raise APIError(
            400,
            "prompt is missing: send a string, a list of strings, a list of token ids or a list of such lists",
            "prompt",
            "missing",
        )
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise APIError(
            400,
            "prompt: send a string, a list of strings, a list of token ids or a list of such lists (not an empty list)",
            "prompt",
            "invalid_type",
        )
    if all(isinstance(item, str) for item in value):
        return list(value)
    if all(isinstance(item, list) for item in value):
        return [ids(item, f"[{i}]") for i, item in enumerate(value)]
    return [ids(value, "")]


def _stop(value: Any) -> List[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(
            400, f"stop: {json.dumps(value)[:80]} is not a string or a list of strings", "stop", "invalid_type"
        )
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise APIError(400, f"stop: send at most {MAX_STOP} non-empty strings", "stop", "invalid_value")
    return stops


# Accepted only at OpenAI's neutral value: (default, what a non-default would need).
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "suffix": None}
KNOWN = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "best_of",
    "stop",
    "logprobs",
    "echo",
    "seed",
    "stream",
    "stream_options",
    "user",
    *_NEUTRAL,
}


def parse_completion(raw: bytes, vocab: int) -> CompletionRequest:
    """The checked request of body `raw` (an APIError naming the parameter otherwise)."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise APIError(
            400,
            f"the request body is not valid UTF-8 (byte {err.start}): send JSON encoded as UTF-8",
            None,
            "invalid_encoding",
        ) from None
    except ValueError as err:
        raise APIError(
            400, f"the request body is not valid JSON ({err}): send a JSON object", None, "invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_type")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise APIError(
            400,
            f"unrecognized request argument supplied: {unknown[0]} (this server refuses parameters "
            "it does not implement; see docs/serving.md)",
            unknown[0],
            "unknown_parameter",
        )
    for name, neutral in _NEUTRAL.items():
        if body.get(name, neutral) not in (neutral, None, {} if name == "logit_bias" else neutral):
            raise APIError(400, f"{name} is not supported by this server; leave it out", name, "unsupported")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"model: {json.dumps(model)} is not a string", "model", "invalid_type")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError(400, f"user: {json.dumps(user)} is not a string", "user", "invalid_type")
    request = CompletionRequest(
        prompts=_prompts(body.get("prompt"), vocab),
        model=model,
        max_tokens=_integer(body, "max_tokens", 0),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        n=_integer(body, "n", 1, MAX_N) or 1,
        best_of=_integer(body, "best_of", 1, MAX_N),
        stop=_stop(body.get("stop")),
        logprobs=_integer(body, "logprobs", 0, MAX_LOGPROBS),
        echo=_boolean(body, "echo"),
        seed=_integer(body, "seed", 0, 2**63 - 1),
        stream=_boolean(body, "stream"),
        user=user,
    )
    top_k = _integer(body, "top_k", -1)
    request.top_k = -1 if top_k in (None, 0) else top_k
    _stream_options(body, request)
    _check_combinations(request)
    return request


def _stream_options(body: dict, request: CompletionRequest) -> None:
    options = body.get("stream_options")
    if options is None:
        return
    if not request.stream:
        raise APIError(400, "stream_options needs stream: true", "stream_options", "invalid_value")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise APIError(400, 'stream_options: send {"include_usage": true or false}', "stream_options", "invalid_type")
    request.include_usage = _boolean(options, "include_usage")


def _check_combinations(request: CompletionRequest) -> None:
    if request.best_of is not None and request.best_of < request.n:
        raise APIError(400, f"best_of ({request.best_of}) must be at least n ({request.n})", "best_of", "invalid_value")
    if request.beam > 1 and request.stream:
        raise APIError(
            400, "best_of > 1 cannot be streamed: send stream: false, or leave best_of out", "best_of", "invalid_value"
        )
    if request.beam > 1 and request.echo and request.max_tokens == 0:
        raise APIError(
            400,
            "best_of > 1 with max_tokens 0 scores nothing to choose from: leave best_of out",
            "best_of",
            "invalid_value",
        )
