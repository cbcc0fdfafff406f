"""Upstream's dataset base classes, for datasets written against fairseq (`--user-dir` plug-ins, scripts).

A `FairseqDataset` is a map-style torch Dataset that also knows item sizes (for batching by size), merges
items into a batch (`collater`) and hears about epoch changes (`set_epoch`). This fork's own datasets
(TokenBlockDataset, MonolingualDataset, ...) derive from it, so `isinstance(ds, FairseqDataset)` holds
for them as upstream. Sizes default to the `sizes` array where a dataset has one; batching goes through
this fork's `fairseq.data.batching` (upstream's batch boundaries).
"""

from typing import List, Optional

import numpy as np
import torch

from fairseq.data.batching import filter_by_size_limits, upstream_batch_by_size


class EpochListening:
    """Mixin for datasets that change with the epoch (`set_epoch` is called before each one)."""

    @property
    def can_reuse_epoch_itr_across_epochs(self) -> bool:
        """Whether batches stay the same across epochs, so an epoch iterator may be reused (upstream's
        name); a dataset that resamples each epoch says False."""
        return True

    def set_epoch(self, epoch: int) -> None:
        pass


class FairseqDataset(torch.utils.data.Dataset, EpochListening):
    """A dataset with upstream fairseq's interface (see the module docstring)."""

    def __getitem__(self, index):
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def collater(self, samples: list):
        """Merge a list of items into a batch (an empty list must give an empty batch)."""
        raise NotImplementedError

    def _sizes_array(self) -> np.ndarray:
        sizes = getattr(self, "sizes", None)
        if isinstance(sizes, list) and len(sizes) == 1:
            sizes = sizes[0]
        if sizes is None:
            raise NotImplementedError(f"{type(self).__name__} has no sizes; implement num_tokens and size")
        return np.asarray(sizes)

    def num_tokens(self, index: int) -> int:
        """Tokens of item `index`, the value --max-tokens limits."""
        return int(self._sizes_array()[index])

    def num_tokens_vec(self, indices) -> np.ndarray:
        """num_tokens of many items at once (faster batching)."""
        return self._sizes_array()[np.asarray(indices, dtype=np.int64)]

    def size(self, index: int):
        """Size of item `index` as the positions limit sees it (a number, or a tuple for pairs)."""
        return self._sizes_array()[index]

    def ordered_indices(self) -> np.ndarray:
        """The order in which items are batched (by default the dataset's order)."""
        return np.arange(len(self), dtype=np.int64)

    @property
    def supports_prefetch(self) -> bool:
        return False

    def attr(self, attr: str, index: int):
        return getattr(self, attr, None)

    def prefetch(self, indices) -> None:
        raise NotImplementedError

    def get_batch_shapes(self):
        """Fixed batch shapes [(bsz, len), ...] to batch into, or None (upstream's TPU option: unsupported)."""
        return None

    def batch_by_size(
        self,
        indices,
        max_tokens: Optional[int] = None,
        max_sentences: Optional[int] = None,
        required_batch_size_multiple: int = 1,
    ) -> List[np.ndarray]:
        """Batches of `indices` (in their order): at most `max_tokens` tokens (count x longest item) and
        `max_sentences` items each, sized in multiples of `required_batch_size_multiple` (upstream's rule)."""
        if self.get_batch_shapes() is not None:
            raise ValueError("fixed batch shapes (get_batch_shapes, upstream's TPU batching) are not supported")
        indices = np.asarray(indices, dtype=np.int64)
        try:
            num_tokens_vec = self.num_tokens_vec(indices).astype(np.int64)
        except NotImplementedError:
            num_tokens_vec = None
        return upstream_batch_by_size(
            indices,
            num_tokens_fn=self.num_tokens,
            num_tokens_vec=num_tokens_vec,
            max_tokens=max_tokens,
            max_sentences=max_sentences,
            required_batch_size_multiple=required_batch_size_multiple,
        )

    def filter_indices_by_size(self, indices, max_sizes):
        """(kept indices, ignored indices as a list): items whose size exceeds `max_sizes` are dropped."""
        return filter_by_size_limits(indices, self, max_sizes)

    @property
    def supports_fetch_outside_dataloader(self) -> bool:
        """Whether items may be read outside the DataLoader's workers (upstream's name)."""
        return True


class FairseqIterableDataset(torch.utils.data.IterableDataset, EpochListening):
    """An iterable dataset with upstream's epoch hook."""

    def __iter__(self):
        raise NotImplementedError
