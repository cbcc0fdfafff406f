"""Loading binarized datasets and padding token lists into batches."""

import logging
import os
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from fairseq.data.indexed_dataset import MMapIndexedDataset, data_file_path

logger = logging.getLogger(__name__)

# (real .bin path, mtime_ns, size, dictionary length) of datasets already checked in this process, so the
# max-id scan runs once per file however many epochs or shards reopen it.
_checked_datasets: Dict[Tuple[str, int, int, int], bool] = {}


# The max-id check reads every token of a dataset up to this size; a larger one is checked on evenly
# spaced windows (beginning and end included), so opening a 100 GB dataset does not read 100 GB.
FULL_SCAN_MAX_TOKENS = 1 << 27
SAMPLE_WINDOWS = 64
SAMPLE_WINDOW_TOKENS = 1 << 18


def load_indexed_dataset(path: str, dictionary=None, dataset_impl: Optional[str] = None,
                         combine: bool = False) -> Optional[MMapIndexedDataset]:
    """Open the MMIDIDX dataset at prefix `path` (`path.bin` + `path.idx`), or return None if absent.

    With a `dictionary`, fails if the data holds an id the dictionary does not have (a dict.txt from
    another preprocessing run). The check costs nothing when the stored dtype cannot represent such an
    id; otherwise the tokens are scanned once per process (see FULL_SCAN_MAX_TOKENS), in bounded chunks.
    """
    if dataset_impl not in (None, "mmap"):
        raise ValueError(f"--dataset-impl {dataset_impl!r} is not supported: only 'mmap' (MMIDIDX) datasets exist here")
    if combine:
        raise ValueError("load_indexed_dataset(combine=True) is not supported; pass each shard's prefix")
    if not MMapIndexedDataset.exists(path):
        return None
    dataset = MMapIndexedDataset(path)
    if dictionary is not None:
        check_dictionary_matches(dataset, dictionary, getattr(dictionary, "path", None))
    return dataset


def _token_windows(tokens: np.ndarray):
    n = len(tokens)
    if n <= FULL_SCAN_MAX_TOKENS:
        for start in range(0, n, 1 << 24):
            yield tokens[start: start + (1 << 24)]
        return
    last = n - SAMPLE_WINDOW_TOKENS
    for k in range(SAMPLE_WINDOWS):
        start = last * k // (SAMPLE_WINDOWS - 1)
        yield tokens[start: start + SAMPLE_WINDOW_TOKENS]


def check_dictionary_matches(dataset: MMapIndexedDataset, dictionary, dict_name: Optional[str] = None) -> None:
    """Raise if `dataset` holds token ids outside `dictionary` (see FULL_SCAN_MAX_TOKENS for the cost)."""
    vocab = len(dictionary)
    dtype = dataset.dtype
    if dtype.kind == "u" and np.iinfo(dtype).max < vocab:
        return  # no storable id can reach past the dictionary
    bin_path = data_file_path(dataset.path)
    st = os.stat(bin_path)
    key = (os.path.realpath(bin_path), st.st_mtime_ns, st.st_size, vocab)
    if key in _checked_datasets:
        return
    max_id, min_id = -1, 0
    for chunk in _token_windows(dataset.tokens):
        if chunk.size:
            max_id = max(max_id, int(chunk.max()))
            min_id = min(min_id, int(chunk.min()))
    if max_id >= vocab or min_id < 0:
        where = dict_name or os.path.join(os.path.dirname(dataset.path) or ".", "dict.txt")
        bad = max_id if max_id >= vocab else min_id
        raise ValueError(
            f"dictionary does not match the data: {bin_path} holds token id {bad} but the dictionary "
            f"({where}) has {vocab} entries; binarize the data with this dict.txt (fairseq-preprocess --srcdict)"
        )
    _checked_datasets[key] = True


def collate_tokens(values: Sequence[torch.Tensor], pad_idx: int, eos_idx: Optional[int] = None,
                   left_pad: bool = False, move_eos_to_beginning: bool = False,
                   pad_to_length: Optional[int] = None, pad_to_multiple: int = 1,
                   pad_to_bsz: Optional[int] = None) -> torch.Tensor:
    """Stack 1-D tensors into a [B, T] tensor filled with `pad_idx` (right padding unless `left_pad`).

    `move_eos_to_beginning` rotates each row's last token (or `eos_idx`) to the front, as for
    teacher-forced decoder inputs; T is rounded up to `pad_to_multiple` and B up to `pad_to_bsz`.
    """
    if len(values) == 0:
        raise ValueError("collate_tokens needs at least one tensor")
    width = max(v.size(0) for v in values)
    if pad_to_length is not None:
        width = max(width, pad_to_length)
    if pad_to_multiple > 1 and width % pad_to_multiple:
        width += pad_to_multiple - width % pad_to_multiple
    rows = len(values) if pad_to_bsz is None else max(len(values), pad_to_bsz)
    out = values[0].new_full((rows, width), pad_idx)
    for i, v in enumerate(values):
        n = v.size(0)
        dst = out[i, width - n:] if left_pad else out[i, :n]
        if move_eos_to_beginning:
            if n == 0:
                continue
            dst[0] = v[-1] if eos_idx is None else eos_idx
            dst[1:] = v[:-1]
        else:
            dst.copy_(v)
    return out
