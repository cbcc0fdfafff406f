"""The HTTP side (Starlette, served by uvicorn): routes, API keys, body and time limits, server-sent events, the
access log. The model and its decode thread are set on the app's `Server` once loaded; until then /health and
/v1/* answer 503.

    GET  /                 the playground page          GET /health     503 loading or draining, 200 ready
    GET  /v1/models        the served model             GET /metrics    Prometheus text
    POST /v1/completions   OpenAI's completions (docs/serving.md)
"""

import asyncio
import hmac
import json
import logging
import os
import signal
import sys
import time
from typing import List, Optional

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from fairseq.serving.completions import CompletionJob, Limits
from fairseq.serving.metrics import Metrics
from fairseq.serving.protocol import APIError, parse_completion
from fairseq.serving.scheduler import Draining, QueueFull, Scheduler

access_log = logging.getLogger("fairseq.serving.access")
PLAYGROUND = os.path.join(os.path.dirname(__file__), "playground.html")
BODY_TIMEOUT = 60.0  # seconds a request body may take to arrive (a slow client gets 408, the others go on)


class Server:
    """What the routes share: the options, the metrics, and (once loaded) the model, its scheduler and limits."""

    def __init__(self, serve_cfg, api_keys: List[str]):
        self.cfg, self.api_keys = serve_cfg, [key.encode() for key in api_keys]
        self.metrics = Metrics()
        self.model = self.scheduler = self.limits = None
        self.leader = None  # rank 0's fairseq.serving.tensor_parallel.Leader (tensor parallelism)
        self.on_fatal = None  # what the decode thread calls when it can serve no more (the server stops)
        self.draining = False
        self.load_error: Optional[str] = None

    def ready(self, model, scheduler: Scheduler, limits: Limits) -> None:
        self.model, self.scheduler, self.limits = model, scheduler, limits

    def check_key(self, request: Request) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        given = header[7:].strip().encode() if header[:7].lower() == "bearer " else b""
        # every key compared, in constant time: neither which key nor how much of one matched shows in the timing
        matched = False
        for key in self.api_keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise APIError(
                401,
                "no API key given: send the header `Authorization: Bearer KEY`"
                if not given
                else "the API key is not valid",
                None,
                "invalid_api_key",
            )

    def check_available(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down: send the request to another replica", None, "draining")
        if self.scheduler is None:
            raise APIError(
                503,
                self.load_error or "the model is still loading: retry when GET /health answers 200",
                None,
                "loading",
            )


def error_response(err: APIError, headers=None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused (413) past `limit` bytes, announced or sent, and (408) when it takes over `timeout`."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(
            413,
            f"the request body is {int(length)} bytes, more than this server's {limit} (--max-body-bytes)",
            None,
            "request_too_large",
        )
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(
                    413,
                    f"the request body is more than this server's {limit} bytes (--max-body-bytes)",
                    None,
                    "request_too_large",
                )
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body took more than {timeout:g} s to arrive", None, "timeout") from None
    return b"".join(chunks)


def build_app(server: Server) -> Starlette:
    async def health(request: Request):
        if server.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if server.scheduler is None:
            return JSONResponse(
                {"status": "error" if server.load_error else "loading", "message": server.load_error}, status_code=503
            )
        return JSONResponse({"status": "ok"})

    async def models(request: Request):
        server.check_key(request)
        server.check_available()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.model.name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "fairseq",
                        "max_model_len": server.model.max_positions,
                    }
                ],
            }
        )

    async def metrics(request: Request):
        return PlainTextResponse(server.metrics.text(), media_type="text/plain; version=0.0.4")

    async def playground(request: Request):
        with open(PLAYGROUND, encoding="utf-8") as f:
            return HTMLResponse(f.read())

    async def completions(request: Request):
        return await handle_completion(server, request)

    async def not_found(request: Request, exc: HTTPException):
        status = exc.status_code
        message = (
            f"no route {request.method} {request.url.path}: the API is POST /v1/completions, GET /v1/models"
            if status in (404, 405)
            else str(exc.detail)
        )
        return error_response(APIError(status, message, None, "not_found" if status == 404 else None))

    async def api_error(request: Request, exc: APIError):
        return error_response(exc)

    routes = [
        Route("/", playground),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found, APIError: api_error})
    app.add_middleware(_AccessLog, server=server)
    return app


class _AccessLog:
    """One line per request: client, method, path, status, seconds (and the request's tokens and user when the
    completion route set them on the scope); the metrics' request count."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.monotonic(), [500]
        scope.setdefault("state", {})

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            seconds = time.monotonic() - started
            path = scope["path"]
            self.server.metrics.request(
                path if path in ("/v1/completions", "/v1/models", "/health", "/metrics", "/") else "other",
                status[0],
                seconds,
            )
            client = scope.get("client") or ("-", 0)
            extra = scope["state"].get("access", "")
            access_log.info(f'{client[0]} "{scope["method"]} {path}" {status[0]} {seconds:.3f}s{extra}')


async def handle_completion(server: Server, request: Request) -> Response:
    started = time.monotonic()
    server.check_key(request)
    server.check_available()
    cfg = server.cfg
    try:
        raw = await read_body(request, cfg.max_body_bytes, BODY_TIMEOUT)
    except ClientDisconnect:
        return Response(status_code=499)
    body = parse_completion(raw, server.model.vocab)
    job = CompletionJob(body, server.model, server.limits)
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    work = job.work(lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
    try:
        server.scheduler.submit(work)
    except QueueFull:
        raise APIError(
            429, f"the server's queue is full ({cfg.max_queue} requests wait): retry later", None, "queue_full"
        ) from None
    except Draining:
        raise APIError(503, "the server is shutting down", None, "draining") from None
    deadline = started + cfg.request_timeout
    note = f" prompt_tokens={job.prompt_tokens} user={json.dumps(body.user) if body.user else '-'}"
    if cfg.log_prompts:
        note += f" prompt={json.dumps(body.prompts)[:2000]}"
    request.scope["state"]["access"] = note
    if body.stream:
        return StreamingResponse(
            _stream(server, job, work, events, deadline, started, request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        await _collect(server, job, work, events, deadline, started)
    except BaseException:
        server.scheduler.cancel(work)  # the client went away, or the request failed: free its rows
        raise
    request.scope["state"]["access"] = note + f" completion_tokens={job.completion_tokens}"
    return JSONResponse(job.response())


async def _next(
    server: Server, job: CompletionJob, work, events: asyncio.Queue, deadline: float, started: float, first: list
):
    """The next event taken into `job` (an APIError for a timeout or a failed decode)."""
    remaining = deadline - time.monotonic()
    try:
        event = await asyncio.wait_for(events.get(), max(remaining, 0.001))
    except asyncio.TimeoutError:
        server.scheduler.cancel(work)
        raise APIError(
            504, f"the request took more than {server.cfg.request_timeout:g} s (--request-timeout)", None, "timeout"
        ) from None
    if event.error is not None:
        raise APIError(500, f"decoding failed: {event.error}", None, "server_error")
    if not first and (event.ids or event.result is not None):
        first.append(True)
        server.metrics.first_token(time.monotonic() - started)
    job.apply(event)
    if job.cut:
        server.scheduler.cancel(work, job.cut)
        job.cut = []


async def _collect(server, job, work, events, deadline, started) -> None:
    first: list = []
    while not job.done:
        await _next(server, job, work, events, deadline, started, first)


def _sse(data) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _stream(server, job, work, events, deadline, started, request: Request):
    first: list = []
    try:
        while not job.done:
            try:
                await _next(server, job, work, events, deadline, started, first)
            except APIError as err:
                yield _sse(err.body())
                break
            for chunk in job.chunks():
                yield _sse(chunk)
        else:
            if job.request.include_usage:
                yield _sse(job.usage_chunk())
        yield b"data: [DONE]\n\n"
        request.scope["state"]["access"] += f" completion_tokens={job.completion_tokens} stream"
    finally:
        if not job.done:  # the client went away mid-stream: its rows leave the batch at the next chunk
            server.scheduler.cancel(work)


def draining_server(config: "uvicorn.Config", server: Server) -> "uvicorn.Server":
    """uvicorn's Server whose exit signal first marks the app as draining (new requests: 503, /health: 503), then
    lets uvicorn stop accepting and wait for the running requests (SIGTERM: exit 0 once done; uvicorn would raise
    the signal again); it prints the address it listens on."""

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            server.draining = True
            if server.scheduler is not None:
                server.scheduler.drain()
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:  # a drain asked for: exit 0 once done (uvicorn would re-raise it)
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

        async def startup(self, sockets=None):
            await super().startup(sockets)
            for listening in self.servers:
                for sock in listening.sockets:
                    host, port = sock.getsockname()[:2]
                    print(f"fairseq-serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)

    return DrainingServer(config)
