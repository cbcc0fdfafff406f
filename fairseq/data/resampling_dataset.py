"""`ResamplingDataset`: each epoch, a fresh random sample of a dataset's items (upstream's class and draws).

Epoch e draws `ceil(len(dataset) * size_ratio)` item indices with `numpy.random.RandomState([42, seed, e])`
(`choice`, with or without replacement, optionally weighted), the same draws as upstream, so a run reads the
same items. With `batch_by_size` the epoch's items are ordered by size for batching.
"""

import math

import numpy as np

from fairseq.data.base_wrapper_dataset import BaseWrapperDataset


class ResamplingDataset(BaseWrapperDataset):
    """Args: dataset; weights (one per item, normalized; None: uniform); replace (sample with replacement);
    size_ratio (epoch size / dataset size; < 1 without replacement); batch_by_size; seed; epoch."""

    def __init__(
        self,
        dataset,
        weights=None,
        replace: bool = True,
        size_ratio: float = 1.0,
        batch_by_size: bool = True,
        seed: int = 0,
        epoch: int = 1,
    ):
        super().__init__(dataset)
        if weights is None:
            self.weights = None
        else:
            if len(weights) != len(dataset):
                raise ValueError(f"ResamplingDataset: {len(weights)} weights for a dataset of {len(dataset)} items")
            weights = np.asarray(weights, dtype=np.float64)
            self.weights = weights / weights.sum()
        if size_ratio <= 0:
            raise ValueError(f"ResamplingDataset: size_ratio must be positive, got {size_ratio}")
        if not replace and size_ratio >= 1:
            raise ValueError(f"ResamplingDataset: sampling without replacement needs size_ratio < 1, got {size_ratio}")
        self.replace = replace
        self.size_ratio = float(size_ratio)
        self.actual_size = int(math.ceil(len(dataset) * self.size_ratio))
        self.batch_by_size = batch_by_size
        self.seed = seed
        self._cur_epoch = None
        self._cur_indices = None
        self.set_epoch(epoch)

    def __getitem__(self, index):
        return self.dataset[int(self._cur_indices[index])]

    def __len__(self) -> int:
        return self.actual_size

    @property
    def sizes(self):
        sizes = self.dataset.sizes
        if isinstance(sizes, list):
            return [np.asarray(s)[self._cur_indices] for s in sizes]
        return np.asarray(sizes)[self._cur_indices]

    def num_tokens(self, index):
        return self.dataset.num_tokens(int(self._cur_indices[index]))

    def size(self, index):
        return self.dataset.size(int(self._cur_indices[index]))

    def ordered_indices(self) -> np.ndarray:
        if self.batch_by_size:
            return np.lexsort([np.arange(len(self)), self.sizes])
        return np.arange(len(self))

    def prefetch(self, indices) -> None:
        self.dataset.prefetch(self._cur_indices[indices])

    @property
    def can_reuse_epoch_itr_across_epochs(self) -> bool:
        return False  # the items change every epoch

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if epoch == self._cur_epoch:
            return
        self._cur_epoch = epoch
        rng = np.random.RandomState([42, self.seed % (2**32), epoch])  # upstream's seeding
        self._cur_indices = rng.choice(len(self.dataset), self.actual_size, replace=self.replace, p=self.weights)
