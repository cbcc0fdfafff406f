"""Upstream's rotary positional embedding (RoFormer, https://arxiv.org/abs/2104.09864) for plug-in attention
layers: `RotaryPositionalEmbedding(dim)(x, seq_len)` gives the cos/sin tables [T, 1, 1, dim] (time first, as
upstream's [T, B, C] activations), `apply_rotary_pos_emb(q, k, cos, sin, offset)` rotates queries and keys
[T, B, H, dim] by them. This fork's own transformer_lm has no rotary positions (--decoder-learned-pos or
sinusoidal ones)."""

import torch


class RotaryPositionalEmbedding(torch.nn.Module):
    def __init__(self, dim: int, base: float = 10000, precision=torch.half):
        """`precision` is kept as upstream keeps it (unused: the tables are float32)."""
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))
        self.seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None
        self.precision = precision

    def forward(self, x: torch.Tensor, seq_len: int = None):
        """(cos, sin), each [seq_len, 1, 1, dim] (seq_len: x's first dim unless given), cached for the last
        seq_len asked for."""
        seq_len = x.shape[0] if seq_len is None else seq_len
        if seq_len != self.seq_len_cached or self.cos_cached.device != x.device:
            positions = torch.arange(seq_len, device=x.device, dtype=self.inv_freq.dtype)
            angles = torch.outer(positions, self.inv_freq.to(x.device))
            table = torch.cat((angles, angles), dim=-1)
            self.seq_len_cached = seq_len
            self.cos_cached = table.cos()[:, None, None, :]
            self.sin_cached = table.sin()[:, None, None, :]
        return self.cos_cached, self.sin_cached


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int = 0):
    """Rotate q and k (time first) by the tables' rows offset .. offset + T - 1."""
    cos = cos[offset : offset + q.shape[0], ...]
    sin = sin[offset : offset + q.shape[0], ...]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
