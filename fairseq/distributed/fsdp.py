"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the decoder: one unit per transformer layer plus the
root, mixed precision with fp32 gradient reduction, CPU offload, and this fork's two scheduling flags,
--fsdp-forward-prefetch (the plan: fairseq.distributed.fsdp_prefetch) and --fsdp-sync-free (its hooks:
fairseq.distributed.sync_free). See docs/fsdp.md for what the flags are for.
"""

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh  # imported by torch itself: free

from fairseq.distributed.fsdp_prefetch import (
    PrefetchPlan,
    apply_prefetch_plan,
    prefetch_plan,
    IMPLICIT_BACKWARD_PREFETCH,
)
from fairseq.distributed.sync_free import ReshardEventLimiter, SyncFreeHooks
from fairseq.models.fairseq_model import BaseFairseqModel

# torch.distributed.fsdp pulls in torch.distributed.tensor (~1 s to import); this module is also imported for
# check_fsdp_flags and transformer_layers on every run, so FSDP2 itself is imported where a model is sharded.
if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

logger = logging.getLogger(__name__)

FSDP_ONLY_FLAGS = (
    ("fsdp_forward_prefetch", "--fsdp-forward-prefetch"),
    ("fsdp_sync_free", "--fsdp-sync-free"),
    ("cpu_offload", "--cpu-offload"),
)


def check_fsdp_flags(
    ddp_backend: str,
    fsdp_forward_prefetch: bool = False,
    fsdp_sync_free: bool = False,
    cpu_offload: bool = False,
    fsdp_prefetch_depth: int = 1,
) -> None:
    """Reject FSDP-only flags under another --ddp-backend, and a prefetch depth below one."""
    if ddp_backend != "fully_sharded":
        values = {
            "fsdp_forward_prefetch": fsdp_forward_prefetch,
            "fsdp_sync_free": fsdp_sync_free,
            "cpu_offload": cpu_offload,
        }
        for field_name, flag in FSDP_ONLY_FLAGS:
            if values[field_name]:
                raise ValueError(f"{flag} needs --ddp-backend fully_sharded (got --ddp-backend {ddp_backend})")
    if fsdp_prefetch_depth < 1:
        raise ValueError(f"--fsdp-prefetch-depth must be at least 1 (got {fsdp_prefetch_depth})")


@dataclass(frozen=True)
class FSDPSettings:
    """The FSDP flags, read once from the config: what `apply_fsdp` does, and what the memory planner
    (fairseq.planning) models, from the same rules."""

    reshard_after_forward: bool = True  # False: --no-reshard-after-forward
    forward_prefetch: bool = False  # --fsdp-forward-prefetch
    prefetch_depth: int = 1  # --fsdp-prefetch-depth (only with --fsdp-forward-prefetch)
    sync_free: bool = False  # --fsdp-sync-free
    cpu_offload: bool = False  # --cpu-offload

    @classmethod
    def from_flags(cls, flags) -> "FSDPSettings":
        """From the distributed_training group (or any object with its field names, as the planner's flags)."""
        return cls(
            reshard_after_forward=not flags.no_reshard_after_forward,
            forward_prefetch=flags.fsdp_forward_prefetch,
            prefetch_depth=flags.fsdp_prefetch_depth,
            sync_free=flags.fsdp_sync_free,
            cpu_offload=flags.cpu_offload,
        )

    @property
    def forward_prefetch_layers(self) -> int:
        """Layers a unit all-gathers ahead of itself in forward (FSDP2 prefetches none unless asked)."""
        return self.prefetch_depth if self.forward_prefetch else 0

    @property
    def backward_prefetch_layers(self) -> int:
        """Layers a unit all-gathers ahead of itself in backward (FSDP2's implicit one unless asked)."""
        return self.prefetch_depth if self.forward_prefetch else IMPLICIT_BACKWARD_PREFETCH

    @property
    def max_in_flight(self) -> int:
        """Layers whose full parameters --fsdp-sync-free lets be gathered at once: prefetching d layers ahead
        needs d + 1; the bound cannot be tighter."""
        return max(2, self.prefetch_depth + 1) if self.forward_prefetch else 2

    def prefetch_plan(self, num_layers: int) -> "PrefetchPlan":
        return prefetch_plan(num_layers, self.prefetch_depth, explicit=self.forward_prefetch)


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks that become one FSDP unit (and one checkpoint/compile region) each: the model
    contract's `transformer_layers()` (fairseq.models.fairseq_model)."""
    layers = model.transformer_layers() if isinstance(model, BaseFairseqModel) else None
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} does not follow the model contract: parallelization needs a "
            "BaseFairseqModel whose transformer_layers() returns the nn.ModuleList of its blocks"
        )
    return layers


def mixed_precision_policy(common_cfg) -> "MixedPrecisionPolicy":
    """bf16/fp16 parameters in forward and backward; gradients always reduced (and kept) in fp32.

    --fp32-reduce-scatter is therefore always in effect; the flag is accepted for upstream recipes.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy  # deferred: startup

    if common_cfg.fp16 or common_cfg.memory_efficient_fp16:
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if common_cfg.bf16 or common_cfg.memory_efficient_bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, cfg, mesh: DeviceMesh, limiter: Optional[ReshardEventLimiter] = None) -> nn.Module:
    """Shard `model` in place with FSDP2: every decoder layer, then the root (embeddings, final norm,
    output projection and anything else left). Returns the model.

    The root keeps its full parameters from forward to backward (reshard_after_forward=False, FSDP2's own
    default for a root): backward starts with the output projection, so freeing it after forward would
    only make backward gather it again at once. --no-reshard-after-forward applies that to every layer.

    `limiter` (only with --fsdp-sync-free) defaults to CUDA events on a CUDA mesh and to no waiting on CPU.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard  # deferred: startup

    settings = FSDPSettings.from_flags(cfg.distributed_training)
    layers = transformer_layers(model)
    mp_policy = mixed_precision_policy(cfg.common)
    offload_policy = (
        CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if settings.cpu_offload else OffloadPolicy()
    )
    for layer in layers:
        fully_shard(
            layer,
            mesh=mesh,
            reshard_after_forward=settings.reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload_policy)

    plan = settings.prefetch_plan(len(layers))
    if settings.forward_prefetch:
        apply_prefetch_plan(model, layers, plan)
    if settings.sync_free:
        if limiter is None:
            limiter = sync_free_limiter(settings, len(layers), torch.device(mesh.device_type))
        if limiter.max_in_flight > 2:
            logger.info(
                "--fsdp-sync-free with --fsdp-prefetch-depth %d: up to %d layers' full parameters at once",
                settings.prefetch_depth,
                limiter.max_in_flight,
            )
        model._fsdp_sync_free_hooks = SyncFreeHooks(limiter, plan, settings.reshard_after_forward).install(
            model, layers
        )
    return model


def sync_free_limiter(settings: FSDPSettings, num_layers: int, device: torch.device) -> ReshardEventLimiter:
    """The limiter --fsdp-sync-free gives apply_fsdp for `num_layers` layers: CUDA events on a CUDA device, no
    waiting on the CPU."""
    max_in_flight = settings.max_in_flight
    # Without allocator pressure: wait about one update back (each layer gathered in forward and in backward),
    # which bounds the CPU's lead without draining the GPU's queue at every layer.
    return ReshardEventLimiter.for_device(device, max_in_flight, relaxed_in_flight=2 * num_layers + max_in_flight)


def apply_fsdp_replicas(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Data-parallel replicas of a tensor-parallel model under a replicated --ddp-backend (pytorch_ddp, c10d),
    where DistributedDataParallel cannot take DTensor parameters: FSDP2 on a (replicate, shard = 1) mesh,
    which shards nothing and all-reduces the gradients (averaged), as DDP does. Parameters stay in their
    dtype: mixed precision is the trainer's autocast, as under DDP."""
    from torch.distributed.fsdp import fully_shard  # deferred: startup

    if mesh.ndim != 2 or mesh.size(1) != 1:
        raise ValueError(f"replicas need a (replicate, shard = 1) mesh, got shape {tuple(mesh.shape)}")
    for layer in transformer_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model
