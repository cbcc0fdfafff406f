"""Host copies of a checkpoint's state (staging): what a save copies out of training before its write.

`HostStaging.stage(state, gather)` returns a `Staged` copy of `state` (nested dicts, lists and tuples of tensors
and plain values) in host memory:
- `gather` (a single-file save): DTensors (FSDP2, tensor parallel) are gathered to whole tensors one at a time
  on every rank (collective) and copied to the host on rank 0 only; the other ranks get None. A DTensor whose
  every sharded mesh dimension has one rank (FSDP2 on one GPU) is already whole: its local tensor is copied as
  it is, without gathering. Never more than one tensor's gathered copy plus `GATHER_WINDOW_BYTES` waits on the
  GPU at a time: the state is never materialised a second time on the GPU.
- otherwise (a sharded DCP save): each DTensor stays a DTensor of the same mesh and placements whose local shard
  lives in host memory (what DCP writes), every rank its own shards.

Buffers. With `keep` (asynchronous saves) the host buffers are allocated at the first save and reused by the next
ones, matched by their place in the state and re-allocated only when a shape or dtype changes; with `pin` they
are page-locked (cudaHostRegister of page-aligned memory of exactly the tensor's size: torch's pinned allocator
would round each buffer up to a power of two). Without `keep` (synchronous saves) each save gets one-off pageable
buffers, freed once written, and tensors already in host memory are not copied (the write runs before training
goes on). The caller must not stage again before the write of the previous `Staged` is done: the buffers are
shared.

Copies. On CUDA, device-to-host copies go on a side stream (non_blocking into pinned memory) that first waits
for the compute stream, so they see the last update's values and `stage` returns once they are queued, not done.
`Staged.ready` is recorded after them; the write waits for it (`Staged.wait`, in the writer's thread). The rule
that keeps the copy exact: nothing changes the parameters, the optimizer state or the EMA between two updates'
optimizer steps except the step itself and what follows it on the compute stream (the EMA step, float8 scale
updates); forward and backward only read them. So `Staged.hold_back(optimizer)` makes the compute stream wait
for `ready` just before the next optimizer step (a one-shot step pre-hook): the copies overlap the next forward
and backward and stall the GPU only if they take longer than those. Tensors in host memory (Adam's step counts
when not capturable, which the step changes on the host) are copied at `stage` time, synchronously.

Why not torch.distributed.checkpoint's DefaultStager: in torch 2.11 its `_stage` calls `StateDictStager.close()`
after every stage, which forgets the cached (pinned) storages, so every save allocates and pins anew, and clears
the deep-copy dispatch table, so the second stage of any dict raises `KeyError: <class 'type'>` (torch 2.13 no
longer closes it). Its cache is also keyed by storage, so a state gathered anew at every save never hits it.
"""

import collections
import contextlib
import copy
import logging
import mmap
import time
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from fairseq.runtime.dtensor import is_dtensor

logger = logging.getLogger(__name__)

GATHER_WINDOW_BYTES = 2 * 2**30  # gathered tensors waiting for their copy to the host, beyond the latest one
PAGE = mmap.PAGESIZE


@dataclass
class StagingTimes:
    """Where a stage's host time went, in seconds (the blocked time of an asynchronous save, less composing the
    plain values and waiting for the previous write)."""

    state_dict: float = 0.0  # the model's and optimizer's state dicts (torch's get_state_dict), set by the caller
    gather: float = 0.0  # gathering DTensors to whole tensors (collectives), single file only
    allocate: float = 0.0  # host buffers: the first save, or a changed shape
    copy: float = 0.0  # copies: host to host, and device to host as far as the host waits for them
    python: float = 0.0  # the rest: walking the state, per-tensor bookkeeping

    def as_dict(self) -> Dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Staged:
    """A staged copy: `state` (None on ranks other than 0 of a gathered stage), readable once `wait()` returns."""

    def __init__(self, state: Any, times: StagingTimes, events: Optional[Tuple[Any, Any]] = None):
        self.state = state
        self.times = times
        self._events = events  # (start, ready) on the side stream, CUDA only

    @property
    def ready(self):
        """The CUDA event recorded after the last device-to-host copy (None: the copies are already done)."""
        return None if self._events is None else self._events[1]

    def wait(self) -> None:
        """Block this thread until the copies are done."""
        if self._events is not None:
            self._events[1].synchronize()

    def copy_seconds(self) -> Optional[float]:
        """Device time of the device-to-host copies (after `wait`; None without CUDA copies)."""
        if self._events is None:
            return None
        start, ready = self._events
        return start.elapsed_time(ready) / 1000

    def hold_back(self, optimizer) -> None:
        """The next `optimizer.step()` waits (on the GPU, not the host) until the copies are done (module
        docstring); with no copy in flight, nothing."""
        if self._events is None:
            return
        ready = self._events[1]
        handle = None

        def wait_for_copies(*_):
            torch.cuda.current_stream().wait_event(ready)
            handle.remove()

        handle = optimizer.register_step_pre_hook(wait_for_copies)


class HostStaging:
    """Stages states into host buffers (module docstring). One per run; not thread-safe."""

    def __init__(self, keep: bool, pin: bool):
        self.keep = keep
        self.pin = keep and pin and torch.cuda.is_available()  # one-off buffers stay pageable
        self._buffers: Dict[Tuple, torch.Tensor] = {}  # kept buffers by place in the state
        self._registered: List[int] = []  # data pointers page-locked with cudaHostRegister
        self._stream = None

    # ------------------------------------------------------------------ buffers
    def _allocate(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        numel = shape.numel()
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        # An anonymous mapping: page-aligned, pages of its own (cudaHostRegister locks whole pages).
        memory = mmap.mmap(-1, nbytes)
        with contextlib.suppress(AttributeError, OSError):
            memory.madvise(mmap.MADV_HUGEPAGE)  # fewer pages to lock and translate (Linux)
        buffer = torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)
        if self.pin:
            result = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
            if result != 0:
                raise RuntimeError(
                    f"pinning {nbytes} bytes of host memory for the checkpoint failed (CUDA error "
                    f"{result}); save synchronously (drop --write-checkpoints-asynchronously)"
                )
            self._registered.append(buffer.data_ptr())
        return buffer

    def _buffer(self, place: Tuple, like: torch.Tensor, times: StagingTimes) -> torch.Tensor:
        buffer = self._buffers.get(place)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            start = time.perf_counter()
            if buffer is not None:
                self._release(buffer)
            buffer = self._allocate(like.shape, like.dtype)
            times.allocate += time.perf_counter() - start
            if self.keep:
                self._buffers[place] = buffer
        return buffer

    def _release(self, buffer: torch.Tensor) -> None:
        if buffer.data_ptr() in self._registered:
            self._registered.remove(buffer.data_ptr())
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())

    def close(self) -> None:
        """Free the kept buffers (after the last write that reads them)."""
        for buffer in self._buffers.values():
            self._release(buffer)
        self._buffers.clear()

    # ------------------------------------------------------------------ staging
    def stage(self, state: Any, gather: bool) -> Staged:
        """Collective when `gather` and the state holds DTensors (every rank, the same state layout)."""
        times = StagingTimes()
        start = time.perf_counter()
        copier = _Copier(self, times, gather)
        staged = copier.walk(state, ())
        times.python = max(0.0, time.perf_counter() - start - times.gather - times.allocate - times.copy)
        if gather and not copier.on_rank_0:
            staged = None
        return Staged(staged, times, copier.events())

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream


class _Copier:
    """One stage's walk over the state."""

    def __init__(self, staging: HostStaging, times: StagingTimes, gather: bool):
        self.staging = staging
        self.times = times
        self.gather = gather
        self.on_rank_0 = _rank() == 0
        self.copied: Dict[Tuple, torch.Tensor] = {}  # aliases (tied weights) staged once
        self.stream = None
        self.start = None
        self.window: List[Tuple[Any, int]] = []  # (event, bytes) of gathered tensors whose copy is queued

    def events(self):
        """(start, ready) of this stage's device-to-host copies, `ready` recorded after the last one (None
        without any)."""
        if self.stream is None:
            return None
        ready = torch.cuda.Event(enable_timing=True)
        ready.record(self.stream)
        return self.start, ready

    def _device_stream(self):
        """The side stream, made to wait for the compute stream at the first device tensor of this stage."""
        if self.stream is None:
            self.stream = self.staging._side_stream()
            self.stream.wait_stream(torch.cuda.current_stream())
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record(self.stream)
        return self.stream

    def walk(self, value: Any, place: Tuple) -> Any:
        if is_dtensor(value):
            return self._dtensor(value, place)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, place)
        if isinstance(value, dict):
            out = type(value)() if type(value) in (dict, collections.OrderedDict) else {}
            for key, item in value.items():
                out[key] = self.walk(item, place + (key,))
            return out
        if isinstance(value, (list, tuple)):
            items = [self.walk(item, place + (i,)) for i, item in enumerate(value)]
            if isinstance(value, list):
                return items
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return copy.deepcopy(value)  # plain values; the state's content is the caller's

    def _dtensor(self, value, place: Tuple):
        if not self.gather:
            from torch.distributed.tensor import DTensor  # deferred: startup (~1 s to import)

            local = self._tensor(value.to_local(), place)
            return local if local is None else DTensor(local, value._spec, requires_grad=False)
        if _whole_locally(value):
            return self._tensor(value.to_local(), place)
        start = time.perf_counter()
        self._bound_window(value)
        whole = _gathered(value)
        self.times.gather += time.perf_counter() - start
        if not self.on_rank_0:
            return None
        if whole.is_cuda:  # the copy must follow the gather, queued on the compute stream after the last wait
            self._device_stream().wait_stream(torch.cuda.current_stream())
        staged = self._tensor(whole, place, alias=False)
        if whole.is_cuda:
            whole.record_stream(self.stream)  # its memory is reused only after the copy (side stream) is done
            event = torch.cuda.Event()
            event.record(self.stream)
            self.window.append((event, whole.numel() * whole.element_size()))
        return staged

    def _bound_window(self, value) -> None:
        """Wait (host) for the oldest queued copies while the gathered tensors waiting for theirs exceed the
        window, so that the GPU never holds more than the window plus one tensor of them."""
        waiting = sum(nbytes for _, nbytes in self.window)
        while self.window and waiting > GATHER_WINDOW_BYTES:
            event, nbytes = self.window.pop(0)
            event.synchronize()
            waiting -= nbytes

    def _tensor(self, value: torch.Tensor, place: Tuple, alias: bool = True) -> Optional[torch.Tensor]:
        if self.gather and not self.on_rank_0:
            return None
        value = value.detach()
        key = _alias_key(value) if alias else None
        if key is not None and key in self.copied:
            return self.copied[key]
        if not self.staging.keep and not value.is_cuda:
            return value  # a synchronous write reads it before training goes on
        buffer = self.staging._buffer(place, value, self.times)
        start = time.perf_counter()
        if value.is_cuda:
            with torch.cuda.stream(self._device_stream()):
                buffer.copy_(value, non_blocking=self.staging.pin)
        else:
            buffer.copy_(value)
        self.times.copy += time.perf_counter() - start
        if key is not None:
            self.copied[key] = buffer
        return buffer


def _alias_key(value: torch.Tensor) -> Optional[Tuple]:
    """The same memory seen through the same view (a tied weight under two names), for non-empty tensors."""
    if value.numel() == 0:
        return None
    return (
        value.device,
        value.untyped_storage().data_ptr(),
        value.storage_offset(),
        tuple(value.shape),
        tuple(value.stride()),
        value.dtype,
    )


def _whole_locally(value) -> bool:
    """Whether the DTensor's local tensor is the whole tensor on every rank: each mesh dimension is replicated or
    has one rank (rank-independent, so that every rank takes the same branch of the collective)."""
    mesh = value.device_mesh
    return all(placement.is_replicate() or mesh.size(dim) == 1 for dim, placement in enumerate(value.placements))


def _gathered(value) -> torch.Tensor:
    """The whole tensor of a DTensor (collective), as torch's full state dict gathers it."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor  # deferred: startup
    from torch.distributed.tensor import Replicate  # deferred: startup (~1 s to import)

    whole = value.redistribute(value.device_mesh, [Replicate()] * len(value.placements)).to_local()
    return whole.wait() if isinstance(whole, AsyncCollectiveTensor) else whole


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
