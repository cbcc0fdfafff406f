"""Beam search (beam >= 2) decoded on the device, with no host sync per step.

SequenceGenerator runs this loop instead of its step-by-step one when the search is `BeamSearch` with a beam of
2 or more and the decoders are this fork's (their caches take a whole prompt at once), following
fairseq.generation.device_decoding (the loop, its buffers and masks are that module's `DeviceLoop`). Per step,
on the device and, on CUDA, inside one captured graph (the key `name`, per row count and attention window):

- the model's one-token step for every hypothesis (the static step over the caches' live window, or on CPU /
  without graphs the dynamic cached forward, as the step-by-step loop runs it);
- the masks of SequenceGenerator._constrain (--min-len, the length limit, forced prompt tokens);
- BeamSearch.step itself: the top 2 * beam of log-probability plus cumulative score over beam x V per
  sentence (at step 0 over the first beam only);
- the hypotheses that end: a candidate that is </s> with a finite score among the first `beam` and not ignored
  is copied, with its history, to the sentence's next free place in the buffers of finalized hypotheses (at
  most `beam`, in candidate order, as the step-by-step loop stores them); a sentence is done when
  it has `beam` of them or at the last step;
- the next hypotheses, as SequenceGenerator._extend takes them: the first `beam` candidates that did not end
  (ended or ignored ones sort last, and become ignored when they must be taken); the tokens and scores
  histories follow the chosen parent rows, over the live window only, and so do the KV caches: by index
  through a block table on the static step (StepModel.reorder_blocks: full 64-slot blocks shared, one block
  copied per row and layer; docs/generation.md), copied on the dynamic one;
- the slot of the next step.

Sentences that are done write nothing more. The host replays CHUNK steps, then reads which sentences are done;
those are stored and leave the batch (their rows and cache rows dropped in place, as DeviceLoop does at beam 1)
when that saves work: always when decoding eagerly, with graphs when the sentence count rounds down to a
smaller graph. Stored hypotheses go through the batch's FinishedHypotheses, in the order the step-by-step
loop would have stored them, and are ranked best first as it ranks them.

The results are the step-by-step loop's: the same operations on the same values (for a one-sentence batch the
tokens, scores and positional scores are equal, not close). In a batch of several sentences the step-by-step
loop drops finished sentences, so its matrix products run at other batch sizes: scores agree to ~1e-6.
"""

import math

import torch
from torch import Tensor

from fairseq.generation import search
from fairseq.generation.device_decoding import DeviceLoop, _Buffers
from fairseq.kernels.decode_attention import CACHE_BLOCK


def applies(generator, beam: int) -> bool:
    """Whether this loop can decode `generator`'s batches (the generator chooses, see its `device_loop`): beam
    search (`BeamSearch` itself) with 2 or more beams, this fork's decoders, and no option the loop does not
    implement (--no-repeat-ngram-size, --match-source-len)."""
    return (
        generator.device_loop is not False
        and beam >= 2
        and type(generator.search) is search.BeamSearch
        and generator.model.can_feed_prompts
        and not generator.no_repeat_ngram_size
        and not generator.match_source_len
    )


class _BeamBuffers(_Buffers):
    """device_decoding's buffers (rows are sentences x beam; `done` is per row, the same for a sentence's beams;
    `end_step` is per finalized place) and beam search's: per sentence, its candidates to ignore (`ignore` [S,
    beam]) and how many hypotheses ended (`count` [S]); per finalized place (row s * beam + p: sentence s, place
    p), the history of the hypothesis stored there (`final_tokens`, `final_scores`, laid out as `tokens` and
    `scores`, the last score the </s> candidate's); constant indices, so that a captured step creates none from
    the host."""

    def __init__(self, rows: int, capacity: int, vocab: int, device: torch.device, beam: int):
        super().__init__(rows, capacity, vocab, device)
        sentences = rows // beam
        self.ignore = torch.zeros(sentences, beam, dtype=torch.bool, device=device)
        self.count = torch.zeros(sentences, dtype=torch.long, device=device)
        self.final_tokens = torch.zeros_like(self.tokens)
        self.final_scores = torch.zeros_like(self.scores)
        self.row_ids = torch.arange(rows, device=device)
        self.first_rows = torch.arange(sentences, device=device) * beam  # each sentence's first row
        self.places = torch.arange(beam, device=device)
        self.cand_offsets = torch.arange(2 * beam, device=device)
        # The caches' block table (static steps: `capacity` is the caches'): row r's keys of block j are in
        # cache row block_rows[r, j] (StepModel.reorder_blocks).
        self.block_rows = torch.zeros(rows, -(-capacity // CACHE_BLOCK), dtype=torch.int32, device=device)


class DeviceBeamSearch(DeviceLoop):
    """The beam search loop of one SequenceGenerator (see the module doc)."""

    name = "beam"

    def _new_buffers(self, rows: int, capacity: int, device: torch.device) -> _BeamBuffers:
        return _BeamBuffers(rows, capacity, self.step_model.vocab_size, device, self.beam)

    def _start(self, b, sample: dict, rows: int, graph_rows: int) -> _BeamBuffers:
        buf = super()._start(b, sample, rows, graph_rows)
        sentences = graph_rows // self.beam
        buf.ignore[:sentences] = False
        buf.count[:sentences] = 0
        if b.graphed is not None:
            # The prompt was copied to every beam's row: the beams read it from their sentence's first row
            # (one copy read by `beam` rows: the GPU's cache serves the others). The first reorder gives each
            # row its own block from the one its next step writes on; rows past the batch read their own.
            table = torch.arange(buf.rows, device=b.device, dtype=torch.int32)
            table[:rows] = table[:rows] // self.beam * self.beam
            buf.block_rows.copy_(table.view(-1, 1))
            self.step_model.use_block_table(b.states, buf.block_rows)
        return buf

    def decode(self, b, lprobs: Tensor, sample: dict, on_tokens=None):
        try:
            return super().decode(b, lprobs, sample, on_tokens)
        finally:  # the caches' next users (a step-by-step loop, a new batch's prompts) read rows as they are
            if b.graphed is not None:
                self.step_model.use_block_table(b.states, None)

    def _choose(self, lp: Tensor, buf: _BeamBuffers, rows: int, b, window: int, first: bool) -> None:
        beam = self.beam
        sentences = rows // beam
        lp = self._constrain(lp, buf, rows).view(sentences, beam, -1)
        # BeamSearch.step reads of the step only whether it is the first, and of the cumulative scores only the
        # last column: the running score `cum` holds that column (copied, so the sums are the loop's).
        cum = None if first else buf.cum[:rows].view(sentences, beam, 1)
        cand_scores, cand_tokens, cand_beams = self.search.step(0 if first else 1, lp, cum)
        parents = cand_beams + buf.first_rows[:sentences].unsqueeze(1)  # the rows the candidates extend
        ends = cand_tokens.eq(self.eos) & cand_scores.ne(-math.inf)
        ignore = buf.ignore[:sentences]
        top_ends = ends[:, :beam] & ~ignore
        live = ~buf.done[:rows].view(sentences, beam)[:, 0]
        self._store_ended(buf, rows, top_ends & live.unsqueeze(1), cand_scores, parents, window)
        # Done: beam hypotheses ended, or the last step (where only </s> was left).
        sentence_done = ~live | buf.count[:sentences].eq(beam) | (buf.slot >= buf.limits[1])
        buf.done[:rows] = sentence_done.unsqueeze(1).expand(sentences, beam).reshape(rows)

        # The next hypotheses: the first beam candidates that did not end (ended and ignored ones sort last).
        ended = torch.cat([top_ends | ignore, ends[:, beam:]], dim=1)
        rank = ended.long() * buf.cand_offsets.size(0) + buf.cand_offsets[: ended.size(1)]
        ranks, chosen = torch.topk(rank, k=beam, dim=1, largest=False)
        going_on = ~sentence_done
        buf.ignore[:sentences] = torch.where(going_on.unsqueeze(1), ranks.ge(buf.cand_offsets.size(0)), ignore)
        self._extend(
            buf,
            rows,
            b,
            window,
            going_on.unsqueeze(1).expand(sentences, beam).reshape(rows),
            parents.gather(1, chosen).view(rows),
            cand_tokens.gather(1, chosen).view(rows),
            cand_scores.gather(1, chosen).view(rows),
        )
        buf.slot += 1

    def _store_ended(
        self, buf: _BeamBuffers, rows: int, ending: Tensor, cand_scores: Tensor, parents: Tensor, window: int
    ) -> None:
        """Copy the hypotheses ending now (`ending` [S, beam]: among the top beam candidates) to their sentence's
        next free places, in candidate order, while places are left."""
        beam, step = self.beam, buf.slot
        count = buf.count[: rows // beam]
        place = count.unsqueeze(1) + ending.long().cumsum(dim=1) - 1  # where each ending candidate goes
        stored = ending & place.lt(beam)
        # For each place of each sentence, the candidate stored there (if any): [S, place, candidate].
        hits = stored.unsqueeze(1) & place.unsqueeze(1).eq(buf.places.view(1, beam, 1))
        filled = hits.any(dim=2).view(rows, 1)
        source = hits.long().argmax(dim=2)
        parent = parents[:, :beam].gather(1, source).view(rows)
        # The parent's tokens up to its last (index step) and cumulative scores up to the step before: the live
        # window covers both (window >= step + 1).
        tokens, scores = buf.final_tokens[:rows, : window + 1], buf.final_scores[:rows, :window]
        tokens.copy_(torch.where(filled, buf.tokens[:rows, : window + 1].index_select(0, parent), tokens))
        scores.copy_(torch.where(filled, buf.scores[:rows, :window].index_select(0, parent), scores))
        eos_score = cand_scores[:, :beam].gather(1, source).view(rows, 1)
        column = buf.final_scores[:rows].index_select(1, step)
        buf.final_scores[:rows].scatter_(1, step.expand(rows, 1), torch.where(filled, eos_score, column))
        buf.end_step[:rows] = torch.where(filled.squeeze(1), step, buf.end_step[:rows])
        buf.count[: rows // beam] = count + stored.sum(dim=1)

    def _extend(
        self,
        buf: _BeamBuffers,
        rows: int,
        b,
        window: int,
        going_on: Tensor,
        parent: Tensor,
        token: Tensor,
        score: Tensor,
    ) -> None:
        """Rows of sentences that go on continue `parent` with `token` (cumulative score `score`): their tokens
        and scores histories and caches are reordered (over the live window), the new token and score written.
        The other rows keep theirs."""
        step = buf.slot
        order = torch.where(going_on, parent, buf.row_ids[:rows])
        tokens, scores = buf.tokens[:rows, : window + 1], buf.scores[:rows, :window]
        tokens.copy_(tokens.index_select(0, order))
        scores.copy_(scores.index_select(0, order))
        buf.tokens[:rows].scatter_(1, (step + 1).expand(rows, 1), torch.where(going_on, token, self.pad).unsqueeze(1))
        column = buf.scores[:rows].index_select(1, step).squeeze(1)
        buf.scores[:rows].scatter_(1, step.expand(rows, 1), torch.where(going_on, score, column).unsqueeze(1))
        buf.cum[:rows] = torch.where(going_on, score, buf.cum[:rows])
        if b.graphed is not None:  # static steps: by index, through the block table (one block copied a row)
            self.step_model.reorder_blocks(b.states, order, step)
        else:  # the dynamic caches: their live slots copied
            self.step_model.reorder(b.states, order)

    @staticmethod
    def _row_buffers(buf: _BeamBuffers):
        return DeviceLoop._row_buffers(buf) + (buf.final_tokens, buf.final_scores)

    @staticmethod
    def _sentence_buffers(buf: _BeamBuffers):
        return buf.ignore, buf.count

    @staticmethod
    def _hypotheses(buf: _BeamBuffers, rows: int):
        return buf.final_tokens[:rows], buf.final_scores[:rows]
