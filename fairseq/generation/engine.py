"""The decode engine: a running batch of rows that requests join and leave between chunks of steps (what a server's
continuous batching runs on).

    engine = DecodeEngine(model, dictionary, max_rows=16, max_positions=1024, device="cuda", dtype=torch.bfloat16)
    engine.add(DecodeRequest(id="a", prompt=ids, max_new_tokens=64, temperature=0.8, top_p=0.9, seed=1))
    while engine.has_work:
        for event in engine.step(max_steps=16):   # one host sync per call
            ...  # event.id, event.tokens, event.logprobs, event.top_logprobs, event.finished, event.finish_reason

Each request is one row: `add` queues it; at the next call of `step` (a chunk boundary) it takes a free row of the
running caches, with its own options and seed, its prompt prefilled (`</s>` or the given `bos` first, as the
generator starts a sentence) in one forward with the other prompts joining at that boundary. `step` then decodes up to `max_steps` tokens for every live row:
one-token steps at each row's own position (`forward_static_step` with a slot per row: rows that joined at
different times sit at different lengths), on CUDA replayed from CUDA graphs. It returns, per request, the
tokens of this chunk, their log-probabilities and top-N, and whether it finished: 'stop' (a stop id was drawn:
it is not in `tokens`) or 'length' (`max_new_tokens` reached). Finished and cancelled rows leave at the chunk's
end or the next boundary, the rows after them moving up (their caches too, in place).

Tokens: greedy (temperature 0, or `top_k`/`top_p` without a temperature) takes the most likely token; sampling
draws with counter-based Gumbel noise keyed by (seed, `sample_index`, new-token index, token)
(fairseq.generation.sampling), so a request's tokens depend on its prompt, options and seed only, not on the rows
it runs beside or when it joined. Reported log-probabilities are the model's (temperature 1, before top-k/top-p),
<pad> never drawn. Beam search is not a row of this engine: it stays SequenceGenerator's (docs/generation.md).
"""

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.generation import decode_memory, sampling
from fairseq.generation.cuda_graph_decoding import attention_window, round_up_sentences
from fairseq.generation.sequence_scorer import SequenceScorer
from fairseq.generation.step_model import EnsembleModel, StepModel

MAX_TOP_LOGPROBS = 20  # the most top-N log-probabilities a request may ask for (OpenAI's limit)
MAX_CHUNK = 64  # the most steps one `step` call takes
_STOP, _LENGTH = 1, 2
_REASONS = {_STOP: "stop", _LENGTH: "length"}


@dataclass
class DecodeRequest:
    """One sequence to continue. `prompt`: token ids (1-D, no padding, no begin token: the engine puts it);
    `stop`: the ids that end it (default the dictionary's </s>); `seed`: the draws' seed (default: one drawn from
    torch's RNG at `add`); `sample_index`: several samples of one prompt and seed (0, 1, ...) draw differently;
    `top_logprobs`: N most likely tokens per step, with their log-probabilities."""

    id: Hashable
    prompt: Tensor
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    sample_index: int = 0
    stop: Optional[Sequence[int]] = None
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class TokenEvent:
    """What one `step` produced for one request: its new tokens (a stop id that ended it is left out), their
    log-probabilities (with `logprobs` or `top_logprobs`), per token the top-N (token id, log-probability) pairs,
    best first; `finished` with `finish_reason` 'stop' or 'length'."""

    id: Hashable
    tokens: List[int]
    logprobs: Optional[List[float]] = None
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    finished: bool = False
    finish_reason: Optional[str] = None


@dataclass
class _Row:
    """The host's view of a live row: its request, how many tokens it has (prompt with the begin token, new)."""

    request: DecodeRequest
    prompt_length: int
    generated: int = 0
    finished: bool = False
    cancelled: bool = False

    @property
    def slot(self) -> int:  # the position of the token fed at its next step
        return self.prompt_length - 1 + self.generated


class _Buffers:
    """The rows' device state, allocated once (CUDA graphs read these addresses); row i is the i-th live row."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.tokens, self.slot = zeros(rows, 1), zeros(rows, 1)  # the token to feed next, and its position
        self.generated, self.max_new, self.min_new = zeros(rows), zeros(rows), zeros(rows)
        self.temperature, self.top_p = zeros(rows, dtype=torch.float32), zeros(rows, dtype=torch.float32)
        self.top_k, self.keys = zeros(rows), zeros(rows)
        self.sampled = zeros(rows, dtype=torch.bool)
        self.stop = zeros(rows, vocab, dtype=torch.bool)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.reason = zeros(rows)
        self.column = zeros(1)  # the chunk's step being taken
        # per row and step of a chunk: the token, its log-probability, the top-N
        self.out_tokens, self.out_lprobs = zeros(rows, MAX_CHUNK), zeros(rows, MAX_CHUNK, dtype=torch.float32)
        self.out_top_ids = zeros(rows, MAX_CHUNK, MAX_TOP_LOGPROBS)
        self.out_top_lprobs = zeros(rows, MAX_CHUNK, MAX_TOP_LOGPROBS, dtype=torch.float32)

    def per_row(self) -> Tuple[Tensor, ...]:
        """The buffers with a row per live row, which follow their rows when rows leave."""
        return (
            self.tokens,
            self.slot,
            self.generated,
            self.max_new,
            self.min_new,
            self.temperature,
            self.top_p,
            self.top_k,
            self.keys,
            self.sampled,
            self.stop,
            self.done,
            self.reason,
        )


class DecodeEngine:
    """A running batch of up to `max_rows` rows of up to `max_positions` tokens each (see the module doc)."""

    def __init__(
        self,
        model,
        dictionary,
        *,
        max_rows: int = 16,
        max_positions: Optional[int] = None,
        device=None,
        dtype: Optional[torch.dtype] = None,
        bos: Optional[int] = None,
        cuda_graphs: bool = True,
        compile_step=None,
    ):
        """`model`: a language model of this fork (or a list: an ensemble); moved to `device` / `dtype` when
        given. `max_positions`: tokens per row, the prompt and its begin token included (default and cap: the
        model's). The caches of `max_rows` x `max_positions` are reserved now (on CUDA: checked against free
        memory first, one line when they do not fit). `compile_step`: the one-token steps compiled by inductor
        (fairseq.generation.compiled_step; None: the process's setting)."""
        models = list(model) if isinstance(model, (list, tuple, torch.nn.ModuleList)) else [model]
        if device is not None or dtype is not None:
            models = [m.to(device=device, dtype=dtype) for m in models]
        self.model = EnsembleModel(models).eval()
        if not self.model.can_static_step:
            raise ValueError(
                "the decode engine needs this fork's decoders (a static one-token step over reserved "
                "caches); decode this model with SequenceGenerator"
            )
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        limit = self.model.max_decoder_positions()
        self.max_positions = min(max_positions or limit, limit)
        parameter = next(models[0].parameters())
        self.device = parameter.device
        decode_memory.check_decode_memory(
            models, max_rows, 1, self.max_positions, self.device, fix="lower max_rows or max_positions"
        )
        self.max_rows = max_rows
        self.dictionary = dictionary
        self.pad, self.eos = dictionary.pad(), dictionary.eos()
        self.bos = self.eos if bos is None else bos
        self.vocab_size = len(dictionary)
        # The model's log-probabilities at temperature 1 (what is reported), NaN -> -inf, never <pad>.
        self.step_model = StepModel(
            self.model, self.vocab_size, self.pad, dictionary.unk(), cuda_graphs=cuda_graphs, compile_step=compile_step
        )
        self.step_model.eager_graphs = not (cuda_graphs and self.device.type == "cuda")
        self._graphed = self.step_model.graph_runner(self.device)  # the caches and, on CUDA, the graphs
        self.states = self._graphed.begin(max_rows, 1, self.max_positions, self.device)
        self._buf = _Buffers(self._graphed.rows, self.vocab_size, self.device)
        self._rows: List[_Row] = []
        self._queue: Deque[DecodeRequest] = deque()

    # ---- what a scheduler reads ---------------------------------------------------------------------------
    @property
    def live_rows(self) -> int:
        """Rows decoding now (finished and cancelled ones leave at the next boundary)."""
        return sum(not (row.finished or row.cancelled) for row in self._rows)

    @property
    def queued_rows(self) -> int:
        return len(self._queue)

    @property
    def has_work(self) -> bool:
        return bool(self._queue) or self.live_rows > 0

    @property
    def kv_capacity_tokens(self) -> int:
        """Cache positions reserved: max_rows x max_positions."""
        return self.max_rows * self.max_positions

    @property
    def kv_tokens_in_use(self) -> int:
        """Cache positions the live and queued requests may fill (prompt, begin token and max_new_tokens each):
        what a scheduler bounds by --max-batch-tokens."""
        requests = [row.request for row in self._rows if not (row.finished or row.cancelled)] + list(self._queue)
        return sum(_positions(request) for request in requests)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one position of one row takes (every layer's key and value, every model)."""
        return decode_memory.decode_bytes(self.model.models, 1, 1)

    # ---- requests -----------------------------------------------------------------------------------------
    def add(self, request: DecodeRequest) -> None:
        """Queue `request`: it joins the running batch at the next `step` with a free row. ValueError (one line
        naming the field) for options out of range or a prompt that does not fit."""
        self._check(request)
        if any(r.id == request.id for r in self._queue) or any(
            row.request.id == request.id and not (row.finished or row.cancelled) for row in self._rows
        ):
            raise ValueError(
                f"a request with id {request.id!r} is already in the engine: ids name events, give each request its own"
            )
        if request.seed is None:
            request.seed = int(torch.randint(2**31, (1,)))
        self._queue.append(request)

    def cancel(self, request_id: Hashable) -> bool:
        """Take the request out: from the queue now, from the batch at the next boundary (its row freed, no more
        events). Whether it was there."""
        for request in self._queue:
            if request.id == request_id:
                self._queue.remove(request)
                return True
        for row in self._rows:
            if row.request.id == request_id and not (row.finished or row.cancelled):
                row.cancelled = True
                return True
        return False

    def score(self, prompt: Tensor) -> Tensor:
        """The log-probability [len(prompt)] of each prompt token given the begin token and the tokens before it
        (`echo` of a prompt; see `score_prompt`)."""
        return score_prompt(list(self.model.models), self.dictionary, prompt.to(self.device), self.bos)

    # ---- a chunk ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, max_steps: int = 16) -> List[TokenEvent]:
        """Let finished and cancelled rows leave, queued requests join (prefilled), then decode up to
        `max_steps` tokens for every live row (fewer when every row ends sooner); one event per live row."""
        if not 1 <= max_steps <= MAX_CHUNK:
            raise ValueError(f"max_steps must be in 1 .. {MAX_CHUNK}, got {max_steps}")
        self._leave()
        self._admit()
        if not self._rows:
            return []
        rows = len(self._rows)
        graph_rows = round_up_sentences(rows) if self._static_shapes else rows
        steps = min(max_steps, max(row.request.max_new_tokens - row.generated for row in self._rows))
        sampled = any(row.request.temperature > 0 for row in self._rows)
        # top-N computed for the chunk: 0, 5 or 20 (a graph per kind of chunk, so few kinds)
        top_n = next(n for n in (0, 5, MAX_TOP_LOGPROBS) if n >= max(r.request.top_logprobs for r in self._rows))
        first_slot = max(row.slot for row in self._rows)
        self._buf.column.zero_()
        for k in range(steps):
            window = self._window(first_slot + k)
            self._graphed.replay(
                ("engine", graph_rows, window, sampled, top_n),
                lambda: self._device_step(graph_rows, window, sampled, top_n),
            )
        return self._events(steps, top_n)

    @property
    def _static_shapes(self) -> bool:
        """Whether steps take few shapes (rows and window rounded up): each is a graph to capture or a compile."""
        return self._graphed.capture or self.step_model.compiled_step is not None

    def _window(self, slot: int) -> int:
        """The cache slots a step attends over when the rows' highest slot is `slot`: the live length rounded up
        (few graphs, few compiles) on CUDA graphs or compiled, the live length itself when eager."""
        if self._static_shapes:
            return attention_window(slot, self._graphed.capacity)
        return slot + 1

    def _device_step(self, rows: int, window: int, sampled: bool, top_n: int) -> None:
        """One token for rows [:rows], all on the device (a CUDA graph captures it): the model's step at each
        row's slot, the choice, the outputs recorded at the chunk's column, the ends, the next slot."""
        b = self._buf
        lp = self.step_model.static_step(b.tokens[:rows], b.slot[:rows], self.states, window)
        live = ~b.done[:rows]
        early = b.stop[:rows] & b.generated[:rows].lt(b.min_new[:rows]).unsqueeze(1)  # before min_new_tokens
        allowed = lp.masked_fill(early, -math.inf)
        token = allowed.argmax(dim=1)
        if sampled:
            token = torch.where(b.sampled[:rows], self._draw(allowed, rows), token)
        self._record(lp, token, rows, top_n)
        stop = b.stop[:rows].gather(1, token.unsqueeze(1)).squeeze(1) & live
        b.generated[:rows] += live.long()
        length = live & ~stop & b.generated[:rows].ge(b.max_new[:rows])
        b.reason[:rows] = torch.where(stop, _STOP, torch.where(length, _LENGTH, b.reason[:rows]))
        b.done[:rows] |= stop | length
        b.tokens[:rows, 0] = torch.where(live, token, b.tokens[:rows, 0])
        b.slot[:rows, 0] += live.long()
        b.column += 1

    def _draw(self, lp: Tensor, rows: int) -> Tensor:
        """Each sampling row's token: its tempered distribution, top-k / top-p, counter-based noise keyed by
        its key and new-token index."""
        b = self._buf
        tempered = F.log_softmax(lp / b.temperature[:rows].unsqueeze(1), dim=1)
        return sampling.draw(tempered, b.keys[:rows], b.generated[:rows], b.top_k[:rows], b.top_p[:rows])

    def _record(self, lp: Tensor, token: Tensor, rows: int, top_n: int) -> None:
        b, column = self._buf, self._buf.column
        b.out_tokens[:rows].index_copy_(1, column, token.unsqueeze(1))
        b.out_lprobs[:rows].index_copy_(1, column, lp.gather(1, token.unsqueeze(1)))
        if top_n:
            values, ids = lp.topk(top_n, dim=1)
            b.out_top_lprobs[:rows, :, :top_n].index_copy_(1, column, values.unsqueeze(1))
            b.out_top_ids[:rows, :, :top_n].index_copy_(1, column, ids.unsqueeze(1))

    def _events(self, steps: int, top_n: int) -> List[TokenEvent]:
        """Read the chunk's outputs (the host sync of the chunk) into one event per row."""
        b, rows = self._buf, len(self._rows)
        generated, reasons = b.generated[:rows].tolist(), b.reason[:rows].tolist()
        tokens, lprobs = b.out_tokens[:rows, :steps].tolist(), b.out_lprobs[:rows, :steps].tolist()
        if top_n:
            top_ids, top_lprobs = b.out_top_ids[:rows, :steps].tolist(), b.out_top_lprobs[:rows, :steps].tolist()
        events = []
        for i, row in enumerate(self._rows):
            request, reason = row.request, _REASONS.get(reasons[i])
            kept = generated[i] - row.generated - (reason == "stop")  # the stop id is no output
            row.generated, row.finished = generated[i], reason is not None
            event = TokenEvent(request.id, tokens[i][:kept], finished=row.finished, finish_reason=reason)
            if request.logprobs or request.top_logprobs:
                event.logprobs = lprobs[i][:kept]
            if request.top_logprobs:
                n = request.top_logprobs
                event.top_logprobs = [list(zip(top_ids[i][j][:n], top_lprobs[i][j][:n])) for j in range(kept)]
            events.append(event)
        self._leave()
        return events

    # ---- rows join and leave ------------------------------------------------------------------------------
    def _leave(self) -> None:
        """Finished and cancelled rows leave; the others move up (their buffers and cache rows, in place)."""
        keep = [i for i, row in enumerate(self._rows) if not (row.finished or row.cancelled)]
        if len(keep) == len(self._rows):
            return
        b = self._buf
        if keep:
            index = torch.tensor(keep, device=self.device)
            for tensor in b.per_row():
                tensor[: len(keep)] = tensor.index_select(0, index)
            self.step_model.drop_rows(self.states, index, self._window(max(self._rows[i].slot for i in keep)))
        b.done[len(keep) :] = True  # rows past the live ones write nothing
        self._rows = [self._rows[i] for i in keep]

    def _admit(self) -> None:
        """Queued requests take the free rows, oldest first: their prompts prefilled together (one forward),
        then each row's options."""
        joining = []
        while self._queue and len(self._rows) + len(joining) < self.max_rows:
            joining.append(self._queue.popleft())
        if not joining:
            return
        first = len(self._rows)
        for start, group in self._prefill_groups(joining):
            self._prefill(group, first + start)
        for i, request in enumerate(joining):
            self._join(request, first + i)
            self._rows.append(_Row(request, request.prompt.numel() + 1))

    def _prefill_groups(self, requests: List[DecodeRequest]):
        """(index of the first, requests) of consecutive groups prefilled in one forward each: a group's prompts
        padded to its longest (and the compiled prefill's multiple, `compile_step`) hold at most max_positions
        tokens (or one row), so that the prefill's temporary caches and activations are never larger than one
        full-length prompt's, the most the decode memory check leaves room for (rows joining one at a time
        needed no more)."""
        groups, start, longest = [], 0, 0
        for i, request in enumerate(requests):
            width = request.prompt.numel()  # the begin token and the prompt but its last token
            padded = self.step_model.prefill_length(max(longest, width))
            if i > start and (i - start + 1) * padded > self.max_positions:
                groups.append((start, requests[start:i]))
                start, longest = i, 0
            longest = max(longest, width)
        groups.append((start, requests[start:]))
        return groups

    def _prefill(self, requests: List[DecodeRequest], first: int) -> None:
        """Rows first, first + 1, ... take the begin token and their request's prompt but its last token in the
        caches: one forward of the prompts right-padded to the longest (compiled: further, to a multiple of 64;
        causal attention: a row's positions never see the padding after them; the padded slots are overwritten
        before a step reads them). Empty prompts have nothing to prefill."""
        rows = [first + i for i, request in enumerate(requests) if request.prompt.numel()]
        if not rows:
            return
        prompts = [request.prompt for request in requests if request.prompt.numel()]
        tokens = torch.full((len(prompts), max(p.numel() for p in prompts)), self.pad, dtype=torch.long)
        for i, prompt in enumerate(prompts):  # the begin token, the prompt but its last token
            tokens[i, 0], tokens[i, 1 : prompt.numel()] = self.bos, prompt[:-1].cpu()
        self.step_model.add_rows(self.states, torch.tensor(rows, device=self.device), tokens.to(self.device))

    def _join(self, request: DecodeRequest, row: int) -> None:
        """Row `row` (its caches prefilled) takes `request`: its last prompt token (the begin token for an
        empty prompt) to feed at the next step, its options."""
        b, device, length = self._buf, self.device, request.prompt.numel()
        b.tokens[row, 0] = int(request.prompt[-1]) if length else self.bos
        b.slot[row, 0] = length
        b.generated[row], b.max_new[row], b.min_new[row] = 0, request.max_new_tokens, request.min_new_tokens
        sampled = request.temperature > 0
        b.sampled[row], b.temperature[row] = sampled, request.temperature if sampled else 1.0
        b.top_k[row], b.top_p[row] = request.top_k, request.top_p
        b.keys[row] = sampling.sentence_keys(request.seed, torch.tensor([request.sample_index], device=device))[0]
        b.stop[row] = False
        b.stop[row, list(self._stop_ids(request))] = True
        b.done[row], b.reason[row] = False, 0

    def _stop_ids(self, request: DecodeRequest) -> List[int]:
        return [self.eos] if request.stop is None else [int(t) for t in request.stop]

    def _check(self, request: DecodeRequest) -> None:
        prompt = request.prompt
        if not torch.is_tensor(prompt) or prompt.dim() != 1 or prompt.dtype != torch.long:
            raise ValueError("DecodeRequest.prompt must be a 1-D LongTensor of token ids")
        if prompt.numel() and (int(prompt.min()) < 0 or int(prompt.max()) >= self.vocab_size):
            raise ValueError(f"DecodeRequest.prompt holds ids outside the dictionary's 0 .. {self.vocab_size - 1}")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {request.max_new_tokens}")
        if not 0 <= request.min_new_tokens <= request.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in 0 .. max_new_tokens ({request.max_new_tokens}), got "
                f"{request.min_new_tokens}"
            )
        if request.temperature < 0 or not math.isfinite(request.temperature):
            raise ValueError(f"temperature must be >= 0, got {request.temperature}")
        if not 0 < request.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {request.top_p}")
        if request.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {request.top_k}")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0 .. {MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
        if any(not 0 <= int(t) < self.vocab_size for t in (request.stop or ())):
            raise ValueError(f"stop ids must be in 0 .. {self.vocab_size - 1}, got {list(request.stop)}")
        needed = _positions(request)
        if needed > self.max_positions:
            raise ValueError(
                f"a prompt of {prompt.numel()} tokens and max_new_tokens {request.max_new_tokens} need "
                f"{needed} positions (the begin token, the prompt, the new tokens but the last) and rows "
                f"have {self.max_positions}; shorten the prompt or ask for at most "
                f"{max(self.max_positions - prompt.numel(), 0)} tokens"
            )


def _positions(request: DecodeRequest) -> int:
    """Positions a request's row fills at most: the begin token, the prompt, the new tokens but the last (it is
    never fed)."""
    return request.prompt.numel() + request.max_new_tokens


def score_prompt(models, dictionary, prompt: Tensor, bos: Optional[int] = None) -> Tensor:
    """The log-probability [len(prompt)] (fp32) of each token of `prompt` (1-D ids) given `bos` (default </s>)
    and the tokens before it: one full forward through SequenceScorer, the scorer of the hub's `score()` and
    --score-reference (an ensemble's probabilities averaged)."""
    models = list(models) if isinstance(models, (list, tuple)) else [models]
    bos = dictionary.eos() if bos is None else bos
    source = torch.cat([prompt.new_tensor([bos]), prompt]).unsqueeze(0)
    target = torch.cat([prompt, prompt.new_tensor([dictionary.pad()])]).unsqueeze(0)
    sample = {"net_input": {"src_tokens": source, "src_lengths": torch.tensor([source.size(1)])}, "target": target}
    with torch.no_grad():
        return SequenceScorer(dictionary).generate(models, sample)[0][0]["positional_scores"]
