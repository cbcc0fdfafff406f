"""One decoder block of a decoder-only transformer, named as upstream fairseq names it.

`forward` takes and returns one tensor [B, T, C], so activation checkpointing and FSDP can wrap a layer
without knowing anything about it. Incremental decoding passes `incremental_state` (and, for the static
one-token step, `static_step`) on to the attention, the only part that keeps a cache; without it the
computation is the training one.
"""

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq.modules.incremental_decoding_utils import IncrementalState
from fairseq.modules.activations import get_activation_fn
from fairseq.modules.causal_attention import CausalSelfAttention, StaticStep


class TransformerDecoderLayer(nn.Module):
    """Causal self-attention then a feed-forward block, each with dropout and a residual connection.

    With `normalize_before` each sub-block normalizes its input (pre-norm); otherwise its output after the
    residual (post-norm, the original Transformer).
    """

    # The layer under tensor parallelism over N ranks (Megatron-LM's split, sequence-parallel between the
    # blocks; the style names are fairseq.models.fairseq_model.TENSOR_PARALLEL_STYLES): each rank computes
    # heads / N heads and ffn / N of the FFN, and holds tokens / N positions of the residual stream and norms.
    TENSOR_PARALLEL_STYLES = {
        "self_attn_layer_norm": "sequence_norm",
        "self_attn": "gather_sequence",  # called as self_attn(x, incremental_state): q/k/v see every position
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.out_proj": "rowwise_to_sequence",
        "final_layer_norm": "sequence_norm",
        "fc1": "colwise_from_sequence",
        "fc2": "rowwise_to_sequence",
    }

    def __init__(self, embed_dim: int, num_heads: int, ffn_embed_dim: int, dropout: float = 0.1,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 activation_fn: str = "relu", normalize_before: bool = False):
        super().__init__()
        self.embed_dim = embed_dim
        self.dropout = dropout
        self.activation_dropout = activation_dropout
        self.activation_fn_name = activation_fn
        self.activation_fn = get_activation_fn(activation_fn)
        self.normalize_before = normalize_before
        self.self_attn = CausalSelfAttention(embed_dim, num_heads, dropout=attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def reset_parameters(self):
        # fc1/fc2 keep nn.Linear's default init, as upstream's layers do.
        self.self_attn.reset_parameters()
        for module in (self.self_attn_layer_norm, self.fc1, self.fc2, self.final_layer_norm):
            module.reset_parameters()

    def forward(self, x: torch.Tensor, incremental_state: Optional[IncrementalState] = None,
                static_step: Optional[StaticStep] = None) -> torch.Tensor:
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x = self.self_attn(x, incremental_state, static_step=static_step)
        x = residual + F.dropout(x, self.dropout, self.training)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_fn(self.fc1(x))
        x = F.dropout(x, self.activation_dropout, self.training)
        x = self.fc2(x)
        x = residual + F.dropout(x, self.dropout, self.training)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x
