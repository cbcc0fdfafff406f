"""Token blocks for language modeling, with upstream fairseq's break modes and block boundaries.

The underlying dataset is a sequence of items (sentences, each ending in `</s>`); the token stream is
their concatenation. Break modes (`--sample-break-mode`):

- `none`: consecutive blocks of exactly `block_size` tokens over the stream, crossing item boundaries;
  the last block holds the remainder.
- `complete`: blocks of whole items, greedily filled while the total stays <= `block_size`; an item longer
  than `block_size` forms a block on its own.
- `complete_doc`: like `complete`, but blocks never cross a document boundary. Documents are separated by
  items of `document_sep_len` tokens (an empty line, i.e. just `</s>`); separators belong to no block and
  blocks of a single token are dropped.
- `eos`: one block per item, whatever its length (`block_size` is ignored).

With `include_targets`, an item is `(source, target, None)`: `target` is the block and `source` is the block
shifted right by one, starting with the token before the block (or `</s>` when the block starts an item).

Boundaries are computed with vectorized numpy (plus one cheap step per block for the greedy modes) and
stored as four small integer arrays per block; tokens are read lazily from the dataset.
"""

from typing import Optional, Tuple

import numpy as np
import torch

from fairseq.data.fairseq_dataset import FairseqDataset
from fairseq.data.indexed_dataset import MMapIndexedDataset

BREAK_MODES = ("none", "complete", "complete_doc", "eos")


def _greedy_blocks(
    sizes: np.ndarray, offsets: np.ndarray, block_size: int, document_sep_len: Optional[int]
) -> Tuple[np.ndarray, np.ndarray]:
    """Blocks of whole items for `complete` (document_sep_len None) and `complete_doc`, as item ranges.

    From item i a block takes every following item while its total stays <= block_size, and at least up to
    the first non-empty item (an empty block accepts any item, even an oversized one); with documents it
    also stops at the next separator, and separators are skipped. One binary search per block.
    """
    n = len(sizes)
    nonempty = np.flatnonzero(sizes > 0) if n and sizes.min() == 0 else None  # only needed with empty items
    seps = np.flatnonzero(sizes == document_sep_len) if document_sep_len is not None else None
    find_offset = offsets.searchsorted
    first_items, end_items = [], []
    i = 0
    while seps is not None and i < n and sizes[i] == document_sep_len:
        i += 1
    while i < n:
        end = int(find_offset(offsets[i] + block_size, "right")) - 1
        first_filled = i
        if nonempty is not None:
            k = int(nonempty.searchsorted(i))
            first_filled = int(nonempty[k]) if k < len(nonempty) else n
        end = max(end, min(first_filled + 1, n))
        if seps is not None:
            k = int(seps.searchsorted(i))
            end = min(end, int(seps[k]) if k < len(seps) else n)
        first_items.append(i)
        end_items.append(end)
        i = end
        while seps is not None and i < n and sizes[i] == document_sep_len:
            i += 1
    return np.asarray(first_items, dtype=np.int64), np.asarray(end_items, dtype=np.int64)


def block_slices(
    sizes, block_size: Optional[int], break_mode: str = "none", document_sep_len: int = 1
) -> Tuple[np.ndarray, np.ndarray]:
    """Token-stream `[start, end)` of every block, as two int64 arrays, for items of lengths `sizes`."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if break_mode is None:
        break_mode = "none"
    if break_mode not in BREAK_MODES:
        raise ValueError(f"--sample-break-mode {break_mode!r} is not one of {', '.join(BREAK_MODES)}")
    if break_mode != "eos" and (block_size is None or block_size <= 0):
        raise ValueError(
            f"--tokens-per-sample must be a positive number for --sample-break-mode {break_mode}, got {block_size}"
        )
    n = len(sizes)
    offsets = np.zeros(n + 1, dtype=np.int64)  # offsets[i]: stream position where item i starts
    np.cumsum(sizes, out=offsets[1:])
    total = int(offsets[-1])

    if break_mode == "none":
        starts = np.arange(0, total, block_size, dtype=np.int64)
        return starts, np.minimum(starts + block_size, total)
    if break_mode == "eos":
        return offsets[:-1].copy(), offsets[1:].copy()

    first, end = _greedy_blocks(sizes, offsets, block_size, document_sep_len if break_mode == "complete_doc" else None)
    starts, ends = offsets[first], offsets[end]
    # A trailing run of empty items makes no block; complete_doc also drops blocks of a single token.
    keep = ends - starts > (1 if break_mode == "complete_doc" else 0)
    return starts[keep], ends[keep]


def final_block_slices(
    sizes, block_size: Optional[int], break_mode: str, document_sep_len: int = 1, at_end: bool = False
) -> Tuple[np.ndarray, np.ndarray, int]:
    """`block_slices` of a stream known only up to its last item (the streaming task's window): the blocks that
    no later item can change, and the stream position to continue from (the end of the last of them, 0 if
    none). All but the last block are final (a greedy block ends at an item that did not fit, a `none` block at
    a fixed position); `at_end`: the stream ends here, every block is final. Slicing again from the returned
    position, with more items, gives the blocks slicing the whole stream gives."""
    starts, ends = block_slices(sizes, block_size, break_mode, document_sep_len)
    if not at_end:
        starts, ends = starts[:-1], ends[:-1]
    return starts, ends, int(ends[-1]) if len(ends) else 0


def _smallest_int_dtype(max_value: int):
    return np.int32 if max_value < 2**31 else np.int64


class TokenBlockDataset(FairseqDataset):
    """Blocks of tokens over `dataset` (see the module docstring for the break modes).

    Args:
        dataset: items indexable as 1-D integer tensors (e.g. an MMapIndexedDataset)
        sizes: the items' lengths
        block_size: tokens per block (`--tokens-per-sample`)
        pad, eos: the dictionary's pad and eos ids
        break_mode: none | complete | complete_doc | eos
        include_targets: return `(source, target, None)` instead of the block
        document_sep_len: length of the items that separate documents (complete_doc)
    """

    def __init__(
        self,
        dataset,
        sizes,
        block_size: Optional[int],
        pad: int,
        eos: int,
        break_mode: Optional[str] = "none",
        include_targets: bool = False,
        document_sep_len: int = 1,
    ):
        super().__init__()
        self.dataset = dataset
        self.pad = pad
        self.eos = eos
        self.include_targets = include_targets
        self.break_mode = break_mode or "none"
        sizes = np.asarray(sizes)
        if len(sizes) != len(dataset):
            raise ValueError(f"TokenBlockDataset: {len(sizes)} sizes for a dataset of {len(dataset)} items")
        self._item_sizes = sizes  # kept (a view of a memmap for binarized data) for upstream's slice views
        starts, ends = block_slices(sizes, block_size, self.break_mode, document_sep_len)
        lengths = ends - starts
        self.sizes = lengths.astype(_smallest_int_dtype(int(lengths.max()) if len(lengths) else 0))
        if self.break_mode == "eos":
            self._first_item = self._first_offset = self._last_item = None  # block i is item i
            return
        # Map each block to (first item, offset inside it, last item) for lazy reads.
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        first_item = np.searchsorted(offsets, starts, side="right") - 1
        last_item = np.searchsorted(offsets, np.maximum(ends - 1, starts), side="right") - 1
        index_dtype = _smallest_int_dtype(len(sizes))
        self._first_item = first_item.astype(index_dtype)
        self._last_item = last_item.astype(index_dtype)
        first_offset = starts - offsets[first_item]
        self._first_offset = first_offset.astype(_smallest_int_dtype(int(first_offset.max()) if len(starts) else 0))

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def block_to_dataset_index(self) -> np.ndarray:
        """Upstream's view, [blocks, 3] int64: (first item, offset of the block in it, last item) per block."""
        if self.break_mode == "eos":
            items = np.arange(len(self.sizes), dtype=np.int64)
            return np.stack([items, np.zeros_like(items), items], axis=1)
        return np.stack(
            [self._first_item.astype(np.int64), self._first_offset.astype(np.int64), self._last_item.astype(np.int64)],
            axis=1,
        )

    @property
    def slice_indices(self) -> np.ndarray:
        """Upstream's view, [blocks, 2] int64: each block's [start, end) in the token stream of all items
        (computed on demand: the dataset stores only per-block item positions)."""
        offsets = np.zeros(len(self._item_sizes) + 1, dtype=np.int64)
        np.cumsum(self._item_sizes, out=offsets[1:])
        index = self.block_to_dataset_index
        starts = offsets[index[:, 0]] + index[:, 1]
        return np.stack([starts, starts + self.sizes.astype(np.int64)], axis=1)

    def _read(self, first: int, last: int, begin: int, length: int) -> torch.Tensor:
        """Tokens `[begin, begin + length)` of the stream that starts at item `first`'s first token."""
        if isinstance(self.dataset, MMapIndexedDataset):
            # Views of the first and last items (only the needed tokens are copied, however long the
            # items), and one contiguous read for the items in between.
            head = self.dataset.get_numpy(first)[begin : begin + length]
            if first == last:
                return torch.from_numpy(head.astype(np.int64))
            middle = self.dataset[first + 1 : last]
            tail = self.dataset.get_numpy(last)[: length - len(head) - len(middle)]
            return torch.cat([torch.from_numpy(head.astype(np.int64)), middle, torch.from_numpy(tail.astype(np.int64))])
        buffer = torch.cat([torch.as_tensor(self.dataset[k]).long() for k in range(first, last + 1)])
        return buffer[begin : begin + length]

    def __getitem__(self, index: int):
        index = int(index)
        if self.break_mode == "eos":
            block = torch.as_tensor(self.dataset[index]).long()
            prev = self.eos
        else:
            first, last = int(self._first_item[index]), int(self._last_item[index])
            offset, length = int(self._first_offset[index]), int(self.sizes[index])
            if offset > 0 and self.include_targets:  # the token before the block is inside item `first`
                tokens = self._read(first, last, offset - 1, length + 1)
                prev, block = int(tokens[0]), tokens[1:]
            else:
                block = self._read(first, last, offset, length)
                prev = self.eos
        if not self.include_targets:
            return block
        source = torch.empty_like(block)
        if len(block):
            source[0] = prev
            source[1:] = block[:-1]
        return source, block, None

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


class TruncateDataset(FairseqDataset):
    """Items cut to at most `truncation_length` tokens (`--shorten-method truncate`)."""

    def __init__(self, dataset, truncation_length: int):
        self.dataset = dataset
        self.truncation_length = truncation_length
        self.sizes = np.minimum(np.asarray(dataset.sizes), truncation_length)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.dataset[index][: self.truncation_length]

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


class RandomCropDataset(TruncateDataset):
    """A random window of `truncation_length` tokens of each longer item (`--shorten-method random_crop`).

    The window depends only on (seed, epoch, index), so every worker and every rerun picks the same one.
    """

    def __init__(self, dataset, truncation_length: int, seed: int = 1):
        super().__init__(dataset, truncation_length)
        self.seed = seed
        self.epoch = 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        super().set_epoch(epoch)

    def __getitem__(self, index: int) -> torch.Tensor:
        item = self.dataset[index]
        excess = len(item) - self.truncation_length
        if excess <= 0:
            return item
        start = int(np.random.default_rng([self.seed, self.epoch, int(index)]).integers(0, excess + 1))
        return item[start : start + self.truncation_length]


def maybe_shorten_dataset(
    dataset, split: str, shorten_data_split_list: str, shorten_method: str, tokens_per_sample: int, seed: int
):
    """Apply `--shorten-method` to `split` if it is in `--shorten-data-split-list` (empty list: all splits)."""
    splits = [s for s in (shorten_data_split_list or "").split(",") if s]
    if shorten_method in (None, "none") or (splits and split not in splits):
        return dataset
    if shorten_method == "truncate":
        return TruncateDataset(dataset, tokens_per_sample)
    if shorten_method == "random_crop":
        return RandomCropDataset(dataset, tokens_per_sample, seed)
    raise ValueError(f"--shorten-method {shorten_method!r} is not one of none, truncate, random_crop")
