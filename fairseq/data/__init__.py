"""Data: the dictionary, binarized (MMIDIDX) datasets and batching helpers."""

from fairseq.data.dictionary import Dictionary
from fairseq.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

__all__ = ["Dictionary", "MMapIndexedDataset", "MMapIndexedDatasetBuilder"]
