"""One /v1/completions request between the HTTP side and the decode thread: its prompts checked against the
limits, its choices (rows of the running batch, or the whole request run on the decode thread for scoring and
best_of), the text of each choice as its tokens arrive (stop strings matched on text, cut before), and the
response or stream chunks in OpenAI's format."""

import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from fairseq.serving.model import ServedModel
from fairseq.serving.protocol import DEFAULT_MAX_TOKENS, APIError, CompletionRequest
from fairseq.serving.scheduler import Choice, Event, Work


@dataclass
class Limits:
    max_prompt_tokens: int
    max_tokens: int
    max_batch_tokens: int


@dataclass
class ChoiceState:
    prompt: List[int]
    prompt_text: str
    ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    top: List[Dict[int, float]] = field(default_factory=list)
    finished: Optional[str] = None
    text: str = ""  # the continuation so far, cut before a stop string
    sent: int = 0  # characters of `text` streamed
    tokens_sent: int = 0
    echo_logprobs: Optional[List[float]] = None
    echo_top: Optional[List[Dict[int, float]]] = None
    echoed: bool = False  # streamed: the prompt's text went out (echo)
    reported: bool = False  # streamed: the finish reason went out


class CompletionJob:
    def __init__(self, request: CompletionRequest, model: ServedModel, limits: Limits):
        self.request, self.model, self.limits = request, model, limits
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        prompts = [(model.encode(p), p) if isinstance(p, str) else (p, None) for p in request.prompts]
        prompts = [(ids, text if text is not None else model.decode(ids)) for ids, text in prompts]
        self.max_new = self._max_new(max(len(ids) for ids, _ in prompts))
        self.states = [ChoiceState(ids, text) for ids, text in prompts for _ in range(request.n)]
        self.seed = request.seed if request.seed is not None else random.randrange(2**31)
        self.scoring = request.max_tokens == 0 or self.max_new == 0
        self.cut: List[int] = []  # choices whose stop string was seen: the decode thread may stop them

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.prompt) for s in self.states[:: self.request.n])

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.ids) for s in self.states)

    def _max_new(self, longest_prompt: int) -> int:
        request, limits, positions = self.request, self.limits, self.model.max_positions
        if longest_prompt + 1 > positions or longest_prompt > limits.max_prompt_tokens:
            most = min(positions - 1, limits.max_prompt_tokens)
            raise APIError(
                413,
                f"the prompt is {longest_prompt} tokens long, more than the {most} this server "
                f"accepts (the model has {positions} positions, one for the </s> it starts from); "
                "shorten the prompt",
                "prompt",
                "context_length_exceeded",
            )
        room = positions - 1 - longest_prompt
        if request.max_tokens is None:
            return min(DEFAULT_MAX_TOKENS, room, limits.max_tokens)
        if request.max_tokens > limits.max_tokens:
            raise APIError(
                400,
                f"max_tokens: {request.max_tokens} is more than this server's limit of "
                f"{limits.max_tokens} (--max-tokens)",
                "max_tokens",
                "invalid_value",
            )
        if request.max_tokens > room:
            raise APIError(
                400,
                f"max_tokens: {request.max_tokens} does not fit: the prompt takes {longest_prompt} "
                f"of the model's {positions} positions (one more for the </s> it starts from), "
                f"{room} are left; send max_tokens <= {room}",
                "max_tokens",
                "context_length_exceeded",
            )
        return request.max_tokens

    # ---- what the decode thread runs ------------------------------------------------------------------------
    def work(self, emit) -> Work:
        request = self.request
        # a request larger than the batch's bounds is admitted when nothing else runs (its rows then queue in the
        # engine); each choice fits the positions (checked above)
        reserved = sum(len(s.prompt) + 1 + self.max_new for s in self.states)
        if self.scoring or request.beam > 1:
            return Work([], emit, reserved, run_whole=self._run_whole)
        choices = [
            Choice(
                f"{self.id}-{i}",
                i,
                s.prompt,
                self.max_new,
                request.temperature,
                request.top_p,
                request.top_k,
                self.seed,
                i,
                request.logprobs or 0,
            )
            for i, s in enumerate(self.states)
        ]
        work = Work(choices, emit, reserved)
        if request.echo and request.logprobs is not None:
            work.prologue = self._score_prompts
        return work

    def _score_prompts(self, model: ServedModel) -> dict:
        """echo with logprobs: each prompt's log p (the scorer's) and top-N."""
        return {
            "echo": [
                (model.score(s.prompt), model.top_logprobs(s.prompt, self.request.logprobs or 0))
                for s in self.states[:: self.request.n]
            ]
        }

    def _run_whole(self, model: ServedModel) -> dict:
        """Scoring (max_tokens 0) or best_of's beam search, the whole request at once: per choice (ids, log p,
        top, finish reason), after the prompts' scores when echo asks for logprobs."""
        request, results = self.request, []
        echo = self._score_prompts(model) if request.echo and request.logprobs is not None else {}
        for state in self.states[:: request.n]:
            if self.scoring:
                hypos = [([], [], "length")] * request.n
            else:
                hypos = model.beam(state.prompt, self.max_new, request.beam, request.n)
            for new, scores, reason in hypos:
                top = (
                    model.top_logprobs(state.prompt + new, request.logprobs or 0)[len(state.prompt) :]
                    if request.logprobs
                    else []
                )
                results.append((new, scores, top, reason))
        return dict(echo, choices=results)

    # ---- events -> text -------------------------------------------------------------------------------------
    def apply(self, event: Event) -> None:
        """Take an event of the decode thread into the choices' state."""
        if event.result is not None:  # a prologue's or a whole request's: {"echo": ..., "choices": ...}
            self._echo(event.result.get("echo"))
            for index, (new, scores, top, reason) in enumerate(event.result.get("choices", ())):
                self.apply(Event(index, new, scores, top, reason))
            return
        state = self.states[event.index]
        if state.finished is not None:
            return
        state.ids += event.ids
        state.logprobs += event.logprobs
        state.top += event.top
        text = self.model.continuation(state.prompt, state.ids)
        cut = min((i for i in (text.find(stop) for stop in self.request.stop) if i >= 0), default=-1)
        if cut >= 0:
            state.text, state.finished = text[:cut], "stop"
            self.cut.append(event.index)
        else:
            state.text, state.finished = text, event.finished

    def _echo(self, echo) -> None:
        if echo is None:
            return
        for p, (scores, top) in enumerate(echo):
            for state in self.states[p * self.request.n : (p + 1) * self.request.n]:
                state.echo_logprobs, state.echo_top = scores, top

    @property
    def done(self) -> bool:
        return all(s.finished is not None for s in self.states)

    # ---- responses ------------------------------------------------------------------------------------------
    def _logprobs(self, state: ChoiceState, start: int, text_start: int) -> dict:
        """OpenAI's logprobs object of the choice's tokens from `start` whose text lies in state.text (those
        after a stop cut are left out), offsets counted from `text_start`."""
        model, request = self.model, self.request
        pieces = model.token_pieces(state.prompt + state.ids[:start], state.ids[start:])
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = len(model.continuation(state.prompt, state.ids[:start])) if start else 0
        for i, piece in enumerate(pieces):
            if offset >= len(state.text) and (state.finished == "stop" or piece):
                break
            out["tokens"].append(piece)
            out["token_logprobs"].append(state.logprobs[start + i] if start + i < len(state.logprobs) else None)
            top = state.top[start + i] if start + i < len(state.top) else {}
            out["top_logprobs"].append(
                model.alternatives(state.prompt + state.ids[: start + i], top) if request.logprobs else None
            )
            out["text_offset"].append(text_start + offset)
            offset += len(piece)
        return out

    def _echo_logprobs(self, state: ChoiceState) -> dict:
        model = self.model
        pieces = model.token_pieces([], state.prompt)
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        tops = state.echo_top or [{} for _ in pieces]
        return {
            "tokens": pieces,
            "token_logprobs": list(state.echo_logprobs or []),
            "top_logprobs": [
                model.alternatives(state.prompt[:i], top) if self.request.logprobs else None
                for i, top in enumerate(tops)
            ],
            "text_offset": offsets,
        }

    def _choice_logprobs(self, state: ChoiceState) -> Optional[dict]:
        if self.request.logprobs is None:
            return None
        prefix = state.prompt_text if self.request.echo else ""
        generated = self._logprobs(state, 0, len(prefix))
        if not self.request.echo:
            return generated
        echo = self._echo_logprobs(state)
        return {key: echo[key] + generated[key] for key in echo}

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def response(self) -> dict:
        choices = []
        for index, state in enumerate(self.states):
            text = (state.prompt_text if self.request.echo else "") + state.text
            choices.append(
                {
                    "text": text,
                    "index": index,
                    "logprobs": self._choice_logprobs(state),
                    "finish_reason": state.finished,
                }
            )
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model.name,
            "choices": choices,
            "usage": self.usage(),
        }

    def chunks(self) -> List[dict]:
        """The stream chunks for what arrived since the last call: per choice the text it adds (held back while
        it could be the start of a stop string, or ends inside a character), its logprobs, its finish reason."""
        out, longest_stop = [], max((len(s) for s in self.request.stop), default=0)
        for index, state in enumerate(self.states):
            visible = len(state.text)
            if state.finished is None:
                visible = max(state.sent, visible - max(longest_stop - 1, 0))
                while visible > state.sent and state.text[visible - 1] == "\ufffd":
                    visible -= 1
            prefix = ""
            if self.request.echo and not state.echoed:
                prefix, state.echoed = state.prompt_text, True
            delta = state.text[state.sent : visible]
            finish = state.finished if visible == len(state.text) else None
            if not delta and not prefix and finish is None:
                continue
            if state.reported:
                continue
            logprobs = None
            if self.request.logprobs is not None:
                logprobs = self._stream_logprobs(state, visible, bool(prefix))
            state.sent = visible
            state.reported = finish is not None
            out.append(
                self._chunk([{"text": prefix + delta, "index": index, "logprobs": logprobs, "finish_reason": finish}])
            )
        return out

    def _stream_logprobs(self, state: ChoiceState, visible: int, with_echo: bool) -> dict:
        """The logprobs of the tokens whose text starts in what this chunk shows."""
        logprobs = self._logprobs(state, state.tokens_sent, 0)
        keep = [
            i
            for i, offset in enumerate(logprobs["text_offset"])
            if offset < visible or (state.finished is not None and visible == len(state.text))
        ]
        logprobs = {key: [values[i] for i in keep] for key, values in logprobs.items()}
        if with_echo:
            echo = self._echo_logprobs(state)
            shift = len(state.prompt_text)
            logprobs["text_offset"] = [o + shift for o in logprobs["text_offset"]]
            logprobs = {key: echo[key] + logprobs[key] for key in echo}
        state.tokens_sent += len(keep)
        return logprobs

    def _chunk(self, choices: list) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model.name,
            "choices": choices,
        }

    def usage_chunk(self) -> dict:
        return dict(self._chunk([]), usage=self.usage())
