"""Turn a freshly built model into the one that trains, in a fixed order:

0. float8 Linear layers (--fp8, see fairseq/distributed/float8.py), then tensor parallelism over the mesh's
   tp dimension (--model-parallel-size, see tensor_parallel.py and mesh.py; torchao's float8 styles split
   the Float8Linear modules, so the conversion comes first, as in torchtitan),
1. activation checkpointing per decoder layer (--checkpoint-activations, --offload-activations),
2. torch.compile per decoder layer (--compile),
3. under tensor parallelism, a per-TP-rank dropout stream around each decoder layer (tensor_parallel_rng.py),
4. the data-parallel engine: FSDP2 (--ddp-backend fully_sharded, see fsdp.py) over the mesh's data-parallel
   dimensions (HSDP with --fsdp-shard-group-size), or DistributedDataParallel (pytorch_ddp / c10d, see
   ddp.py; with tensor parallelism FSDP2 keeps unsharded replicas instead, DDP taking no DTensors); a single
   process without fully_sharded keeps the model as it is.

Also here: which models are built on the meta device (`build_model`) and materializing them, and the gradient
operations whose meaning depends on the engine (global norm clipping over sharded gradients, the cross-rank
finiteness check for fp16 loss scaling, skipping the gradient all-reduce between micro-batches).

Model files hold no distributed code; everything here is a function of (model, cfg); what tensor parallelism
splits is the model's own plan (`model.tensor_parallel_plan()`).
"""

import contextlib
import logging
from typing import Callable, Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh  # imported by torch itself: free
from torch.nn.parallel import DistributedDataParallel

from fairseq.distributed.ddp import apply_ddp
from fairseq.runtime.dtensor import is_dtensor
from fairseq.distributed.fsdp import apply_fsdp, apply_fsdp_replicas, transformer_layers
from fairseq.distributed.mesh import ParallelLayout, forget_parallel_mesh, has_tp_dim, init_parallel_mesh
from fairseq.distributed.tensor_parallel_rng import apply_dropout_streams
from fairseq.modules.checkpoint_activations import checkpointed, checkpointed_offloaded
from fairseq.distributed.float8 import apply_float8
from fairseq.distributed.tensor_parallel_checks import uses_loss_parallel

# torch.distributed.tensor (behind tensor_parallel) costs ~1 s to import: it is imported only when a model is
# split (--model-parallel-size > 1), and DTensors are recognized through fairseq.runtime.dtensor.

logger = logging.getLogger(__name__)

__all__ = [
    "apply_activation_checkpointing",
    "apply_compile",
    "build_model",
    "clip_coefficient",
    "clip_grad_norm_",
    "gradient_sync",
    "local_grads_by_device",
    "materialize",
    "parallelize_model",
    "scale_grads_",
    "total_grad_norm",
    "unwrap_model",
]


def parallelize_model(model: nn.Module, cfg, device: torch.device, world_mesh: Optional[DeviceMesh] = None):
    """Apply checkpointing, compilation and the data-parallel engine to `model`; returns the model to train
    (the same object, or a DistributedDataParallel around it).

    A model built on the meta device is materialized here (see `materialize`): after sharding under
    fully_sharded, so that no rank ever holds all full parameters, and before wrapping otherwise.
    The device mesh is the one of the flags' layout (fairseq.distributed.mesh, built once); `world_mesh`
    replaces its data-parallel part for FSDP2 (tests). The flags are taken as validated (validate(cfg), once
    per job, before any process is spawned).
    """
    dt = cfg.distributed_training
    fully_sharded = dt.ddp_backend == "fully_sharded"
    on_meta = any(t.is_meta for t in _params_and_buffers(model))
    if on_meta and not fully_sharded:
        materialize(model, device)

    layout = ParallelLayout.from_config(dt, dist.get_world_size() if dist.is_initialized() else 1)
    split = has_tp_dim(layout)
    mesh = init_parallel_mesh(layout, device.type) if fully_sharded or split else forget_parallel_mesh()
    if split and not on_meta:
        model.to(device)
    _convert_and_split(model, cfg, mesh if split else None)
    _wrap_layers(model, cfg, mesh if split else None)
    if fully_sharded:
        apply_fsdp(model, cfg, world_mesh if world_mesh is not None else mesh.fsdp_mesh)
        if on_meta:
            materialize(model, device, params_on_cpu=dt.cpu_offload)
        return model
    if split:
        _replicate_split_model(model, dt.ddp_backend, layout, mesh)
        return model
    if not on_meta:
        model.to(device)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size == 1:
        return model
    return apply_ddp(model, cfg, device)


def _convert_and_split(model: nn.Module, cfg, mesh) -> None:
    """Step 0: float8 Linears (--fp8), then tensor parallelism over `mesh`'s tp dimension (None: not split)."""
    if cfg.common.fp8:  # torchao's order: swap the Linears before splitting, compile and sharding
        apply_float8(model, cfg)
    if mesh is not None:
        # torch.distributed.tensor: ~1 s
        from fairseq.distributed.tensor_parallel import apply_tensor_parallel  # deferred: startup

        apply_tensor_parallel(model, mesh.tp_mesh, loss_parallel=uses_loss_parallel(cfg))


def _wrap_layers(model: nn.Module, cfg, mesh) -> None:
    """Steps 1-3 around each decoder layer: activation checkpointing, torch.compile and, when split over
    `mesh`'s tp dimension (None: not split), the per-TP-rank dropout streams."""
    model_cfg = cfg.model  # a plug-in model's config may have neither checkpointing option
    offload = bool(getattr(model_cfg, "offload_activations", False))
    if offload or getattr(model_cfg, "checkpoint_activations", False):
        apply_activation_checkpointing(model, offload_to_cpu=offload)
    if cfg.distributed_training.compile:
        # Tensor-parallel layers under autocast fail to compile with a symbolic sequence length (torch 2.13:
        # "mul expected 2 arguments, got 3" in inductor); each new length is compiled as a static shape instead.
        apply_compile(model, dynamic=False if mesh is not None else None)
    if mesh is not None:  # around the outermost layer modules: after checkpointing
        apply_dropout_streams(model, mesh.tp_mesh)


def _replicate_split_model(model: nn.Module, ddp_backend: str, layout: ParallelLayout, mesh) -> None:
    """A tensor-parallel model under a replicated --ddp-backend: FSDP2 replicas without sharding over the
    data-parallel ranks, or with none, the partial gradients reduced over the tp ranks."""
    if layout.dp > 1:
        logger.info(
            f"--ddp-backend {ddp_backend} with --model-parallel-size {layout.tp}: {layout.dp} "
            "data-parallel replicas kept by FSDP2 without sharding (all-reduced gradients, as DDP)"
        )
        apply_fsdp_replicas(model, mesh.fsdp_mesh)
    else:
        from fairseq.distributed.tensor_parallel import reduce_partial_gradients  # deferred: startup

        reduce_partial_gradients(model)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model itself, without a DistributedDataParallel wrapper (FSDP2 shards in place: no wrapper)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


# -------------------------------------------------------------------------------- meta-device models


# Under fully_sharded, models at least this large are built on the meta device and each rank initializes only
# its shards after sharding (fast, and no rank ever holds the whole model). Smaller ones are built whole on
# the CPU first, so that their initial weights are identical to a single-process run with the same seed.
META_INIT_MIN_PARAMS = 1_000_000_000


def build_model(cfg, task) -> nn.Module:
    """`task.build_model(cfg.model)` as `parallelize_model` takes it: on the meta device when that policy says
    (the training config `cfg` decides), else on the CPU."""
    if cfg.distributed_training.ddp_backend == "fully_sharded":
        with torch.device("meta"):
            model = task.build_model(cfg.model)
        if sum(p.numel() for p in model.parameters()) >= META_INIT_MIN_PARAMS:
            return model
    return task.build_model(cfg.model)


def _params_and_buffers(model: nn.Module):
    yield from model.parameters()
    yield from model.buffers()


def materialize(model: nn.Module, device: torch.device, params_on_cpu: bool = False) -> nn.Module:
    """Allocate a model built on the meta device and initialize it with `model.reset_parameters()`.

    Works before or after sharding (after fully_shard, each rank allocates and initializes only its
    shards, so values differ from an unsharded initialization with the same seed). With
    `params_on_cpu` (FSDP2 CPU offload) the parameters are allocated on the CPU and buffers on `device`.
    A model with nothing on meta is returned untouched.
    """
    if not any(t.is_meta for t in _params_and_buffers(model)):
        return model
    if not callable(getattr(model, "reset_parameters", None)):
        raise TypeError(f"{type(model).__name__} was built on the meta device but has no reset_parameters()")
    model.to_empty(device=torch.device("cpu") if params_on_cpu else device)
    if params_on_cpu:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(device)
    with torch.no_grad():
        model.reset_parameters()
    return model


# ----------------------------------------------------------------------- activation checkpointing


def apply_activation_checkpointing(model: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Recompute each decoder layer's activations in backward instead of keeping them.

    Each layer is replaced by a CheckpointWrapper around it (state-dict keys are unchanged: the wrapper
    strips its prefix, and torch.distributed.checkpoint understands it). With `offload_to_cpu`
    (--offload-activations, which implies checkpointing as upstream) the layer inputs that checkpointing
    keeps are also held in pinned CPU memory between forward and backward.
    """
    layers = transformer_layers(model)
    checkpoint_fn = checkpointed_offloaded if offload_to_cpu else checkpointed
    for index, layer in enumerate(layers):
        if isinstance(layer, CheckpointWrapper):
            raise ValueError(f"decoder layer {index} is already checkpointed")
        layers[index] = checkpoint_wrapper(layer, checkpoint_fn=checkpoint_fn)
    return model


# ----------------------------------------------------------------------------------------- compile


def apply_compile(model: nn.Module, backend: str = "inductor", dynamic: Optional[bool] = None) -> nn.Module:
    """torch.compile each decoder layer's forward, in place (parameter names do not change).

    The layer's own `forward` is compiled, inside any checkpoint wrapper, so that FSDP2's and the
    checkpoint's hooks stay outside the compiled code and recomputation runs the compiled forward.
    `dynamic`: torch.compile's (None: static shapes first, a symbolic shape once a dim is seen to change).
    """
    for layer in transformer_layers(model):
        inner = layer._checkpoint_wrapped_module if isinstance(layer, CheckpointWrapper) else layer
        inner.forward = torch.compile(inner.forward, backend=backend, dynamic=dynamic)
    return model


# ----------------------------------------------------------------------------------------- gradients


def _grads(params: Union[torch.Tensor, Iterable[torch.Tensor]]) -> List[torch.Tensor]:
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    return [p.grad for p in params if p.grad is not None]


def local_grads_by_device(params) -> Dict[torch.device, List[torch.Tensor]]:
    """The gradients of `params` as the local tensors each rank holds (a DTensor's shard), by device."""
    by_device = {}
    for grad in _grads(params):
        local = grad.to_local() if is_dtensor(grad) else grad
        by_device.setdefault(local.device, []).append(local)
    return by_device


def _collective_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _local_groups(grads: List[torch.Tensor]):
    """Split gradients by how their local pieces combine into the global vector.

    Returns [(mesh or None, sharded mesh dims, local tensors)]: plain tensors (DDP, one process) are whole
    on every rank; a DTensor's local pieces are disjoint along its Shard mesh dims and equal along its
    Replicate ones.
    """
    groups = {}
    for grad in grads:
        if is_dtensor(grad):
            if any(p.is_partial() for p in grad.placements):
                raise ValueError("gradient norm of a Partial DTensor: reduce the gradient first")
            # Every placement but Replicate splits the tensor: Shard, and _StridedShard (FSDP2 over a
            # tensor-parallel dim, whose is_shard() is False)
            dims = tuple(i for i, p in enumerate(grad.placements) if not p.is_replicate())
            key = (id(grad.device_mesh), dims)
            groups.setdefault(key, (grad.device_mesh, dims, []))[2].append(grad.to_local())
        else:
            groups.setdefault(None, (None, (), []))[2].append(grad)
    return list(groups.values())


def _reduce_over_shards(value: torch.Tensor, mesh: Optional[DeviceMesh], dims, op) -> torch.Tensor:
    if mesh is None or not dims:
        return value
    value = value.to(_collective_device(mesh))
    for dim in dims:
        if mesh.size(dim) > 1:  # a group of one rank: the collective would change nothing, at a launch's cost
            dist.all_reduce(value, op=op, group=mesh.get_group(dim))
    return value


@torch.no_grad()
def clip_grad_norm_(
    params,
    max_norm: float,
    foreach: Optional[bool] = None,
    aggregate_norm_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """Clip gradients to a global L2 norm of `max_norm` and return the norm before clipping (`aggregate_norm_fn`,
    upstream's, maps the norm before the clip coefficient is computed).

    Correct for FSDP2's sharded gradients (DTensors: local sums of squares are all-reduced over the mesh
    dims they are sharded on) and for plain ones. Everything stays in tensors (the clip coefficient is
    applied through clamp, not a Python branch), so nothing waits for the device. max_norm <= 0 only
    computes the norm. A non-finite norm scales the gradients to non-finite values, as torch does.
    """
    total_norm = total_grad_norm(params, foreach)
    if aggregate_norm_fn is not None:
        total_norm = aggregate_norm_fn(total_norm)
    if max_norm > 0:
        scale_grads_(params, clip_coefficient(total_norm, max_norm), foreach)
    return total_norm


@torch.no_grad()
def total_grad_norm(params, foreach: Optional[bool] = None) -> torch.Tensor:
    """Global L2 norm (fp32, 0-d) of the gradients of `params`, sharded (DTensor) or not; no host sync."""
    grads = _grads(params)
    if not grads:
        return torch.zeros(())
    total_squared = None
    for mesh, dims, local in _local_groups(grads):
        norm = torch.nn.utils.get_total_norm(local, 2.0, foreach=foreach).float()
        squared = _reduce_over_shards(norm * norm, mesh, dims, dist.ReduceOp.SUM)
        total_squared = squared if total_squared is None else total_squared + squared.to(total_squared.device)
    return total_squared.sqrt()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that brings gradients of norm `total_norm` to at most `max_norm` (torch's formula)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


@torch.no_grad()
def scale_grads_(params, factor: torch.Tensor, foreach: Optional[bool] = None) -> None:
    """Multiply every gradient of `params` by the device scalar `factor`, in place."""
    for device, tensors in local_grads_by_device(params).items():
        # Gradients offloaded to the CPU (--cpu-offload) need the factor's value on the host: that copy
        # must complete before the CPU multiplies (a non-blocking device-to-host copy would race).
        device_factor = factor.to(device, non_blocking=device.type != "cpu")
        if foreach is False:
            for tensor in tensors:
                tensor.mul_(device_factor.to(tensor.dtype))
        else:
            torch._foreach_mul_(tensors, device_factor)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro-batch's forward and backward: with enabled=False (every micro-batch but the
    last of an update) DistributedDataParallel skips its all-reduce and accumulates locally.

    Under FSDP2 gradients are reduce-scattered after every micro-batch, as upstream fairseq does with
    fully_sharded: skipping it would keep full unsharded gradients for every layer until the last one,
    which defeats sharding for the models FSDP is used for.
    """
    if not enabled and isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield
