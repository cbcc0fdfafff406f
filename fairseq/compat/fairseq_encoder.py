"""`FairseqEncoder` and `EncoderOut`: upstream fairseq's encoder base class, for plug-ins (`--user-dir`) and
upstream's test helpers that subclass it.

This fork ships no encoder or encoder-decoder architecture of its own (it trains decoder-only language models;
fairseq.upstream_absent lists upstream's translation models as absent). The base class is here so that an
encoder written against upstream imports and runs: `forward(src_tokens, src_lengths)` returns whatever the
paired decoder reads as `encoder_out` (upstream's older encoders return an `EncoderOut`), and beam search
calls `reorder_encoder_out(encoder_out, new_order)` when it reorders hypotheses.
"""

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from fairseq.models.fairseq_model import BaseFairseqModel
from fairseq.modules.fairseq_decoder import FairseqDecoder


class EncoderOut(NamedTuple):
    """Upstream's encoder output record (field names and order as upstream's; shapes as upstream documents)."""

    encoder_out: Tensor  # T x B x C
    encoder_padding_mask: Optional[Tensor]  # B x T
    encoder_embedding: Optional[Tensor]  # B x T x C
    encoder_states: Optional[List[Tensor]]  # a T x B x C tensor per layer
    src_tokens: Optional[Tensor]  # B x T
    src_lengths: Optional[Tensor]  # B x 1


class FairseqEncoder(nn.Module):
    def __init__(self, dictionary):
        super().__init__()
        self.dictionary = dictionary

    def forward(self, src_tokens: Tensor, src_lengths: Optional[Tensor] = None, **kwargs):
        """The encoding of `src_tokens` [B, T] (lengths [B]) that the decoder attends to."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward(src_tokens, src_lengths)")

    def forward_torchscript(self, net_input: Dict[str, Tensor]):
        """Upstream's entry point for generators: under TorchScript only the two standard inputs are passed."""
        if torch.jit.is_scripting():
            return self.forward(src_tokens=net_input["src_tokens"], src_lengths=net_input["src_lengths"])
        return self.forward_non_torchscript(net_input)

    @torch.jit.unused
    def forward_non_torchscript(self, net_input: Dict[str, Tensor]):
        # A batch's net_input also holds the decoder's input; the encoder gets everything else.
        return self.forward(**{k: v for k, v in net_input.items() if k != "prev_output_tokens"})

    def reorder_encoder_out(self, encoder_out, new_order: Tensor):
        """`encoder_out` with its batch rows taken in `new_order` (beam search); each encoder knows its layout."""
        raise NotImplementedError(f"{type(self).__name__} must implement reorder_encoder_out(encoder_out, new_order)")

    def max_positions(self) -> int:
        return int(1e6)  # upstream's "arbitrary large number" for encoders without a limit

    def upgrade_state_dict(self, state_dict: dict) -> dict:
        return state_dict

    def upgrade_state_dict_named(self, state_dict: dict, name: str) -> dict:
        return state_dict

    def set_num_updates(self, num_updates: int) -> None:
        """Pass the trainer's update count on to every submodule that wants it (upstream's hook)."""
        for module in self.modules():
            if module is not self and hasattr(module, "set_num_updates"):
                module.set_num_updates(num_updates)


class FairseqEncoderDecoderModel(BaseFairseqModel):
    """Upstream's encoder-decoder base class, for plug-ins: `model(src_tokens, src_lengths, prev_output_tokens)`
    encodes the source and runs the decoder over `prev_output_tokens` with the encoding as `encoder_out`,
    returning the decoder's `(logits, extra)`. This fork has no encoder-decoder architecture of its own;
    FSDP, activation checkpointing and compile need the plug-in to provide `transformer_layers()`."""

    def __init__(self, encoder: nn.Module, decoder: nn.Module):
        super().__init__()
        if not isinstance(encoder, FairseqEncoder) or not isinstance(decoder, FairseqDecoder):
            raise TypeError(
                f"{type(self).__name__} takes a fairseq.models.FairseqEncoder and a FairseqDecoder, "
                f"got {type(encoder).__name__} and {type(decoder).__name__}"
            )
        self.encoder = encoder
        self.decoder = decoder

    def forward(self, src_tokens: torch.Tensor, src_lengths: torch.Tensor, prev_output_tokens: torch.Tensor, **kwargs):
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths, **kwargs)
        return self.decoder(prev_output_tokens, encoder_out=encoder_out, **kwargs)

    def forward_decoder(self, prev_output_tokens: torch.Tensor, **kwargs):
        return self.decoder(prev_output_tokens, **kwargs)

    def extract_features(
        self, src_tokens: torch.Tensor, src_lengths: torch.Tensor, prev_output_tokens: torch.Tensor, **kwargs
    ):
        """The decoder's `(features, extra)` before its output layer."""
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths, **kwargs)
        return self.decoder.extract_features(prev_output_tokens, encoder_out=encoder_out, **kwargs)

    def output_layer(self, features: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.decoder.output_layer(features, **kwargs)

    def max_positions(self) -> Tuple[int, int]:
        """(source, target) limits, as upstream's size filters compare them with (source, target) sizes."""
        return self.encoder.max_positions(), self.decoder.max_positions()

    def max_decoder_positions(self) -> int:
        return self.decoder.max_positions()

    def get_normalized_probs(self, net_output, log_probs: bool, sample=None) -> torch.Tensor:
        # The decoder decides (upstream's TestIncrementalDecoder returns probabilities, not logits).
        return self.decoder.get_normalized_probs(net_output, log_probs, sample)
