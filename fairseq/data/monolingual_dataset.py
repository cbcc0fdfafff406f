"""Language-model samples and their collation into upstream fairseq's batch dict.

An item is `{"id", "source", "target"}`: `target` is a token block and `source` the same block shifted
right by one (see TokenBlockDataset). With `add_bos_token`, `<s>` is prepended to both, as upstream does
(so the first position predicts `<s>` from `<s>`). A batch is

    {"id": LongTensor[B], "nsentences": B, "ntokens": tokens in the sources,
     "net_input": {"src_tokens": LongTensor[B, T], "src_lengths": LongTensor[B]},
     "target": LongTensor[B, T]}

right-padded with the dictionary's pad; an empty list of items collates to `{}` (a padding batch).
"""

from typing import List, Optional

import numpy as np
import torch

from fairseq.data.data_utils import collate_tokens
from fairseq.data.fairseq_dataset import FairseqDataset


def collate(
    samples: List[dict], pad_idx: int, fixed_pad_length: Optional[int] = None, pad_to_bsz: Optional[int] = None
) -> dict:
    if len(samples) == 0:
        return {}
    sources = [s["source"] for s in samples]
    src_tokens = collate_tokens(sources, pad_idx, left_pad=False, pad_to_length=fixed_pad_length, pad_to_bsz=pad_to_bsz)
    if samples[0]["target"] is not None:
        target = collate_tokens(
            [s["target"] for s in samples],
            pad_idx,
            left_pad=False,
            pad_to_length=fixed_pad_length,
            pad_to_bsz=pad_to_bsz,
        )
    else:
        target = src_tokens
    lengths = torch.tensor([len(s) for s in sources], dtype=torch.long)
    return {
        "id": torch.tensor([int(s["id"]) for s in samples], dtype=torch.long),
        "nsentences": len(samples),
        "ntokens": int(lengths.sum()),
        "net_input": {"src_tokens": src_tokens, "src_lengths": lengths},
        "target": target,
    }


class MonolingualDataset(FairseqDataset):
    """Wraps a TokenBlockDataset built with `include_targets=True`.

    Args:
        dataset: items `(source, target, _)`, or token tensors (upstream's items without targets: the batch's
            target is then its source)
        sizes: block lengths (used for batching; `<s>` from `add_bos_token` is not counted, as upstream)
        src_vocab, tgt_vocab: dictionaries (`tgt_vocab` may be smaller: target ids past it become `<unk>`)
        shuffle: break ties between equal sizes randomly (from the seed) when ordering for batching
        add_bos_token: prepend `<s>` to source and target
        fixed_pad_length: pad every batch to this many positions (`--pad-to-fixed-length`)
        pad_to_bsz: pad every batch to this many rows (`--pad-to-fixed-bsz`)
        targets, add_eos_for_other_targets: upstream's keywords; only next-token targets exist here
            (targets None or ["future"])
    """

    def __init__(
        self,
        dataset,
        sizes,
        src_vocab,
        tgt_vocab=None,
        shuffle: bool = True,
        add_bos_token: bool = False,
        fixed_pad_length: Optional[int] = None,
        pad_to_bsz: Optional[int] = None,
        *,
        targets=None,
        add_eos_for_other_targets: bool = False,
    ):
        if targets not in (None, [], ["future"]):
            raise ValueError(
                f"MonolingualDataset(targets={targets!r}): only next-token targets (['future']) are "
                "supported; self and past targets are not part of this fork"
            )
        self.dataset = dataset
        self.sizes = np.asarray(sizes)
        self.vocab = src_vocab
        self.tgt_vocab = tgt_vocab if tgt_vocab is not None else src_vocab
        self.shuffle = shuffle
        self.add_bos_token = add_bos_token
        self.fixed_pad_length = fixed_pad_length
        self.pad_to_bsz = pad_to_bsz

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        item = self.dataset[index]
        if torch.is_tensor(item):  # upstream's items without targets: the collated source is the target
            source, target = item, None
        else:
            source, target, _ = item
        if target is not None and len(self.tgt_vocab) < len(self.vocab):  # --output-dictionary-size
            target = target.masked_fill(target >= len(self.tgt_vocab), self.tgt_vocab.unk())
        if self.add_bos_token:
            source = torch.cat([source.new_full((1,), self.vocab.bos()), source])
            if target is not None:
                target = torch.cat([target.new_full((1,), self.tgt_vocab.bos()), target])
        return {"id": int(index), "source": source, "target": target}

    def ordered_indices(self, seed: int = 1) -> np.ndarray:
        """Indices sorted by size; equal sizes in a random order from `seed` (upstream's order)."""
        if self.shuffle:
            tie_break = np.random.RandomState(seed).permutation(len(self))
        else:
            tie_break = np.arange(len(self))
        return np.lexsort([tie_break, self.sizes])

    def collater(self, samples: List[dict]) -> dict:
        return collate(samples, self.vocab.pad(), self.fixed_pad_length, self.pad_to_bsz)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
