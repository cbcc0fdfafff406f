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
"""

import math
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Union

import numpy as np
import torch

from fairseq.data.batching import Batches


class CountingIterator:
    """Wraps an iterable and counts the items consumed (`n`), out of `total`."""

    def __init__(self, iterable: Iterable, start: Optional[int] = None, total: Optional[int] = None):
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
        """Stop after `count` items in total (counting those already consumed)."""
        self.total = min(self.total, count)
        return self


class GroupedIterator(CountingIterator):
    """Lists of `chunk_size` consecutive items (the last one may be shorter); `n` counts lists."""

    def __init__(self, iterable: CountingIterator, chunk_size: int):
        if chunk_size < 1:
            raise ValueError(f"--update-freq must be >= 1, got {chunk_size}")
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


class _BatchOrderSampler:
    """Batch sampler for the DataLoader: the batches at `order`, as lists of ints (-1: an empty batch)."""

    def __init__(self, batches: Batches, order: np.ndarray):
        self.batches = batches
        self.order = order

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[List[int]]:
        for b in self.order.tolist():
            yield [] if b < 0 else self.batches[b].tolist()


def shuffled_batch_order(num_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's batch order, as upstream shuffles it."""
    return np.random.RandomState(seed + epoch).permutation(num_batches)


def shard_batch_order(order: np.ndarray, num_shards: int, shard_id: int) -> np.ndarray:
    """Batches `shard_id::num_shards` of `order`, padded with -1 (empty batch) to ceil(len / num_shards)."""
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"shard_id {shard_id} must lie in [0, {num_shards}) (num_shards {num_shards})")
    per_shard = math.ceil(len(order) / num_shards)
    mine = order[shard_id::num_shards]
    return np.concatenate([mine, np.full(per_shard - len(mine), -1, dtype=mine.dtype)])


class EpochBatchIterator:
    """Iterates over `dataset` in `batch_sampler`'s batches, epoch after epoch (see the module docstring).

    Args:
        dataset: map-style dataset whose items `collate_fn` merges into a batch
        collate_fn: list of items -> batch (must accept an empty list)
        batch_sampler: the batches: a `Batches` or a sequence of index sequences
        seed: shuffling seed (`--seed`)
        num_shards, shard_id: data-parallel world size and rank
        num_workers: DataLoader worker processes (0: load in the calling process)
        epoch: the epoch the first `next_epoch_itr()` starts (1-based)
        pin_memory: pin batches in page-locked memory (only done when CUDA is available)
        buffer_size: batches each worker prepares ahead (DataLoader's prefetch_factor; 0: its default)
        timeout: seconds to wait for a worker's batch (0: forever)
    """

    def __init__(self, dataset, collate_fn: Callable, batch_sampler: Union[Batches, Sequence[Sequence[int]]],
                 seed: int = 1, num_shards: int = 1, shard_id: int = 0, num_workers: int = 0, epoch: int = 1,
                 pin_memory: bool = False, buffer_size: int = 0, timeout: float = 0):
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id {shard_id} must lie in [0, {num_shards})")
        if num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.frozen_batches = Batches.from_list(batch_sampler)
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

    def __len__(self) -> int:
        """Batches per epoch on this shard."""
        return math.ceil(len(self.frozen_batches) / self.num_shards)

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

    def next_epoch_itr(self, shuffle: bool = True, fix_batches_to_gpus: bool = False,
                       set_dataset_epoch: bool = True) -> CountingIterator:
        """An iterator over the next epoch's batches (the rest of the epoch after `load_state_dict`).

        `fix_batches_to_gpus` is accepted for upstream callers; it has no effect (nothing is prefetched).
        """
        self.epoch = self.next_epoch_idx
        if set_dataset_epoch and hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        if self._next_epoch_itr is not None:
            self._cur_epoch_itr, self._next_epoch_itr = self._next_epoch_itr, None
        else:
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
        order = shuffled_batch_order(num, self.seed, epoch) if shuffle else np.arange(num)
        return shard_batch_order(order, self.num_shards, self.shard_id)

    def _iterator_for_epoch(self, epoch: int, shuffle: bool, offset: int = 0) -> CountingIterator:
        order = self.batch_order(epoch, shuffle)
        sampler = _BatchOrderSampler(self.frozen_batches, order[offset:])
        extra = {}
        if self.num_workers > 0 and self.buffer_size > 0:
            extra["prefetch_factor"] = self.buffer_size
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=sampler, collate_fn=self.collate_fn, num_workers=self.num_workers,
            pin_memory=self.pin_memory, timeout=self.timeout, **extra,
        )
        return CountingIterator(loader, start=offset, total=len(order))

