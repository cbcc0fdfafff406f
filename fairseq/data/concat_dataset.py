"""`ConcatDataset`: datasets one after the other, each optionally repeated (`sample_ratios`), as upstream's.

Item i belongs to the first dataset whose cumulative length exceeds i; an up-sampled dataset (ratio r)
takes r times its length and repeats its items in order. Batches are collated by the first dataset's
collater (all parts are expected to be of one kind). `load_indexed_dataset(..., combine=True)` uses it for
`valid`, `valid1`, `valid2`, ... (--combine-valid-subsets).
"""

import bisect
from typing import List, Sequence, Union

import numpy as np
from torch.utils.data.dataloader import default_collate

from fairseq.data.fairseq_dataset import FairseqDataset


class ConcatDataset(FairseqDataset):
    @staticmethod
    def cumsum(sequence: Sequence, sample_ratios: Sequence) -> List[int]:
        """End offsets of the parts: [len0 * r0, len0 * r0 + len1 * r1, ...]."""
        ends, total = [], 0
        for dataset, ratio in zip(sequence, sample_ratios):
            total += int(ratio * len(dataset))
            ends.append(total)
        return ends

    def __init__(self, datasets, sample_ratios: Union[int, Sequence] = 1):
        super().__init__()
        self.datasets = list(datasets)
        if not self.datasets:
            raise ValueError("ConcatDataset needs at least one dataset")
        if isinstance(sample_ratios, int):
            sample_ratios = [sample_ratios] * len(self.datasets)
        if len(sample_ratios) != len(self.datasets):
            raise ValueError(f"ConcatDataset: {len(sample_ratios)} sample ratios for {len(self.datasets)} datasets")
        self.sample_ratios = list(sample_ratios)
        self.cumulative_sizes = self.cumsum(self.datasets, self.sample_ratios)
        self.real_sizes = [len(d) for d in self.datasets]

    def __len__(self) -> int:
        return self.cumulative_sizes[-1]

    def _get_dataset_and_sample_index(self, idx: int):
        dataset_idx = bisect.bisect_right(self.cumulative_sizes, idx)
        start = self.cumulative_sizes[dataset_idx - 1] if dataset_idx > 0 else 0
        return dataset_idx, (idx - start) % self.real_sizes[dataset_idx]

    def __getitem__(self, idx: int):
        dataset_idx, sample_idx = self._get_dataset_and_sample_index(int(idx))
        return self.datasets[dataset_idx][sample_idx]

    def collater(self, samples, **extra_args):
        first = self.datasets[0]
        if hasattr(first, "collater"):
            return first.collater(samples, **extra_args)
        return default_collate(samples, **extra_args)

    def size(self, idx: int):
        dataset_idx, sample_idx = self._get_dataset_and_sample_index(int(idx))
        part = self.datasets[dataset_idx]
        return part.size(sample_idx) if hasattr(part, "size") else np.asarray(part.sizes)[sample_idx]

    def num_tokens(self, index: int):
        return np.max(self.size(index))

    def attr(self, attr: str, index: int):
        return getattr(self.datasets[bisect.bisect_right(self.cumulative_sizes, index)], attr, None)

    @property
    def sizes(self) -> np.ndarray:
        parts = []
        for dataset, ratio in zip(self.datasets, self.sample_ratios):
            sizes = dataset.sizes
            if isinstance(sizes, list):  # upstream: only datasets with a single size array
                sizes = sizes[0]
            sizes = np.asarray(sizes)
            repeats = int(ratio * len(dataset))  # whole repeats, then the start of one more, as __getitem__
            parts.append(np.resize(sizes, repeats) if len(sizes) else sizes)
        return np.concatenate(parts)

    @property
    def supports_prefetch(self) -> bool:
        return all(getattr(d, "supports_prefetch", False) for d in self.datasets)

    def ordered_indices(self) -> np.ndarray:
        """Indices sorted by size (numpy's default sort, as upstream); for pairs ([N, 2] sizes) by target, then
        source size (stable)."""
        sizes = self.sizes
        if sizes.ndim > 1 and sizes.shape[1] > 1:
            order = np.argsort(sizes[:, 1], kind="mergesort")
            return order[np.argsort(sizes[order, 0], kind="mergesort")]
        return np.argsort(sizes)

    def prefetch(self, indices) -> None:
        start = 0
        for end, dataset in zip(self.cumulative_sizes, self.datasets):
            real = len(dataset)
            mine = [(i - start) % real for i in indices if start <= i < end]
            if getattr(dataset, "supports_prefetch", False):
                dataset.prefetch(mine)
            start = end

    @property
    def can_reuse_epoch_itr_across_epochs(self) -> bool:
        return all(getattr(d, "can_reuse_epoch_itr_across_epochs", True) for d in self.datasets)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        for dataset in self.datasets:
            if hasattr(dataset, "set_epoch"):
                dataset.set_epoch(epoch)
