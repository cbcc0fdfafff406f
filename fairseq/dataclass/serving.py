"""fairseq-serve's own flags (`ServeConfig`): where it listens, who may call it, and the limits of one request and
of the running batch. The model, its precision and --quantize are the generation tools' flags (--path, --bf16,
--quantize, --model-parallel-size); docs/serving.md describes each limit."""

from dataclasses import dataclass
from typing import Optional

from fairseq.dataclass.fields import opt


@dataclass
class ServeConfig:
    host: str = opt(
        "127.0.0.1",
        "address to listen on (default: this machine only; 0.0.0.0 for every interface: then pass --api-keys)",
    )
    port: int = opt(8000, "TCP port to listen on (0: a free one, printed at start-up)")
    api_keys: Optional[str] = opt(
        None,
        "file of API keys, one a line: requests must send `Authorization: Bearer "
        "KEY`; default the environment variable FAIRSEQ_API_KEYS (keys separated "
        "by commas), else no key is asked for",
    )
    served_model_name: Optional[str] = opt(
        None, "the model's id in /v1/models and the responses (default: the --path's file or directory name)"
    )
    max_running: int = opt(64, "most requests (completion choices) decoded together in the running batch")
    max_batch_tokens: Optional[int] = opt(
        None,
        "most KV-cache positions the running batch may fill (each choice "
        "counts its prompt + 1 + max_tokens); default and cap: the caches "
        "the engine reserves at start, --max-running x the model's "
        "positions (checked against the GPU's free memory)",
    )
    max_queue: int = opt(256, "most requests waiting for a place in the batch; more are answered 429")
    max_prompt_tokens: Optional[int] = opt(
        None, "longest prompt accepted, in tokens (default: the model's positions); longer ones are answered 413"
    )
    max_tokens: Optional[int] = opt(
        None, "largest max_tokens a request may ask for (default: the model's positions); larger ones are answered 400"
    )
    max_body_bytes: int = opt(1 << 20, "largest request body, in bytes; larger ones are answered 413")
    request_timeout: float = opt(
        600.0,
        "seconds a request may take, waiting included; then it is cancelled "
        "(504, or a streamed one ends with an error event)",
    )
    log_prompts: bool = opt(
        False, "write each request's prompt into its access-log line (off: prompts stay out of the logs)"
    )
    drain_timeout: float = opt(60.0, "on SIGTERM, seconds to let running requests finish before exiting")


def check_serve_config(serve: ServeConfig) -> None:
    """ValueError naming the flag for a value out of its range."""
    for name, low in (
        ("port", 0),
        ("max_running", 1),
        ("max_batch_tokens", 1),
        ("max_queue", 1),
        ("max_prompt_tokens", 1),
        ("max_tokens", 0),
        ("max_body_bytes", 1024),
    ):
        value = getattr(serve, name)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be at least {low}")
    if serve.port > 65535:
        raise ValueError(f"--port {serve.port}: must be at most 65535")
    for name in ("request_timeout", "drain_timeout"):
        if not getattr(serve, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(serve, name)}: must be a positive number of seconds")
