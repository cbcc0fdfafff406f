"""Upstream's `Fp32GroupNorm`: group norm computed in float32, returned in the input's dtype."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Fp32GroupNorm(nn.GroupNorm):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return F.group_norm(input.float(), self.num_groups, weight, bias, self.eps).type_as(input)
