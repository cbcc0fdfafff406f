"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the decoder: one unit per transformer layer plus the
root, mixed precision with fp32 gradient reduction, CPU offload, and this fork's two scheduling flags,
--fsdp-forward-prefetch and --fsdp-sync-free. See docs/fsdp.md for what the flags are for.

Where FSDP2 (torch 2.13, torch/distributed/fsdp/_fully_shard/) gathers and frees full parameters, which is
what the hooks below are placed against:

- A unit's own all-gather is issued from its forward pre-hook (`FSDPState._pre_forward`, registered with
  prepend=True when `fully_shard` runs) and, in backward, from its pre-backward hook (`_pre_backward`, a
  tensor hook FSDP puts on the unit's outputs in its forward post-hook).
- Prefetches are issued from the same two hooks, right after the unit's own all-gather: explicit ones from
  `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`; without an explicit backward list,
  FSDP2 prefetches in backward the unit that finished forward just before this one (so the root prefetches
  the last layer). There is no forward prefetch unless asked for.
- With reshard_after_forward=True the full parameters are freed on the CPU, synchronously, inside the
  forward post-hook: `FSDPParamGroup.post_forward -> reshard -> FSDPParam.to_sharded ->
  free_unsharded_param`, which does `storage.resize_(0)`. In backward they are freed the same way by the
  post-backward autograd node FSDP inserts in front of the unit's inputs (`RegisterPostBackwardFunction`).

Hooks registered after `fully_shard` therefore see: a prepended forward pre-hook runs before FSDP issues
anything; an appended forward post-hook runs after FSDP has freed the parameters; an autograd node put
after FSDP's post-forward on a unit's output runs (in backward) before FSDP's pre-backward; one put on a
unit's input before FSDP's pre-forward runs (in backward) after FSDP's post-backward has freed them.
"""

import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh  # imported by torch itself: free

# torch.distributed.fsdp pulls in torch.distributed.tensor (~1 s to import); this module is also imported for
# check_fsdp_flags and transformer_layers on every run, so FSDP2 itself is imported where a model is sharded.
if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

logger = logging.getLogger(__name__)

CPU_SYNC_FREE_NOTICE = "--fsdp-sync-free: no CUDA streams on CPU; the wait has nothing to wait for"

FSDP_ONLY_FLAGS = (
    ("fsdp_forward_prefetch", "--fsdp-forward-prefetch"),
    ("fsdp_sync_free", "--fsdp-sync-free"),
    ("cpu_offload", "--cpu-offload"),
)


# FSDP2's own backward prefetch (no explicit list): the unit that finished forward just before this one.
IMPLICIT_BACKWARD_PREFETCH = 1


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
    from fairseq.models.fairseq_model import BaseFairseqModel

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
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if common_cfg.fp16 or common_cfg.memory_efficient_fp16:
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if common_cfg.bf16 or common_cfg.memory_efficient_bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


# ------------------------------------------------------------------------------------------ prefetch plan


@dataclass(frozen=True)
class PrefetchPlan:
    """Which decoder layers each FSDP unit all-gathers, besides its own parameters, when it starts its
    forward or its backward. Layers are indices into model.transformer_layers(); the root is the whole model."""

    root_forward: Tuple[int, ...]
    root_backward: Tuple[int, ...]
    layer_forward: Tuple[Tuple[int, ...], ...]
    layer_backward: Tuple[Tuple[int, ...], ...]


def prefetch_plan(num_layers: int, depth: int, explicit: bool) -> PrefetchPlan:
    """explicit=False describes what FSDP2 does by itself (nothing ahead in forward; in backward each unit
    prefetches the one that ran before it in forward). explicit=True is --fsdp-forward-prefetch: the next
    `depth` layers in forward and the previous `depth` layers in backward, nearest first."""
    if not explicit:
        return PrefetchPlan(
            root_forward=(),
            root_backward=(num_layers - 1,) if num_layers else (),
            layer_forward=tuple(() for _ in range(num_layers)),
            layer_backward=tuple((i - 1,) if i > 0 else () for i in range(num_layers)),
        )
    return PrefetchPlan(
        root_forward=tuple(range(min(depth, num_layers))),
        root_backward=tuple(range(num_layers - 1, max(num_layers - 1 - depth, -1), -1)),
        layer_forward=tuple(tuple(range(i + 1, min(i + 1 + depth, num_layers))) for i in range(num_layers)),
        layer_backward=tuple(tuple(range(i - 1, max(i - 1 - depth, -1), -1)) for i in range(num_layers)),
    )


def apply_prefetch_plan(root: nn.Module, layers: Sequence[nn.Module], plan: PrefetchPlan) -> None:
    """Hand an explicit plan to FSDP2. An empty backward list leaves FSDP2's own choice in place, which for
    the first layer is nothing (no unit ran before it)."""
    root.set_modules_to_forward_prefetch([layers[j] for j in plan.root_forward])
    root.set_modules_to_backward_prefetch([layers[j] for j in plan.root_backward])
    for layer, forward, backward in zip(layers, plan.layer_forward, plan.layer_backward):
        layer.set_modules_to_forward_prefetch([layers[j] for j in forward])
        layer.set_modules_to_backward_prefetch([layers[j] for j in backward])


# ----------------------------------------------------------------------------------- --fsdp-sync-free


class AllocatorPressure:
    """Whether the CUDA caching allocator is near the point where it must free its cache and retry (a
    device-wide synchronize), read once per forward pass from one memory_stats call: an allocation retry
    since the last reading, or reserved memory at RESERVED_FRACTION of what this process may use."""

    RESERVED_FRACTION = 0.95  # the next block the cache cannot serve would then need a retry or fail

    def __init__(self, device: torch.device):
        # torch.device("cuda") names no GPU; the allocator's per-process limit is per GPU
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.capacity = torch.cuda.get_device_properties(
            self.device
        ).total_memory * torch.cuda.get_per_process_memory_fraction(self.device)
        self._retries = 0

    def __call__(self) -> bool:
        stats = torch.cuda.memory_stats(self.device)
        retries = stats.get("num_alloc_retries", 0)
        # != rather than >: the count starts again from 0 if someone resets the accumulated statistics
        retried = retries > 0 and retries != self._retries
        self._retries = retries
        return retried or stats.get("reserved_bytes.all.current", 0) >= self.RESERVED_FRACTION * self.capacity


class ReshardEventLimiter:
    """The wait logic of --fsdp-sync-free, free of FSDP and CUDA so it can be tested with stand-ins.

    Every all-gather of a layer gets the next sequence number. When the layer's full parameters are freed
    (`on_reshard`), an event is recorded on the current (compute) stream; it completes once the GPU has
    finished everything that used them. Before all-gather number s is issued (`before_unshard`), the CPU
    waits on the event of all-gather s - window; more precisely on the most recently recorded event among
    those of all-gathers s - window and older (normally that very one; they differ when frees come out of
    gathering order, as with --no-reshard-after-forward). Events on one stream complete in recording
    order, so after the wait every all-gather up to s - window has been freed on the GPU too: at most
    `window` layers' full parameters exist, and the CPU runs at most that many layers ahead. Only that
    event is waited on; the device as a whole is never synchronized.

    The window is `max_in_flight` (two layers) while the allocator is under pressure and `relaxed_in_flight`
    (about one update's all-gathers) otherwise. A wait that tight drains the GPU's queue at every layer,
    which costs 5-10% of a GPU-bound run (docs/fsdp.md), and it buys nothing while the allocator can still
    serve every block from its cache. `start_pass()` (at each forward of the model) asks `pressure_probe`
    which window applies until the next pass; with no probe (or no relaxed window) it is always the tight one.

    Layer indices are those of model.transformer_layers(); the sequence runs on across forward, backward and
    iterations (in backward, the layer two all-gathers back is layer i+2). A layer already gathered (by a
    prefetch, or kept from forward with --no-reshard-after-forward) issues nothing and waits for nothing.

    event_factory: a callable returning an object with record() and synchronize() (torch.cuda.Event). With
    None (CPU: no streams) only the bookkeeping runs and nothing is ever waited on.
    """

    def __init__(
        self,
        max_in_flight: int = 2,
        event_factory: Optional[Callable[[], object]] = None,
        relaxed_in_flight: Optional[int] = None,
        pressure_probe: Optional[Callable[[], bool]] = None,
    ):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1 (got {max_in_flight})")
        if relaxed_in_flight is not None and relaxed_in_flight < max_in_flight:
            raise ValueError(
                f"relaxed_in_flight ({relaxed_in_flight}) must be at least max_in_flight ({max_in_flight})"
            )
        self.max_in_flight = max_in_flight
        self.relaxed_in_flight = relaxed_in_flight
        self.event_factory = event_factory
        self.pressure_probe = pressure_probe if relaxed_in_flight is not None else None
        self.window = max_in_flight
        self.passes = 0
        self.pressured_passes = 0
        self._next_seq = 0
        self._records = 0
        self._gathered: Dict[int, int] = {}  # layer -> sequence number of its all-gather not yet freed
        self._freed: Dict[int, Tuple[int, object]] = {}  # sequence number -> (recording order, event)

    @classmethod
    def for_device(
        cls, device: torch.device, max_in_flight: int = 2, relaxed_in_flight: Optional[int] = None
    ) -> "ReshardEventLimiter":
        if device.type == "cuda":
            probe = AllocatorPressure(device) if relaxed_in_flight is not None else None
            return cls(max_in_flight, torch.cuda.Event, relaxed_in_flight, probe)
        logger.info(CPU_SYNC_FREE_NOTICE)
        return cls(max_in_flight, None)

    @property
    def waits(self) -> bool:
        return self.event_factory is not None

    def gathered_layers(self) -> List[int]:
        """Layers whose all-gather was issued and whose full parameters have not been freed (CPU view)."""
        return sorted(self._gathered)

    def start_pass(self) -> None:
        """Pick the window for the forward (and backward) pass that starts now."""
        self.passes += 1
        if self.pressure_probe is None:
            return
        pressured = bool(self.pressure_probe())
        if pressured:
            if self.pressured_passes == 0:
                logger.info(
                    "--fsdp-sync-free: the CUDA allocator is under pressure (an allocation retry, or reserved "
                    "memory near the limit): waiting %d layers back while it lasts (%d otherwise)",
                    self.max_in_flight,
                    self.relaxed_in_flight,
                )
            self.pressured_passes += 1
        self.window = self.max_in_flight if pressured else self.relaxed_in_flight

    def before_unshard(self, layer: int) -> None:
        if layer in self._gathered:
            return  # its all-gather is already issued: nothing new to bound
        seq = self._next_seq
        self._next_seq += 1
        self._gathered[layer] = seq
        eligible = [entry for s, entry in self._freed.items() if s <= seq - self.window]
        if not eligible:
            return
        order, event = max(eligible, key=lambda entry: entry[0])
        event.synchronize()
        # Everything recorded on the stream before it has completed as well.
        self._freed = {s: entry for s, entry in self._freed.items() if entry[0] > order}

    def on_reshard(self, layer: int) -> None:
        seq = self._gathered.pop(layer, None)
        if seq is None or self.event_factory is None:
            return
        event = self.event_factory()
        event.record()
        self._freed[seq] = (self._records, event)
        self._records += 1

    def reset(self) -> None:
        """Forget in-flight bookkeeping (after FSDPModule.reset_iter_state following a failed step)."""
        self._gathered.clear()
        self._freed.clear()


class _NotifyInBackward(torch.autograd.Function):
    """Identity in forward; calls `callback` when the gradient reaches this point in backward."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        ctx.set_materialize_grads(False)
        # detach(): new tensor objects (sharing storage and version counter) rather than views, so that
        # callers may still modify the outputs in place.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def _notify_in_backward(callback: Callable[[], None], args: tuple, kwargs: dict):
    """Route every grad-requiring tensor of (args, kwargs) through one _NotifyInBackward node."""
    positions = [("a", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    positions += [("k", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not positions:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    tensors = [args[key] if kind == "a" else kwargs[key] for kind, key in positions]
    for (kind, key), tensor in zip(positions, _NotifyInBackward.apply(callback, *tensors)):
        if kind == "a":
            args[key] = tensor
        else:
            kwargs[key] = tensor
    return tuple(args), kwargs


def _notify_output_in_backward(callback: Callable[[], None], output):
    if isinstance(output, torch.Tensor):
        return _notify_in_backward(callback, (output,), {})[0][0]
    if isinstance(output, (tuple, list)):
        return type(output)(_notify_in_backward(callback, tuple(output), {})[0])
    return output


class SyncFreeHooks:
    """Drives a ReshardEventLimiter from module hooks so that every wait happens before FSDP2 issues the
    all-gather it bounds, and every event is recorded after FSDP2 freed the parameters (see the module
    docstring for where FSDP2 does both). The prefetch plan must be the one FSDP2 actually follows."""

    def __init__(self, limiter: ReshardEventLimiter, plan: PrefetchPlan, reshard_after_forward: bool):
        self.limiter = limiter
        self.plan = plan
        self.reshard_after_forward = reshard_after_forward
        self.handles = []
        self._backward_started = False

    def install(self, root: nn.Module, layers: Sequence[nn.Module]) -> "SyncFreeHooks":
        """Call after fully_shard has run on the layers and the root (hook order depends on it)."""
        self.handles.append(root.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        self.handles.append(root.register_forward_hook(self._root_post_forward))
        for index, layer in enumerate(layers):
            self.handles.append(
                layer.register_forward_pre_hook(partial(self._layer_pre_forward, index), prepend=True, with_kwargs=True)
            )
            self.handles.append(layer.register_forward_hook(partial(self._layer_post_forward, index)))
        return self

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _before_unshards(self, layers: Sequence[int]) -> None:
        for layer in layers:
            self.limiter.before_unshard(layer)

    def _root_pre_forward(self, module, args):
        if self._backward_started:
            # FSDP2 frees every layer by the end of backward. A layer whose inputs need no gradient is freed
            # in FSDP's end-of-backward callback instead of a node we can follow; report it now (later
            # than it happened, so any wait on it is longer, never shorter, than needed).
            self._backward_started = False
            for layer in self.limiter.gathered_layers():
                self.limiter.on_reshard(layer)
        self.limiter.start_pass()
        self._before_unshards(self.plan.root_forward)

    def _root_post_forward(self, module, args, output):
        if not torch.is_grad_enabled():
            return output
        return _notify_output_in_backward(self._root_pre_backward, output)

    def _root_pre_backward(self):
        self._backward_started = True
        self._before_unshards(self.plan.root_backward)

    def _layer_pre_forward(self, index, module, args, kwargs):
        self.limiter.before_unshard(index)
        self._before_unshards(self.plan.layer_forward[index])
        if not torch.is_grad_enabled():
            return None
        # Placed in front of FSDP's post-backward node: runs once FSDP freed this layer in backward.
        return _notify_in_backward(partial(self.limiter.on_reshard, index), args, kwargs)

    def _layer_post_forward(self, index, module, args, output):
        if self.reshard_after_forward:
            self.limiter.on_reshard(index)  # FSDP's post-forward hook, which ran before this one, freed them
        if not torch.is_grad_enabled():
            return output
        # Placed after FSDP's pre-backward hook on this output: runs before it in backward.
        return _notify_output_in_backward(partial(self._layer_pre_backward, index), output)

    def _layer_pre_backward(self, index):
        self.limiter.before_unshard(index)
        self._before_unshards(self.plan.layer_backward[index])


# ------------------------------------------------------------------------------------------- apply_fsdp


def apply_fsdp(model: nn.Module, cfg, mesh: DeviceMesh, limiter: Optional[ReshardEventLimiter] = None) -> nn.Module:
    """Shard `model` in place with FSDP2: every decoder layer, then the root (embeddings, final norm,
    output projection and anything else left). Returns the model.

    The root keeps its full parameters from forward to backward (reshard_after_forward=False, FSDP2's own
    default for a root): backward starts with the output projection, so freeing it after forward would
    only make backward gather it again at once. --no-reshard-after-forward applies that to every layer.

    `limiter` (only with --fsdp-sync-free) defaults to CUDA events on a CUDA mesh and to no waiting on CPU.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

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
    from torch.distributed.fsdp import fully_shard

    if mesh.ndim != 2 or mesh.size(1) != 1:
        raise ValueError(f"replicas need a (replicate, shard = 1) mesh, got shape {tuple(mesh.shape)}")
    for layer in transformer_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model
