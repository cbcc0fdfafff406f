"""`ListDataset`: a plain sequence (list, tensor, ...) as a FairseqDataset; a batch is the list of its items."""

from fairseq.data.base_wrapper_dataset import BaseWrapperDataset


class ListDataset(BaseWrapperDataset):
    """`dataset[i]` is `items[i]`; `sizes` (optional) gives each item's size for batching."""

    def __init__(self, dataset, sizes=None):
        super().__init__(dataset)
        self._sizes = sizes

    def __iter__(self):
        yield from self.dataset

    def collater(self, samples):
        return samples

    @property
    def sizes(self):
        return self._sizes

    def num_tokens(self, index):
        return self.sizes[index]

    def size(self, index):
        return self.sizes[index]

    def set_epoch(self, epoch: int) -> None:
        pass
