"""Generate text with language models: greedy, beam search and sampling (upstream fairseq's SequenceGenerator).

    generator = SequenceGenerator([model], task.target_dictionary, beam_size=5, max_len_b=50)
    hypos = generator.generate([model], sample, prefix_tokens=prompts)   # or task.inference_step(...)

For each sentence of the batch, in batch order, up to `beam_size` hypotheses best first, each
`{"tokens", "score", "attention", "alignment", "positional_scores"}` as upstream's: `tokens` ends with </s>
and includes the prompt, `positional_scores` holds one log-probability per token of `tokens` (prompt tokens
included), `score` is their sum divided by len(tokens) ** len_penalty (unless `normalize_scores=False`);
`attention` is None and `alignment` empty (a language model has no source).

Upstream's decoding, step by step: hypotheses start with `bos_token` (default </s>, as upstream's language
models are trained), step s predicts token s + 1 of every hypothesis, a prompt (`prefix_tokens`, right-padded
with <pad>) is forced where it is not <pad>, finished sentences leave the batch. So every row of the decoder
input holds real tokens only, and a prompt's continuation does not depend on the prompts batched with it.

What is done faster than upstream, with the same results: the decoders' KV caches are allocated once (see
TransformerDecoder.reserve_incremental_state); with decoders of this fork (those that have
`reserve_incremental_state`) the prompts' first tokens, as many as every row has, are fed in one forward of
one row per sentence, the beams copied from it after, and the steps after run on the device (greedy, sampling:
fairseq.generation.device_decoding; beam search: device_beam_search; a host sync per 16 steps, one graph a step).
The step-by-step loop here (a host sync per step) serves the other cases: upstream-style plug-in decoders (fed
one token per step from the start), --no-repeat-ngram-size, --match-source-len, other searches, and greedy and
beam search on the CPU, where it is faster (`device_loop`); on CUDA its
one-token steps are replayed from CUDA graphs (fairseq.generation.cuda_graph_decoding; --no-cuda-graphs,
`cuda_graphs=False`, turns that off). Two deliberate differences: --min-len and --no-repeat-ngram-size also
apply to rows whose prompt ended while others are still forced (upstream skips --min-len for the whole batch
during any prompt); a forced prompt token is never blocked by --no-repeat-ngram-size (upstream's blocking kills it).

Every loop decodes one BatchState and stores ended hypotheses in its FinishedHypotheses
(fairseq.generation.batch_state), and reaches the models through the StepModel (fairseq.generation.step_model).
A running batch that requests join and leave is fairseq.generation.engine's DecodeEngine.
"""

import logging
import math
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from fairseq.generation import decode_memory, device_beam_search, device_decoding, search
from fairseq.generation.batch_state import BatchState, FinishedHypotheses
from fairseq.generation.step_model import EnsembleModel, StepModel

logger = logging.getLogger("fairseq.sequence_generator")  # upstream's module name


def _check_options(beam_size: int, temperature: float, no_repeat_ngram_size: int) -> None:
    """One line for an option out of range (the flag's name)."""
    if beam_size < 1:
        raise ValueError(f"--beam must be at least 1, got {beam_size}")
    if temperature <= 0:
        raise ValueError(f"--temperature must be greater than 0, got {temperature}")
    if no_repeat_ngram_size < 0:
        raise ValueError(f"--no-repeat-ngram-size must be >= 0, got {no_repeat_ngram_size}")


class SequenceGenerator(nn.Module):
    def __init__(
        self,
        models,
        tgt_dict,
        beam_size: int = 1,
        max_len_a: float = 0,
        max_len_b: int = 200,
        max_len: int = 0,
        min_len: int = 1,
        normalize_scores: bool = True,
        len_penalty: float = 1.0,
        unk_penalty: float = 0.0,
        temperature: float = 1.0,
        match_source_len: bool = False,
        no_repeat_ngram_size: int = 0,
        search_strategy: Optional[search.Search] = None,
        eos: Optional[int] = None,
        symbols_to_strip_from_output=None,
        cuda_graphs: bool = True,
        device_loop: Optional[bool] = None,
        compile_step=None,
    ):
        """`max_len`: cap on the total length (default: the models' positions); the output of a sentence has at
        most min(max_len_a * src_len + max_len_b, max_len - 1) tokens before </s>, src_len the width of
        `src_tokens`, the prompt included, as upstream counts it. `cuda_graphs`: replay the one-token steps
        from CUDA graphs where possible (CUDA, this fork's decoders, no dropout); the graphs and the KV caches
        they read are kept for the next call while the batch and length fit. `device_loop`: decode greedy
        search and sampling at beam 1 (fairseq.generation.device_decoding) and beam search (device_beam_search)
        on the device (no host sync per token; the same search results; sampling draws that depend on the seed
        and the sentence only); False keeps the step-by-step loop (sampling draws from torch's RNG, as upstream);
        None (default): the device loops, but on the CPU (where the step-by-step loop is faster) for sampling and
        streaming only. `compile_step`: the graphs' steps compiled by inductor (fairseq.generation.compiled_step;
        None: the process's setting, off unless FAIRSEQ_COMPILE_DECODE_STEP; True; or an inductor mode)."""
        super().__init__()
        _check_options(beam_size, temperature, no_repeat_ngram_size)
        self.model = models if isinstance(models, EnsembleModel) else EnsembleModel(models)
        self.tgt_dict = tgt_dict
        self.pad, self.unk = tgt_dict.pad(), tgt_dict.unk()
        self.eos = tgt_dict.eos() if eos is None else eos
        self.symbols_to_strip_from_output = set(symbols_to_strip_from_output or ()) | {self.eos}
        self.vocab_size = len(tgt_dict)
        self.beam_size = min(beam_size, self.vocab_size - 1)  # pad is never a candidate
        self.model.set_decoder_beam_size(self.beam_size)
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self._warned_long_prompt = False
        self.min_len = min_len
        self.max_len = max_len or self.model.max_decoder_positions()
        self.normalize_scores, self.len_penalty, self.unk_penalty = normalize_scores, len_penalty, unk_penalty
        self.temperature, self.match_source_len = temperature, match_source_len
        self.no_repeat_ngram_size = no_repeat_ngram_size
        self.search = search.BeamSearch(tgt_dict) if search_strategy is None else search_strategy
        self.should_set_src_lengths = getattr(self.search, "needs_src_lengths", False)
        self.cuda_graphs = cuda_graphs
        self.step_model = StepModel(
            self.model, self.vocab_size, self.pad, self.unk, unk_penalty, temperature, cuda_graphs, compile_step
        )
        self.device_loop = device_loop
        loop = device_beam_search.DeviceBeamSearch if self.beam_size > 1 else device_decoding.DeviceDecodeLoop
        self._device_loop = loop(self.step_model, self.search, self.beam_size, self.eos, self.pad)
        self.model.eval()

    def cuda(self):
        self.model.cuda()
        return self

    @torch.no_grad()
    def forward(self, sample: Dict, prefix_tokens: Optional[Tensor] = None, bos_token: Optional[int] = None):
        return self._generate(sample, prefix_tokens, bos_token)

    @torch.no_grad()
    def generate(
        self,
        models,
        sample: Dict,
        prefix_tokens: Optional[Tensor] = None,
        bos_token: Optional[int] = None,
        on_tokens=None,
        **kwargs,
    ) -> List[List[Dict[str, Tensor]]]:
        """Hypotheses for `sample["net_input"]["src_tokens"]`'s sentences (see the module doc). `models` is
        accepted for upstream's signature; the generator's own (given at construction) decode.
        `on_tokens(tokens, done)`: stream the tokens as they are produced (greedy or sampling at beam 1 with
        this fork's decoders, see fairseq.generation.device_decoding.DeviceDecodeLoop.decode)."""
        if kwargs.pop("constraints", None) is not None:
            raise ValueError("--constraints (lexically constrained decoding) is not supported with language models")
        if kwargs:
            raise TypeError(f"generate() got unexpected keyword arguments: {', '.join(sorted(kwargs))}")
        if on_tokens is not None and not device_decoding.applies(self, self.beam_size):
            raise ValueError(
                "streaming tokens (--stream, on_tokens) needs greedy search or sampling with --beam 1, "
                "this fork's decoders and no --no-repeat-ngram-size / --match-source-len; drop it or "
                "those options"
            )
        return self._generate(sample, prefix_tokens, bos_token, on_tokens)

    # ---- setup --------------------------------------------------------------------------------------------
    def _max_len(self, src_len: int, src_lengths: Tensor) -> int:
        if self.match_source_len:
            max_len = int(src_lengths.max())
        else:
            max_len = decode_memory.longest_output(src_len, self.max_len_a, self.max_len_b, self.max_len)
        decode_memory.check_output_length(max_len, self.min_len, src_len, self.max_len_a, self.max_len_b, self.max_len)
        return max_len

    def _prompts(
        self, prefix_tokens: Optional[Tensor], bsz: int, max_len: int, device: torch.device
    ) -> Tuple[Optional[Tensor], int, Set[int]]:
        """(the prompts [bsz, width] on `device` without all-pad columns, or None; how many leading tokens every
        row has, up to the first </s> of any row; the steps at which a prompt forces </s>). The prompts are read
        on the host: one copy of a device prompt instead of a host sync per question asked of it."""
        if prefix_tokens is None or prefix_tokens.numel() == 0:
            return None, 0, set()
        if prefix_tokens.dim() != 2 or prefix_tokens.size(0) != bsz:
            raise ValueError(f"prefix_tokens must be [batch size {bsz}, length], got {list(prefix_tokens.shape)}")
        host = prefix_tokens.to(device="cpu", dtype=torch.long)
        real = host.ne(self.pad)
        columns = real.any(dim=0).nonzero()
        width = int(columns.max()) + 1 if columns.numel() else 0
        positions = self.model.max_decoder_positions()
        if width >= positions:
            raise ValueError(
                f"a prompt of {width} tokens does not fit the model: with the begin-of-sentence token "
                f"it needs {width + 1} positions and the model has {positions}; shorten the prompts to "
                f"{positions - 1} tokens or less (fairseq-generate: a smaller --tokens-per-sample, "
                "or --prefix-size N)"
            )
        if width > max_len:  # upstream's rule: the prompt is forced until the output is that long, then </s>
            if not self._warned_long_prompt:
                logger.warning(
                    f"a prompt of {width} tokens is longer than the longest output allowed, {max_len} "
                    f"tokens (--max-len-a {self.max_len_a} * source length + --max-len-b "
                    f"{self.max_len_b}): the output is its first {max_len} tokens, as upstream's "
                    "generator gives (said once); raise --max-len-b to continue the prompts"
                )
                self._warned_long_prompt = True
            width = max_len
        if width == 0:
            return None, 0, set()
        shared = int(real[:, :width].long().cumprod(dim=1).sum(dim=1).min())
        eos_columns = host[:, :width].eq(self.eos).any(dim=0).nonzero()[:, 0].tolist()
        if eos_columns and eos_columns[0] < shared:  # a forced </s> ends hypotheses: left to the step-by-step path
            shared = eos_columns[0]
        return prefix_tokens[:, :width].to(device=device, dtype=torch.long), shared, set(eos_columns)

    def _feed_prompts(
        self,
        tokens: Tensor,
        scores: Tensor,
        prefix: Optional[Tensor],
        shared: int,
        states: List[dict],
        bsz: int,
        beam: int,
    ) -> Tensor:
        """Feed <bos> and the first `shared` prompt tokens of every sentence in one forward (one row per
        sentence); fill `tokens` and `scores` of steps 0 .. shared-1 as that many forced steps of the search
        would; return the log-probabilities of step `shared` for every hypothesis row."""
        inputs = tokens[::beam, :1]
        if shared:
            inputs = torch.cat([inputs, prefix[:, :shared]], dim=1)
        forced, next_lprobs = self.step_model.prefill(inputs, states)
        if shared:
            forced = forced.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
            if self.unk_penalty:
                forced = forced - self.unk_penalty * prefix[:, :shared].eq(self.unk)
            tokens[:, 1 : shared + 1] = prefix[:, :shared].repeat_interleave(beam, dim=0)
            scores[:, :shared] = forced.cumsum(dim=1).repeat_interleave(beam, dim=0)
            if beam > 1 and self.search.forced_beams == "first":
                scores.view(bsz, beam, -1)[:, 1:, :shared] = -math.inf
        if beam > 1:
            self.step_model.reorder(states, torch.arange(bsz, device=tokens.device).repeat_interleave(beam))
            next_lprobs = next_lprobs.repeat_interleave(beam, dim=0)
        return next_lprobs

    # ---- one step -----------------------------------------------------------------------------------------
    def _no_hypothesis_can_end(self, step: int, max_len: int, forced_eos_steps: set) -> bool:
        """</s> is -inf for every hypothesis at `step` (--min-len; not the last step; no prompt forces </s>)
        and the search gives -inf tokens no finite score: no hypothesis ends, so there is nothing to check."""
        return (
            step < self.min_len
            and step < max_len
            and step not in forced_eos_steps
            and self.search.respects_masked_tokens
        )

    def _constrain(
        self, lprobs: Tensor, step: int, max_len: int, tokens: Tensor, forced_rows: Optional[Tensor]
    ) -> Tensor:
        """Apply the length limits, --no-repeat-ngram-size and the forced prompt (`forced_rows`: each row's
        prompt, <pad> after it) to lprobs, masked already by `StepModel.mask_special`."""
        if step >= max_len:  # only </s> is left
            lprobs[:, : self.eos] = -math.inf
            lprobs[:, self.eos + 1 :] = -math.inf
        forced = None
        if forced_rows is not None and step < forced_rows.size(1) and step < max_len:
            forced = forced_rows[:, step : step + 1]
            forced_lprobs = lprobs.gather(1, forced)
        if step < self.min_len:
            lprobs[:, self.eos] = -math.inf
        if self.no_repeat_ngram_size:
            self._block_repeated_ngrams(tokens, lprobs, step)
        if forced is not None:  # rows whose prompt goes on can only continue it
            only_forced = torch.full_like(lprobs, -math.inf).scatter_(1, forced, forced_lprobs)
            lprobs = torch.where(forced.ne(self.pad), only_forced, lprobs)
        return lprobs

    def _block_repeated_ngrams(self, tokens: Tensor, lprobs: Tensor, step: int) -> None:
        """-inf for every token that would repeat an n-gram of the hypothesis (tokens[:, :step + 1], the
        begin-of-sentence token included, as upstream counts)."""
        n = self.no_repeat_ngram_size
        if step + 1 < n:
            return
        seen = tokens[:, : step + 1]
        ngrams = seen.unfold(1, n, 1)  # [rows, step + 2 - n, n]
        suffix = seen[:, step + 2 - n :]  # the last n - 1 tokens
        repeats = (ngrams[:, :, :-1] == suffix.unsqueeze(1)).all(dim=2)
        # Non-repeats point at pad, which is -inf already.
        lprobs.scatter_(1, ngrams[:, :, -1].masked_fill(~repeats, self.pad), -math.inf)

    # ---- the loop -----------------------------------------------------------------------------------------
    def _on_device_loop(self, device: torch.device, streaming: bool) -> bool:
        """Whether a batch on `device` decodes on a device loop (see `device_loop`)."""
        beam = self.beam_size
        if not (device_decoding.applies(self, beam) or device_beam_search.applies(self, beam)):
            return False
        if self.device_loop is None and device.type == "cpu":
            return streaming or isinstance(self.search, search.Sampling)
        return True

    def _generate(
        self, sample: Dict, prefix_tokens: Optional[Tensor] = None, bos_token: Optional[int] = None, on_tokens=None
    ) -> List[List[Dict[str, Tensor]]]:
        """Decode one batch: the set-up and prefill, then per step the candidates, the hypotheses that end, the
        sentences that leave the batch and the hypotheses extended; each sentence's hypotheses best first.
        Greedy search, sampling at beam 1 and beam search run on the device instead (device_decoding, ...)."""
        b, lprobs = self._begin(sample, prefix_tokens, bos_token)
        beam, max_len = self.beam_size, b.max_len
        if lprobs is not None and self._on_device_loop(b.device, on_tokens is not None):
            return self._device_loop.decode(b, lprobs, sample, on_tokens)
        for step in range(b.start, max_len + 1):  # the last step only adds </s>
            if lprobs is None:
                lprobs = self.step_model.next_log_probs(b.tokens, step, b.states, b.graphed)
            lprobs = self._constrain(lprobs, step, max_len, b.tokens, b.forced_rows)
            cand_scores, cand_indices, cand_beams = self.search.step(
                step,
                lprobs.view(b.bsz, -1, self.vocab_size),
                b.scores.view(b.bsz, beam, -1)[:, :, :step],
                b.tokens[:, : step + 1],
                b.original_batch_idxs,
            )
            lprobs = None

            eos_mask, any_top_eos, done = self._end_hypotheses(b, step, cand_scores, cand_indices, cand_beams)
            if b.finished.remaining == 0 or step == max_len:
                break
            batch_idxs = None
            if done:  # drop the finished sentences from the batch, and from this step's candidates
                batch_idxs = self._drop_sentences(b, done)
                eos_mask, cand_beams = eos_mask[batch_idxs], cand_beams[batch_idxs]
                cand_scores, cand_indices = cand_scores[batch_idxs], cand_indices[batch_idxs]
            self._extend(b, step, eos_mask, any_top_eos, cand_scores, cand_indices, cand_beams, batch_idxs)
        return b.finished.best_first()

    def _begin(
        self, sample: Dict, prefix_tokens: Optional[Tensor], bos_token: Optional[int]
    ) -> Tuple[BatchState, Optional[Tensor]]:
        """The batch before its first step (buffers, caches, search state), with the prompts fed when the
        decoders take them at once (prefill): then also the log-probabilities of the first step to take."""
        net_input = sample["net_input"]
        if "src_tokens" not in net_input:
            raise ValueError(
                "sample['net_input'] has no 'src_tokens': language-model generation reads the batch "
                "size and source length from it (see task.build_dataset_for_inference)"
            )
        src_tokens = net_input["src_tokens"]
        device, (bsz, src_len), beam = src_tokens.device, src_tokens.size()[:2], self.beam_size
        src_lengths = (src_tokens.ne(self.eos) & src_tokens.ne(self.pad)).long().sum(dim=1)
        max_len = self._max_len(src_len, src_lengths)
        prefix, shared, forced_eos_steps = self._prompts(prefix_tokens, bsz, max_len, device)
        if self.search.forced_beams is None:
            shared = 0  # an unknown search sees every forced step
        rows = bsz * beam
        b = BatchState(
            device=device,
            bsz=bsz,
            beam=beam,
            max_len=max_len,
            min_len=self.min_len,
            src_lengths=src_lengths,
            tokens=torch.full((rows, max_len + 2), self.pad, dtype=torch.long, device=device),
            scores=torch.zeros(rows, max_len + 1, device=device),  # cumulative, per step
            finished=FinishedHypotheses(
                bsz, beam, self.eos, self.normalize_scores, self.len_penalty, self.match_source_len
            ),
        )
        b.tokens[:, 0] = self.eos if bos_token is None else bos_token
        b.states, b.graphed = self.step_model.begin(bsz, beam, max_len + 1, device)
        if self.should_set_src_lengths:
            self.search.set_src_lengths(b.src_lengths)
        lprobs = None
        if self.model.can_feed_prompts:
            lprobs = self._feed_prompts(b.tokens, b.scores, prefix, shared, b.states, bsz, beam)
            b.start = shared
        b.set_prompts(prefix, forced_eos_steps)
        return b, lprobs

    def _end_hypotheses(
        self, b: BatchState, step: int, cand_scores: Tensor, cand_indices: Tensor, cand_beams: Tensor
    ) -> Tuple[Optional[Tensor], bool, List[int]]:
        """Hypotheses ending with </s> among the top beam candidates are done (not -inf, not ignored): store
        them. Returns (the candidates that end with </s>, or None when none can; whether a top one did; the
        batch indices of the sentences now done)."""
        beam = self.beam_size
        can_end = not self._no_hypothesis_can_end(step, b.max_len, b.forced_eos_steps)
        eos_mask, any_top_eos, done = None, False, []
        if can_end or b.may_ignore:
            eos_mask = cand_indices.eq(self.eos) & cand_scores.ne(-math.inf)
            if b.may_ignore:
                eos_mask[:, :beam] &= ~b.cands_to_ignore
        if can_end:
            top_eos = eos_mask[:, :beam]
            any_top_eos = bool(top_eos.any())  # the host sync of this step
        if any_top_eos:
            cand_bbsz_idx = cand_beams + b.bbsz_offsets
            done = b.store_ended(
                step, cand_bbsz_idx[:, :beam][top_eos], cand_scores[:, :beam][top_eos], b.tokens, b.scores
            )
        return eos_mask, any_top_eos, done

    def _drop_sentences(self, b: BatchState, done: List[int]) -> Tensor:
        """Remove the sentences at batch indices `done` from the batch and the search; returns the indices kept."""
        done_set = set(done)
        batch_idxs = b.keep_sentences([i for i in range(b.bsz) if i not in done_set])
        self.search.prune_sentences(batch_idxs)
        if self.should_set_src_lengths:
            self.search.set_src_lengths(b.src_lengths)
        return batch_idxs

    def _extend(
        self,
        b: BatchState,
        step: int,
        eos_mask: Optional[Tensor],
        any_top_eos: bool,
        cand_scores: Tensor,
        cand_indices: Tensor,
        cand_beams: Tensor,
        batch_idxs: Optional[Tensor],
    ) -> None:
        """The beam best candidates that did not end become the hypotheses (token step + 1 and its score);
        the caches follow their rows (and the sentences dropped at this step, `batch_idxs`)."""
        beam, bsz, tokens, scores = self.beam_size, b.bsz, b.tokens, b.scores
        if not (b.may_ignore or any_top_eos):
            # No top candidate ended and none is ignored: the first beam candidates continue, in order.
            active_hypos = b.first_beams[:bsz]
            active_bbsz_idx = (cand_beams[:, :beam] + b.bbsz_offsets).view(-1) if beam > 1 else None
            next_tokens, next_scores = cand_indices[:, :beam], cand_scores[:, :beam]
        else:
            # The beam best candidates that did not end continue (finished or ignored ones sort last).
            cand_size = b.cand_offsets.size(0)
            eos_mask[:, :beam] |= b.cands_to_ignore
            active_mask = eos_mask.to(b.cand_offsets.dtype) * cand_size + b.cand_offsets[: eos_mask.size(1)]
            new_cands_to_ignore, active_hypos = torch.topk(active_mask, k=beam, dim=1, largest=False)
            b.cands_to_ignore = new_cands_to_ignore.ge(cand_size)[:, :beam]
            active_bbsz_idx = torch.gather(cand_beams + b.bbsz_offsets, 1, active_hypos).view(-1)
            next_tokens = torch.gather(cand_indices, 1, active_hypos)
            next_scores = torch.gather(cand_scores, 1, active_hypos)
            b.may_ignore = beam > 1
        if beam > 1:  # with one beam every row continues itself
            tokens[:, : step + 1] = tokens[:, : step + 1].index_select(0, active_bbsz_idx)
            if step > 0:
                scores[:, :step] = scores[:, :step].index_select(0, active_bbsz_idx)
        tokens.view(bsz, beam, -1)[:, :, step + 1] = next_tokens
        scores.view(bsz, beam, -1)[:, :, step] = next_scores
        self.search.update_constraints(active_hypos)

        if beam > 1 or batch_idxs is not None:
            # Cache rows are still those of before the drop: shift each sentence back to its old rows.
            order = active_bbsz_idx
            if batch_idxs is not None:
                shift = (batch_idxs - torch.arange(bsz, device=b.device)) * beam
                order = (order.view(bsz, beam) + shift.unsqueeze(1)).view(-1)
            self.step_model.reorder(b.states, order)
