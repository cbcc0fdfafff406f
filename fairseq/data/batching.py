"""Mini-batches by size: `--max-tokens`, `--batch-size` and `--required-batch-size-multiple`.

`batch_by_size` yields the same batches as upstream fairseq's `batch_by_size_vec`: walking the indices in
the given order, a batch takes as many items as fit (count * longest item <= max_tokens and
count <= max_sentences); if that count n is at least the multiple, the batch is cut down to the largest
multiple of it and the rest starts the next batch; a final leftover forms its own smaller batch.

Everything is vectorized: the count that fits from every position is found with binary lifting over
range-maximum tables (computed in bounded chunks), then one cheap step per batch follows the chain.
Batches are stored compactly (`Batches`: one index array plus boundaries), never as millions of objects.
"""

import copy
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

_CHUNK = 1 << 16  # start positions processed at once while finding how many items fit


class Batches:
    """A list of batches stored as one array of dataset indices and `len + 1` boundaries."""

    def __init__(self, indices: np.ndarray, bounds: np.ndarray):
        self.indices = np.asarray(indices, dtype=np.int64)
        self.bounds = np.asarray(bounds, dtype=np.int64)
        if self.bounds[0] != 0 or self.bounds[-1] != len(self.indices) or np.any(np.diff(self.bounds) < 0):
            raise ValueError("Batches: bounds must rise from 0 to the number of indices")

    @classmethod
    def from_list(cls, batches: Sequence[Sequence[int]]) -> "Batches":
        if isinstance(batches, Batches):
            return batches
        lengths = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
        bounds = np.zeros(len(batches) + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        flat = [np.asarray(b, dtype=np.int64).reshape(-1) for b in batches if len(b)]
        indices = np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64)
        return cls(indices, bounds)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"batch {i} out of range ({len(self)} batches)")
        i %= len(self)
        return self.indices[self.bounds[i] : self.bounds[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    def sizes(self) -> np.ndarray:
        """Number of items in each batch."""
        return np.diff(self.bounds)

    def to_list(self) -> list:
        return [b.tolist() for b in self]


def _fit_counts(sizes: np.ndarray, max_tokens: int, max_sentences: int) -> np.ndarray:
    """For every start s: the largest n with n <= max_sentences, s + n <= len and n * max(sizes[s:s+n]) <= max_tokens."""
    n = len(sizes)
    limit = max_sentences if max_sentences > 0 else n
    remaining = n - np.arange(n, dtype=np.int64)
    if max_tokens <= 0:
        return np.minimum(remaining, limit)
    smallest, largest = int(sizes.min()), int(sizes.max())
    if smallest == largest:  # all items the same size: no range maxima needed
        per_batch = max_tokens // smallest if smallest > 0 else limit
        return np.minimum(remaining, min(limit, per_batch))
    window = min(limit, n, max_tokens // smallest if smallest > 0 else n)
    levels = max(1, window.bit_length())
    counts = np.zeros(n, dtype=np.int64)
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        segment = sizes[a : min(n, b + window)].astype(np.int64)
        tables = [segment]  # tables[j][p] = max(segment[p : p + 2**j])
        for j in range(1, levels):
            prev, half = tables[-1], 1 << (j - 1)
            tables.append(np.maximum(prev[:-half], prev[half:]) if len(prev) > half else prev[:0])
        local = np.arange(b - a, dtype=np.int64)
        count = np.zeros(b - a, dtype=np.int64)
        longest = np.zeros(b - a, dtype=np.int64)
        for j in reversed(range(levels)):
            step = 1 << j
            table = tables[j]
            candidate = count + step
            valid = (candidate <= limit) & (candidate <= remaining[a:b])
            if not valid.any() or len(table) == 0:
                continue
            window_max = table[np.minimum(local + count, len(table) - 1)]
            new_longest = np.maximum(longest, window_max)
            ok = valid & (new_longest * candidate <= max_tokens)
            count = np.where(ok, candidate, count)
            longest = np.where(ok, new_longest, longest)
        counts[a:b] = count
    return counts


def batch_by_size(
    indices,
    num_tokens,
    max_tokens: Optional[int] = None,
    max_sentences: Optional[int] = None,
    required_batch_size_multiple: int = 1,
) -> Batches:
    """Group `indices` (in the given order) into batches; `num_tokens[k]` is the size of `indices[k]`.

    Items larger than `max_tokens` must have been filtered out before (see `filter_by_size`).
    """
    indices = np.asarray(indices, dtype=np.int64)
    sizes = np.asarray(num_tokens, dtype=np.int64)
    if len(sizes) != len(indices):
        raise ValueError(f"batch_by_size: {len(sizes)} sizes for {len(indices)} indices")
    max_tokens = max_tokens or 0
    max_sentences = max_sentences or 0
    multiple = max(1, required_batch_size_multiple)
    n = len(indices)
    if n == 0:
        return Batches(indices, np.zeros(1, dtype=np.int64))
    if max_tokens > 0 and sizes.max() > max_tokens:
        k = int(np.argmax(sizes > max_tokens))
        raise ValueError(
            f"item {int(indices[k])} has {int(sizes[k])} tokens, more than --max-tokens {max_tokens}; "
            "raise --max-tokens or pass --skip-invalid-size-inputs-valid-test to skip such items"
        )
    fit = _fit_counts(sizes, max_tokens, max_sentences)
    take = np.where(fit < multiple, fit, fit - fit % multiple)
    next_start = np.arange(n, dtype=np.int64) + take
    bounds = [0]
    s = 0
    while s < n:  # one step per batch
        s = int(next_start[s])
        bounds.append(s)
    return Batches(indices, np.asarray(bounds, dtype=np.int64))


# What sets the positions limit of a language model: the task's block size and the model's positions.
POSITIONS_FLAGS = "--tokens-per-sample / --max-target-positions"


def filter_by_size(
    indices, sizes, limit: Optional[int], ignore_invalid: bool, flag: str = POSITIONS_FLAGS
) -> Tuple[np.ndarray, np.ndarray]:
    """Drop indices whose size exceeds `limit`; without `ignore_invalid`, fail naming `flag` instead.

    Returns (kept indices, dropped indices). `sizes` is indexed by dataset index.
    """
    indices = np.asarray(indices, dtype=np.int64)
    if limit is None or len(indices) == 0:
        return indices, indices[:0]
    item_sizes = np.asarray(sizes)[indices]
    too_long = item_sizes > limit
    if not too_long.any():
        return indices, indices[:0]
    if not ignore_invalid:
        k = int(np.argmax(too_long))
        raise ValueError(
            f"item {int(indices[k])} has {int(item_sizes[k])} tokens, more than {flag} {limit}; raise {flag} "
            "or pass --skip-invalid-size-inputs-valid-test to skip such items"
        )
    return indices[~too_long], indices[too_long]


# ---- upstream's signatures (data_utils.batch_by_size, FairseqDataset.filter_indices_by_size) ----
def collect_filtered(function: Callable, iterable, filtered: list):
    """Yield the items for which `function` is true; append the others to `filtered`."""
    for item in iterable:
        if function(item):
            yield item
        else:
            filtered.append(item)


def upstream_batch_by_size(
    indices,
    num_tokens_fn: Optional[Callable[[int], int]] = None,
    num_tokens_vec=None,
    max_tokens: Optional[int] = None,
    max_sentences: Optional[int] = None,
    required_batch_size_multiple: int = 1,
    fixed_shapes=None,
) -> List[np.ndarray]:
    """Upstream's signature over `fairseq.data.batching.batch_by_size` (the same batches): a list of index
    arrays. `num_tokens_vec` (sizes of `indices`, in their order) or else `num_tokens_fn(index)` gives sizes."""
    if fixed_shapes is not None:
        raise ValueError("batch_by_size(fixed_shapes=...) (upstream's TPU batching) is not supported")
    indices = np.fromiter(indices, dtype=np.int64) if not isinstance(indices, np.ndarray) else indices
    if num_tokens_vec is None:
        if num_tokens_fn is None:
            raise ValueError("batch_by_size needs num_tokens_fn or num_tokens_vec")
        num_tokens_vec = np.fromiter((num_tokens_fn(int(i)) for i in indices), dtype=np.int64, count=len(indices))
    batches = batch_by_size(
        indices.astype(np.int64),
        np.asarray(num_tokens_vec, dtype=np.int64),
        max_tokens=max_tokens,
        max_sentences=max_sentences,
        required_batch_size_multiple=required_batch_size_multiple,
    )
    return [indices[batches.bounds[b] : batches.bounds[b + 1]] for b in range(len(batches))]


def _fits(size, limit) -> bool:
    """Upstream's size comparison: numbers, tuples (element-wise, None is no limit) and dicts of tuples."""
    if isinstance(limit, dict):
        return all(_fits(size[key], limit[key]) for key in set(limit) & set(size))
    if isinstance(limit, (int, float)):
        return (max(size) if isinstance(size, (tuple, list)) else size) <= limit
    if not isinstance(size, (tuple, list, np.ndarray)):
        return all(size <= b for b in limit if b is not None)
    return all(a is None or b is None or a <= b for a, b in zip(size, limit))


def filter_by_size_limits(indices, dataset, max_sizes) -> Tuple[np.ndarray, list]:
    """(kept indices, ignored indices): upstream's `FairseqDataset.filter_indices_by_size`. A number limit is
    applied to the `sizes` array when the dataset has one; other limits compare `dataset.size(i)` per item."""
    indices = np.asarray(indices, dtype=np.int64)
    if max_sizes is None:
        return indices, []
    sizes = getattr(dataset, "sizes", None)
    if isinstance(sizes, list) and len(sizes) == 1:
        sizes = sizes[0]
    if isinstance(max_sizes, (int, float)) and isinstance(sizes, np.ndarray) and sizes.ndim == 1:
        too_long = sizes[indices] > max_sizes
        return indices[~too_long], indices[too_long].tolist()
    ignored: list = []
    kept = np.fromiter(collect_filtered(lambda i: _fits(dataset.size(i), max_sizes), indices, ignored), dtype=np.int64)
    return kept, ignored


def size_limit(max_positions, max_tokens: Optional[int]) -> Tuple[Optional[int], str]:
    """The longest item allowed in a batch and the flag that set that limit.

    An item longer than --max-tokens fits in no batch (a batch holds count * longest tokens), so the limit
    is the smaller of the positions limit (`max_positions`: the task's and the model's, POSITIONS_FLAGS)
    and `max_tokens`. On a tie --max-tokens is named: callers written for upstream pass a positions limit
    already lowered to --max-tokens (upstream's resolve_max_positions(..., max_tokens)), and raising
    --max-tokens is needed in any case.
    """
    positions = resolve_limit(max_positions)
    tokens = int(max_tokens) if max_tokens else None  # 0 or None: no token budget (as batch_by_size)
    if tokens is not None and (positions is None or tokens <= positions):
        return tokens, "--max-tokens"
    return positions, POSITIONS_FLAGS


@dataclass(frozen=True)
class SizeFilterReport:
    """What the size filter did to a dataset: its item count, and how many items `limit` (set by `flag`)
    dropped, with the shortest and longest item sizes (0 without items)."""

    num_items: int
    num_dropped: int
    limit: Optional[int]
    flag: str
    shortest: int
    longest: int

    @classmethod
    def of(cls, sizes, num_dropped: int, limit: Optional[int], flag: str) -> "SizeFilterReport":
        sizes = np.asarray(sizes)
        if len(sizes) == 0:
            return cls(0, num_dropped, limit, flag, 0, 0)
        return cls(len(sizes), num_dropped, limit, flag, int(sizes.min()), int(sizes.max()))

    @property
    def mostly_dropped(self) -> bool:
        """More than half the items skipped: the split is no longer what the run is about (a few long lines
        skipped only warn)."""
        return self.num_dropped * 2 > self.num_items

    def fix(self, token_flag: str = "--max-tokens") -> str:
        """How to let the dropped items through; `token_flag` is the flag
        that gave the token budget (e.g. --max-tokens-valid)."""
        if self.flag == "--max-tokens":
            return f"raise {token_flag} to at least {self.longest} (the longest item)"
        return (
            f"let the model take longer items (--max-target-positions at least {self.longest}, the longest "
            f"item) or make the items shorter (--tokens-per-sample at most {self.limit}, or --shorten-method "
            "truncate)"
        )


def resolve_limit(*limits: Union[int, None, Tuple]) -> Optional[int]:
    """The smallest of the given size limits (None: no limit; tuples contribute their first entry)."""
    values = []
    for limit in limits:
        if isinstance(limit, (tuple, list)):
            limit = limit[0] if limit else None
        if limit is not None:
            values.append(int(limit))
    return min(values) if values else None


def _match_types(a, b):
    """A number next to a tuple (or dict) becomes one of the same shape."""

    def upgrade(number, structure):
        if isinstance(structure, tuple):
            return tuple([number] * len(structure))
        if isinstance(structure, dict):
            return {k: upgrade(number, v) for k, v in structure.items()}
        return number

    if isinstance(a, (int, float)):
        return upgrade(a, b), b
    if isinstance(b, (int, float)):
        return a, upgrade(b, a)
    return a, b


def resolve_max_positions(*args):
    """The tightest of several max-positions limits (None: no limit), in the type of the limits given:
    numbers take the minimum, tuples the element-wise minimum, dicts per key (upstream's rule)."""

    def nullsafe_min(values):
        present = [v for v in values if v is not None]
        return min(present) if present else None

    result = None
    for arg in args:
        if result is None:
            result = copy.deepcopy(arg)
        elif arg is not None:
            result, arg = _match_types(result, arg)
            if isinstance(arg, (int, float)):
                result = min(result, arg)
            elif isinstance(arg, dict):
                merged = dict(result)
                for key, value in arg.items():
                    merged[key] = value if key not in merged else min(merged[key], value)
                result = merged
            else:
                result = tuple(map(nullsafe_min, zip(result, arg)))
    return result
