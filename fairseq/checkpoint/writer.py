"""Where a checkpoint's bytes are written: in the training loop, or in the background while training goes on
(--write-checkpoints-asynchronously, upstream's flag and meaning). The writer owns that choice (`AsyncMode`).

A save has two parts (fairseq.checkpoint.manager composes them):
1. In the training loop, on every rank: the state is gathered and staged (`CheckpointWriter.stage`, through
   fairseq.checkpoint.staging): asynchronously, copied into host buffers allocated at the first save and
   reused by the later ones (pinned on CUDA, the copies on a side stream that the next optimizer step waits
   for); synchronously, a single file's state is copied to one-off host buffers and a sharded one is written
   from where it lives.
2. The write (`Write`): its bytes under a temporary name (single file: fairseq.checkpoint.io; sharded: DCP's
   shards into `<name>.tmp`, then metadata.pt: fairseq.checkpoint.sharded), then its publication: the rename,
   the copies to the other names due and the retention. Synchronously it runs in the loop; asynchronously, in
   this writer's one thread (collectives of sharded writes on a gloo process group of their own, so that they
   never interleave with the training loop's).

What holds for background writes:
- At most one write is in flight: the next save, the end of training and a preemption checkpoint first wait
  for it (`wait`, which logs how long); the staging buffers are reused only then.
- The publication follows the bytes: every name points at a whole checkpoint, and nothing is removed for a
  write that did not complete.
- A write that fails is raised at the next update (`poll`) as the one-line CheckpointSaveError a synchronous
  save raises; the previous checkpoint is intact (the rename never happened). kill -9 leaves only temporaries
  (`.NAME.*.tmp` files, `NAME.tmp` directories), which the next start removes.

The seam for tests: FAIRSEQ_TEST_SLOW_CHECKPOINT_WRITE=SECONDS (read when the writer is made) pauses every
background write that long between its bytes and its publication, so that a test can kill or signal a run while
a write is in flight. Nothing else reads it.
"""

import enum
import logging
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fairseq.checkpoint.staging import HostStaging, Staged, StagingTimes

logger = logging.getLogger(__name__)

SLOW_WRITE_ENV = "FAIRSEQ_TEST_SLOW_CHECKPOINT_WRITE"


class AsyncMode(enum.Enum):
    """How checkpoints are written (torchtitan's names)."""

    DISABLED = "disabled"  # in the training loop
    ASYNC = "async"  # in the writer's thread, from host buffers kept between saves
    ASYNC_WITH_PINNED_MEM = "async_with_pinned_mem"  # the same, pinned, device-to-host copies on a side stream

    @classmethod
    def for_run(cls, asynchronous: bool, cuda: bool) -> "AsyncMode":
        """--write-checkpoints-asynchronously, on a CUDA device or not."""
        if not asynchronous:
            return cls.DISABLED
        return cls.ASYNC_WITH_PINNED_MEM if cuda and torch.cuda.is_available() else cls.ASYNC


def async_save_host_bytes(model_bytes: int, optimizer_bytes: int, *, sharded: bool, state_shards: int = 1) -> int:
    """Host memory that asynchronous saves hold on the busiest rank, from the sizes in bytes of the whole
    (unsharded) model state and optimizer state (with --store-ema, add the EMA's to `model_bytes`): the staging
    buffers, allocated at the first save and kept for the next ones; pinned when training on CUDA.

    - sharded (--use-sharded-state): each rank stages its own part of the state, (model + optimizer) /
      `state_shards`, where `state_shards` is the number of ranks one copy of the state is split over (FSDP
      shard group size x tensor-parallel size; HSDP replicas each stage their copy). Per node: this times the
      ranks per node.
    - single file: rank 0 stages the whole state (gathered one tensor at a time), the other ranks nothing.
    """
    if model_bytes < 0 or optimizer_bytes < 0 or state_shards < 1:
        raise ValueError("async_save_host_bytes: sizes must be >= 0 and state_shards >= 1")
    state = model_bytes + optimizer_bytes
    return -(-state // state_shards) if sharded else state  # ceil: the first shards hold the remainder


@dataclass
class Write:
    """The second part of a save: `bytes()` writes the checkpoint under its temporary name, `publish()` renames
    it into place and does what follows (copies, retention, the log line). Both run on every rank that takes
    part (a sharded write's collectives are in both)."""

    bytes: Callable[[], None]
    publish: Callable[[], None]


@dataclass
class _InFlight:
    name: str  # the path written first: what the log names
    future: Future  # its result: the seconds the save took, from its start to the last rename


class CheckpointWriter:
    """Stages each save and runs its write now or in the background, one at a time (module docstring). One per
    training run."""

    def __init__(self, mode: AsyncMode = AsyncMode.DISABLED, timeout=None):
        self.mode = mode
        self._timeout = timeout  # of the background writes' process group
        self._executor: Optional[ThreadPoolExecutor] = None
        self._in_flight: Optional[_InFlight] = None
        self._group = None
        self._staging = HostStaging(keep=self.asynchronous, pin=mode is AsyncMode.ASYNC_WITH_PINNED_MEM)
        self._pause = float(os.environ.get(SLOW_WRITE_ENV) or 0)  # the seam for tests (module docstring)
        self.waited = 0.0  # seconds the last `wait` blocked

    @property
    def asynchronous(self) -> bool:
        return self.mode is not AsyncMode.DISABLED

    # ------------------------------------------------------------------ part 1: staging
    def stage(self, state: Any, single_file: bool, optimizer=None) -> Staged:
        """The state a write may read once training goes on (fairseq.checkpoint.staging). `single_file`: gathered
        to rank 0 (collective; None elsewhere); otherwise each rank's shards, as DTensors. `optimizer`: its next
        step waits for the device-to-host copies. A synchronous sharded save is written from the live state."""
        if not self.asynchronous and not single_file:
            return Staged(state, StagingTimes())
        staged = self._staging.stage(state, gather=single_file)
        if optimizer is not None:
            staged.hold_back(optimizer)
        else:
            staged.wait()
        return staged

    def group(self):
        """The process group of sharded writes: None (the default group) when they run in the loop; for
        background writes a gloo group of their own, where DCP's collectives and the rename's run in the writer
        thread, never on the groups the training loop uses. Collective: created at the first background sharded
        save, which every rank reaches at the same update."""
        if self.asynchronous and self._group is None and dist.is_available() and dist.is_initialized():
            kwargs = {"timeout": self._timeout} if self._timeout is not None else {}
            self._group = dist.new_group(backend="gloo", **kwargs)
        return self._group

    # ------------------------------------------------------------------ part 2: the write
    def run(self, write: Write, name: str, started: float, now: bool = False) -> Optional[float]:
        """Run `write`, the second part of a save whose own work began at `started` (time.perf_counter): in the
        loop when synchronous or `now` (the preemption checkpoint: the job is about to end), returning the
        seconds the save took; otherwise in this writer's thread, returning None (`poll` or `wait` give the
        seconds once it is done). Call `wait` first: one write at a time."""
        if not self.asynchronous or now:
            write.bytes()
            write.publish()
            return time.perf_counter() - started
        if self._in_flight is not None:
            raise RuntimeError(f"a checkpoint write is in flight ({self._in_flight.name}): wait for it first")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._in_flight = _InFlight(name, self._executor.submit(self._background, write, started))
        return None

    def _background(self, write: Write, started: float) -> float:
        write.bytes()
        if self._pause > 0:
            time.sleep(self._pause)
        write.publish()
        return time.perf_counter() - started

    @property
    def in_flight(self) -> Optional[str]:
        """The path of the write in flight, if any."""
        return None if self._in_flight is None else self._in_flight.name

    def poll(self) -> Optional[float]:
        """At every update: the seconds of the background write that has completed since (None while it runs,
        or when none is in flight); the error of one that failed is raised here."""
        if self._in_flight is None or not self._in_flight.future.done():
            return None
        return self._collect()

    def wait(self, before: str) -> Optional[float]:
        """Wait for the write in flight, logging how long (`before`: what waits, e.g. "before the next save");
        returns its seconds as `poll` does (None when none was in flight) and raises its error. `waited`: the
        seconds this call blocked."""
        self.waited = 0.0
        if self._in_flight is None:
            return None
        if not self._in_flight.future.done():
            start = time.perf_counter()
            self._in_flight.future.exception()  # waits; the error, if any, is raised by _collect
            self.waited = time.perf_counter() - start
            logger.info(f"waited {self.waited:.2f} s for the background write of {self._in_flight.name} {before}")
        return self._collect()

    def _collect(self) -> float:
        in_flight, self._in_flight = self._in_flight, None
        return in_flight.future.result()

    def close(self) -> None:
        """End of the run, also after an error: wait for the write in flight (an error is logged, not raised:
        the run ends with its own), then free the staging buffers and the thread."""
        try:
            self.wait("at the end of the run")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: B036 (DCP's CheckpointException is a BaseException)
            logger.error(f"the background checkpoint write failed: {str(err).splitlines()[0] if str(err) else err!r}")
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._staging.close()


def wait_advice(write_seconds: float, updates_apart: int, seconds_apart: float, interval_flag: bool) -> str:
    """The warning of a save that waited for the previous write: the write's time, how far apart the saves are,
    and the interval that would not wait (`interval_flag`: the saves come from --save-interval-updates)."""
    per_update = seconds_apart / max(updates_apart, 1)
    # one update more than the write lasts: a save that comes just as the write ends would still wait
    enough = math.ceil(write_seconds / per_update - 1e-9) + 1 if per_update > 0 else updates_apart + 1
    would = f"--save-interval-updates >= {enough}" if interval_flag else f"saves at least {enough} updates apart"
    return (
        f"checkpoint write took {write_seconds:.1f} s; saves every {updates_apart} updates (~{seconds_apart:.0f} "
        f"s) wait for it; {would} would not"
    )
