"""Upstream's `TransposeLast`: swap dim `tranpose_dim` (upstream's spelling) with the last one, after taking
element `deconstruct_idx` of a tuple input when given."""

import torch.nn as nn


class TransposeLast(nn.Module):
    def __init__(self, deconstruct_idx=None, tranpose_dim: int = -2):
        super().__init__()
        self.deconstruct_idx = deconstruct_idx
        self.tranpose_dim = tranpose_dim

    def forward(self, x):
        if self.deconstruct_idx is not None:
            x = x[self.deconstruct_idx]
        return x.transpose(self.tranpose_dim, -1)
