"""Upstream's `cross_entropy(logits, target, ignore_index, reduction)`: the log-softmax in float32, then the
negative log-likelihood."""

import torch
import torch.nn.functional as F


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    return F.nll_loss(lprobs, target, ignore_index=ignore_index, reduction=reduction)
