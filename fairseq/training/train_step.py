"""One optimizer update: forward and backward over the micro-batches, clip, step.

No host synchronization happens here except the fp16 overflow check (the update must know whether to be
skipped). Statistics are added to a `LoggingOutputSums` as device tensors and read at log intervals.
"""

from typing import List, Optional, Tuple

import logging

import torch
import torch.distributed as dist

from fairseq.distributed.parallelize import (
    clip_coefficient,
    gradient_sync,
    local_grads_by_device,
    scale_grads_,
    total_grad_norm,
)
from fairseq.distributed.utils import get_data_parallel_group
from fairseq.training.precision import Precision
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


def run_update(
    model,
    criterion,
    optimizer,
    precision: Precision,
    samples: List[dict],
    stats: LoggingOutputSums,
    clip_norm: float,
    sentence_avg: bool,
    device: torch.device,
    data_parallel_size: int,
) -> Optional[torch.Tensor]:
    """Run one update over `samples` (the micro-batches of --update-freq); returns the gradient norm
    tensor, or None when an fp16 overflow skipped the update."""
    model.train()
    criterion.train()
    # Gradients become d(sum of losses / global sample size); DDP and FSDP average over ranks, hence
    # the factor data_parallel_size.
    normalizer = data_parallel_size / _global_sample_size(samples, sentence_avg, device).clamp(min=1.0)
    loss_scale = precision.loss_scale
    outputs = _forward_backward(model, criterion, precision, samples, normalizer * loss_scale)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm, grad_factor = _norm_and_factor(params, loss_scale, clip_norm)
    if precision.scaler is not None:
        overflow = not bool(torch.isfinite(grad_norm))  # the one host sync of an fp16 update
        if precision.scaler.update(overflow):
            logger.info(
                f"gradient overflow detected, ignoring gradient, setting loss scale to: {precision.scaler.loss_scale:g}"
            )
            optimizer.zero_grad(set_to_none=True)
            stats.add({"overflows": 1})  # the skipped update's losses and tokens are not counted (upstream)
            return None
    for logging_output in outputs:
        stats.add(logging_output)
    step_with_grad_factor(optimizer, params, grad_factor)
    optimizer.zero_grad(set_to_none=True)
    update_stats = {"gnorm": grad_norm.detach(), "updates": 1}
    if clip_norm > 0:
        update_stats["clip"] = (grad_norm > clip_norm).float()
    stats.add(update_stats)
    return grad_norm


def _forward_backward(model, criterion, precision: Precision, samples: List[dict], scale) -> List[dict]:
    """Forward and backward of each micro-batch, its loss multiplied by `scale` (the normalizer times the loss
    scale); the gradient all-reduce runs after the last one only. Returns the micro-batches' logging outputs."""
    outputs = []
    for i, sample in enumerate(samples):
        is_dummy = sample.get("is_dummy", False)
        with gradient_sync(model, i == len(samples) - 1), precision.autocast():
            loss, sample_size, logging_output = criterion(model, sample)
        if is_dummy:  # keeps collectives in step on ranks with fewer batches; contributes nothing
            loss = loss * 0.0
        (loss * scale).backward()
        if is_dummy:  # zeros keep every rank's keys identical for the interval all-reduce
            logging_output = {k: v * 0 for k, v in logging_output.items()}
        outputs.append(logging_output)
    return outputs


def _norm_and_factor(params, loss_scale: float, clip_norm: float) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The unscaled gradients' norm, and the one factor (unscaling and clipping; None: 1) the step applies.

    Unscaling (fp16) and clipping become one factor, applied by the optimizer step as it reads the
    gradients (see step_with_grad_factor). The norm of the scaled gradients over the scale is the norm of
    the unscaled ones: exactly for power-of-two scales (the default), to an fp32 rounding otherwise."""
    grad_norm = total_grad_norm(params)
    grad_factor = None
    if loss_scale != 1.0:
        grad_norm = grad_norm / loss_scale
        grad_factor = torch.full_like(grad_norm, 1.0 / loss_scale)
    if clip_norm > 0:
        coefficient = clip_coefficient(grad_norm, clip_norm)
        grad_factor = coefficient if grad_factor is None else coefficient * grad_factor
    return grad_norm, grad_factor


def step_with_grad_factor(optimizer, params, grad_factor: Optional[torch.Tensor]) -> None:
    """optimizer.step() on the gradients multiplied by the device scalar `grad_factor` (None: by 1).

    torch's fused optimizers (fused AdamW, what --optimizer adam builds) divide each gradient by
    `optimizer.grad_scale` inside their one kernel, the attribute torch.amp.GradScaler sets for them. The
    kernel then writes the scaled gradients back, so against multiplying first this saves one read of every
    gradient per update (2.4 ms for 2.65B fp32 parameters on one H200: docs/benchmarks_h200.md). Other
    optimizers, and gradients on several devices (the factor's value would have to reach each), get the
    gradients multiplied first.
    """
    if grad_factor is None:
        optimizer.step()
        return
    devices = set(local_grads_by_device(params))
    if getattr(optimizer, "_step_supports_amp_scaling", False) and len(devices) == 1:
        # fp32, as the kernels read it; a copy to the CPU (--cpu-offload) must be blocking: the CPU kernel
        # reads the value at once (torch's own copy would be non-blocking)
        optimizer.grad_scale = (1.0 / grad_factor.float()).to(devices.pop())
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
        return
    scale_grads_(params, grad_factor)
    optimizer.step()


@torch.no_grad()
def run_valid_step(model, criterion, precision: Precision, sample: dict, stats: LoggingOutputSums):
    """Dummy batches still run forward: under FSDP every rank must join the same all-gathers."""
    model.eval()
    criterion.eval()
    with precision.autocast():
        _, _, logging_output = criterion(model, sample)
    weight = 0 if sample.get("is_dummy", False) else 1
    stats.add({**{k: v * weight for k, v in logging_output.items()}, "batches": weight})
