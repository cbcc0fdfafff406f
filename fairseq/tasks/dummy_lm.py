"""`--task dummy_lm`: synthetic language-model data for benchmarks (upstream's flags), no files needed.

The dictionary has the 4 special symbols plus `--dict-size` words (`word0`, `word1`, ...), padded to a
multiple of 8 as upstream. Upstream feeds one fixed sequence; here every sample is a different window of a
single random cycle through all words (the cycle and each sample's start come from `--seed`), so each
token determines the next one: the loss falls from log(vocab) towards 0 as a model learns the successor
of every word, which makes a benchmark's loss curve meaningful. Samples are `--tokens-per-sample` tokens
long, there are `--dataset-size` of them per split, and they go through the same batching, iterator and
collation as `language_modeling`, so batches have the same format.
"""

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fairseq.data.dictionary import Dictionary
from fairseq.data.monolingual_dataset import collate
from fairseq.dataclass.configs import II, opt
from fairseq.registry import register_task
from fairseq.tasks.fairseq_task import FairseqTask

logger = logging.getLogger(__name__)


@dataclass
class DummyLMConfig:
    dict_size: int = opt(49996, "number of words in the synthetic dictionary (besides the 4 special symbols)")
    dataset_size: int = opt(100000, "number of samples in each split")
    tokens_per_sample: int = opt(512, "tokens per sample")
    add_bos_token: bool = opt(False, "prepend <s> to every sample (to the source and the target)")
    max_target_positions: Optional[int] = opt(None, "maximum sequence length (default: --tokens-per-sample)")
    seed: int = II("common.seed", 1)


def _mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a fixed, well-spread hash of each uint64 (wrapping arithmetic intended)."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class DummyLMDataset(torch.utils.data.Dataset):
    """`num_items` samples; sample i is `length + 1` consecutive words of the cycle, from a start hashed from i."""

    def __init__(
        self,
        dictionary: Dictionary,
        num_words: int,
        num_items: int,
        length: int,
        seed: int,
        add_bos_token: bool = False,
    ):
        if num_words < 1 or num_items < 0 or length < 1:
            raise ValueError(
                f"dummy_lm needs --dict-size >= 1, --dataset-size >= 0 and --tokens-per-sample >= 1; "
                f"got {num_words}, {num_items}, {length}"
            )
        self.dictionary = dictionary
        self.add_bos_token = add_bos_token
        self.length = length
        self.seed = seed
        first_word = dictionary.nspecial
        # cycle[k] is followed by cycle[k + 1]: every word has exactly one successor.
        self.cycle = np.random.RandomState(seed).permutation(num_words).astype(np.int64) + first_word
        self.sizes = np.full(num_items, length, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        key = np.array([((self.seed & 0xFFFFFFFF) << 32) | (index & 0xFFFFFFFF)], dtype=np.uint64)
        start = int(_mix64(key)[0] % np.uint64(len(self.cycle)))
        positions = (start + np.arange(self.length + 1)) % len(self.cycle)
        tokens = torch.from_numpy(self.cycle[positions])
        source, target = tokens[:-1], tokens[1:]
        if self.add_bos_token:
            bos = tokens.new_full((1,), self.dictionary.bos())
            source, target = torch.cat([bos, source]), torch.cat([bos, target])
        return {"id": index, "source": source, "target": target}

    def ordered_indices(self, seed: int = 1) -> np.ndarray:
        return np.arange(len(self))  # all samples have the same size

    def collater(self, samples) -> dict:
        return collate(samples, self.dictionary.pad())


@register_task("dummy_lm", dataclass=DummyLMConfig)
class DummyLMTask(FairseqTask):
    def __init__(self, cfg: DummyLMConfig, **kwargs):
        super().__init__(cfg)
        self.dictionary = Dictionary()
        for i in range(cfg.dict_size):
            self.dictionary.add_symbol(f"word{i}")
        self.dictionary.pad_to_multiple_(8)  # matrix sizes divisible by 8 run faster
        logger.info(f"dummy_lm dictionary: {len(self.dictionary):,} types")

    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, **kwargs) -> DummyLMDataset:
        cfg = self.cfg
        self.datasets[split] = DummyLMDataset(
            self.dictionary, cfg.dict_size, cfg.dataset_size, cfg.tokens_per_sample, cfg.seed, cfg.add_bos_token
        )
        return self.datasets[split]

    def max_positions(self) -> Optional[int]:
        return self.cfg.max_target_positions or self.cfg.tokens_per_sample

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.dictionary
