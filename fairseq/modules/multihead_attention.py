"""Causal multi-head self-attention through `F.scaled_dot_product_attention`.

Parameter names and initialization follow upstream fairseq's MultiheadAttention (separate q/k/v/out
projections with bias), so upstream state dicts load unchanged. No mask is materialized: SDPA's
`is_causal=True` selects the fused kernels (flash / memory-efficient) where available.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"--decoder-embed-dim {embed_dim} is not divisible by --decoder-attention-heads {num_heads}; "
                "pick a head count that divides the embedding dim"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.reset_parameters()

    def reset_parameters(self):
        # As upstream: q/k/v keep nn.Linear's default bias init, weights get xavier with gain 1/sqrt(2)
        # (upstream found it converges better); the output projection gets plain xavier and a zero bias.
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            proj.reset_parameters()
        for proj in (self.k_proj, self.v_proj, self.q_proj):
            nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over x [B, T, C] -> [B, T, C]."""
        batch, length, channels = x.shape
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(x))
        v = self._split_heads(self.v_proj(x))
        attn = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        attn = attn.transpose(1, 2).reshape(batch, length, channels)
        return self.out_proj(attn)
