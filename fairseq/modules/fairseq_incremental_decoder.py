"""`FairseqIncrementalDecoder`: upstream fairseq's base class of decoders that decode step by step.

Upstream's contract, kept for plug-ins: `forward(prev_output_tokens, encoder_out=None, incremental_state=None)`
is given the whole prefix generated so far; with an `incremental_state` (a dict the caller creates empty and
passes back every step) the decoder computes only what it has not seen yet, reading and writing its caches
in that dict. Beam search calls `reorder_incremental_state_scripting(incremental_state, new_order)` when it
reorders or drops hypotheses. Upstream plug-ins compute exactly the last token per call; this fork's
TransformerDecoder computes every token past its cache (so a prompt is fed in one call) and says so by
having `reserve_incremental_state` (see fairseq.generation.sequence_generator).
"""

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from fairseq.modules.incremental_decoding_utils import FairseqIncrementalState, IncrementalState
from fairseq.modules.fairseq_decoder import FairseqDecoder


def check_token_input(tokens: Tensor) -> None:
    """A decoder's input is [batch, length] with at least one token: anything else is one ValueError naming it,
    not an error about a reshape deep inside (a shape check: no host sync)."""
    if tokens.dim() != 2 or tokens.numel() == 0:
        what = "empty" if tokens.numel() == 0 else f"{tokens.dim()}-D"
        raise ValueError(
            f"the model's input tokens are {what} (shape {list(tokens.shape)}): pass ids of shape "
            "[batch, length] with at least one sentence of at least one token"
        )


def probs_of_logits(net_output, log_probs: bool) -> Tensor:
    """`get_normalized_probs` of a decoder whose output (`net_output`, or its first item) is logits or an adaptive
    softmax's log-probabilities (which a log-softmax leaves as they are), never features as upstream's decoders
    with an adaptive softmax return: the (log-)softmax over the vocabulary, in fp32."""
    logits = net_output[0] if isinstance(net_output, (tuple, list)) else net_output
    return F.log_softmax(logits.float(), dim=-1) if log_probs else F.softmax(logits.float(), dim=-1)


class FairseqIncrementalDecoder(FairseqIncrementalState, FairseqDecoder):
    def __init__(self, dictionary):
        super().__init__(dictionary)

    def forward(
        self,
        prev_output_tokens: Tensor,
        encoder_out=None,
        incremental_state: Optional[IncrementalState] = None,
        **kwargs,
    ):
        raise NotImplementedError(f"{type(self).__name__} must implement forward")

    def extract_features(
        self,
        prev_output_tokens: Tensor,
        encoder_out=None,
        incremental_state: Optional[IncrementalState] = None,
        **kwargs,
    ):
        raise NotImplementedError(f"{type(self).__name__} must implement extract_features")

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        """Reorder this module's own cached state along the batch dim (upstream: a no-op here; submodules
        with caches have their own, called by `reorder_incremental_state_scripting`)."""

    def reorder_incremental_state_scripting(self, incremental_state: IncrementalState, new_order: Tensor) -> None:
        """The entry point of the generator: reorder every cache of this decoder and its submodules.

        `new_order[i]` is the batch row whose state row i continues (rows may repeat or be dropped)."""
        for module in self.modules():
            if hasattr(module, "reorder_incremental_state"):
                result = module.reorder_incremental_state(incremental_state, new_order)
                if result is not None:
                    incremental_state = result

    def set_beam_size(self, beam_size: int) -> None:
        """Tell this decoder and its submodules the beam size (some use it to share work across beams)."""
        if getattr(self, "_beam_size", -1) != beam_size:
            seen = set()

            def apply_set_beam_size(module):
                if module is not self and hasattr(module, "set_beam_size") and module not in seen:
                    seen.add(module)
                    module.set_beam_size(beam_size)

            self.apply(apply_set_beam_size)
            self._beam_size = beam_size
