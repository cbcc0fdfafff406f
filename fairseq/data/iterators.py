"""Resumable, shuffled, sharded iteration over fixed batches (upstream fairseq's iterator semantics).

- `EpochBatchIterator` holds the batches (lists of dataset indices). Each epoch it shuffles their order with
  `numpy.random.RandomState(seed + epoch)` (the permutation upstream's `np.random.shuffle` produces under
  `numpy_seed(seed + epoch)`), gives data-parallel rank `shard_id` the batches `shard_id::num_shards`, and
  loads them through a `torch.utils.data.DataLoader` (`num_workers=0` loads in-process).
- Every rank gets ceil(len / num_shards) batches, as upstream's ShardedIterator: ranks short of a batch get
  empty batches at the end, which the dataset's collater turns into an empty dict `{}`. A trainer must run
  such a step as a dummy step (zero loss weight) so that collectives still match across ranks.
- `state_dict()` records the epoch and the number of batches consumed in it; `load_state_dict()` followed
  by `next_epoch_itr()` yields exactly the remaining batches of that epoch, in the same order.
- `GroupedIterator(itr, k)` yields lists of k batches (`--update-freq`); its position counts groups.
- Upstream's other iterators: `ShardedIterator` (every `num_shards`-th item, padded with `fill_value`) and
  `BufferedIterator` (a background thread keeps `size` items ready).
"""

import itertools
import logging
import math
import queue
import threading
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Union

import numpy as np
import torch

from fairseq.data.batching import Batches

logger = logging.getLogger(__name__)


class CountingIterator:
    """Wraps an iterable and counts the items consumed (`n`), out of `total`."""

    def __init__(self, iterable: Iterable, start: Optional[int] = None, total: Optional[int] = None):
        self.iterable = iterable
        self._itr = iter(iterable)
        self.n = start if start is not None else getattr(iterable, "n", 0)
        self.total = total if total is not None else self.n + len(iterable)

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> "CountingIterator":
        return self

    def __next__(self):
        if not self.has_next():
            raise StopIteration
        try:
            item = next(self._itr)
        except StopIteration:
            raise IndexError(f"iterator expected {self.total} items but ended after {self.n}") from None
        self.n += 1
        return item

    def has_next(self) -> bool:
        return self.n < self.total

    def skip(self, count: int) -> "CountingIterator":
        for _ in range(count):
            next(self)
        return self

    def take(self, count: int) -> "CountingIterator":
        """Stop after `count` items in total (counting those already consumed); an underlying iterator with
        its own `take` (BufferedIterator) is told how many items are still wanted from it."""
        self.total = min(self.total, count)
        if hasattr(self.iterable, "take"):
            self.iterable.take(max(count - self.n, 0))
        return self


class GroupedIterator(CountingIterator):
    """Lists of `chunk_size` consecutive items (the last one may be shorter, or, with `skip_remainder_batch`,
    dropped); `n` counts lists."""

    def __init__(self, iterable: CountingIterator, chunk_size: int, skip_remainder_batch: bool = False):
        if chunk_size < 1:
            raise ValueError(f"--update-freq must be >= 1, got {chunk_size}")
        if skip_remainder_batch:
            total = len(iterable) // chunk_size
            logger.info(f"skipping the last group of fewer than {chunk_size} batches: {total} groups")
        else:
            total = math.ceil(len(iterable) / chunk_size)
        start = math.ceil(getattr(iterable, "n", 0) / chunk_size)
        super().__init__(self._chunks(iterable, chunk_size), start=start, total=total)
        self.chunk_size = chunk_size

    @staticmethod
    def _chunks(iterable, size: int) -> Iterator[list]:
        chunk = []
        for item in iterable:
            chunk.append(item)
            if len(chunk) == size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


class ShardedIterator(CountingIterator):
    """Items `shard_id, shard_id + num_shards, ...` of a sized iterable, padded with `fill_value` to
    ceil(len / num_shards) items, so that every shard has as many."""

    def __init__(self, iterable, num_shards: int, shard_id: int, fill_value: Any = None, skip_remainder_batch=None):
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id {shard_id} must lie in [0, {num_shards}) (num_shards {num_shards})")
        per_shard = math.ceil(len(iterable) / num_shards)
        mine = itertools.islice(iterable, shard_id, len(iterable), num_shards)
        padded = itertools.islice(itertools.chain(mine, itertools.repeat(fill_value)), per_shard)
        super().__init__(padded, start=math.ceil(getattr(iterable, "n", 0) / num_shards), total=per_shard)


_END = object()  # BufferedIterator's end-of-data marker


class BufferedIterator:
    """Reads a sized iterable in a background thread, keeping up to `size` items ready (upstream's
    --data-buffer-size mechanism; this fork's EpochBatchIterator uses the DataLoader's prefetching instead).
    An exception in the reader is raised by `next`."""

    def __init__(self, size: int, iterable):
        self._queue: "queue.Queue" = queue.Queue(max(1, size))
        self._iterable = iterable
        self._reader: Optional[threading.Thread] = None
        self._done = False
        self.total = len(iterable)

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> "BufferedIterator":
        return self

    def take(self, count: int) -> None:
        """Read at most `count` items (told to the underlying iterable too when it can take)."""
        self.total = min(self.total, count)
        if hasattr(self._iterable, "take"):
            self._iterable.take(count)

    def _read(self) -> None:
        try:
            read = 0
            for item in self._iterable:
                if read >= self.total:
                    break
                self._queue.put(item)
                read += 1
            self._queue.put(_END)
        except Exception as err:  # handed to the consumer, which raises it
            self._queue.put(err)

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        item = self._queue.get(True)
        if item is _END or isinstance(item, Exception):
            self._done = True
            if item is _END:
                raise StopIteration
            raise item
        return item


class _BatchOrderSampler:
    """Batch sampler for the DataLoader: the batches at `order`, as lists of ints (-1: an empty batch). A
    reused DataLoader (`reuse_dataloader`) gets each epoch's batches by a new `order`."""

    def __init__(self, batches: Batches, order: np.ndarray):
        self.batches = batches
        self.order = order

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[List[int]]:
        for b in self.order.tolist():
            yield [] if b < 0 else self.batches[b].tolist()


def shuffled_batch_order(num_batches: int, seed: int, epoch: int, group_size: int = 1) -> np.ndarray:
    """The epoch's batch order, as upstream shuffles it. With `group_size` > 1 (`grouped_shuffling`), runs
    of `group_size` consecutive batches are shuffled as units and a last incomplete run is left out, as
    upstream does (so each rank of a group gets batches of similar lengths)."""
    if group_size <= 1:
        return np.random.RandomState(seed + epoch).permutation(num_batches)
    groups = np.random.RandomState(seed + epoch).permutation(num_batches // group_size)
    return (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)


def shard_batch_order(order: np.ndarray, num_shards: int, shard_id: int) -> np.ndarray:
    """Batches `shard_id::num_shards` of `order`, padded with -1 (empty batch) to ceil(len / num_shards)."""
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"shard_id {shard_id} must lie in [0, {num_shards}) (num_shards {num_shards})")
    per_shard = math.ceil(len(order) / num_shards)
    mine = order[shard_id::num_shards]
    return np.concatenate([mine, np.full(per_shard - len(mine), -1, dtype=mine.dtype)])


class EpochBatchIterating:
    """Upstream's interface of epoch iterators (`isinstance` checks in plug-ins); see EpochBatchIterator."""

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def next_epoch_idx(self) -> int:
        raise NotImplementedError

    def next_epoch_itr(self, shuffle: bool = True, fix_batches_to_gpus: bool = False, set_dataset_epoch: bool = True):
        raise NotImplementedError

    def end_of_epoch(self) -> bool:
        raise NotImplementedError

    @property
    def iterations_in_epoch(self) -> int:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError

    @property
    def first_batch(self):
        return "DUMMY"


class EpochBatchIterator(EpochBatchIterating):
    """Iterates over `dataset` in `batch_sampler`'s batches, epoch after epoch (see the module docstring).

    Args (upstream's, in upstream's order; `pin_memory` is this fork's):
        dataset: map-style dataset whose items `collate_fn` merges into a batch
        collate_fn: list of items -> batch (must accept an empty list)
        batch_sampler: the batches: a `Batches`, a sequence of index sequences, or a callable
            `batch_sampler(dataset, epoch)` returning them, called again each epoch
        seed: shuffling seed (`--seed`)
        num_shards, shard_id: data-parallel world size and rank
        num_workers: DataLoader worker processes (0: load in the calling process)
        epoch: the epoch the first `next_epoch_itr()` starts (1-based)
        buffer_size: batches each worker prepares ahead (DataLoader's prefetch_factor; 0: its default)
        timeout: seconds to wait for a worker's batch (0: forever)
        disable_shuffling: never shuffle, whatever `next_epoch_itr(shuffle=...)` says
        skip_remainder_batch: leave out the last batch of every epoch (upstream: whether or not it is full)
        grouped_shuffling: shuffle runs of `num_shards` batches as units (see `shuffled_batch_order`)
        reuse_dataloader: keep one DataLoader (and, with `persistent_workers`, its workers) for all epochs
        persistent_workers: the DataLoader's option (with num_workers > 0)
        pin_memory: pin batches in page-locked memory (only done when CUDA is available)
    """

    def __init__(
        self,
        dataset,
        collate_fn: Callable,
        batch_sampler: Union[Batches, Sequence[Sequence[int]], Callable[[Any, int], Sequence]],
        seed: int = 1,
        num_shards: int = 1,
        shard_id: int = 0,
        num_workers: int = 0,
        epoch: int = 1,
        buffer_size: int = 0,
        timeout: float = 0,
        disable_shuffling: bool = False,
        skip_remainder_batch: bool = False,
        grouped_shuffling: bool = False,
        reuse_dataloader: bool = False,
        persistent_workers: bool = False,
        pin_memory: bool = False,
    ):
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id {shard_id} must lie in [0, {num_shards})")
        if num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.batch_sampler = batch_sampler
        self._frozen_batches = None if callable(batch_sampler) else Batches.from_list(batch_sampler)
        self.disable_shuffling = disable_shuffling
        self.skip_remainder_batch = skip_remainder_batch
        self.grouped_shuffling = grouped_shuffling
        self.reuse_dataloader = reuse_dataloader
        self.persistent_workers = persistent_workers and num_workers > 0
        self._dataloader = None
        self.seed = seed
        self.num_shards = num_shards
        self.shard_id = shard_id
        self.num_workers = num_workers
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.buffer_size = buffer_size
        self.timeout = timeout
        self.epoch = max(epoch, 1)  # the epoch in progress, or the next one before any next_epoch_itr()
        self.shuffle = True
        self._cur_epoch_itr: Optional[CountingIterator] = None
        self._next_epoch_itr: Optional[CountingIterator] = None

    @property
    def frozen_batches(self) -> Batches:
        """This epoch's batches (from a callable `batch_sampler`: made for the current epoch on first use)."""
        if self._frozen_batches is None:
            self._frozen_batches = Batches.from_list(self.batch_sampler(self.dataset, self.epoch))
        return self._frozen_batches

    def __len__(self) -> int:
        """Batches per epoch on this shard."""
        return math.ceil(len(self.frozen_batches) / self.num_shards)

    @property
    def n(self) -> int:
        """Upstream's alias of `iterations_in_epoch`."""
        return self.iterations_in_epoch

    @property
    def first_batch(self):
        """The first batch, collated (for a trainer's dummy step), or "DUMMY" when there are none."""
        if len(self.frozen_batches) == 0:
            return "DUMMY"
        return self.collate_fn([self.dataset[int(i)] for i in self.frozen_batches[0]])

    @property
    def next_epoch_idx(self) -> int:
        """The epoch that the next `next_epoch_itr()` call iterates."""
        if self._next_epoch_itr is not None:
            return self.epoch
        if self._cur_epoch_itr is not None and self.end_of_epoch():
            return self.epoch + 1
        return self.epoch

    def next_epoch_itr(
        self, shuffle: bool = True, fix_batches_to_gpus: bool = False, set_dataset_epoch: bool = True
    ) -> CountingIterator:
        """An iterator over the next epoch's batches (the rest of the epoch after `load_state_dict`).

        `fix_batches_to_gpus` is accepted for upstream callers; it has no effect (nothing is prefetched).
        """
        shuffle = shuffle and not self.disable_shuffling
        previous_epoch = self.epoch
        self.epoch = self.next_epoch_idx
        if set_dataset_epoch and hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        if self._next_epoch_itr is not None:
            self._cur_epoch_itr, self._next_epoch_itr = self._next_epoch_itr, None
        else:
            if callable(self.batch_sampler) and previous_epoch != self.epoch:
                self._frozen_batches = None  # the new epoch's batches
            self._cur_epoch_itr = self._iterator_for_epoch(self.epoch, shuffle)
            self.shuffle = shuffle
        return self._cur_epoch_itr

    def end_of_epoch(self) -> bool:
        return self._cur_epoch_itr is not None and not self._cur_epoch_itr.has_next()

    @property
    def iterations_in_epoch(self) -> int:
        """Batches consumed in the current epoch."""
        if self._cur_epoch_itr is not None:
            return self._cur_epoch_itr.n
        if self._next_epoch_itr is not None:
            return self._next_epoch_itr.n
        return 0

    def state_dict(self) -> dict:
        if self.end_of_epoch():
            epoch, position = self.epoch + 1, 0
        else:
            epoch, position = self.epoch, self.iterations_in_epoch
        return {"version": 2, "epoch": epoch, "iterations_in_epoch": position, "shuffle": self.shuffle}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = int(state_dict["epoch"])
        position = int(state_dict.get("iterations_in_epoch", 0))
        self.shuffle = bool(state_dict.get("shuffle", True))
        self._cur_epoch_itr = None
        if position > 0 and position == len(self) and state_dict.get("version", 1) < 2:
            # upstream's version-1 states record a finished epoch at its last position: the next epoch follows
            self.epoch, position = self.epoch + 1, 0
        if position > 0:
            if position > len(self):
                raise RuntimeError(
                    f"cannot resume the data iterator at batch {position} of epoch {self.epoch}: this epoch has "
                    f"only {len(self)} batches (the data, batch size or number of ranks changed); "
                    "restart with --reset-dataloader"
                )
            self._next_epoch_itr = self._iterator_for_epoch(self.epoch, self.shuffle, offset=position)
        else:
            self._next_epoch_itr = None

    def batch_order(self, epoch: int, shuffle: bool) -> np.ndarray:
        """This shard's batch ids for `epoch` (-1 marks an empty padding batch)."""
        num = len(self.frozen_batches)
        if shuffle:
            order = shuffled_batch_order(num, self.seed, epoch, self.num_shards if self.grouped_shuffling else 1)
        else:
            order = np.arange(num)
        return shard_batch_order(order, self.num_shards, self.shard_id)

    def _iterator_for_epoch(self, epoch: int, shuffle: bool, offset: int = 0) -> CountingIterator:
        order = self.batch_order(epoch, shuffle)
        if self.reuse_dataloader and self._dataloader is not None:
            sampler = self._dataloader.batch_sampler
            sampler.batches, sampler.order = self.frozen_batches, order[offset:]
            loader = self._dataloader
        else:
            sampler = _BatchOrderSampler(self.frozen_batches, order[offset:])
            extra = {}
            if self.num_workers > 0 and self.buffer_size > 0:
                extra["prefetch_factor"] = self.buffer_size
            loader = torch.utils.data.DataLoader(
                self.dataset,
                batch_sampler=sampler,
                collate_fn=self.collate_fn,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                timeout=self.timeout,
                persistent_workers=self.persistent_workers,
                **extra,
            )
            if self.reuse_dataloader:
                self._dataloader = loader
        itr = CountingIterator(loader, start=offset, total=len(order))
        if self.skip_remainder_batch:  # upstream drops the last batch whether or not it is full
            itr.take(max(len(order) - 1, 0))
        return itr
