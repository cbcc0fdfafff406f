"""Upstream's `fairseq.data.data_utils_fast` (a Cython module there): its batching functions, by name and
signature, over this fork's one batcher (`fairseq.data.data_utils.batch_by_size` -> `batching.batch_by_size`).

    batch_by_size_vec(indices, num_tokens_vec, max_tokens, max_sentences, bsz_mult) -> List[np.ndarray]
    batch_by_size_fn(indices, num_tokens_fn, max_tokens, max_sentences, bsz_mult) -> List[np.ndarray]

`max_tokens` / `max_sentences` <= 0 mean no limit, as upstream's -1.
"""

from typing import Callable, List

import numpy as np

from fairseq.data.data_utils import batch_by_size


def batch_by_size_vec(indices, num_tokens_vec, max_tokens: int, max_sentences: int, bsz_mult: int) -> List[np.ndarray]:
    """Batches of `indices` in their order; `num_tokens_vec[k]` is the size of `indices[k]`."""
    return batch_by_size(
        np.asarray(indices, dtype=np.int64),
        num_tokens_vec=num_tokens_vec,
        max_tokens=max(max_tokens, 0),
        max_sentences=max(max_sentences, 0),
        required_batch_size_multiple=bsz_mult,
    )


def batch_by_size_fn(
    indices, num_tokens_fn: Callable[[int], int], max_tokens: int, max_sentences: int, bsz_mult: int
) -> List[np.ndarray]:
    """Batches of `indices` in their order; `num_tokens_fn(index)` is the size of an index."""
    return batch_by_size(
        np.asarray(indices, dtype=np.int64),
        num_tokens_fn=num_tokens_fn,
        max_tokens=max(max_tokens, 0),
        max_sentences=max(max_sentences, 0),
        required_batch_size_multiple=bsz_mult,
    )


def batch_fixed_shapes_fast(*args, **kwargs):
    raise ValueError(
        "batch_fixed_shapes_fast (upstream's TPU batching by fixed shapes) is not supported: "
        "batch with --max-tokens / --batch-size"
    )
