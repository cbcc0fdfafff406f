"""The step-model interface: the model as every decode loop sees it, over its incremental state (KV caches).

`EnsembleModel` holds the models of a generator (each with its own incremental state; log-probabilities averaged
in probability space, as upstream) and offers the loops these operations on a batch of rows:

- `new_incremental_states(max_batch, max_length)`: the caches, reserved once at that size;
- prefill: `feed_prompts(tokens, states, ...)`, a batch of prompts into empty caches in one forward (or
  `static_prefill`, the same forward with no plain-int length read, which a compiled prefill compiles);
- step: `forward_decoder` (the dynamic cached forward: upstream-style decoders too) or `forward_static_step`
  (one token per row at a slot held in a device tensor, [1] for every row or [rows, 1] one per row: what CUDA
  graphs capture, and what rows at different lengths need);
- reorder: `reorder_incremental_state(states, order)` (beams follow their parents, the caches copied); after
  static steps, by index through a block table (`set_block_table`, `take_parent_blocks`: one block copied per
  row and layer, see `StepModel.reorder_blocks`);
- drop rows: `drop_rows(states, keep)` (finished sentences leave the batch, the rest move up, in place);
- add rows: `add_rows(states, rows, source, length)` (a prompt prefilled in a state of its own joins a running
  batch at cache rows `rows`; static steps then continue each row at its own slot).

`StepModel` puts over these what every step of a loop applies (temperature, NaN -> -inf, never <pad>,
--unkpen) and the CUDA-graph runner that holds the caches. The sequence generator's loops
(fairseq.generation.sequence_generator, device_decoding, device_beam_search) and the decode engine
(fairseq.generation.engine) use nothing else of the models.
"""

import math
import sys
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from fairseq.generation.compiled_step import (
    CompiledPrefill,
    CompiledStep,
    compile_decode_step_mode,
    compile_mode,
    model_dtype,
)
from fairseq.generation.cuda_graph_decoding import GraphedDecodeStep
from fairseq.kernels.decode_attention import CACHE_BLOCK
from fairseq.modules.fairseq_incremental_decoder import FairseqIncrementalDecoder

# When a prompt is fed in one forward, logits of at most this many values exist at once.
_LOGITS_CHUNK = 2**25


class EnsembleModel(nn.Module):
    """The models of a generator: each decodes with its own incremental state; log-probabilities are averaged
    in probability space (log of the mean probability), as upstream."""

    def __init__(self, models):
        super().__init__()
        models = list(models)
        if not models:
            raise ValueError("the generator needs at least one model")
        if any(getattr(m, "encoder", None) is not None for m in models):
            raise ValueError("encoder-decoder models are not supported: this generator decodes language models")
        self.models_size = len(models)
        self.single_model = models[0]
        self.models = nn.ModuleList(models)
        self.has_incremental = all(isinstance(getattr(m, "decoder", None), FairseqIncrementalDecoder) for m in models)
        # Decoders of this fork take several new tokens per call and preallocate their caches.
        self.can_feed_prompts = self.has_incremental and all(
            hasattr(m.decoder, "reserve_incremental_state") for m in models
        )
        # ... and have a static one-token step, which CUDA graphs capture (fairseq.generation.cuda_graph_decoding),
        # reading their caches through a block table when beam search asks (the three methods go together:
        # docs/incremental_decoding.md).
        static_methods = ("forward_static_step", "set_block_table", "take_parent_blocks")
        self.can_static_step = self.can_feed_prompts and all(
            hasattr(m.decoder, name) for m in models for name in static_methods
        )
        # ... and a static prefill (what a compiled prefill compiles).
        self.can_static_prefill = self.can_static_step and all(
            hasattr(m.decoder, "forward_static_prefill") for m in models
        )

    def has_incremental_states(self) -> bool:
        return self.has_incremental

    def max_decoder_positions(self) -> int:
        limits = []
        for m in self.models:
            limit = (
                m.max_decoder_positions()
                if hasattr(m, "max_decoder_positions")
                else (m.max_positions() if hasattr(m, "max_positions") else None)
            )
            if limit is not None:
                limits.append(int(limit))
        return min(limits + [sys.maxsize])

    def set_decoder_beam_size(self, beam_size: int) -> None:
        if beam_size > 1:
            for m in self.models:
                target = m if hasattr(m, "set_beam_size") else getattr(m, "decoder", None)
                if hasattr(target, "set_beam_size"):
                    target.set_beam_size(beam_size)

    def new_incremental_states(self, max_batch: int, max_length: int) -> Optional[List[dict]]:
        """One empty state per model (None without incremental decoders), caches reserved at that size."""
        if not self.has_incremental:
            return None
        states = [{} for _ in self.models]
        if self.can_feed_prompts:
            for m, state in zip(self.models, states):
                m.decoder.reserve_incremental_state(state, max_length, max_batch)
        return states

    def reorder_incremental_state(self, states: Optional[List[dict]], new_order: Tensor, window=None) -> None:
        """Row i of the caches continues row new_order[i] (`window`: only its first slots, see the decoder's)."""
        for m, state in zip(self.models, states or ()):
            if window is not None:
                m.decoder.reorder_incremental_state(state, new_order, window)
            else:
                m.decoder.reorder_incremental_state_scripting(state, new_order)

    def set_block_table(self, states: List[dict], block_rows: Optional[Tensor]) -> None:
        """Static steps of every model read their caches through `block_rows` (one table: the models' rows
        are reordered together), or each row its own (None)."""
        for m, state in zip(self.models, states):
            m.decoder.set_block_table(state, block_rows)

    def take_parent_blocks(self, states: List[dict], parents: Tensor, slot: Tensor) -> None:
        """Row i of every cache takes row parents[i]'s block that holds `slot` (a [1] device tensor)."""
        for m, state in zip(self.models, states):
            m.decoder.take_parent_blocks(state, parents, slot)

    def prefill(self, tokens: Tensor, states: List[dict]) -> None:
        """Feed `tokens` [B, T] into empty caches, one forward per model, no logits (a prompt whose next
        log-probabilities a later step computes)."""
        for m, state in zip(self.models, states):
            m.decoder(tokens, incremental_state=state, features_only=True)

    def drop_rows(self, states: Optional[List[dict]], keep: Tensor, window: Optional[int] = None) -> None:
        """Keep cache rows `keep` (a long tensor, increasing), moved up to rows 0 .. len(keep) - 1, in place."""
        self.reorder_incremental_state(states, keep, window)

    def add_rows(self, states: List[dict], rows: Tensor, source: List[dict], length: int) -> None:
        """Cache rows `rows` take the first `length` positions of `source`'s first rows (states of the same
        models, prefilled apart: `feed_prompts`)."""
        for m, state, prefilled in zip(self.models, states, source):
            m.decoder.copy_incremental_rows(state, prefilled, rows, length)

    @staticmethod
    def _log_probs(model, logits: Tensor, extra, temperature: float) -> Tensor:
        if temperature != 1.0:
            logits = logits / temperature
        normalize = getattr(model, "get_normalized_probs", None)
        if normalize is None:
            return torch.log_softmax(logits.float(), dim=-1)
        return normalize((logits, extra), log_probs=True, sample=None)

    def _average(self, log_probs: List[Tensor]) -> Tensor:
        if len(log_probs) == 1:
            return log_probs[0]
        return torch.logsumexp(torch.stack(log_probs, dim=0), dim=0) - math.log(len(log_probs))

    def forward_decoder(self, tokens: Tensor, states: Optional[List[dict]], temperature: float = 1.0) -> Tensor:
        """Log-probabilities [rows, V] of the token after `tokens` [rows, T] (the whole prefix)."""
        log_probs = []
        for i, m in enumerate(self.models):
            if states is not None:
                out = m.decoder(tokens, encoder_out=None, incremental_state=states[i])
            elif hasattr(m, "decoder"):
                out = m.decoder(tokens, encoder_out=None)
            else:
                out = m(tokens)
            if isinstance(out, (tuple, list)):  # upstream-style (logits, extra)
                logits, extra = out[0], (out[1] if len(out) > 1 else None)
            else:
                logits, extra = out, None
            log_probs.append(self._log_probs(m, logits[:, -1:, :], extra, temperature)[:, -1, :])
        return self._average(log_probs)

    def forward_static_step(
        self, tokens: Tensor, slot: Tensor, states: List[dict], temperature: float, window: Optional[int] = None
    ) -> Tensor:
        """Log-probabilities [rows, V] of the token after `tokens` [rows, 1], at index `slot` (a device tensor),
        through each decoder's `forward_static_step` (static shapes, no host sync: CUDA graphs capture it),
        attention over the caches' first `window` slots (default: all)."""
        return self._average(
            [
                self._log_probs(m, m.decoder.forward_static_step(tokens, slot, state, window), None, temperature)[
                    :, -1, :
                ]
                for m, state in zip(self.models, states)
            ]
        )

    def static_cache_shape(self, states: List[dict], rows: int, device: torch.device) -> Tuple[int, int]:
        """(rows, capacity) every model's caches have, allocated first where nothing is cached yet (at their
        reserved size, at least `rows` rows)."""
        like = torch.empty(0, dtype=model_dtype(self), device=device)
        shapes = [m.decoder.static_cache_shape(state, rows, like) for m, state in zip(self.models, states)]
        return min(r for r, _ in shapes), min(c for _, c in shapes)

    def static_prefill(self, tokens: Tensor, rows: Tensor, states: List[dict]) -> List[Tensor]:
        """Each model's features [B, T, C] of `tokens` [B, T] fed into the caches' rows `rows` ([B]), slots
        0 .. T-1, through its decoder's `forward_static_prefill` (no plain-int length read: what
        fairseq.generation.compiled_step compiles)."""
        return [m.decoder.forward_static_prefill(tokens, rows, state) for m, state in zip(self.models, states)]

    def feed_prompts(
        self, tokens: Tensor, states: List[dict], temperature: float, vocab_size: int
    ) -> Tuple[Tensor, Tensor]:
        """Feed `tokens` [B, T] into empty caches in one forward per model: (log-probabilities [B, T-1] of
        tokens[:, 1:], each given the tokens before it; log-probabilities [B, V] of the token after them)."""
        features = [
            m.decoder(tokens, incremental_state=state, features_only=True)[0] for m, state in zip(self.models, states)
        ]
        return self.prompt_scores(tokens, features, temperature, vocab_size)

    def prompt_scores(
        self, tokens: Tensor, features: List[Tensor], temperature: float, vocab_size: int
    ) -> Tuple[Tensor, Tensor]:
        """`feed_prompts`' log-probabilities from each model's features [B, T, C] of `tokens` [B, T], computed
        over a few positions at a time (at most _LOGITS_CHUNK logits exist at once)."""
        batch, length = tokens.shape
        forced = torch.empty(batch, length - 1, device=tokens.device)
        chunk = max(1, _LOGITS_CHUNK // (batch * vocab_size))
        next_lprobs = None
        for begin in range(0, length, chunk):
            end = min(length, begin + chunk)
            lprobs = self._average(
                [
                    self._log_probs(m, m.decoder.output_layer(f[:, begin:end]), None, temperature)
                    for m, f in zip(self.models, features)
                ]
            )
            scored = min(end, length - 1) - begin  # positions that predict a given token
            if scored > 0:
                targets = tokens[:, begin + 1 : begin + 1 + scored].unsqueeze(-1)
                forced[:, begin : begin + scored] = lprobs[:, :scored].gather(2, targets).squeeze(-1)
            if end == length:
                next_lprobs = lprobs[:, -1]
        return forced, next_lprobs


class StepModel:
    """SequenceGenerator's step-model interface: the ensemble's operations (prefill, step, reorder, drop rows)
    with what every step applies (the generator's temperature; NaN -> -inf, never <pad>, --unkpen), and the
    CUDA-graph runner of the static one-token steps (fairseq.generation.cuda_graph_decoding), which holds the
    caches it replays over; `compile_step`: those steps, and the prefill over the runner's caches, compiled by
    inductor (fairseq.generation.compiled_step; None: the process's setting, FAIRSEQ_COMPILE_DECODE_STEP)."""

    def __init__(
        self,
        ensemble: EnsembleModel,
        vocab_size: int,
        pad: int,
        unk: int,
        unk_penalty: float = 0.0,
        temperature: float = 1.0,
        cuda_graphs: bool = True,
        compile_step=None,
    ):
        self.model = ensemble
        self.vocab_size, self.pad, self.unk = vocab_size, pad, unk
        self.unk_penalty, self.temperature = unk_penalty, temperature
        self.cuda_graphs = cuda_graphs
        self.graphed = None  # the GraphedDecodeStep, built on first use
        self.block_table: Optional[Tensor] = None  # the caches' block table while beam search uses one
        self.eager_graphs = False  # True: the static-step path without capture on any device (CPU tests)
        mode = compile_decode_step_mode() if compile_step is None else compile_mode(compile_step)
        self.compiled_step = None if mode is None else CompiledStep(self._static_step, ensemble, mode)
        # The prompts' forward compiled too, over the caches the static steps run on (the graph runner's), in
        # inductor's default mode whatever the step's: autotuning its GEMMs lengthens every compile.
        compiles_prefill = mode is not None and ensemble.can_static_prefill
        self.compiled_prefill = CompiledPrefill(ensemble, pad) if compiles_prefill else None

    def mask_special(self, lprobs: Tensor) -> Tensor:
        """The masks of every step: NaN -> -inf, never <pad>, --unkpen (inside the CUDA graph when one runs)."""
        lprobs = lprobs.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        lprobs[:, self.pad] = -math.inf
        if self.unk_penalty:
            lprobs[:, self.unk] -= self.unk_penalty
        return lprobs

    def static_step(self, tokens: Tensor, slot: Tensor, states: List[dict], window: int) -> Tensor:
        """What a CUDA graph captures: masked log-probabilities after `tokens` [R, 1], at index `slot`
        (attending over the caches' first `window` slots); compiled with `compile_step`."""
        if self.compiled_step is not None:
            return self.compiled_step(tokens, slot, states, window)
        return self._static_step(tokens, slot, states, window)

    def _static_step(self, tokens: Tensor, slot: Tensor, states: List[dict], window: int) -> Tensor:
        return self.mask_special(self.model.forward_static_step(tokens, slot, states, self.temperature, window))

    def graph_runner(self, device: torch.device):
        """The CUDA-graph runner of the one-token steps, when a batch on `device` can use it (CUDA, this fork's
        decoders, no dropout; or `eager_graphs`)."""
        usable = self.eager_graphs or (self.cuda_graphs and device.type == "cuda")
        if not (usable and self.model.can_static_step and not any(m.training for m in self.model.modules())):
            return None
        if self.graphed is None:
            self.graphed = GraphedDecodeStep(
                self.model, self.static_step, self.vocab_size, capture=not self.eager_graphs
            )
        return self.graphed

    def begin(self, bsz: int, beam: int, max_length: int, device: torch.device):
        """(the incremental states of a batch of bsz x beam rows and up to `max_length` tokens, reserved; the
        graph runner that holds them, or None)."""
        graphed = self.graph_runner(device) if self.model.can_feed_prompts else None
        if graphed is not None:
            return graphed.begin(bsz, beam, max_length, device), graphed
        return self.model.new_incremental_states(max_batch=bsz * beam, max_length=max_length), None

    def prefill(self, tokens: Tensor, states: List[dict]) -> Tuple[Tensor, Tensor]:
        """Prompts `tokens` [B, T] into empty caches: (log-probabilities [B, T-1] of tokens[:, 1:]; the masked
        log-probabilities [B, V] of the token after them). Compiled (`compile_step`) over the graph runner's
        caches: the models' forward, its length padded to a multiple of 64 (fairseq.generation.compiled_step)."""
        if self.compiled_prefill is not None and self.graphed is not None and states is self.graphed.states:
            features = self.compiled_prefill(tokens, states)
            self.graphed.set_length(tokens.size(1))  # the static prefill leaves the plain-int lengths
            forced, next_lprobs = self.model.prompt_scores(tokens, features, self.temperature, self.vocab_size)
        else:
            forced, next_lprobs = self.model.feed_prompts(tokens, states, self.temperature, self.vocab_size)
        return forced, self.mask_special(next_lprobs)

    def prefill_length(self, length: int) -> int:
        """The length a prefill of prompts `length` tokens long runs at, padding included (compiled: a multiple of
        64, at most the model's positions)."""
        return length if self.compiled_prefill is None else self.compiled_prefill.padded_length(length)

    def next_log_probs(self, tokens: Tensor, step: int, states: Optional[List[dict]], graphed) -> Tensor:
        """Masked log-probabilities [rows, V] of the token after tokens[:, :step + 1] (the dynamic cached forward,
        or the graph runner's one-token step)."""
        if graphed is not None:
            return graphed(tokens[:, step], step)
        return self.mask_special(self.model.forward_decoder(tokens[:, : step + 1], states, self.temperature))

    def reorder(self, states: Optional[List[dict]], order: Tensor) -> None:
        """Row i of the caches continues row order[i] (beams follow their parents, finished rows leave): the
        caches' filled slots copied."""
        self.model.reorder_incremental_state(states, order)

    # ---- beam search's reorder by index ---------------------------------------------------------------------
    def use_block_table(self, states: List[dict], block_rows: Optional[Tensor]) -> None:
        """From now on static steps read the caches of `states` through the block table `block_rows` [rows, n]
        (int32 on the device, n * CACHE_BLOCK slots at least the capacity; it starts as each row's own: row b
        in every column) and `reorder_blocks` reorders through it; None: each row reads its own cache row again
        (which no longer holds that row's whole history: the caches are then for new text, from slot 0). The
        caller keeps the table's memory (a CUDA graph reads its address)."""
        self.block_table = block_rows
        self.model.set_block_table(states, block_rows)

    def reorder_blocks(self, states: List[dict], parents: Tensor, slot: Tensor) -> None:
        """Rows 0 .. len(parents) - 1 continue rows `parents` after the step at `slot` (a [1] device tensor:
        their caches hold slots 0 .. slot), through the block table of `use_block_table`, with static shapes.

        The table's blocks before the one the next step writes (slot + 1) are full and never written again:
        row i takes its parent's entries for them (ints, shared blocks). The block slot + 1 falls in, and every
        later one, stays row i's own (each row writes its own row, in the block its step is in, so a block
        that other rows read is never overwritten): row i copies that block's slots from its parent's row.
        Per row and layer one block of CACHE_BLOCK slots is copied, whatever the length (the copy reorder
        copied every live slot)."""
        table, rows = self.block_table, parents.numel()
        blocks = torch.arange(table.size(1), device=table.device)
        own = torch.arange(rows, device=table.device, dtype=table.dtype).view(-1, 1)
        next_block = (slot + 1) // CACHE_BLOCK
        table[:rows] = torch.where(blocks >= next_block, own, table[:rows].index_select(0, parents))
        self.model.take_parent_blocks(states, parents, slot + 1)

    def drop_rows(self, states: List[dict], keep: Tensor, window: Optional[int] = None) -> None:
        """Keep cache rows `keep` (increasing), moved up to the first rows, in place (over `window` slots).
        Through a block table (`use_block_table`) its entries follow the rows they name (a row's table names
        only rows of its own sentence, which are kept or dropped with it)."""
        self.model.drop_rows(states, keep, window)
        table = self.block_table
        if table is not None:
            moved_to = torch.full((table.size(0),), -1, dtype=table.dtype, device=table.device)
            moved_to[keep] = torch.arange(keep.numel(), dtype=table.dtype, device=table.device)
            table[: keep.numel()] = moved_to[table.index_select(0, keep).long()]

    def add_rows(self, states: List[dict], rows: Tensor, tokens: Tensor) -> None:
        """Cache rows `rows` take `tokens` [len(rows), T] in their first T slots: prefilled in a state of their
        own (one forward), copied into the running caches; compiled (`compile_step`), written there directly."""
        if self.compiled_prefill is not None:  # straight into the running caches' rows, one compiled forward
            self.compiled_prefill(tokens, states, rows)
            return
        source = self.model.new_incremental_states(max_batch=tokens.size(0), max_length=tokens.size(1))
        self.model.prefill(tokens, source)
        self.model.add_rows(states, rows, source, tokens.size(1))
