"""Greedy search and sampling (one hypothesis per sentence) decoded on the device, with no host sync per token.

SequenceGenerator runs this loop instead of its step-by-step one when the beam is 1 and the search is greedy
(`BeamSearch`) or `Sampling`, with this fork's decoders (their caches take a whole prompt at once). Per step,
on the device and, on CUDA, inside one captured graph: the model's one-token step over the caches' live window
(fairseq.generation.cuda_graph_decoding), the masks (<pad>, --unkpen, --min-len, the length limit, the forced
prompt tokens), the choice of the next token, its cumulative score, whether the hypothesis ended, and the slot
of the next step. The host replays CHUNK steps, then reads which sentences are done: one host sync per CHUNK
tokens instead of one per token. A finished sentence's row writes nothing more; between chunks finished
sentences are stored and leave the batch (their cache rows dropped in place) when that saves work: always when
decoding eagerly, with graphs when the row count rounds down to a smaller graph. The tokens are read once at
the end, or after every chunk when the caller streams them (`on_tokens`). The loop itself (`DeviceLoop`: buffers, masks, chunks, graphs, the hypotheses stored at the
end) also runs beam search, whose steps fairseq.generation.device_beam_search takes.

Greedy results are the step-by-step loop's: the same operations on the same values (the candidates are the top
two of log-probability plus cumulative score, as BeamSearch takes them; the hypotheses are stored in the batch's
FinishedHypotheses, as that loop stores them), so tokens and scores are equal, not close.

The loops reach the models through the generator's StepModel (fairseq.generation.step_model) only, and decode its
BatchState (fairseq.generation.batch_state). Sampling draws are counter-based (fairseq.generation.sampling, with the
one top-k / top-p filter every sampler uses): the Gumbel noise of token v at step s of sentence i is a hash of
(seed, i, s, v), where i is the sentence's id (`sample["id"]`: its line in fairseq-generate's input, its index in
the hub's list) and the seed is the search's `seed` (default: torch.initial_seed(), which --seed sets). A sentence's
sample therefore depends on the seed and the sentence alone, not on the batch it is decoded in, its place there, the
batch size or the graphs. The drawn token is the argmax of log-probability plus noise over the kept tokens (top-k,
or the top-p set), which draws from the kept tokens' renormalized distribution, as a multinomial over their
probabilities does; its score is the model's log-probability of it, as with `Sampling.step`.
"""

import math
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from fairseq.generation import sampling, search
from fairseq.generation.batch_state import BatchState
from fairseq.generation.cuda_graph_decoding import attention_window, round_up_sentences

# Steps replayed between two reads of the "every sentence is done" flag: at most CHUNK - 1 steps are computed
# past the end of the longest output, and a step costs one host sync per CHUNK tokens.
CHUNK = 16


def applies(generator, beam: int) -> bool:
    """Whether this loop can decode `generator`'s batches (the generator chooses, see its `device_loop`): beam 1,
    greedy or sampling, this fork's decoders, and no option the loop does not implement (--no-repeat-ngram-size,
    --match-source-len)."""
    kind = type(generator.search)
    return (
        generator.device_loop is not False
        and beam == 1
        and kind in (search.BeamSearch, search.Sampling)
        and generator.model.can_feed_prompts
        and not generator.no_repeat_ngram_size
        and not generator.match_source_len
    )


class _Buffers:
    """The loop's device state, allocated once per cache size (graphs read these addresses): rows R, cache
    capacity C. `tokens` [R, C + 2] and `scores` [R, C + 1] are laid out as SequenceGenerator's (begin-of-
    sentence token first; cumulative scores per step)."""

    def __init__(self, rows: int, capacity: int, vocab: int, device: torch.device):
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # the step being taken
        self.limits = torch.zeros(2, dtype=torch.long, device=device)  # --min-len, the longest output
        self.tokens = torch.zeros(rows, capacity + 2, dtype=torch.long, device=device)
        self.scores = torch.zeros(rows, capacity + 1, device=device)
        self.forced = torch.zeros(rows, capacity + 1, dtype=torch.long, device=device)  # prompt token per step
        self.cum = torch.zeros(rows, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.end_step = torch.zeros(rows, dtype=torch.long, device=device)
        self.keys = torch.zeros(rows, dtype=torch.long, device=device)
        self.vocab_ids = torch.arange(vocab, device=device)
        self.rows, self.capacity = rows, capacity


class DeviceLoop:
    """What the device loops share (greedy search and sampling here, beam search in
    fairseq.generation.device_beam_search): the buffers, the masks, the loop of whole steps (captured on CUDA
    under the key `name`), one host sync per chunk, and the hypotheses stored at the end. A subclass chooses
    each step's tokens (`_choose`)."""

    name = "loop"  # the key of its graphs and buffers in the graph runner (a generator has one loop: one beam)

    def __init__(self, step_model, search_strategy: search.Search, beam: int, eos: int, pad: int):
        """`step_model`: the generator's StepModel (fairseq.generation.step_model), the only way to the models;
        `search_strategy`: its search (greedy or sampling options, the sampling seed)."""
        self.step_model, self.search = step_model, search_strategy
        self.beam, self.eos, self.pad = beam, eos, pad
        self._eager_buffers: Optional[_Buffers] = None

    def _new_buffers(self, rows: int, capacity: int, device: torch.device) -> _Buffers:
        return _Buffers(rows, capacity, self.step_model.vocab_size, device)

    def _choose(self, lp: Tensor, buf: _Buffers, rows: int, b: BatchState, window: int, first: bool) -> None:
        """Take the step at `buf.slot` for rows [:rows] given their masked log-probabilities, and move to the
        next slot. `b`: the batch (its caches); `window`: the cache slots live after this step's model call;
        `first`: whether it is step 0 (known on the host: never true inside a captured graph)."""
        raise NotImplementedError

    # ---- one step, all on the device ----------------------------------------------------------------------
    def _constrain(self, lp: Tensor, buf: _Buffers, rows: int) -> Tensor:
        """SequenceGenerator._constrain's masks with the step read from the device: only </s> at the length
        limit, no </s> before --min-len, a row whose prompt goes on can only continue it."""
        step = buf.slot
        at_limit = step >= buf.limits[1]
        lp = lp.masked_fill(at_limit & buf.vocab_ids.ne(self.eos), -math.inf)
        forced = buf.forced[:rows].index_select(1, step).masked_fill(at_limit, self.pad)  # [rows, 1]
        forced_lp = lp.gather(1, forced)
        lp = lp.masked_fill((step < buf.limits[0]) & buf.vocab_ids.eq(self.eos), -math.inf)
        only_forced = torch.full_like(lp, -math.inf).scatter_(1, forced, forced_lp)
        return torch.where(forced.ne(self.pad), only_forced, lp)

    # ---- the loop -----------------------------------------------------------------------------------------
    def _buffers(self, b: BatchState, rows: int) -> _Buffers:
        graphed = b.graphed
        if graphed is not None:  # with the graphs' caches, at their size: the graphs read these addresses
            buf = graphed.extra.get(self.name)
            if buf is None:
                buf = graphed.extra[self.name] = self._new_buffers(graphed.rows, graphed.capacity, b.device)
            return buf
        buf = self._eager_buffers
        if buf is None or buf.rows < rows or buf.capacity < b.max_len + 1 or buf.tokens.device != b.device:
            buf = self._eager_buffers = self._new_buffers(rows, b.max_len + 1, b.device)
        return buf

    def _start(self, b: BatchState, sample: dict, rows: int, graph_rows: int) -> _Buffers:
        buf = self._buffers(b, graph_rows)
        width = b.tokens.size(1)
        buf.tokens[:graph_rows].fill_(self.pad)
        buf.tokens[:rows, :width] = b.tokens
        buf.scores[:rows, : width - 1] = b.scores
        buf.forced[:graph_rows].fill_(self.pad)
        if b.forced_rows is not None:
            buf.forced[:rows, : b.forced_rows.size(1)] = b.forced_rows
        buf.done[:graph_rows] = True
        buf.done[:rows] = False
        buf.end_step[:graph_rows] = -1
        buf.cum[:graph_rows] = 0.0
        if b.start > 0:
            buf.cum[:rows] = b.scores[:, b.start - 1]
        buf.slot.fill_(b.start)
        buf.limits.copy_(torch.tensor([b.min_len, b.max_len]))
        if isinstance(self.search, search.Sampling):
            ids = sample.get("id")
            ids = torch.arange(rows, device=b.device) if ids is None else ids.to(b.device)
            seed = self.search.seed if self.search.seed is not None else torch.initial_seed()
            buf.keys[:rows] = sampling.sentence_keys(seed, ids)
        return buf

    def decode(
        self, b: BatchState, lprobs: Tensor, sample: dict, on_tokens: Optional[Callable[[Tensor, Tensor], None]] = None
    ) -> List[List[dict]]:
        """Decode the batch `b` set up by SequenceGenerator._begin (prompts fed, `lprobs` the log-probabilities
        of step b.start); returns each sentence's hypotheses as the step-by-step loop stores them, best first.
        `on_tokens(tokens, done)`: called after every chunk with the tokens so far [B, T] (host, the begin-of-
        sentence token first, <pad> after a sentence's end) and which sentences are done [B] (beam 1)."""
        beam, max_len = self.beam, b.max_len
        rows = b.bsz * beam
        graph_rows = beam * round_up_sentences(b.bsz) if b.graphed is not None else rows
        buf = self._start(b, sample, rows, graph_rows)
        shown = None if on_tokens is None else _StreamedBatch(b.bsz, max_len + 2, self.pad)
        # step b.start, from the prompt's forward
        self._choose(lprobs, buf, rows, b, self._window(b, b.start), b.start == 0)
        step = b.start + 1
        while step <= max_len:
            for _ in range(min(CHUNK, max_len + 1 - step)):
                self._step(b, buf, step, rows, graph_rows)
                step += 1
            finished = int(buf.done[:rows].sum())  # the host sync of this chunk
            if shown is not None:
                on_tokens(*shown.update(b.sent_of_row, buf.tokens[:rows, : step + 1], buf.done[:rows]))
            if finished == rows:
                break
            if finished:
                rows, graph_rows = self._drop_finished(b, buf, rows, graph_rows, finished, step)
        self._set_length(b, step)
        return self._finalize(b, buf, rows)

    @staticmethod
    def _set_length(b: BatchState, length: int) -> None:
        """Say how many tokens the caches hold (static steps leave the plain-int lengths alone)."""
        if b.graphed is not None:
            b.graphed.set_length(length)

    def _drop_finished(
        self, b: BatchState, buf: _Buffers, rows: int, graph_rows: int, finished: int, step: int
    ) -> Tuple[int, int]:
        """Store the sentences that are done (`finished` rows) and take them (their `beam` rows) out of the
        batch, as the step-by-step loop drops them but once per chunk, when that saves work: always when
        decoding eagerly, with graphs when the row count rounds down. Returns the new (rows, graph rows)."""
        beam = self.beam
        new_rows = rows - finished
        new_graph_rows = beam * round_up_sentences(new_rows // beam) if b.graphed is not None else new_rows
        if new_graph_rows == graph_rows:
            return rows, graph_rows
        device = buf.tokens.device
        live = (~buf.done[:rows].view(-1, beam)[:, 0]).nonzero().squeeze(1).cpu()  # the sentences going on
        self._store(b, *self._hypotheses(buf, rows), buf.end_step[:rows].masked_fill(~buf.done[:rows], -1), beam)
        sentences, keep = live.to(device), (live.unsqueeze(1) * beam + torch.arange(beam)).view(-1).to(device)
        for tensor in self._row_buffers(buf):
            tensor[:new_rows] = tensor[:rows].index_select(0, keep)
        for tensor in self._sentence_buffers(buf):
            tensor[: live.numel()] = tensor[: rows // beam].index_select(0, sentences)
        buf.done[new_rows:graph_rows] = True  # rows past the live ones write nothing
        b.sent_of_row = [b.sent_of_row[i] for i in live.tolist()]
        b.src_lengths = b.src_lengths.index_select(0, sentences)
        self._set_length(b, step)
        self.step_model.drop_rows(b.states, keep)  # in place: the graphs' addresses stay
        return new_rows, new_graph_rows

    @staticmethod
    def _row_buffers(buf: _Buffers) -> Tuple[Tensor, ...]:
        """The buffers with a row per hypothesis, which follow their rows when sentences leave the batch."""
        return buf.tokens, buf.scores, buf.forced, buf.cum, buf.done, buf.end_step, buf.keys

    @staticmethod
    def _sentence_buffers(buf: _Buffers) -> Tuple[Tensor, ...]:
        """The buffers with a row per sentence."""
        return ()

    @staticmethod
    def _hypotheses(buf: _Buffers, rows: int) -> Tuple[Tensor, Tensor]:
        """The (tokens, scores) histories the ended hypotheses are stored from (`_store`)."""
        return buf.tokens[:rows], buf.scores[:rows]

    @staticmethod
    def _window(b: BatchState, step: int) -> int:
        """The cache slots live after the model call of `step`: what a static step attends over (the live
        length rounded up, one graph per window), the live length itself on the dynamic path."""
        return step + 1 if b.graphed is None else attention_window(step, b.graphed.capacity)

    def _step(self, b: BatchState, buf: _Buffers, step: int, rows: int, graph_rows: int) -> None:
        """Step `step` (the host's count; buf.slot holds the same on the device)."""
        graphed, window = b.graphed, self._window(b, step)
        if graphed is None:  # eager: the dynamic cached forward (what the step-by-step loop runs)
            lp = self.step_model.next_log_probs(buf.tokens[:rows], step, b.states, None)
            self._choose(lp, buf, rows, b, window, False)
            return

        def whole_step():
            tokens = buf.tokens[:graph_rows].index_select(1, buf.slot)
            lp = self.step_model.static_step(tokens, buf.slot, graphed.states, window)
            self._choose(lp, buf, graph_rows, b, window, False)

        graphed.replay((self.name, graph_rows, window), whole_step)

    def _finalize(self, b: BatchState, buf: _Buffers, rows: int) -> List[List[dict]]:
        """Store the hypotheses that ended in the rows left; each sentence's hypotheses, best first."""
        self._store(b, *self._hypotheses(buf, rows), buf.end_step[:rows], self.beam)
        return b.finished.best_first()

    def _store(self, b: BatchState, tokens: Tensor, scores: Tensor, end_steps: Tensor, beam: int) -> None:
        """Store the ended hypotheses (row r of `tokens` / `scores` laid out as SequenceGenerator's, its last
        column the </s> score, ended at `end_steps[r]`, -1: none; row r // beam is its sentence, rows in the
        order the step-by-step loop stores them) in the batch's store of finished hypotheses, as the
        step-by-step loop stores them (one call per end step)."""
        # One read of the end steps and of the scores they end with: each end step's rows and the ranking values
        # are then found on the host, not by a sync per end step.
        end_scores = scores.gather(1, end_steps.clamp(min=0).unsqueeze(1)).squeeze(1)
        host_end_steps, host_end_scores = end_steps.cpu(), end_scores.cpu()
        for step in sorted(set(host_end_steps.tolist()) - {-1}):
            rows_ending = host_end_steps.eq(step).nonzero().squeeze(1)
            b.store_ended(
                step,
                rows_ending,
                end_scores.index_select(0, rows_ending.to(scores.device)),
                tokens,
                scores,
                host_end_scores.index_select(0, rows_ending),
            )


class DeviceDecodeLoop(DeviceLoop):
    """Greedy search and sampling at beam 1 (see the module doc)."""

    def _choose(self, lp: Tensor, buf: _Buffers, rows: int, b: BatchState, window: int, first: bool) -> None:
        # One hypothesis per sentence: no cache rows to reorder, and step 0 is like any other.
        step = buf.slot
        lp = self._constrain(lp, buf, rows)
        cum = buf.cum[:rows]
        if isinstance(self.search, search.Sampling):
            token = self._draw(lp, buf, rows)
            score = lp.gather(1, token.unsqueeze(1)).squeeze(1) + cum
        else:  # BeamSearch's candidates at beam 1 (its step adds the cumulative score, then takes the top two)
            cand_scores, cand_tokens = torch.topk(lp + cum.unsqueeze(1), k=min(2, lp.size(1) - 1))
            token, score = cand_tokens[:, 0], cand_scores[:, 0]
        live = ~buf.done[:rows]
        ends = live & token.eq(self.eos) & score.ne(-math.inf)
        buf.tokens[:rows].scatter_(1, (step + 1).expand(rows, 1), torch.where(live, token, self.pad).unsqueeze(1))
        column = buf.scores[:rows].index_select(1, step).squeeze(1)
        buf.scores[:rows].scatter_(1, step.expand(rows, 1), torch.where(live, score, column).unsqueeze(1))
        buf.cum[:rows] = torch.where(live, score, cum)
        buf.end_step[:rows] = torch.where(ends, step, buf.end_step[:rows])
        buf.done[:rows] |= ends | (step >= buf.limits[1])
        buf.slot += 1

    def _draw(self, lp: Tensor, buf: _Buffers, rows: int) -> Tensor:
        """Sampling's next token per row: argmax of log-probability plus Gumbel noise over the kept tokens."""
        sampler = self.search
        return sampling.draw(lp, buf.keys[:rows], buf.slot, sampler.sampling_topk, sampler.sampling_topp)


class _StreamedBatch:
    """The host's copy of a streamed batch (beam 1), in batch order: rows leave the device batch as they finish."""

    def __init__(self, sentences: int, width: int, pad: int):
        self.tokens = torch.full((sentences, width), pad, dtype=torch.long)
        self.done = torch.zeros(sentences, dtype=torch.bool)

    def update(self, sent_of_row: List[int], tokens: Tensor, done: Tensor) -> Tuple[Tensor, Tensor]:
        sentences = torch.tensor(sent_of_row)
        self.tokens[sentences, : tokens.size(1)] = tokens.cpu()
        self.done[sentences] = done.cpu()
        return self.tokens[:, : tokens.size(1)].clone(), self.done.clone()
