"""Loading binarized datasets, padding token lists into batches, and upstream's `data_utils` helpers
(`numpy_seed`, `batch_by_size`, `collate_tokens`, ...) over this fork's batching."""

import contextlib
import itertools
import logging
import os
import re
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from fairseq.data.concat_dataset import ConcatDataset
from fairseq.data.indexed_dataset import MMapIndexedDataset, check_dataset_impl, data_file_path
from fairseq.dataclass.flag_values import task_data_dir

logger = logging.getLogger(__name__)

# (real .bin path, mtime_ns, size) -> (smallest id, largest id, whether every token was read) of datasets
# already scanned in this process, so the scan runs once per file however many epochs, shards or
# dictionaries reopen it.
_scanned_datasets: Dict[Tuple[str, int, int], Tuple[int, int, bool]] = {}
# (real .bin path, mtime_ns, size, dictionary length) already warned about (see _warn_if_unused_entries).
_warned_datasets: Dict[Tuple[str, int, int, int], bool] = {}


# The max-id check reads every token of a dataset up to this size; a larger one is checked on evenly
# spaced windows (beginning and end included), so opening a 100 GB dataset does not read 100 GB.
FULL_SCAN_MAX_TOKENS = 1 << 27
SAMPLE_WINDOWS = 64
SAMPLE_WINDOW_TOKENS = 1 << 18

# fairseq-preprocess stores ids as uint16 exactly when its dictionary has fewer entries than this
# (best_fitting_dtype; upstream's and Megatron's binarizers follow the same rule), a wider type otherwise.
UINT16_MAX_VOCAB = 65500


def load_indexed_dataset(
    path: str, dictionary=None, dataset_impl: Optional[str] = None, combine: bool = False, expect_all_ids: bool = False
):
    """Open the MMIDIDX dataset at prefix `path` (`path.bin` + `path.idx`), or return None if absent.
    With `combine` (--combine-valid-subsets), `path1`, `path2`, ... follow it as one ConcatDataset.

    With a `dictionary`, fails if the data cannot have been binarized with it (an id the dictionary does
    not have, or a dtype fairseq-preprocess does not write for a dictionary of its size), and with
    `expect_all_ids` (a training split) warns when the dictionary has entries past the largest id the data
    uses (see check_dictionary_matches). The dtype check costs nothing; the ids are scanned once per file
    and process (see FULL_SCAN_MAX_TOKENS), in bounded chunks, and only where the dtype can hold an id past
    the dictionary or `expect_all_ids` asks for the largest id.
    """
    check_dataset_impl(dataset_impl)
    datasets = []
    for k in itertools.count():  # with `combine`, as upstream: path, path1, path2, ... up to the first missing one
        path_k = path + (str(k) if k > 0 else "")
        if not MMapIndexedDataset.exists(path_k):
            break
        dataset = MMapIndexedDataset(path_k)
        if dictionary is not None:
            check_dictionary_matches(dataset, dictionary, getattr(dictionary, "path", None), expect_all_ids)
        if combine:
            logger.info(f"loaded {len(dataset):,} examples from: {path_k}")
        datasets.append(dataset)
        if not combine:
            break
    if not datasets:
        return None
    if len(datasets) == 1:
        return datasets[0]
    return ConcatDataset(datasets)


def _token_windows(tokens: np.ndarray):
    n = len(tokens)
    if n <= FULL_SCAN_MAX_TOKENS:
        for start in range(0, n, 1 << 24):
            yield tokens[start : start + (1 << 24)]
        return
    last = n - SAMPLE_WINDOW_TOKENS
    for k in range(SAMPLE_WINDOWS):
        start = last * k // (SAMPLE_WINDOWS - 1)
        yield tokens[start : start + SAMPLE_WINDOW_TOKENS]


def _file_key(bin_path: str) -> Tuple[str, int, int]:
    st = os.stat(bin_path)
    return os.path.realpath(bin_path), st.st_mtime_ns, st.st_size


def _scan_ids(dataset: MMapIndexedDataset, key) -> Tuple[int, int, bool]:
    """(smallest id, largest id, whether all tokens were read); -1 as the largest id of an empty dataset."""
    if key not in _scanned_datasets:
        max_id, min_id = -1, 0
        for chunk in _token_windows(dataset.tokens):
            if chunk.size:
                max_id = max(max_id, int(chunk.max()))
                min_id = min(min_id, int(chunk.min()))
        _scanned_datasets[key] = (min_id, max_id, len(dataset.tokens) <= FULL_SCAN_MAX_TOKENS)
    return _scanned_datasets[key]


def check_dictionary_matches(
    dataset: MMapIndexedDataset, dictionary, dict_name: Optional[str] = None, expect_all_ids: bool = False
) -> None:
    """Raise if `dataset` cannot have been binarized with `dictionary`; with `expect_all_ids`, warn if the
    dictionary looks larger than the one it was binarized with.

    A dictionary SMALLER than the data's shows as an id >= len(dictionary) (an error). A LARGER one is
    only proven by the dtype: fairseq-preprocess writes uint16 for fewer than UINT16_MAX_VOCAB entries, so
    uint16 data with a dictionary at least that large is an error. The other direction (a wider dtype with
    a small dictionary) proves nothing: int32 is upstream's dtype for a vocabulary of unknown size and int64
    this builder's default, so scripts write them for any vocabulary.
    """
    vocab = len(dictionary)
    dtype = dataset.dtype
    bin_path = data_file_path(dataset.path)
    where = dict_name or os.path.join(os.path.dirname(dataset.path) or ".", "dict.txt")
    if dtype == np.dtype(np.uint16) and vocab >= UINT16_MAX_VOCAB:
        raise ValueError(
            f"dictionary does not match the data: {bin_path} stores uint16 token ids, which fairseq-preprocess "
            f"writes only for a dictionary of fewer than {UINT16_MAX_VOCAB:,} entries, but the dictionary "
            f"({where}) has {vocab:,} entries; binarize the data with this dict.txt (fairseq-preprocess --srcdict "
            f"{where})"
        )
    can_overflow = not (dtype.kind == "u" and np.iinfo(dtype).max < vocab)
    if not (can_overflow or expect_all_ids):
        return  # no storable id can reach past the dictionary, and the largest id is not asked for
    key = _file_key(bin_path)
    min_id, max_id, full = _scan_ids(dataset, key)
    if max_id >= vocab or min_id < 0:
        bad = max_id if max_id >= vocab else min_id
        raise ValueError(
            f"dictionary does not match the data: {bin_path} holds token id {bad} but the dictionary "
            f"({where}) has {vocab} entries; binarize the data with this dict.txt (fairseq-preprocess --srcdict)"
        )
    if expect_all_ids and full and key + (vocab,) not in _warned_datasets:
        _warned_datasets[key + (vocab,)] = True
        _warn_if_unused_entries(bin_path, max_id, dictionary, where)


def _warn_if_unused_entries(bin_path: str, max_id: int, dictionary, where: str) -> None:
    """Warn when real entries of `dictionary` lie past the largest id of a fully scanned training split.

    fairseq-preprocess builds a dictionary from the training text, so each of its entries occurs there, apart
    from the count-0 padding (madeupwordNNNN) that rounds its size to a multiple of --padding-factor: data
    binarized with its own dictionary uses the last real entry. Entries past the largest id therefore mean a
    dictionary not built from this data: a larger dict.txt than the data's (its ids then name other words),
    or a shared dictionary given with --srcdict, such as GPT-2's, whose rare entries a corpus may never use.
    The second is legitimate and common for large LMs, and nothing in the files tells the two apart, so this is
    a warning rather than an error (an error would refuse a correct setup, with no flag to overrule it).
    """
    counts = getattr(dictionary, "count", None)
    real = len(dictionary)
    if counts is not None and len(counts) == real:
        nspecial = getattr(dictionary, "nspecial", 0)
        while real > nspecial and counts[real - 1] == 0:  # trailing padding: never in any text
            real -= 1
    unused = real - 1 - max_id
    if max_id < 0 or unused <= 0:  # no tokens at all (an empty split is reported where it is trained on)
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return  # every rank reads the same files: one warning, from rank 0
    logger.warning(
        f"the dictionary may not be the one the data was binarized with: {bin_path} uses token ids up to "
        f"{max_id} (a dictionary of {max_id + 1:,} entries suffices) but {where} has {len(dictionary):,} "
        f"entries, {unused:,} of them used nowhere in this training data. If the data was binarized with "
        f"another dict.txt, its ids name the wrong words: binarize it again with this one (fairseq-preprocess "
        f"--srcdict {where}). A shared dictionary (e.g. GPT-2's, given with --srcdict) leaves entries unused: "
        "then nothing is wrong."
    )


def collate_tokens(
    values: Sequence[torch.Tensor],
    pad_idx: int,
    eos_idx: Optional[int] = None,
    left_pad: bool = False,
    move_eos_to_beginning: bool = False,
    pad_to_length: Optional[int] = None,
    pad_to_multiple: int = 1,
    pad_to_bsz: Optional[int] = None,
) -> torch.Tensor:
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
        dst = out[i, width - n :] if left_pad else out[i, :n]
        if move_eos_to_beginning:
            if n == 0:
                continue
            dst[0] = v[-1] if eos_idx is None else eos_idx
            dst[1:] = v[:-1]
        else:
            dst.copy_(v)
    return out


# ------------------------------------------------------------------------------ upstream's helpers

from fairseq.data.dictionary import post_process  # noqa: E402,F401 (upstream's data_utils.post_process)


@contextlib.contextmanager
def numpy_seed(seed: Optional[int], *addl_seeds: int):
    """Seed numpy's global PRNG for the block, then restore its previous state (None: leave it alone)."""
    if seed is None:
        yield
        return
    if addl_seeds:
        seed = int(hash((seed, *addl_seeds)) % 1e6)
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


# Upstream's batching and size-filtering helpers live with the batcher, below FairseqDataset, which uses them.
from fairseq.data.batching import (  # noqa: E402,F401
    collect_filtered,
    filter_by_size_limits,
    upstream_batch_by_size as batch_by_size,
)


# Upstream's pattern for extra validation splits ("valid1.bin", "valid_2.idx", ...) next to the data.
_EXTRA_VALID = re.compile(r"valid*[0-9].*")


def find_extra_valid_paths(data: str) -> set:
    """Names (without extension) of the files in the DATA directories that look like extra valid splits."""
    found = set()
    for directory in (p for p in data.split(os.pathsep) if p):
        if os.path.isdir(directory):
            found |= {os.path.splitext(name)[0] for name in os.listdir(directory) if _EXTRA_VALID.match(name)}
    return found


def raise_if_valid_subsets_unintentionally_ignored(train_cfg) -> None:
    """Upstream's guard: extra valid splits (valid1, ...) next to the data that --valid-subset leaves out would
    be silently ignored; fail, naming them, unless --combine-valid-subsets or --ignore-unused-valid-subsets."""
    ds = train_cfg.dataset
    data = task_data_dir(train_cfg.task)
    if ds.ignore_unused_valid_subsets or ds.combine_valid_subsets or ds.disable_validation or not data:
        return
    specified = set(ds.valid_subset.split(","))
    ignored = sorted(p for p in find_extra_valid_paths(data) if p not in specified)
    if ignored:
        raise ValueError(
            f"validation splits {ignored} in DATA are not in --valid-subset {ds.valid_subset} and would "
            "be ignored; pass --combine-valid-subsets to validate on them together with each subset, "
            "add them to --valid-subset, or pass --ignore-unused-valid-subsets"
        )
