"""Weight-normalized layers of the gated convolutional language model (`--arch fconv_lm*`; Dauphin et al., 2017,
"Language Modeling with Gated Convolutional Networks", https://arxiv.org/abs/1612.08083), under upstream
fairseq's parameter names.

Upstream wraps an nn.Linear and its ConvTBC (time x batch x channel) convolution in torch's `weight_norm` hook,
so its checkpoints hold `weight_g`, `weight_v` and `bias` for each. Here the weight is computed from them in
forward, `weight = weight_g * weight_v / ||weight_v||` (the norm over every dim but `dim`): the same function
and the same state-dict entries, without a hook for FSDP2, the meta device or activation checkpointing to
work around.

- `WeightNormLinear`: `weight_v` [out, in], `weight_g` [out, 1] (one norm per output row), `bias` [out].
- `GatedCausalConv`: ConvTBC's weight layout, `weight_v` [kernel, in, 2 * out] and `weight_g` [1, 1, 2 * out]
  (one norm per output channel, upstream's `weight_norm(conv, dim=2)`), `bias` [2 * out]. Input dropout, a
  causal convolution (output t sees inputs t - kernel + 1 .. t: the left is zero-padded by kernel - 1, or
  continued from `history` when decoding incrementally), then a GLU that halves the channels to `out`.

Initialization is upstream's: weight_v normal with std sqrt((1 - dropout) / in) (Linear) or
sqrt(4 (1 - dropout) / (kernel * in)) (convolution), weight_g its norm (so the weight starts as weight_v), bias 0.
"""

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def norm_except_dim(v: torch.Tensor, dim: int) -> torch.Tensor:
    """||v|| over every dim but `dim`, keeping dims (the shape of weight_g)."""
    return torch.linalg.vector_norm(v, dim=[d for d in range(v.dim()) if d != dim], keepdim=True)


def weight_normalized(weight_g: torch.Tensor, weight_v: torch.Tensor, dim: int) -> torch.Tensor:
    """weight_g * weight_v / ||weight_v||, computed in fp32 (a bf16 norm over thousands of entries is coarse)
    and returned in weight_v's dtype."""
    v = weight_v.float()
    return (v * (weight_g.float() / norm_except_dim(v, dim))).to(weight_v.dtype)


def _init_weight_norm_(
    weight_g: nn.Parameter, weight_v: nn.Parameter, bias: nn.Parameter, std: float, dim: int
) -> None:
    # Whole-tensor ops, so that it also initializes FSDP2's sharded parameters (DTensors, after a meta-device
    # build) in place. A convolution's norm spans the kernel dim, which FSDP2 shards: the value is a pending
    # reduction that an in-place copy will not redistribute, so it is brought to weight_g's placement first.
    with torch.no_grad():
        nn.init.normal_(weight_v, mean=0.0, std=std)
        norm = norm_except_dim(weight_v, dim)
        if hasattr(norm, "redistribute"):
            norm = norm.redistribute(weight_g.device_mesh, weight_g.placements)
        weight_g.copy_(norm)
        bias.zero_()


class WeightNormLinear(nn.Module):
    """y = x W^T + b, W = weight_g * weight_v / ||weight_v|| (row norms); upstream's weight-normed `Linear`.
    `dropout` is the dropout applied to this layer's input, which scales the initial weights."""

    def __init__(self, in_features: int, out_features: int, dropout: float = 0.0):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.init_dropout = dropout
        self.weight_g = nn.Parameter(torch.empty(out_features, 1))
        self.weight_v = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = math.sqrt((1.0 - self.init_dropout) / self.in_features)
        _init_weight_norm_(self.weight_g, self.weight_v, self.bias, std, dim=0)

    @property
    def weight(self) -> torch.Tensor:
        return weight_normalized(self.weight_g, self.weight_v, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class GatedCausalConv(nn.Module):
    """[B, T, in_channels] -> [B, T, out_channels]: dropout, a causal weight-normed convolution to
    2 * out_channels, GLU (the first half times the sigmoid of the second, as `F.glu`)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dropout: float = 0.0):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.dropout = dropout
        self.weight_g = nn.Parameter(torch.empty(1, 1, 2 * out_channels))
        self.weight_v = nn.Parameter(torch.empty(kernel_size, in_channels, 2 * out_channels))
        self.bias = nn.Parameter(torch.empty(2 * out_channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = math.sqrt(4.0 * (1.0 - self.dropout) / (self.kernel_size * self.in_channels))
        _init_weight_norm_(self.weight_g, self.weight_v, self.bias, std, dim=2)

    @property
    def weight(self) -> torch.Tensor:
        """The normalized weight in ConvTBC's layout [kernel, in, 2 * out]; tap k meets input t - (kernel - 1) + k."""
        return weight_normalized(self.weight_g, self.weight_v, dim=2)

    def forward(self, x: torch.Tensor, history: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`history` [B, kernel - 1, in]: the inputs before x (incremental decoding); zeros when None."""
        x = F.dropout(x, self.dropout, self.training)
        if history is not None:
            x = torch.cat([history.to(x.dtype), x], dim=1)
        elif self.kernel_size > 1:
            x = F.pad(x, (0, 0, self.kernel_size - 1, 0))
        # conv1d is a cross-correlation over [B, C, T] with weight [out, in, kernel]: tap k of ConvTBC's weight
        # meets input t + k of the left-padded sequence, as in torch.conv_tbc.
        y = F.conv1d(x.transpose(1, 2), self.weight.permute(2, 1, 0), self.bias)
        return F.glu(y.transpose(1, 2), dim=-1)

    def next_history(self, x: torch.Tensor, history: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The kernel - 1 inputs that precede whatever comes after `x` (None for a kernel of 1)."""
        if self.kernel_size == 1:
            return None
        if history is None:
            history = x.new_zeros(x.size(0), self.kernel_size - 1, x.size(2))
        return torch.cat([history.to(x.dtype), x], dim=1)[:, -(self.kernel_size - 1) :]

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, dropout={self.dropout}"
