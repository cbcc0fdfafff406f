"""Search strategies of the sequence generator, with upstream fairseq's names and step contract.

`step(step, lprobs, scores, prev_output_tokens=None, original_batch_idxs=None)` gets, for a batch of
`bsz` sentences with `beam_size` hypotheses each:

- `lprobs` [bsz, beam_size, V]: log-probabilities of the next token (already masked by the generator);
- `scores` [bsz, beam_size, step]: cumulative scores of the hypotheses so far;

and returns `(scores, indices, beams)`, each [bsz, 2 * beam_size] (twice the beam, in case half end with
</s>): the candidates' cumulative scores, their tokens and the beam each one extends.
"""

import math
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from fairseq.dataclass.generation import check_sampling_range
from fairseq.generation.sampling import top_k_top_p


class Search(nn.Module):
    # How the beams of a sentence fare while its next tokens are forced (a prompt), which lets the generator
    # feed a prompt shared by the whole batch in one forward: "first" (only the first beam keeps a finite
    # score, as beam search, whose first step reads the first beam only) or "all" (every beam continues, as
    # sampling). None: unknown, so the generator forces prompt tokens through step() one at a time.
    forced_beams: Optional[str] = None
    # True when step() gives a token whose log-probability is -inf no finite score: then, while </s> is masked
    # for every hypothesis (--min-len), none can end and the generator skips its per-step check (a host sync).
    respects_masked_tokens: bool = False

    def __init__(self, tgt_dict):
        super().__init__()
        self.pad = tgt_dict.pad()
        self.unk = tgt_dict.unk()
        self.eos = tgt_dict.eos()
        self.vocab_size = len(tgt_dict)
        self.src_lengths = torch.tensor(-1)
        self.supports_constraints = False
        self.stop_on_max_len = False

    def step(
        self,
        step: int,
        lprobs: Tensor,
        scores: Tensor,
        prev_output_tokens: Optional[Tensor] = None,
        original_batch_idxs: Optional[Tensor] = None,
    ):
        raise NotImplementedError(f"{type(self).__name__} must implement step")

    def set_src_lengths(self, src_lengths: Tensor) -> None:
        self.src_lengths = src_lengths

    def init_constraints(self, batch_constraints: Optional[Tensor], beam_size: int) -> None:
        pass

    def prune_sentences(self, batch_idxs: Tensor) -> None:
        """The generator dropped finished sentences: keep state for `batch_idxs` only."""

    def update_constraints(self, active_hypos: Tensor) -> None:
        pass


class BeamSearch(Search):
    forced_beams = "first"
    respects_masked_tokens = True  # scores are sums with the -inf

    def __init__(self, tgt_dict):
        super().__init__(tgt_dict)
        self.constraint_states = None

    def step(
        self,
        step: int,
        lprobs: Tensor,
        scores: Optional[Tensor],
        prev_output_tokens: Optional[Tensor] = None,
        original_batch_idxs: Optional[Tensor] = None,
    ):
        bsz, beam_size, vocab_size = lprobs.size()
        if step == 0:
            # Every hypothesis is the same empty one: expanding only the first avoids duplicates.
            lprobs = lprobs[:, ::beam_size, :].contiguous()
        else:
            lprobs = lprobs + scores[:, :, step - 1].unsqueeze(-1)
        flat = lprobs.view(bsz, -1)
        # At most all candidates but one, so that pad (always -inf) is never among them.
        cand_scores, cand_flat = torch.topk(flat, k=min(2 * beam_size, flat.size(1) - 1))
        cand_beams = torch.div(cand_flat, vocab_size, rounding_mode="trunc")
        return cand_scores, cand_flat.fmod(vocab_size), cand_beams


class LengthConstrainedBeamSearch(Search):
    """Beam search whose outputs have between a*x+b tokens (min) and a*x+b tokens (max), x the source length
    (upstream's --match-source-len uses min = max = x)."""

    def __init__(self, tgt_dict, min_len_a: float, min_len_b: int, max_len_a: float, max_len_b: int):
        super().__init__(tgt_dict)
        self.min_len_a, self.min_len_b = min_len_a, min_len_b
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.beam = BeamSearch(tgt_dict)
        self.needs_src_lengths = True

    def step(
        self,
        step: int,
        lprobs: Tensor,
        scores: Tensor,
        prev_output_tokens: Optional[Tensor] = None,
        original_batch_idxs: Optional[Tensor] = None,
    ):
        min_lens = self.min_len_a * self.src_lengths + self.min_len_b
        max_lens = self.max_len_a * self.src_lengths + self.max_len_b
        lprobs[step < min_lens, :, self.eos] = -math.inf
        lprobs[step >= max_lens, :, self.eos] = 0
        return self.beam.step(step, lprobs, scores)


class Sampling(Search):
    """Draw each hypothesis' next token from the model's distribution (torch's RNG: seed it to reproduce),
    restricted to the `sampling_topk` most likely tokens, or to the smallest set whose probability exceeds
    `sampling_topp` (top-p wins when both are set, as upstream). Probabilities are not renormalized over the
    kept set (the score is the model's log-probability of the drawn token)."""

    forced_beams = "all"
    respects_masked_tokens = True  # a -inf token has probability 0: never drawn, or drawn with a -inf score

    def __init__(self, tgt_dict, sampling_topk: int = -1, sampling_topp: float = -1.0, seed: Optional[int] = None):
        """`seed`: the draws' seed where the generator decodes on the device (beam 1, see
        fairseq.generation.device_decoding; default torch.initial_seed()); `step` itself draws from torch's RNG."""
        super().__init__(tgt_dict)
        check_sampling_range(sampling_topk, sampling_topp, vocab_size=self.vocab_size)
        self.sampling_topk = sampling_topk
        self.sampling_topp = sampling_topp
        self.seed = seed

    def step(
        self,
        step: int,
        lprobs: Tensor,
        scores: Tensor,
        prev_output_tokens: Optional[Tensor] = None,
        original_batch_idxs: Optional[Tensor] = None,
    ):
        bsz, beam_size, vocab_size = lprobs.size()
        if step == 0:
            lprobs = lprobs[:, ::beam_size, :].contiguous()
        # The top-p set is not truncated to its largest size, as upstream does: that would read the device.
        candidates, top_indices = top_k_top_p(lprobs, self.sampling_topk, self.sampling_topp)
        probs = candidates.exp()
        if step == 0:  # beam_size draws from the one distribution of each sentence
            drawn = torch.multinomial(probs.view(bsz, -1), beam_size, replacement=True).view(bsz, beam_size)
            probs = probs.expand(bsz, beam_size, -1)
        else:
            drawn = torch.multinomial(probs.view(bsz * beam_size, -1), 1, replacement=True).view(bsz, beam_size)
        cand_scores = torch.gather(probs, 2, drawn.unsqueeze(-1)).log().view(bsz, -1)
        if top_indices is not None:
            drawn = torch.gather(top_indices.expand(bsz, beam_size, -1), 2, drawn.unsqueeze(-1)).squeeze(2)
        if step == 0:
            cand_beams = drawn.new_zeros(bsz, beam_size)
        else:
            cand_beams = torch.arange(beam_size, device=drawn.device).repeat(bsz, 1)
            cand_scores = cand_scores + torch.gather(scores[:, :, step - 1], 1, cand_beams)
        return cand_scores, drawn, cand_beams
