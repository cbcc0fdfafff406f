"""DistributedDataParallel for --ddp-backend pytorch_ddp (and upstream's other replicated spellings)."""

import inspect
import logging

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

# Upstream's LegacyDistributedDataParallel (no_c10d / legacy_ddp) all-reduced once after backward. Its
# results are those of DistributedDataParallel, which overlaps the all-reduce with backward instead.
LEGACY_BACKENDS = ("no_c10d", "legacy_ddp")
REPLICATED_BACKENDS = ("pytorch_ddp", "c10d") + LEGACY_BACKENDS

# --broadcast-buffers is upstream's name for copying buffers from rank 0 before each forward. torch 2.13
# calls that DDP argument `forward_sync_buffers` and deprecates `broadcast_buffers`, the only name torch
# 2.11 and 2.12 know.
SYNC_BUFFERS_ARGUMENT = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


def apply_ddp(model: nn.Module, cfg, device: torch.device) -> DistributedDataParallel:
    """Wrap `model` (already on `device`) in DistributedDataParallel over the default process group."""
    dt = cfg.distributed_training
    if dt.ddp_backend not in REPLICATED_BACKENDS:
        raise ValueError(f"apply_ddp does not handle --ddp-backend {dt.ddp_backend}")
    if dt.ddp_backend in LEGACY_BACKENDS:
        logger.warning(
            "--ddp-backend %s: upstream's legacy implementation is not reproduced; using "
            "DistributedDataParallel, which computes the same gradients",
            dt.ddp_backend,
        )
    device_ids = None
    if device.type == "cuda":
        device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        bucket_cap_mb=dt.bucket_cap_mb,
        find_unused_parameters=dt.find_unused_parameters,
        # Buffers are also synchronized once at construction; this model's buffers are identical on every
        # rank, so that changes nothing.
        **{SYNC_BUFFERS_ARGUMENT: dt.broadcast_buffers},
    )
