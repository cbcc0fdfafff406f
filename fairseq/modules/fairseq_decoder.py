"""`FairseqDecoder`: upstream fairseq's base class of decoders, for plug-ins (`--user-dir`) written against it.

Upstream's contract: `forward(prev_output_tokens, encoder_out=None, **kwargs)` returns `(logits, extra)`,
composed of `extract_features` (hidden states and a dict of extras) and `output_layer` (hidden states to
vocabulary logits). This fork's TransformerDecoder keeps it; consumers here also accept a plug-in decoder that
returns the logits tensor alone.
"""

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn


class FairseqDecoder(nn.Module):
    def __init__(self, dictionary):
        super().__init__()
        self.dictionary = dictionary
        self.onnx_trace = False
        self.adaptive_softmax = None

    def forward(self, prev_output_tokens: Tensor, encoder_out=None, **kwargs):
        """(logits [B, T, V], extra dict) for the decoder inputs `prev_output_tokens` [B, T]."""
        features, extra = self.extract_features(prev_output_tokens, encoder_out=encoder_out, **kwargs)
        return self.output_layer(features), extra

    def extract_features(self, prev_output_tokens: Tensor, encoder_out=None, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must implement extract_features")

    def output_layer(self, features: Tensor, **kwargs) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement output_layer")

    def get_normalized_probs(self, net_output, log_probs: bool, sample: Optional[dict] = None) -> Tensor:
        """fp32 (log-)probabilities of the logits in `net_output` (a `(logits, extra)` tuple or the tensor)."""
        return self.get_normalized_probs_scriptable(net_output, log_probs, sample)

    def get_normalized_probs_scriptable(self, net_output, log_probs: bool, sample: Optional[dict] = None) -> Tensor:
        # Upstream's split: plug-ins override this one.
        if self.adaptive_softmax is not None:  # upstream's convention: such a decoder returns features
            target = sample["target"] if sample is not None else None
            out = self.adaptive_softmax.get_log_prob(net_output[0], target=target)
            return out if log_probs else out.exp()
        logits = net_output[0] if isinstance(net_output, (tuple, list)) else net_output
        return F.log_softmax(logits.float(), dim=-1) if log_probs else F.softmax(logits.float(), dim=-1)

    def max_positions(self) -> int:
        return int(1e6)  # upstream's "arbitrary large number" for decoders without a limit

    def upgrade_state_dict_named(self, state_dict: dict, name: str) -> dict:
        return state_dict

    def prepare_for_onnx_export_(self) -> None:
        self.onnx_trace = True
