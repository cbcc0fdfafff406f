"""Continuous batching: one background thread owns the model and runs the decode loop; the HTTP side hands it
work and reads events through thread-safe queues.

Between two chunks of decode steps the thread takes cancellations (a client gone, a stop string seen, a
timeout), then admits waiting requests oldest first while the running batch stays within --max-running rows and
--max-batch-tokens KV positions (each choice reserves its prompt plus its max_tokens), and the head of the queue
is never overtaken (so no request waits for ever behind smaller ones). Requests that are not a row of the running
batch (scoring with max_tokens 0, beam search for best_of) run whole on the thread between chunks.

The decode engine is reached through one backend object (`add`, `step`, `cancel`, `live`; `idle`, called about
once a second while nothing runs): the engine of fairseq.generation.engine (fairseq.serving.engine_backend), or
`SerialBackend`, which decodes one choice at a time through the hub's generator (models the engine cannot step;
the benchmark's one-at-a-time baseline). Under tensor parallelism rank 0's backend is a
fairseq.serving.tensor_parallel.Leader over the engine's, which sends each operation to the other ranks.
"""

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional

from fairseq.serving.model import ServedModel, generation_options

logger = logging.getLogger("fairseq.serving.scheduler")


@dataclass
class Choice:
    """One completion choice: a row of the running batch."""

    id: str
    index: int  # its place among the request's choices
    prompt: List[int]
    max_new: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    sample_id: int  # the sampling draws' key with the seed: choice i of a request draws as sentence i
    top_n: int = 0  # logprobs wanted: the top-N alternatives per token (0: only the token's own)


@dataclass
class Event:
    """What the decode thread tells a request: new tokens of one choice (`ids`, their log p `logprobs`, the
    `top` alternatives per token), its end (`finished`: 'stop' or 'length'), or an error / the whole request's
    result (`result`, for work run whole)."""

    index: int = -1
    ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    top: List[Dict[int, float]] = field(default_factory=list)
    finished: Optional[str] = None
    error: Optional[BaseException] = None
    result: object = None


class Work:
    """A request in the scheduler: its choices (decoded in the running batch) or `run_whole` (called on the
    decode thread, its return value sent as the result); `emit(event)` is called on the decode thread and must
    only hand the event over (e.g. loop.call_soon_threadsafe)."""

    def __init__(
        self,
        choices: List[Choice],
        emit: Callable[[Event], None],
        reserved: int,
        run_whole: Optional[Callable[[ServedModel], object]] = None,
    ):
        self.choices, self.emit, self.reserved, self.run_whole = choices, emit, reserved, run_whole
        self.prologue: Optional[Callable[[ServedModel], object]] = None  # run before the choices are added
        self.rows = max(len(choices), 1)
        self.open = {c.id for c in choices}
        self.enqueued = time.monotonic()
        self.cancelled = False


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


class Fatal(Exception):
    """Raised by a backend that can serve no more (under tensor parallelism: the ranks are out of step): the
    decode thread answers every request with it and ends, then calls `on_fatal` (the server stops)."""


class SerialBackend:
    """The engine's interface over the hub's generator, one choice decoded alone per step (the stand-in while no
    fairseq.generation.engine is importable): each choice's text is what it gets alone."""

    def __init__(self, model: ServedModel):
        self.model = model
        self.waiting: Deque[Choice] = collections.deque()

    @property
    def live(self) -> int:
        return len(self.waiting)

    kv_capacity_tokens = None  # reserves no caches of its own (the hub's generator allocates per call)

    def add(self, choice: Choice) -> None:
        self.waiting.append(choice)

    def idle(self) -> None:
        pass

    def cancel(self, choice_id: str) -> None:
        self.waiting = collections.deque(c for c in self.waiting if c.id != choice_id)

    def step(self) -> List[tuple]:
        """[(choice id, Event)] of one choice decoded whole."""
        if not self.waiting:
            return []
        choice, model = self.waiting.popleft(), self.model
        options = generation_options(choice.temperature, choice.top_p, choice.top_k)
        hypo = model.sample_alone(choice.prompt, choice.max_new, options, choice.seed, choice.sample_id)
        new, scores, reason = model.split_hypothesis(choice.prompt, hypo, choice.max_new)
        top = model.top_logprobs(choice.prompt + new, choice.top_n)[len(choice.prompt) :] if choice.top_n else []
        return [(choice.id, Event(choice.index, new, scores, top, reason))]


class Scheduler:
    def __init__(
        self, model: ServedModel, backend, max_running: int, max_batch_tokens: int, max_queue: int, metrics=None
    ):
        self.model, self.backend, self.metrics = model, backend, metrics
        self.max_running, self.max_batch_tokens, self.max_queue = max_running, max_batch_tokens, max_queue
        self.waiting: Deque[Work] = collections.deque()
        self.running: Dict[str, Work] = {}  # choice id -> its request
        self.rows = self.reserved = 0
        self.cancels: List[tuple] = []  # (request, its choices to stop or None: all)
        self.lock = threading.Condition()
        self.draining = self.stopped = False
        self.failed: Optional[Fatal] = None
        self.on_fatal: Optional[Callable[[Fatal], None]] = None
        self.starting: List[Work] = []  # admitted, not yet started (a Fatal error answers them too)
        self.thread = threading.Thread(target=self._loop, name="fairseq-serve-decode", daemon=True)

    # ---- the HTTP side ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, work: Work) -> None:
        with self.lock:
            if self.draining:
                raise Draining()
            if len(self.waiting) >= self.max_queue:
                raise QueueFull()
            self.waiting.append(work)
            self._gauge()
            self.lock.notify()

    def cancel(self, work: Work, indices: Optional[List[int]] = None) -> None:
        """Free the request's rows (those of choices `indices`: a stop string matched; all: a client gone, a
        timeout) at the next chunk."""
        with self.lock:
            if work.cancelled:
                return
            work.cancelled = indices is None
            if work.cancelled and work in self.waiting:  # not started: its place in the queue is free now
                self.waiting.remove(work)
                self._gauge()
                return
            self.cancels.append((work, indices))
            self.lock.notify()

    def drain(self) -> None:
        """Accept nothing more; what waits or runs goes on."""
        with self.lock:
            self.draining = True

    def idle(self) -> bool:
        with self.lock:
            return not self.waiting and not self.running

    def stop(self, wait_s: float = 10.0) -> None:
        """End the decode thread once its current operation is done (waiting at most `wait_s`)."""
        with self.lock:
            self.stopped = True
            self.lock.notify()
        self.thread.join(timeout=wait_s)

    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    # ---- the decode thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
        except Fatal as err:
            logger.error(f"fairseq-serve: error: {err}")
            with self.lock:
                self.failed, self.draining = err, True
                works = self.starting + list(self.waiting) + list({id(w): w for w in self.running.values()}.values())
                self.waiting.clear()
                self.running.clear()
            for work in works:
                work.emit(Event(error=err))
            if self.on_fatal is not None:
                self.on_fatal(err)

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self._has_work():
                    self.lock.wait(timeout=1.0)
                if self.stopped:
                    return
                idle = not self._has_work()
                cancels, self.cancels = self.cancels, []
                admitted = self._admit()
            if idle:
                self.backend.idle()  # about once a second while nothing runs (tensor parallelism: a heartbeat)
                continue
            for work, indices in cancels:
                self._drop(work, indices)
            self.starting = admitted
            while self.starting:
                self._start(self.starting[0])
                self.starting.pop(0)
            if self.backend.live:
                self._step()

    def _has_work(self) -> bool:
        return bool(self.stopped or self.waiting or self.running or self.cancels)

    def _admit(self) -> List[Work]:
        admitted = []
        while self.waiting:
            work = self.waiting[0]
            if work.cancelled:
                self.waiting.popleft()
                continue
            if self.rows and (
                self.rows + work.rows > self.max_running or self.reserved + work.reserved > self.max_batch_tokens
            ):
                break  # the oldest waits for room; nothing overtakes it
            self.waiting.popleft()
            admitted.append(work)
            self.rows += work.rows
            self.reserved += work.reserved
        self._gauge()
        return admitted

    def _start(self, work: Work) -> None:
        if work.run_whole is not None:
            try:
                work.emit(Event(result=work.run_whole(self.model)))
            except Fatal:
                raise
            except Exception as err:  # the request's, not the server's: told to its client
                logger.exception("a request failed")
                work.emit(Event(error=err))
            self._release(work)
            return
        if work.prologue is not None:
            try:
                work.emit(Event(result=work.prologue(self.model)))
            except Fatal:
                raise
            except Exception as err:
                logger.exception("a request failed")
                work.emit(Event(error=err))
                self._release(work)
                return
        for choice in work.choices:
            self.running[choice.id] = work
            self.backend.add(choice)

    def _step(self) -> None:
        try:
            events = self.backend.step()
        except Fatal:
            raise
        except Exception as err:
            logger.exception("the decode step failed: the running requests are answered with an error")
            for work in {id(w): w for w in self.running.values()}.values():
                work.emit(Event(error=err))
                self._release(work)
            self.running.clear()
            return
        for choice_id, event in events:
            work = self.running.get(choice_id)
            if work is None:
                continue
            if self.metrics is not None:
                self.metrics.tokens(len(event.ids))
            if not work.cancelled:
                work.emit(event)
            if event.finished is not None:
                del self.running[choice_id]
                work.open.discard(choice_id)
                if not work.open:
                    self._release(work)

    def _drop(self, work: Work, indices: Optional[List[int]]) -> None:
        for choice in work.choices:
            if indices is not None and choice.index not in indices:
                continue
            if self.running.pop(choice.id, None) is not None:
                self.backend.cancel(choice.id)
                work.open.discard(choice.id)
                if not work.open:
                    self._release(work)

    def _release(self, work: Work) -> None:
        with self.lock:
            self.rows -= work.rows
            self.reserved -= work.reserved
            self._gauge()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.batch(len(self.waiting), self.rows)
