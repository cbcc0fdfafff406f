"""Upstream's `LayerNorm` (a factory: torch's LayerNorm, which is fused on CUDA already, so upstream's apex
FusedLayerNorm is not needed) and `Fp32LayerNorm` (normalizes in float32, returns the input's dtype)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def LayerNorm(normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, export: bool = False):
    """`export` (upstream's switch away from apex for ONNX/TorchScript) is accepted; torch's module is used
    either way."""
    return nn.LayerNorm(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)


class Fp32LayerNorm(nn.LayerNorm):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(input.float(), self.normalized_shape, weight, bias, self.eps).type_as(input)
