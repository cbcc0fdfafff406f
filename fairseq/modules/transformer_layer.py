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

    NormFormer (https://arxiv.org/abs/2110.09456; upstream's options and parameter names, so its checkpoints load):
    `scale_heads` multiplies the attention's output, in head-sized chunks, by a learned scale per head (`c_attn`,
    [heads]: upstream scales after the output projection, and so does this layer); `scale_attn` normalizes the
    attention's output (`attn_ln`) and `scale_fc` the FFN's activations (`ffn_layernorm`, after the activation
    dropout), each before the residual; `scale_resids` multiplies the FFN block's residual by a learned vector
    (`w_resid`, [embed dim]). Scales start at 1.
    """

    # The layer under tensor parallelism over N ranks (Megatron-LM's split, sequence-parallel between the
    # blocks; the style names are fairseq.models.fairseq_model.TENSOR_PARALLEL_STYLES): each rank computes
    # heads / N heads and ffn / N of the FFN, and holds tokens / N positions of the residual stream and norms.
    # NormFormer's attn_ln is a norm of the sequence-split stream too; its other parts are refused under tensor
    # parallelism (TransformerLanguageModel.TENSOR_PARALLEL_REFUSED).
    TENSOR_PARALLEL_STYLES = {
        "self_attn_layer_norm": "sequence_norm",
        "self_attn": "gather_sequence",  # called as self_attn(x, incremental_state): q/k/v see every position
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.out_proj": "rowwise_to_sequence",
        "attn_ln": "sequence_norm",
        "final_layer_norm": "sequence_norm",
        "fc1": "colwise_from_sequence",
        "fc2": "rowwise_to_sequence",
    }

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ffn_embed_dim: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation_dropout: float = 0.0,
        activation_fn: str = "relu",
        normalize_before: bool = False,
        scale_attn: bool = False,
        scale_fc: bool = False,
        scale_heads: bool = False,
        scale_resids: bool = False,
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.dropout = dropout
        self.activation_dropout = activation_dropout
        self.activation_fn_name = activation_fn
        self.activation_fn = get_activation_fn(activation_fn)
        self.normalize_before = normalize_before
        self.self_attn = CausalSelfAttention(embed_dim, num_heads, dropout=attention_dropout)
        self.attn_ln = nn.LayerNorm(embed_dim) if scale_attn else None
        self.c_attn = nn.Parameter(torch.ones(num_heads)) if scale_heads else None
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.ffn_layernorm = nn.LayerNorm(ffn_embed_dim) if scale_fc else None
        self.w_resid = nn.Parameter(torch.ones(embed_dim)) if scale_resids else None
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def tensor_parallel_styles(self) -> dict:
        """{path: style} of the modules this layer has (TENSOR_PARALLEL_STYLES)."""
        return {
            path: style
            for path, style in self.TENSOR_PARALLEL_STYLES.items()
            if path != "attn_ln" or self.attn_ln is not None
        }

    def reset_parameters(self):
        # fc1/fc2 keep nn.Linear's default init, as upstream's layers do.
        self.self_attn.reset_parameters()
        for module in (
            self.self_attn_layer_norm,
            self.attn_ln,
            self.ffn_layernorm,
            self.fc1,
            self.fc2,
            self.final_layer_norm,
        ):
            if module is not None:
                module.reset_parameters()
        with torch.no_grad():
            for scale in (self.c_attn, self.w_resid):
                if scale is not None:
                    scale.fill_(1.0)

    def forward(
        self,
        x: torch.Tensor,
        incremental_state: Optional[IncrementalState] = None,
        static_step: Optional[StaticStep] = None,
    ) -> torch.Tensor:
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x = self.self_attn(x, incremental_state, static_step=static_step)
        if self.c_attn is not None:
            x = (x.unflatten(-1, (self.c_attn.size(0), -1)) * self.c_attn.unsqueeze(-1)).flatten(-2)
        if self.attn_ln is not None:
            x = self.attn_ln(x)
        x = residual + F.dropout(x, self.dropout, self.training)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_fn(self.fc1(x))
        x = F.dropout(x, self.activation_dropout, self.training)
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        x = self.fc2(x)
        if self.w_resid is not None:
            residual = self.w_resid * residual
        x = residual + F.dropout(x, self.dropout, self.training)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x
