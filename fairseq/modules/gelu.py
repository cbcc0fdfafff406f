"""Upstream's `gelu` (exact, computed in float32) and `gelu_accurate` (the tanh approximation, upstream's
"gelu_fast"); `--activation-fn` selects the same functions through fairseq.modules.activations."""

import torch
import torch.nn.functional as F


def gelu_accurate(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x.float()).type_as(x)
