"""Upstream's `SamePad`: drops the trailing time steps a padded 1-D convolution adds ([B, C, T] input), so the
output keeps the input's length (`causal`: all kernel_size - 1 of them)."""

import torch.nn as nn


class SamePad(nn.Module):
    def __init__(self, kernel_size: int, causal: bool = False):
        super().__init__()
        self.remove = kernel_size - 1 if causal else (1 if kernel_size % 2 == 0 else 0)

    def forward(self, x):
        return x[:, :, : -self.remove] if self.remove > 0 else x
