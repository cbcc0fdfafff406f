"""The decoder of fconv_lm (fairseq.models.fconv_lm): token embedding, fc1, gated causal convolutions with
residuals, fc2 and fc3 (or an adaptive softmax), under upstream's parameter names. The layer spec it takes is
`fairseq.models.fconv_lm.parse_decoder_layers`' output.

Network (batch-major, [B, T, C]): token embedding (no positions: the convolutions see order), dropout, fc1 to
the first layer's width, then per layer `residual` (projected if needed), `GatedCausalConv` (dropout, causal
convolution, GLU), `(x + residual) * sqrt(0.5)`; then the output layer. Incremental decoding keeps, per
convolution, its last kernel - 1 inputs; any number of new tokens per call.
"""

import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq.modules.adaptive_softmax import AdaptiveSoftmax
from fairseq.modules.fairseq_incremental_decoder import FairseqIncrementalDecoder, check_token_input, probs_of_logits
from fairseq.modules.gated_convolution import GatedCausalConv, WeightNormLinear
from fairseq.modules.incremental_decoding_utils import IncrementalState
from fairseq.modules.positional_embedding import zero_row_

_STATE_KEY = "fconv_state"
LayerSpec = Tuple[int, int, int]  # (dim, kernel_size, residual)


class FConvDecoder(FairseqIncrementalDecoder):
    """Embedding -> fc1 -> gated causal convolutions with residuals -> fc2, fc3 (or an adaptive softmax).

    State-dict keys (under the model's `decoder.`): `version` ([2.], upstream's weight-norm layout),
    `embed_tokens.weight`, `fc1.{weight_g,weight_v,bias}`, `projections.N.*` (only for layers whose residual
    has another width), `convolutions.N.{weight_g,weight_v,bias}`, `fc2.*` and `fc3.*`, or
    `adaptive_softmax.*` (fairseq.modules.adaptive_softmax's names)."""

    def __init__(
        self,
        vocab_size: int,
        padding_idx: int,
        embed_dim: int,
        layers: List[LayerSpec],
        dropout: float,
        adaptive_softmax_cutoff: Optional[List[int]] = None,
        adaptive_softmax_dropout: float = 0.0,
        output_vocab_size: Optional[int] = None,
    ):
        super().__init__(dictionary=None)  # built from sizes; the task holds the dictionary
        self.register_buffer("version", torch.tensor([2.0]))
        self.padding_idx = padding_idx
        self.dropout = dropout
        out_size = vocab_size if output_vocab_size is None else output_vocab_size
        self.embed_tokens = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx)
        self.embed_positions = None  # upstream's fconv_lm has no positional embeddings
        in_channels = layers[0][0]
        self.fc1 = WeightNormLinear(embed_dim, in_channels, dropout=dropout)
        self.projections = nn.ModuleList()
        self.convolutions = nn.ModuleList()
        self.residuals = []
        layer_in_channels = [in_channels]  # the width of each output a residual may come from
        for out_channels, kernel_size, residual in layers:
            residual_dim = out_channels if residual == 0 else layer_in_channels[-residual]
            self.projections.append(
                WeightNormLinear(residual_dim, out_channels) if residual_dim != out_channels else None
            )
            self.convolutions.append(GatedCausalConv(in_channels, out_channels, kernel_size, dropout=dropout))
            self.residuals.append(residual)
            in_channels = out_channels
            layer_in_channels.append(out_channels)
        self.output_dim = in_channels
        self.adaptive_softmax = None
        self.fc2 = self.fc3 = None
        if adaptive_softmax_cutoff is not None:
            if adaptive_softmax_cutoff[0] <= padding_idx:
                raise ValueError(
                    f"--adaptive-softmax-cutoff {','.join(map(str, adaptive_softmax_cutoff))}: the first "
                    f"cutoff must be larger than the padding index {padding_idx}"
                )
            self.adaptive_softmax = AdaptiveSoftmax(
                out_size, in_channels, adaptive_softmax_cutoff, dropout=adaptive_softmax_dropout
            )
        else:
            self.fc2 = WeightNormLinear(in_channels, embed_dim)
            self.fc3 = WeightNormLinear(embed_dim, out_size, dropout=dropout)
        self._init_embedding()

    def _init_embedding(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=0.1)
        zero_row_(self.embed_tokens.weight, self.padding_idx)

    def reset_parameters(self) -> None:
        """Initialize every parameter and buffer as upstream does, drawing from the torch RNG."""
        self._init_embedding()
        for module in (self.fc1, *self.projections, *self.convolutions, self.fc2, self.fc3, self.adaptive_softmax):
            if module is not None:
                module.reset_parameters()
        with torch.no_grad():
            self.version.fill_(2.0)

    def max_positions(self) -> Optional[int]:
        return None  # no positional embeddings: any length (upstream says float("inf"))

    def extract_features(
        self, prev_output_tokens: torch.Tensor, encoder_out=None, incremental_state: Optional[IncrementalState] = None
    ) -> torch.Tensor:
        """Outputs of the last convolution, [B, T, last dim]; with `incremental_state`, of the tokens past the
        cached ones only."""
        if encoder_out is not None:
            raise ValueError(
                "FConvDecoder is a language model's decoder and has no encoder attention; pass encoder_out=None"
            )
        check_token_input(prev_output_tokens)
        histories = None
        tokens = prev_output_tokens
        if incremental_state is not None:
            entry = self._state_entry(incremental_state)
            start = entry["length"]
            if tokens.size(1) <= start:
                raise ValueError(
                    f"incremental decoding: {tokens.size(1)} tokens given but {start} are cached "
                    "already; pass the whole sequence so far plus at least one new token"
                )
            tokens, histories = tokens[:, start:], entry["histories"]
            entry["length"] = prev_output_tokens.size(1)
        x = F.dropout(self.embed_tokens(tokens), self.dropout, self.training)
        x = self.fc1(x)
        outputs = [x]  # fc1's output, then every layer's: where residuals come from
        for i, (projection, conv, residual_from) in enumerate(zip(self.projections, self.convolutions, self.residuals)):
            residual = None
            if residual_from > 0:
                residual = outputs[-residual_from]
                if projection is not None:
                    residual = projection(residual)
            if histories is None:
                x = conv(x)
            else:
                history = histories[i]
                histories[i] = conv.next_history(x, history)
                x = conv(x, history)
            if residual is not None:
                x = (x + residual) * math.sqrt(0.5)
            outputs.append(x)
        return x

    def output_layer(self, features: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (fc2, dropout, fc3), or an adaptive softmax's fp32 log-probabilities over the whole
        vocabulary (a log-softmax leaves them unchanged; --criterion adaptive_loss takes the features instead)."""
        if self.adaptive_softmax is not None:
            return self.adaptive_softmax.get_log_prob(features)
        x = F.dropout(self.fc2(features), self.dropout, self.training)
        return self.fc3(x)

    def forward(
        self,
        prev_output_tokens: torch.Tensor,
        encoder_out=None,
        incremental_state: Optional[IncrementalState] = None,
        features_only: bool = False,
        src_lengths: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, None]:
        """Upstream's `(logits [B, T, V], attention)` (the features with `features_only`); the attention is
        None, as upstream's for a language model (no encoder to attend to)."""
        features = self.extract_features(prev_output_tokens, encoder_out, incremental_state)
        return (features if features_only else self.output_layer(features)), None

    def get_normalized_probs_scriptable(self, net_output, log_probs: bool, sample: Optional[dict] = None):
        return probs_of_logits(net_output, log_probs)

    # ---- incremental state: per convolution, its last kernel - 1 inputs --------------------------------------
    def _state_entry(self, incremental_state: IncrementalState) -> dict:
        entry = self.get_incremental_state(incremental_state, _STATE_KEY)
        if entry is None:
            entry = {"length": 0, "histories": [None] * len(self.convolutions)}
            self.set_incremental_state(incremental_state, _STATE_KEY, entry)
        return entry

    def reserve_incremental_state(
        self, incremental_state: IncrementalState, max_length: int, max_batch: int = 0
    ) -> None:
        """The caches have a fixed size (kernel - 1 inputs per layer), whatever the length: nothing to reserve.
        Having this method tells the generator that one call may take several new tokens (a whole prompt)."""
        self._state_entry(incremental_state)

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: torch.Tensor) -> None:
        """Row i of every cache continues row `new_order[i]` (beam search, dropped sentences)."""
        entry = self._state_entry(incremental_state)
        entry["histories"] = [h.index_select(0, new_order) if h is not None else None for h in entry["histories"]]

    def reorder_incremental_state_scripting(self, incremental_state: IncrementalState, new_order: torch.Tensor) -> None:
        self.reorder_incremental_state(incremental_state, new_order)
