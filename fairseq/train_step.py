"""One optimizer update: forward and backward over the micro-batches, clip, step.

No host synchronization happens here except the fp16 overflow check (the update must know whether to be
skipped). Statistics are added to a `LoggingOutputSums` as device tensors and read at log intervals.
"""

from typing import List, Optional

import logging

import torch
import torch.distributed as dist

from fairseq.distributed.parallelize import clip_grad_norm_, gradient_sync
from fairseq.distributed.utils import get_data_parallel_group
from fairseq.precision import Precision
from fairseq.logging.logging_outputs import LoggingOutputSums

logger = logging.getLogger(__name__)


def _global_sample_size(samples, sentence_avg: bool, device) -> torch.Tensor:
    """Sum of the normalizer over micro-batches and ranks, as a device tensor (no host sync)."""
    local = sum(_sample_size(s, sentence_avg) for s in samples)
    # A fill kernel with the value as its argument: neither a host-to-device copy (torch.tensor(..., device=)
    # waits for the GPU) nor a pinned staging tensor (cudaHostAlloc each update, measured at ~5 ms of host time
    # per update on an H200: docs/benchmarks_h200.md).
    total = torch.full((), float(local), device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, group=get_data_parallel_group())  # a tensor-parallel group shares one batch
    return total


def _sample_size(sample, sentence_avg: bool) -> int:
    if sample.get("is_dummy", False):
        return 0
    return sample["nsentences"] if sentence_avg else sample["ntokens"]


def run_update(model, criterion, optimizer, precision: Precision, samples: List[dict], stats: LoggingOutputSums,
               clip_norm: float, sentence_avg: bool, device: torch.device,
               data_parallel_size: int) -> Optional[torch.Tensor]:
    """Run one update over `samples` (the micro-batches of --update-freq); returns the gradient norm
    tensor, or None when an fp16 overflow skipped the update."""
    model.train()
    criterion.train()
    # Gradients become d(sum of losses / global sample size); DDP and FSDP average over ranks, hence
    # the factor data_parallel_size.
    normalizer = data_parallel_size / _global_sample_size(samples, sentence_avg, device).clamp(min=1.0)
    loss_scale = precision.loss_scale
    outputs = []
    for i, sample in enumerate(samples):
        is_dummy = sample.get("is_dummy", False)
        with gradient_sync(model, i == len(samples) - 1), precision.autocast():
            loss, sample_size, logging_output = criterion(model, sample)
        if is_dummy:  # keeps collectives in step on ranks with fewer batches; contributes nothing
            loss = loss * 0.0
        (loss * (normalizer * loss_scale)).backward()
        if is_dummy:  # zeros keep every rank's keys identical for the interval all-reduce
            logging_output = {k: v * 0 for k, v in logging_output.items()}
        outputs.append(logging_output)

    params = [p for p in model.parameters() if p.grad is not None]
    if loss_scale != 1.0:
        torch._foreach_mul_([p.grad for p in params], 1.0 / loss_scale)
    grad_norm = clip_grad_norm_(params, clip_norm)

    if precision.scaler is not None:
        overflow = not bool(torch.isfinite(grad_norm))  # the one host sync of an fp16 update
        if precision.scaler.update(overflow):
            logger.info("gradient overflow detected, ignoring gradient, setting loss scale to: "
                        f"{precision.scaler.loss_scale:g}")
            optimizer.zero_grad(set_to_none=True)
            stats.add({"overflows": 1})  # the skipped update's losses and tokens are not counted (upstream)
            return None
    for logging_output in outputs:
        stats.add(logging_output)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    update_stats = {"gnorm": grad_norm.detach(), "updates": 1}
    if clip_norm > 0:
        update_stats["clip"] = (grad_norm > clip_norm).float()
    stats.add(update_stats)
    return grad_norm


@torch.no_grad()
def run_valid_step(model, criterion, precision: Precision, sample: dict, stats: LoggingOutputSums):
    """Dummy batches still run forward: under FSDP every rank must join the same all-gathers."""
    model.eval()
    criterion.eval()
    with precision.autocast():
        _, _, logging_output = criterion(model, sample)
    weight = 0 if sample.get("is_dummy", False) else 1
    stats.add({**{k: v * weight for k, v in logging_output.items()}, "batches": weight})
