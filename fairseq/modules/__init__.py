"""Building blocks of the transformer language model (no distributed or precision code here), and upstream's
`fairseq.modules` names that plug-in models build on (the ones left out raise an ImportError saying why:
fairseq.upstream_absent)."""

from fairseq.modules.activations import ACTIVATION_FNS, get_activation_fn
from fairseq.modules.adaptive_input import AdaptiveInput
from fairseq.modules.adaptive_softmax import AdaptiveSoftmax
from fairseq.modules.causal_attention import CausalSelfAttention
from fairseq.modules.cross_entropy import cross_entropy
from fairseq.modules.fairseq_dropout import FairseqDropout
from fairseq.modules.fp32_group_norm import Fp32GroupNorm
from fairseq.modules.gelu import gelu, gelu_accurate
from fairseq.modules.grad_multiply import GradMultiply
from fairseq.modules.layer_drop import LayerDropModuleList
from fairseq.modules.layer_norm import Fp32LayerNorm, LayerNorm
from fairseq.modules.positional_embedding import (
    LearnedPositionalEmbedding,
    PositionalEmbedding,
    SinusoidalPositionalEmbedding,
    build_positional_embedding,
    make_positions,
    sinusoidal_table,
)
from fairseq.modules.rotary_positional_embedding import RotaryPositionalEmbedding
from fairseq.modules.same_pad import SamePad
from fairseq.modules.transformer_decoder import TransformerDecoder
from fairseq.modules.transformer_layer import TransformerDecoderLayer
from fairseq.modules.transpose_last import TransposeLast
from fairseq.upstream_absent import absent_name as _absent_name

__all__ = [
    "ACTIVATION_FNS",
    "AdaptiveInput",
    "AdaptiveSoftmax",
    "CausalSelfAttention",
    "FairseqDropout",
    "Fp32GroupNorm",
    "Fp32LayerNorm",
    "GradMultiply",
    "LayerDropModuleList",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "PositionalEmbedding",
    "RotaryPositionalEmbedding",
    "SamePad",
    "SinusoidalPositionalEmbedding",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransposeLast",
    "build_positional_embedding",
    "cross_entropy",
    "gelu",
    "gelu_accurate",
    "get_activation_fn",
    "make_positions",
    "sinusoidal_table",
]


def __getattr__(name):
    return _absent_name(__name__, name)
