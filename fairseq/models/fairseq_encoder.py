"""`FairseqEncoder` and `EncoderOut`: upstream fairseq's encoder base class, for plug-ins (`--user-dir`) and
upstream's test helpers that subclass it.

This fork ships no encoder or encoder-decoder architecture of its own (it trains decoder-only language models;
fairseq.upstream_absent lists upstream's translation models as absent). The base class is here so that an
encoder written against upstream imports and runs: `forward(src_tokens, src_lengths)` returns whatever the
paired decoder reads as `encoder_out` (upstream's older encoders return an `EncoderOut`), and beam search
calls `reorder_encoder_out(encoder_out, new_order)` when it reorders hypotheses.
"""

from typing import Dict, List, NamedTuple, Optional

import torch
from torch import Tensor, nn


class EncoderOut(NamedTuple):
    """Upstream's encoder output record (field names and order as upstream's; shapes as upstream documents)."""

    encoder_out: Tensor                          # T x B x C
    encoder_padding_mask: Optional[Tensor]       # B x T
    encoder_embedding: Optional[Tensor]          # B x T x C
    encoder_states: Optional[List[Tensor]]       # a T x B x C tensor per layer
    src_tokens: Optional[Tensor]                 # B x T
    src_lengths: Optional[Tensor]                # B x 1


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
