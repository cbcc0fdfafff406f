"""Data: the dictionary, binarized (MMIDIDX) datasets, batching helpers, and upstream's dataset classes.

Upstream's names are exported here as upstream does (`from fairseq.data import TokenBlockDataset`);
upstream datasets this fork leaves out (backtranslation, audio, masking) raise an ImportError saying so.
"""

from fairseq.data import data_utils, iterators  # noqa: F401 (upstream's submodule attributes)
from fairseq.data.base_wrapper_dataset import BaseWrapperDataset
from fairseq.data.concat_dataset import ConcatDataset
from fairseq.data.dictionary import Dictionary, TruncatedDictionary
from fairseq.data.fairseq_dataset import EpochListening, FairseqDataset, FairseqIterableDataset
from fairseq.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from fairseq.data.iterators import CountingIterator, EpochBatchIterator, GroupedIterator, ShardedIterator
from fairseq.data.list_dataset import ListDataset
from fairseq.data.monolingual_dataset import MonolingualDataset
from fairseq.data.resampling_dataset import ResamplingDataset
from fairseq.data.token_block_dataset import RandomCropDataset, TokenBlockDataset, TruncateDataset
from fairseq.upstream_absent import absent_name as _absent_name

__all__ = [
    "BaseWrapperDataset",
    "ConcatDataset",
    "CountingIterator",
    "Dictionary",
    "EpochBatchIterator",
    "EpochListening",
    "FairseqDataset",
    "FairseqIterableDataset",
    "GroupedIterator",
    "ListDataset",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "MonolingualDataset",
    "RandomCropDataset",
    "ResamplingDataset",
    "ShardedIterator",
    "TokenBlockDataset",
    "TruncateDataset",
    "TruncatedDictionary",
]


def __getattr__(name):
    return _absent_name(__name__, name)
