"""Building blocks of the transformer language model (no distributed or precision code here)."""

from fairseq.modules.activations import ACTIVATION_FNS, get_activation_fn
from fairseq.modules.adaptive_input import AdaptiveInput
from fairseq.modules.adaptive_softmax import AdaptiveSoftmax
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.modules.positional_embedding import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEmbedding,
    build_positional_embedding,
    make_positions,
    sinusoidal_table,
)
from fairseq.modules.transformer_decoder import TransformerDecoder
from fairseq.modules.transformer_layer import TransformerDecoderLayer

__all__ = [
    "ACTIVATION_FNS",
    "AdaptiveInput",
    "AdaptiveSoftmax",
    "LearnedPositionalEmbedding",
    "MultiheadAttention",
    "SinusoidalPositionalEmbedding",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "build_positional_embedding",
    "get_activation_fn",
    "make_positions",
    "sinusoidal_table",
]
