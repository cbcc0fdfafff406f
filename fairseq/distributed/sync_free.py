"""--fsdp-sync-free: bound how far the CPU runs ahead of the GPU by waiting, before each all-gather, on an event
recorded when an earlier layer's full parameters were freed (ReshardEventLimiter), driven by module hooks placed
around FSDP2's own (SyncFreeHooks). See docs/fsdp.md for what the flag is for.

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
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from fairseq.distributed.fsdp_prefetch import PrefetchPlan

logger = logging.getLogger(__name__)

CPU_SYNC_FREE_NOTICE = "--fsdp-sync-free: no CUDA streams on CPU; the wait has nothing to wait for"


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
