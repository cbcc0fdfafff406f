"""The decoder stack of a transformer language model, with upstream fairseq's module names.

State-dict keys (under the model's `decoder.` prefix): `embed_tokens.weight`, `project_in_dim.weight`
(only when the input dim differs from the embed dim), `embed_positions.weight` (learned) or
`embed_positions._float_tensor` (sinusoidal), `layernorm_embedding.*` (optional), `layers.N.*`,
`layer_norm.*` (pre-norm without --no-decoder-final-norm), `project_out_dim.weight` (output dim differs
from the embed dim), `output_projection.weight` (the embedding matrix itself when input and output
embeddings are shared) and `version` (upstream's loader reads a missing version as a pre-2019
checkpoint and drops the final layer norm, so it is kept).

Incremental decoding (upstream's `incremental_state`): `decoder(tokens, incremental_state=state)` with the
same dict every call, `tokens` [B, T] the whole sequence so far. Only `tokens[:, cached:]` is computed
(several tokens at once, e.g. a prompt, or one per step), positions continue from the cached length, and
`(logits of those new tokens, extra)` comes back. Entries in `state`: this decoder's token count (and its attention
modules), per layer, the attention's key/value buffers (see CausalSelfAttention._cache_entry). The caller
says the longest length with `reserve_incremental_state` so the buffers are allocated once; beams are reordered
with `reorder_incremental_state`. All rows share one length: a batch must not be left-padded (upstream's
generator forces prompts token by token instead, see fairseq.generation.sequence_generator).

The static one-token step, `forward_static_step(tokens, slot, state)`, computes the same logits with shapes
that do not depend on the cached length and no host sync, so that a CUDA graph can capture it once and replay
it every step (fairseq.generation.cuda_graph_decoding): the position is a device tensor, the new keys/values go to that
slot of the reserved cache and attention runs over the whole capacity, masked after the slot.
"""

import math

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq.kernels.decode_attention import decode_attention_available
from fairseq.modules.incremental_decoding_utils import IncrementalState
from fairseq.modules.fairseq_incremental_decoder import FairseqIncrementalDecoder, check_token_input, probs_of_logits
from fairseq.modules.adaptive_input import AdaptiveInput, parse_cutoffs
from fairseq.modules.adaptive_softmax import AdaptiveSoftmax
from fairseq.modules.causal_attention import CausalSelfAttention, StaticStep
from fairseq.modules.positional_embedding import build_positional_embedding, zero_row_
from fairseq.modules.transformer_layer import TransformerDecoderLayer

_STATE_KEY = "decoder_state"


class TransformerDecoder(FairseqIncrementalDecoder):
    """Token embeddings -> positions -> N decoder layers -> final norm -> vocabulary logits.

    `cfg` holds the hyper-parameters named as in `TransformerLanguageModelConfig` (read by attribute);
    `max_target_positions` must already be resolved to an int.
    """

    def __init__(self, cfg, vocab_size: int, padding_idx: int, output_vocab_size: Optional[int] = None):
        """`output_vocab_size` (--output-dictionary-size) narrows the softmax to the first symbols; it applies
        only to an untied output projection, as upstream (a tied one is the whole embedding matrix)."""
        super().__init__(dictionary=None)  # the model is built from sizes; its task holds the dictionary
        self.register_buffer("version", torch.tensor([3.0]))
        self.padding_idx = padding_idx
        self.vocab_size = vocab_size
        self.dropout = cfg.dropout
        self.share_input_output_embed = cfg.share_decoder_input_output_embed
        self.embed_dim = cfg.decoder_embed_dim
        self.output_embed_dim = cfg.decoder_output_dim
        self.max_target_positions = cfg.max_target_positions
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(self.embed_dim)
        # In this order: the modules draw their initial weights from the torch RNG as they are built.
        self._build_embeddings(cfg, vocab_size, padding_idx)
        self._build_layers(cfg)
        self._build_output(cfg, vocab_size, padding_idx, output_vocab_size)
        self.tie_weights()
        # The layers initialized themselves when built; the rest differs from PyTorch's defaults.
        self._init_outside_layers()

    def _build_embeddings(self, cfg, vocab_size: int, padding_idx: int) -> None:
        """Token embeddings (or an adaptive input), the projection to the embed dim, positions and their norm."""
        if cfg.adaptive_input:  # bands of --decoder-input-dim // factor**i, each projected to the embed dim
            self.embed_tokens = AdaptiveInput(
                vocab_size,
                padding_idx,
                cfg.decoder_input_dim,
                cfg.adaptive_input_factor,
                self.embed_dim,
                parse_cutoffs(cfg.adaptive_input_cutoff, "--adaptive-input-cutoff"),
            )
        else:
            self.embed_tokens = nn.Embedding(vocab_size, cfg.decoder_input_dim, padding_idx=padding_idx)
        self.input_embed_dim = self.embed_tokens.embedding_dim
        self.project_in_dim = (
            nn.Linear(self.input_embed_dim, self.embed_dim, bias=False)
            if self.input_embed_dim != self.embed_dim
            else None
        )
        self.embed_positions = (
            build_positional_embedding(
                self.max_target_positions, self.embed_dim, padding_idx, learned=cfg.decoder_learned_pos
            )
            if not cfg.no_token_positional_embeddings
            else None
        )
        self.layernorm_embedding = nn.LayerNorm(self.embed_dim) if cfg.layernorm_embedding else None

    def _build_layers(self, cfg) -> None:
        """The decoder layers and the final layer norm (pre-norm only)."""
        # Upstream: a dropout of 0 after the activation falls back to --relu-dropout.
        activation_dropout = cfg.activation_dropout or cfg.relu_dropout or 0.0
        self.layers = nn.ModuleList(
            TransformerDecoderLayer(
                self.embed_dim,
                cfg.decoder_attention_heads,
                cfg.decoder_ffn_embed_dim,
                dropout=cfg.dropout,
                attention_dropout=cfg.attention_dropout,
                activation_dropout=activation_dropout,
                activation_fn=cfg.activation_fn,
                normalize_before=cfg.decoder_normalize_before,
                scale_attn=cfg.scale_attn,
                scale_fc=cfg.scale_fc,
                scale_heads=cfg.scale_heads,
                scale_resids=cfg.scale_resids,
            )
            for _ in range(cfg.decoder_layers)
        )
        self.layer_norm = (
            nn.LayerNorm(self.embed_dim) if cfg.decoder_normalize_before and not cfg.no_decoder_final_norm else None
        )

    def _build_output(self, cfg, vocab_size: int, padding_idx: int, output_vocab_size: Optional[int]) -> None:
        """The projection to the output dim, then an adaptive softmax or the output projection (tied or not)."""
        self.project_out_dim = (
            nn.Linear(self.embed_dim, self.output_embed_dim, bias=False)
            if self.embed_dim != self.output_embed_dim
            else None
        )
        self.adaptive_softmax = None
        out_size = vocab_size if output_vocab_size is None else output_vocab_size
        if cfg.adaptive_softmax_cutoff is not None:
            cutoffs = parse_cutoffs(cfg.adaptive_softmax_cutoff, "--adaptive-softmax-cutoff")
            if cutoffs[0] <= padding_idx:
                raise ValueError(
                    f"--adaptive-softmax-cutoff {cfg.adaptive_softmax_cutoff}: the first cutoff must be "
                    f"larger than the padding index {padding_idx} (the head holds the padding symbol)"
                )
            self.adaptive_softmax = AdaptiveSoftmax(
                out_size,
                self.output_embed_dim,
                cutoffs,
                cfg.adaptive_softmax_dropout,
                factor=cfg.adaptive_softmax_factor,
                tie_proj=cfg.tie_adaptive_proj,
                adaptive_inputs=self.embed_tokens if cfg.tie_adaptive_weights else None,
            )
            self.output_projection = None
        elif self.share_input_output_embed:
            if self.input_embed_dim != self.output_embed_dim:
                raise ValueError(
                    "--share-decoder-input-output-embed needs --decoder-input-dim == --decoder-output-dim "
                    f"(got {self.input_embed_dim} and {self.output_embed_dim}); set them equal or drop the flag"
                )
            # Its own weight is replaced by the embedding matrix at once: never allocate it.
            self.output_projection = nn.Linear(self.output_embed_dim, vocab_size, bias=False, device="meta")
        else:
            self.output_projection = nn.Linear(self.output_embed_dim, out_size, bias=False)

    def tie_weights(self):
        """Share the output projection with the token embeddings when configured to.

        Moving a meta-device model with `to_empty` unties them; `reset_parameters` calls this again.
        """
        if self.adaptive_softmax is not None:
            if isinstance(self.embed_tokens, AdaptiveInput):
                self.adaptive_softmax.tie_to(self.embed_tokens)
        elif self.share_input_output_embed and self.output_projection.weight is not self.embed_tokens.weight:
            self.output_projection.weight = self.embed_tokens.weight

    def reset_parameters(self):
        """Initialize every parameter and buffer as upstream does, drawing from the torch RNG."""
        self.tie_weights()
        for module in (self.embed_positions, self.layernorm_embedding, self.layer_norm, self.adaptive_softmax):
            if module is not None:
                module.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()
        self._init_outside_layers()

    def _init_outside_layers(self):
        with torch.no_grad():
            self.version.fill_(3.0)
        if isinstance(self.embed_tokens, AdaptiveInput):
            self.embed_tokens.reset_parameters()
        else:
            nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=self.input_embed_dim**-0.5)
            zero_row_(self.embed_tokens.weight, self.padding_idx)
        for projection in (self.project_in_dim, self.project_out_dim):
            if projection is not None:
                nn.init.xavier_uniform_(projection.weight)
        if self.output_projection is not None and not self.share_input_output_embed:
            nn.init.normal_(self.output_projection.weight, mean=0.0, std=self.output_embed_dim**-0.5)

    def tensor_parallel_styles(self) -> dict:
        """{module path: style} of this decoder under tensor parallelism (the layers' tensor_parallel_styles();
        around them a vocabulary-parallel embedding and output, everything else with parameters replicated)."""
        styles = {"embed_tokens": "vocab_embedding", "output_projection": "vocab_output"}
        for name in ("embed_positions", "layernorm_embedding", "project_in_dim", "layer_norm", "project_out_dim"):
            module = getattr(self, name)
            if module is not None and any(True for _ in module.parameters()):
                styles[name] = "replicate"
        for index, layer in enumerate(self.layers):
            if type(layer) is not TransformerDecoderLayer:
                raise TypeError(
                    f"decoder layer {index} is a {type(layer).__name__}: the tensor-parallel plan covers "
                    "TransformerDecoderLayer (apply it before checkpointing, compile and FSDP)"
                )
            styles.update({f"layers.{index}.{path}": style for path, style in layer.tensor_parallel_styles().items()})
        return styles

    def max_positions(self) -> int:
        if self.embed_positions is None:
            return self.max_target_positions
        return min(self.max_target_positions, self.embed_positions.max_positions)

    def embed(
        self, tokens: torch.Tensor, start: Optional[int] = None, slot: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Scaled token embeddings plus positions, [B, T] -> [B, T, embed_dim], before the layers.

        `start`: the tokens follow `start` cached ones (incremental decoding), positions continue from there;
        `slot` (a long tensor, [1] or one per row [B, 1]): the one token of each row is at that index (the static
        step)."""
        x = self.embed_scale * self.embed_tokens(tokens)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if self.embed_positions is not None:
            if slot is not None:
                positions = self.embed_positions.embed_slots(slot)
            elif start is None:
                positions = self.embed_positions(tokens)
            else:
                positions = self.embed_positions.embed_range(start, tokens.size(1))
            x = x + positions.to(x.dtype)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return F.dropout(x, self.dropout, self.training)

    def extract_features(
        self,
        prev_output_tokens: torch.Tensor,
        encoder_out=None,
        incremental_state: Optional[IncrementalState] = None,
        return_all_hiddens: bool = False,
    ) -> Tuple[torch.Tensor, dict]:
        """(hidden states after the last layer and the final norm / output-dim projection [B, T, output_dim],
        extra) as upstream; with `incremental_state`, of the tokens past the cached ones only. `extra`:
        "attn": [None] (SDPA computes no attention weights), "inner_states": the last layer's output before the
        final norm ([B, T, C], not upstream's [T, B, C]), or with `return_all_hiddens` the embeddings and every
        layer's output (full forwards only: kept alive until the caller drops them)."""
        if encoder_out is not None:
            raise ValueError("this decoder-only TransformerDecoder has no encoder attention; pass encoder_out=None")
        check_token_input(prev_output_tokens)
        inner_states = None
        if incremental_state is None:
            x = self.embed(prev_output_tokens)
            inner_states = [x] if return_all_hiddens else None
            for layer in self.layers:
                x = layer(x)
                if inner_states is not None:
                    inner_states.append(x)
        else:
            x = self._layers_incremental(prev_output_tokens, incremental_state)
        return self._final_norm_and_projection(x), {"attn": [None], "inner_states": inner_states or [x]}

    def _final_norm_and_projection(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x

    def _layers_incremental(self, tokens: torch.Tensor, incremental_state: IncrementalState) -> torch.Tensor:
        entry = self._decoder_entry(incremental_state)
        start = entry["length"]
        if tokens.size(1) <= start:
            raise ValueError(
                f"incremental decoding: {tokens.size(1)} tokens given but {start} are cached already; "
                "pass the whole sequence so far plus at least one new token"
            )
        x = self.embed(tokens[:, start:], start=start)
        for layer in self.layers:
            x = layer(x, incremental_state=incremental_state)
        entry["length"] = tokens.size(1)
        return x

    def forward_static_step(
        self,
        tokens: torch.Tensor,
        slot: torch.Tensor,
        incremental_state: IncrementalState,
        window: Optional[int] = None,
    ) -> torch.Tensor:
        """Logits [R, 1, V] of `tokens` [R, 1], the tokens at index `slot` (a long tensor on the model's device, [1], or
        [R, 1]: one index per row) of R sequences whose first `slot` tokens are cached in `incremental_state`: the same
        logits as `self(prefix, incremental_state=state)` would give, from shapes and kernels that do not depend on
        `slot` and without reading it on the host, so a CUDA graph can capture this call.

        The cache must be reserved (`reserve_incremental_state`) or allocated by an earlier call; attention runs
        over its first `window` slots (default: its whole capacity), masked after `slot`. `slot` must stay below
        the window, the capacity and the model's positions (not checked: that would read it). The plain-int
        lengths are left as they were: say how many tokens are cached with `set_incremental_length` before
        calling anything that reads them (the dynamic forward, `reorder_incremental_state`)."""
        x = self.embed(tokens, slot=slot)
        step = None
        capacity = self.static_cache_shape(incremental_state, tokens.size(0), x)[1]
        if capacity:
            window = capacity if window is None else min(window, capacity)
            step = self._static_step_attention(x, slot, window)
        for layer in self.layers:
            x = layer(x, incremental_state=incremental_state, static_step=step)
        return self.output_layer(self._final_norm_and_projection(x))

    def forward_static_prefill(
        self, tokens: torch.Tensor, rows: torch.Tensor, incremental_state: IncrementalState
    ) -> torch.Tensor:
        """Features [B, T, output_dim] of `tokens` [B, T], the first T tokens of B sequences, their keys and values
        written to slots 0 .. T-1 of the caches' rows `rows` (a long tensor [B]; the caches reserved, or allocated
        by an earlier call): what `self(tokens, incremental_state=state, features_only=True)` gives over empty
        caches, from code that reads no plain-int length (a compiled prefill compiles once for many shapes). Every
        row is T tokens long (a prompt right-padded: causal attention keeps its positions from seeing the padding);
        the plain-int lengths are left alone, as by `forward_static_step`."""
        x = self.embed(tokens, start=0)
        capacity = self.static_cache_shape(incremental_state, tokens.size(0), x)[1]
        if capacity < tokens.size(1):
            raise ValueError(
                f"a static prefill of {tokens.size(1)} tokens does not fit caches of {capacity} slots; reserve "
                "them longer with reserve_incremental_state"
            )
        step = StaticStep(None, None, window=tokens.size(1), rows=rows)
        for layer in self.layers:
            x = layer(x, incremental_state=incremental_state, static_step=step)
        return self._final_norm_and_projection(x)

    def static_cache_shape(self, incremental_state: IncrementalState, rows: int, like: torch.Tensor):
        """(rows, capacity) of the caches the static steps write, allocated first (at the reserved size, at least
        `rows` rows, `like`'s dtype and device) when nothing is cached yet; (0, 0) without attention layers."""
        shapes = set()
        # A loop, not a set comprehension: through a comprehension dynamo (torch 2.13, Python 3.11) guarded on
        # this decoder's plain-int length, and a compiled step recompiled for every prompt width.
        for attention in self._decoder_entry(incremental_state)["attentions"]:
            shapes.add(attention.static_cache_shape(incremental_state, rows, like))
        if len(shapes) > 1:
            raise ValueError(
                f"the layers' caches have different (rows, capacity) {sorted(shapes)}; reserve them "
                "together with reserve_incremental_state"
            )
        return shapes.pop() if shapes else (0, 0)

    def _static_step_attention(self, x: torch.Tensor, slot: torch.Tensor, window: int) -> StaticStep:
        """How a static step's attention sees the cache: the live length for the decode attention kernel where
        it runs (CUDA with Triton, inference; chosen here once per step, on the host, so a captured graph holds
        the one chosen), else a mask over the window for SDPA."""
        if not self.training and decode_attention_available(x):
            return StaticStep(slot, None, lengths=(slot + 1).view(-1), window=window)
        visible = torch.arange(window, device=x.device) <= slot  # [window], or [rows, window] with a slot per row
        mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, -math.inf)
        return StaticStep(slot, mask.view(-1, 1, 1, window), window=window)

    def output_layer(self, features: torch.Tensor) -> torch.Tensor:
        """Vocabulary scores of `features`; with an adaptive softmax, its fp32 log-probabilities (already
        normalized: a log-softmax over them changes nothing, so every consumer of logits gets the model's
        distribution; --criterion adaptive_loss takes the features instead)."""
        if self.adaptive_softmax is not None:
            return self.adaptive_softmax.get_log_prob(features)
        return self.output_projection(features)

    def get_normalized_probs_scriptable(self, net_output, log_probs: bool, sample: Optional[dict] = None):
        return probs_of_logits(net_output, log_probs)

    def forward(
        self,
        prev_output_tokens: torch.Tensor,
        encoder_out=None,
        incremental_state: Optional[IncrementalState] = None,
        features_only: bool = False,
        src_lengths: Optional[torch.Tensor] = None,
        return_all_hiddens: bool = False,
    ) -> Tuple[torch.Tensor, dict]:
        """Upstream's `(logits [B, T, V], extra)` (the features with `features_only`); `extra` as in
        `extract_features`. `src_lengths` is accepted for upstream callers and unused."""
        features, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state, return_all_hiddens)
        return (features if features_only else self.output_layer(features)), extra

    # ---- incremental state ------------------------------------------------------------------------------
    def _decoder_entry(self, incremental_state: IncrementalState) -> dict:
        """This decoder's entry of the state: "length", the tokens cached, and "attentions", the modules that
        hold the caches, looked up once per state (walking the modules at every step costs more host time than
        a CUDA-graph step takes on the GPU)."""
        entry = self.get_incremental_state(incremental_state, _STATE_KEY)
        if entry is None:
            entry = {"length": 0, "attentions": self._attention_modules()}
            self.set_incremental_state(incremental_state, _STATE_KEY, entry)
        return entry

    def _attention_modules(self):
        return [m for m in self.modules() if isinstance(m, CausalSelfAttention)]

    def reserve_incremental_state(
        self, incremental_state: IncrementalState, max_length: int, max_batch: int = 0
    ) -> None:
        """Say, before the first call, that `incremental_state` will hold up to `max_length` tokens of up to
        `max_batch` rows: every layer's cache is then allocated once, at that size, on the first call."""
        for attention in self._decoder_entry(incremental_state)["attentions"]:
            attention.reserve_incremental_state(incremental_state, max_length, max_batch)

    def set_incremental_length(self, incremental_state: IncrementalState, length: int) -> None:
        """Say that `length` tokens are cached: after `forward_static_step` calls (which leave the plain-int
        lengths alone), or 0 to decode new text into the same buffers (what is left there is masked, then
        overwritten)."""
        entry = self._decoder_entry(incremental_state)
        entry["length"] = length
        for attention in entry["attentions"]:
            attention.set_incremental_length(incremental_state, length)

    def copy_incremental_rows(
        self, incremental_state: IncrementalState, source_state: IncrementalState, rows: torch.Tensor, length: int
    ) -> None:
        """Rows `rows` of every cache take the first `length` slots of `source_state`'s first rows (a prompt
        prefilled apart joins a running batch; static steps then continue them at their own slots)."""
        for attention in self._decoder_entry(incremental_state)["attentions"]:
            attention.copy_incremental_rows(incremental_state, source_state, rows, length)

    def set_block_table(self, incremental_state: IncrementalState, block_rows: Optional[torch.Tensor]) -> None:
        """Static steps read every layer's cache through the block table `block_rows` (None: each row its own;
        see CausalSelfAttention.set_block_table)."""
        for attention in self._decoder_entry(incremental_state)["attentions"]:
            attention.set_block_table(incremental_state, block_rows)

    def take_parent_blocks(
        self, incremental_state: IncrementalState, parents: torch.Tensor, slot: torch.Tensor
    ) -> None:
        """Row i of every cache takes row `parents[i]`'s block that holds `slot` (a [1] device tensor)."""
        for attention in self._decoder_entry(incremental_state)["attentions"]:
            attention.take_parent_blocks(incremental_state, parents, slot)

    def reorder_incremental_state(
        self, incremental_state: IncrementalState, new_order: torch.Tensor, window: Optional[int] = None
    ) -> None:
        """Row i of every cache continues row `new_order[i]` (a LongTensor on the model's device); with `window`,
        over the caches' first `window` slots, with static shapes and no length read (after static steps)."""
        # Upstream's two-argument call where no window is asked for: subclasses may override it so.
        extra = () if window is None else (window,)
        for attention in self._decoder_entry(incremental_state)["attentions"]:
            attention.reorder_incremental_state(incremental_state, new_order, *extra)

    def reorder_incremental_state_scripting(self, incremental_state: IncrementalState, new_order: torch.Tensor) -> None:
        # The base class visits every submodule; here reorder_incremental_state already covers them all.
        self.reorder_incremental_state(incremental_state, new_order)
