"""What a generate call's loops share: the batch state (`BatchState`, named fields) and the store of finished
hypotheses (`FinishedHypotheses`).

The step-by-step loop (fairseq.generation.sequence_generator) and the device loops (device_decoding,
device_beam_search) decode one `BatchState`, built by SequenceGenerator._begin, and store every hypothesis that
ends through its `finished` store, which ranks them at the end: both loops give the same hypotheses in the same
order because they store through the same code.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import torch
from torch import Tensor


class FinishedHypotheses:
    """Per sentence, up to `beam` hypotheses in the order they ended (upstream's `finalized`), as output dicts
    `{"tokens", "score", "attention", "alignment", "positional_scores"}`; which sentences are done."""

    def __init__(
        self, sentences: int, beam: int, eos: int, normalize_scores: bool, len_penalty: float, match_source_len: bool
    ):
        self.beam, self.eos = beam, eos
        self.normalize_scores, self.len_penalty, self.match_source_len = normalize_scores, len_penalty, match_source_len
        self.hypotheses: List[List[Dict[str, Tensor]]] = [[] for _ in range(sentences)]
        self.scores: List[List[float]] = [[] for _ in range(sentences)]
        self.done = [False] * sentences
        self.remaining = sentences

    def store(
        self,
        step: int,
        rows: Tensor,
        eos_scores: Tensor,
        tokens: Tensor,
        scores: Tensor,
        sent_of_row: List[int],
        src_lengths: Tensor,
        max_len: int,
        host_eos_scores: Optional[Tensor] = None,
    ) -> List[int]:
        """Store the hypotheses of rows `rows` of `tokens` / `scores` (laid out as BatchState's: the begin token
        first; cumulative scores per step) that end with </s> at `step` (score `eos_scores`); row r belongs to
        batch sentence r // beam, original sentence `sent_of_row[r // beam]`. Returns the batch indices of the
        sentences now done (beam hypotheses, or the last step). The device loops pass `rows` and the same scores
        (`host_eos_scores`) on the host, read once for every end step: the bookkeeping then reads no device value."""
        device_rows = rows.to(tokens.device)
        ended = tokens.index_select(0, device_rows)[:, 1 : step + 2]  # without the begin-of-sentence token
        ended[:, step] = self.eos
        pos_scores = scores.index_select(0, device_rows)[:, : step + 1]
        pos_scores[:, step] = eos_scores
        pos_scores[:, 1:] = pos_scores[:, 1:] - pos_scores[:, :-1]  # cumulative -> per token
        batch_rows = torch.div(rows, self.beam, rounding_mode="trunc")
        eos_scores = self._ranking_scores(step, eos_scores, batch_rows, src_lengths)
        values = (
            eos_scores
            if host_eos_scores is None
            else self._ranking_scores(step, host_eos_scores, batch_rows, src_lengths)
        )
        seen = {}
        for i, (row, value) in enumerate(zip(batch_rows.tolist(), values.tolist())):
            sent = sent_of_row[row]
            seen[sent] = row
            if len(self.hypotheses[sent]) < self.beam:
                self.hypotheses[sent].append(
                    {
                        "tokens": ended[i],
                        "score": eos_scores[i],
                        "attention": None,
                        "alignment": torch.empty(0),
                        "positional_scores": pos_scores[i],
                    }
                )
                self.scores[sent].append(value)
        now_done = []
        for sent, row in seen.items():
            if not self.done[sent] and (len(self.hypotheses[sent]) == self.beam or step == max_len):
                self.done[sent] = True
                now_done.append(row)
        self.remaining -= len(now_done)
        return now_done

    def _ranking_scores(self, step: int, eos_scores: Tensor, batch_rows: Tensor, src_lengths: Tensor) -> Tensor:
        """The scores hypotheses ending at `step` are ranked by: length-normalized, -inf past the source length
        with --match-source-len (on the device of `eos_scores`)."""
        if self.normalize_scores:
            eos_scores = eos_scores / (step + 1) ** self.len_penalty
        if self.match_source_len:
            limits = src_lengths.index_select(0, batch_rows.to(src_lengths.device)).to(eos_scores.device)
            eos_scores = torch.where(step > limits, -math.inf, eos_scores)
        return eos_scores

    def best_first(self) -> List[List[Dict[str, Tensor]]]:
        """Each sentence's hypotheses, best first (a stable sort: equal scores keep the order they ended in)."""
        ranked = []
        for hypotheses, scores in zip(self.hypotheses, self.scores):
            order = sorted(range(len(hypotheses)), key=lambda i: scores[i], reverse=True)
            ranked.append([hypotheses[i] for i in order])
        return ranked


@dataclass
class BatchState:
    """One generate call's batch of hypotheses (`bsz` sentences x `beam` rows), which shrinks as sentences
    finish: the rows still decoding and what one step hands the next.

    `tokens` [rows, max_len + 2]: the begin token, then one token per step (<pad> after); `scores`
    [rows, max_len + 1]: cumulative scores per step; `states`: the models' incremental states (KV caches),
    `graphed` the CUDA-graph runner that holds them when the static step runs; `start`: the first step to take
    (after a prefilled prompt); `prefix` [bsz, width] the prompts (None: none), `forced_rows` one per row, and
    the steps at which a prompt forces </s>; `sent_of_row[i]` the original sentence of batch sentence i;
    `finished` the store of ended hypotheses. Beam bookkeeping: `cands_to_ignore` [bsz, beam] (hypotheses
    that ended while their sentence goes on: only True after that happened, `may_ignore`), the row offset of
    each sentence, the candidate and beam indices."""

    device: torch.device
    bsz: int
    beam: int
    max_len: int
    min_len: int
    src_lengths: Tensor
    tokens: Tensor
    scores: Tensor
    finished: FinishedHypotheses
    states: Optional[List[dict]] = None
    graphed: Optional[object] = None
    start: int = 0
    prefix: Optional[Tensor] = None
    forced_rows: Optional[Tensor] = None
    forced_eos_steps: set = field(default_factory=set)
    sent_of_row: List[int] = field(default_factory=list)
    original_batch_idxs: Optional[Tensor] = None
    cands_to_ignore: Optional[Tensor] = None
    may_ignore: bool = False
    bbsz_offsets: Optional[Tensor] = None
    cand_offsets: Optional[Tensor] = None
    first_beams: Optional[Tensor] = None

    def __post_init__(self):
        device, bsz, beam = self.device, self.bsz, self.beam
        self.sent_of_row = list(range(bsz))
        self.original_batch_idxs = torch.arange(bsz, device=device)
        self.cands_to_ignore = torch.zeros(bsz, beam, dtype=torch.bool, device=device)
        self.bbsz_offsets = (torch.arange(bsz, device=device) * beam).unsqueeze(1)
        self.cand_offsets = torch.arange(2 * beam, device=device)  # twice the beam, in case half end with </s>
        self.first_beams = torch.arange(beam, device=device).repeat(bsz, 1)

    def set_prompts(self, prefix: Optional[Tensor], forced_eos_steps: Set[int]) -> None:
        self.prefix = prefix
        self.forced_rows = None if prefix is None else prefix.repeat_interleave(self.beam, dim=0)
        self.forced_eos_steps = forced_eos_steps

    def store_ended(
        self,
        step: int,
        rows: Tensor,
        eos_scores: Tensor,
        tokens: Tensor,
        scores: Tensor,
        host_eos_scores: Optional[Tensor] = None,
    ) -> List[int]:
        """`finished.store` for this batch (see FinishedHypotheses.store)."""
        return self.finished.store(
            step, rows, eos_scores, tokens, scores, self.sent_of_row, self.src_lengths, self.max_len, host_eos_scores
        )

    def keep_sentences(self, keep: List[int]) -> Tensor:
        """Keep batch sentences `keep` (in order): every per-sentence and per-row field follows; returns them
        as a device tensor. The caches and the search are the caller's."""
        beam, index = self.beam, torch.tensor(keep, device=self.device)
        new_bsz = len(keep)
        self.bbsz_offsets = self.bbsz_offsets[:new_bsz]
        if self.prefix is not None:
            self.prefix = self.prefix[index]
            self.forced_rows = self.prefix.repeat_interleave(beam, dim=0)
        self.src_lengths = self.src_lengths[index]
        self.cands_to_ignore = self.cands_to_ignore[index]
        self.scores = self.scores.view(self.bsz, -1)[index].view(new_bsz * beam, -1)
        self.tokens = self.tokens.view(self.bsz, -1)[index].view(new_bsz * beam, -1)
        self.original_batch_idxs = self.original_batch_idxs[index]
        self.sent_of_row = [self.sent_of_row[i] for i in keep]
        self.bsz = new_bsz
        return index
