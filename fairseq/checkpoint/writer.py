"""Where a checkpoint's bytes are written: in the training loop, or in the background while training goes on
(--write-checkpoints-asynchronously, upstream's flag and meaning).

A save has two parts (fairseq.checkpoint.manager composes them):
1. In the training loop, on every rank: the state is gathered and, for a background write, copied into host
   memory (the snapshot). The copy is made by torch.distributed.checkpoint's DefaultStager, whose buffers are
   allocated at the first save and reused by every later one (pinned when training on CUDA); a sharded save
   hands the stager to `dcp.async_save`. Training resumes once the snapshot is taken.
2. The write: a temporary name, fsync, rename (single file: fairseq.checkpoint.io; sharded: DCP's shards into
   `<name>.tmp`, then metadata.pt and the directory's rename: fairseq.checkpoint.sharded), then the copies to
   the other names due and the retention. Synchronously it runs in the loop; in the background, in this
   writer's one thread (collectives of sharded writes on a gloo process group of their own, so that they never
   interleave with the training loop's).

What holds for background writes:
- At most one write is in flight: the next save, the end of training and a preemption checkpoint first wait
  for it (`wait`, which logs how long); the snapshot buffers are reused only then.
- checkpoint_last / checkpoint_best / checkpointN copies and the retention are steps of the write after its
  rename: every name points at a whole checkpoint, and nothing is removed for a write that did not complete.
- A write that fails is raised at the next update (`poll`) as the one-line CheckpointSaveError a synchronous
  save raises; the previous checkpoint is intact (the rename never happened). kill -9 leaves only temporaries
  (`.NAME.*.tmp` files, `NAME.tmp` directories), which the next start removes.

Test hook: FAIRSEQ_TEST_SLOW_CHECKPOINT_WRITE=SECONDS makes every background write sleep that long once its
bytes are written, before the rename (read in `slow_write_for_tests` only), so that a test can kill or signal
a run while a write is in flight.
"""

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)

SLOW_WRITE_ENV = "FAIRSEQ_TEST_SLOW_CHECKPOINT_WRITE"


def slow_write_for_tests() -> None:
    """The test hook (module docstring): sleep FAIRSEQ_TEST_SLOW_CHECKPOINT_WRITE seconds, if set."""
    seconds = float(os.environ.get(SLOW_WRITE_ENV) or 0)
    if seconds > 0:
        time.sleep(seconds)


def async_save_host_bytes(model_bytes: int, optimizer_bytes: int, *, sharded: bool, state_shards: int = 1,
                          gathered: bool = False) -> int:
    """Host memory that asynchronous saves hold on the busiest rank, from the sizes in bytes of the whole
    (unsharded) model state and optimizer state (with --store-ema, add the EMA's to `model_bytes`). It is the
    snapshot, allocated at the first save and kept for the next ones; pinned when training on CUDA.

    - sharded (--use-sharded-state): each rank stages its own part of the state, (model + optimizer) /
      `state_shards`, where `state_shards` is the number of ranks one copy of the state is split over (FSDP
      shard group size x tensor-parallel size; HSDP replicas each stage their copy). Per node: this times the
      ranks per node.
    - single file: rank 0 stages the whole state (the other ranks nothing). When the full state is gathered
      (`gathered`: FSDP or tensor parallel), torch's gathered copy is held beside the snapshot while it is taken
      and the snapshot is allocated anew (pageable) at each save: twice the state at the peak.
    """
    if model_bytes < 0 or optimizer_bytes < 0 or state_shards < 1:
        raise ValueError("async_save_host_bytes: sizes must be >= 0 and state_shards >= 1")
    state = model_bytes + optimizer_bytes
    if sharded:
        return -(-state // state_shards)  # ceil: the first shards hold the remainder
    return 2 * state if gathered else state


@dataclass
class _InFlight:
    name: str  # the path written first: what the log names
    future: Future  # its result: the seconds the save took, from its start to the last rename


class CheckpointWriter:
    """Runs each save's write now or in the background, one at a time (module docstring). One per training run."""

    def __init__(self, background: bool, pin_memory: bool = False, timeout=None):
        self.background = background
        self._pin_memory = pin_memory  # also non-blocking device-to-host copies: both need CUDA
        self._timeout = timeout  # of the background writes' process group
        self._executor: Optional[ThreadPoolExecutor] = None
        self._in_flight: Optional[_InFlight] = None
        self._stager = None
        self._group = None

    # ------------------------------------------------------------------ the snapshot
    def stager(self):
        """DCP's DefaultStager of this run: its host buffers are allocated at the first save, keyed by the
        storage they copy, and reused by later saves (pinned on CUDA). Staging blocks until the copy is taken."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pin = self._pin_memory and torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pin, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=pin))
        return self._stager

    def snapshot(self, state: Any, reusable: bool = True) -> Any:
        """A copy of `state` (containers and tensors) in host memory that training cannot change. `reusable`:
        its tensors are views of the training state, the same storages at every save, so the copy goes to the
        reused buffers; otherwise (a state gathered anew at each save) to one-off pageable buffers."""
        if reusable:
            return self.stager().stage(state)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        one_off = DefaultStager(StagingOptions(False, False, False, False))
        try:
            return one_off.stage(state)
        finally:
            one_off.close()  # forgets its storages; the copy lives as long as the snapshot

    def group(self):
        """The process group (gloo) of background sharded writes: DCP's collectives and the rename's run there,
        in the writer thread, never on the groups the training loop uses. Collective: created at the first
        background sharded save, which every rank reaches at the same update."""
        import torch.distributed as dist

        if self._group is None and dist.is_available() and dist.is_initialized():
            kwargs = {"timeout": self._timeout} if self._timeout is not None else {}
            self._group = dist.new_group(backend="gloo", **kwargs)
        return self._group

    # ------------------------------------------------------------------ the write
    def run(self, write: Callable[[], None], name: str, started: float, background: bool) -> Optional[float]:
        """Run `write()`, the second part of a save whose own work began at `started` (time.perf_counter), now:
        returns the seconds the save took; or with `background` in this writer's thread: returns None, and
        `poll` or `wait` give the seconds once it is done. Call `wait` first: one write at a time."""
        if not background:
            write()
            return time.perf_counter() - started
        if self._in_flight is not None:
            raise RuntimeError(f"a checkpoint write is in flight ({self._in_flight.name}): wait for it first")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._in_flight = _InFlight(name, self._executor.submit(_timed, write, started))
        return None

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
        returns its seconds as `poll` does (None when none was in flight) and raises its error."""
        if self._in_flight is None:
            return None
        if not self._in_flight.future.done():
            start = time.perf_counter()
            self._in_flight.future.exception()  # waits; the error, if any, is raised by _collect
            logger.info(f"waited {time.perf_counter() - start:.2f} s for the background write of "
                        f"{self._in_flight.name} {before}")
        return self._collect()

    def _collect(self) -> float:
        in_flight, self._in_flight = self._in_flight, None
        return in_flight.future.result()

    def close(self) -> None:
        """End of the run, also after an error: wait for the write in flight (an error is logged, not raised:
        the run ends with its own), then free the snapshot buffers and the thread."""
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
            if self._stager is not None:
                self._stager.close()
                self._stager = None


def _timed(write: Callable[[], None], started: float) -> float:
    write()
    return time.perf_counter() - started
