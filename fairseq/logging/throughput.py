"""Model FLOPs utilization: `tflops` (model FLOPs per GPU per second) and `mfu` (percent of peak).

FLOPs per token = 6 * N + 12 * L * d * T, the usual dense-transformer estimate (forward + backward):
N counts every matrix weight a token passes through (attention q/k/v/out, both feed-forward matrices, the
input/output dimension projections and the output projection onto the vocabulary, counted even when it is
tied to the embedding; embedding lookups and biases/norms are not matrix multiplies and are left out),
L the layers, d the model width and T the sequence length (the attention score and value products).
Activation recomputation (--checkpoint-activations) is not counted: this is *model* FLOPs, not hardware FLOPs.
"""

import logging
from typing import Dict, Optional

import torch
import torch.nn as nn


logger = logging.getLogger(__name__)

# Dense bf16/fp16 tensor-core peak, TFLOP/s per accelerator (vendor datasheets, without sparsity).
PEAK_TFLOPS_BY_NAME = (("H100", 989.0), ("H200", 989.0), ("H800", 989.0), ("A100", 312.0), ("A800", 312.0))


def default_peak_tflops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS_BY_NAME:
        if key in name:
            return value
    return None


def matrix_weight_count(model: nn.Module) -> int:
    """N above: weights of every nn.Linear, plus the output projection when it is a bare parameter."""
    count = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    decoder = getattr(model, "decoder", model)
    projection = getattr(decoder, "output_projection", None)
    if projection is not None and not isinstance(projection, nn.Linear) and isinstance(projection, nn.Parameter):
        count += projection.numel()
    return count


def flops_per_token(model: nn.Module, num_layers: int, width: int, seq_len: int) -> float:
    return 6.0 * matrix_weight_count(model) + 12.0 * num_layers * width * seq_len


class Throughput:
    """tflops and mfu of an interval, given the tokens processed by all ranks (logged by log_line)."""

    def __init__(self, model_flops_per_token: float, world_size: int, peak_tflops: Optional[float]):
        self.flops_per_token = model_flops_per_token
        self.world_size = world_size
        self.peak_tflops = peak_tflops

    def interval_values(self, ntokens_all_ranks: float, elapsed: float) -> Dict[str, float]:
        tflops = self.flops_per_token * ntokens_all_ranks / self.world_size / elapsed / 1e12
        values = {"tflops": tflops}
        if self.peak_tflops:
            values["mfu"] = 100.0 * tflops / self.peak_tflops
        return values
