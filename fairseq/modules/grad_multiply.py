"""Upstream's `GradMultiply`: identity forward, gradient multiplied by `scale` (e.g. to slow a sub-network)."""

import torch


class GradMultiply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None
