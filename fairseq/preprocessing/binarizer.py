"""Streaming text -> token-id binarization and dictionary counting, split among worker processes.

A file is cut into byte ranges at line boundaries (`find_offsets`); each range is read in blocks of a few
MB that end at a newline, so memory stays bounded whatever the file size. Lines are what upstream's
text-mode reading yields: `\\n`, `\\r\\n` and a lone `\\r` all end a line; each line is split on
whitespace and followed by `</s>`. Whole blocks are encoded at once (one `str.split`, one dict lookup per
token into a numpy array) instead of line by line into tensors, which is where the speed comes from.

Outputs go to hidden `*.part` names in the destination directory and are renamed into place only when
complete, the `.idx` last; an interrupted run never leaves a `<prefix>.bin`/`.idx` pair behind
(fairseq/preprocessing/binarizer_jobs.py: the atomic writer; fairseq/data/worker_pool.py: the worker pool).
"""

import os
from collections import Counter
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from fairseq.data.dictionary import Dictionary
from fairseq.data.indexed_dataset import best_fitting_dtype

# The text -> ids step, shared with the streaming task; its names stay importable from here (and fairseq.binarizer).
from fairseq.data.line_encoder import (  # noqa: F401
    GPT2LineEncoder,
    LineEncoder,
    LocalIdTable,
    SentencepieceLineEncoder,
    bpe_spec,
    encode_block,
    line_encoder_for,
    make_line_encoder,
    map_local_ids,
    marked_indices,
    register_line_encoder,
)

# The reading and counting of text files are the Dictionary's too (add_file_to_dictionary); named here as before.
from fairseq.data.text_files import count_words, count_words_range, find_offsets, iter_text_blocks  # noqa: F401
from fairseq.data.worker_pool import make_pool, maybe_pool, settle  # noqa: F401 (make_pool: fairseq-preprocess's)
from fairseq.preprocessing.binarizer_jobs import BinarizeSummary, run_jobs_atomically

# Upstream's binarizer classes, under their upstream module name (fairseq.binarizer).
from fairseq.preprocessing.line_binarizers import (  # noqa: F401
    AlignmentDatasetBinarizer,
    Binarizer,
    FileBinarizer,
    VocabularyDatasetBinarizer,
)


def build_dictionary(
    paths: List[str], num_workers: int = 1, threshold: int = -1, nwords: int = -1, padding_factor: int = 8, pool=None
):
    """A finalized Dictionary counted from text files, as upstream's task.build_dictionary builds it."""
    d = Dictionary()
    for path in paths:
        counter, lines = count_words(path, num_workers, pool)
        counter[d.eos_word] += lines  # upstream counts one </s> per line
        d.add_counts(counter)
    d.finalize(threshold=threshold, nwords=nwords, padding_factor=padding_factor)
    return d


# ---- no --bpe: the block encoder (fairseq.data.line_encoder.encode_block) ----------------------------------
def binarize_range(
    builder, path: str, start: int, end: int, indices: Dict[str, int], unk: int, eos: int, unk_word: str
) -> BinarizeSummary:
    """Encode bytes [start, end) of `path` into `builder` (one job of `run_jobs_atomically`)."""
    return _encode_into(builder, path, start, end, indices, marked_indices(indices), unk, eos, unk_word)


def _encode_into(builder, path, start, end, indices, marked, unk, eos, unk_word) -> BinarizeSummary:
    summary = BinarizeSummary()
    for text in iter_text_blocks(path, start, end):
        ids, sizes, replaced = encode_block(text, indices, marked, unk, eos, unk_word)
        builder.add_items(ids.astype(builder.dtype), sizes)
        summary.num_seq += len(sizes)
        summary.num_tok += len(ids)
        summary.num_replaced += replaced
    return summary


def binarize_file(path: str, dictionary, output_prefix: str, num_workers: int = 1, pool=None) -> BinarizeSummary:
    """Binarize a text file into `output_prefix.bin/.idx` (dtype from the dictionary size, as upstream).

    The result does not depend on `num_workers`. Files appear under their final names only once both
    are complete: the `.bin` is renamed first, the `.idx` last (a reader needs both).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file {path} does not exist")
    dtype = best_fitting_dtype(len(dictionary))
    offsets = find_offsets(path, max(1, num_workers))
    common = (dictionary.indices, dictionary.unk_index, dictionary.eos_index, dictionary.unk_word)
    jobs = [(binarize_range, (path, s, e) + common) for s, e in zip(offsets, offsets[1:])]
    return run_jobs_atomically(output_prefix, dtype, jobs, pool)


# ---- one pass: raw text -> --bpe -> token ids ------------------------------------------------------------
# `fairseq-preprocess --bpe NAME` equals the two-step route (the encoder script with --keep-empty, then
# fairseq-preprocess on its output); the line encoders and the local-id table are fairseq.data.line_encoder's.


def _iter_encoded(path: str, start: int, end: int, encoder: LineEncoder) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """(local ids, tokens per line) for each block of bytes [start, end) of `path`: lines stripped, as the
    encoder scripts strip them, and encoded."""
    for text in iter_text_blocks(path, start, end):
        lines = text.split("\n")
        if lines[-1] == "":
            lines.pop()
        yield encoder.encode([line.strip() for line in lines])


def _add_mapped(
    builder, summary: BinarizeSummary, local: np.ndarray, sizes: np.ndarray, table: LocalIdTable, eos: int
) -> None:
    """Append lines given as local ids (`sizes` tokens each, no </s>) as dictionary indices plus </s>."""
    if len(sizes) == 0:
        return
    out, out_sizes, replaced = map_local_ids(local, sizes, table, eos)
    builder.add_items(out.astype(builder.dtype), out_sizes)
    summary.num_seq += len(sizes)
    summary.num_tok += len(out)
    summary.num_replaced += replaced


def encode_binarize_range(
    builder, path: str, start: int, end: int, spec: tuple, indices: Dict[str, int], unk: int, eos: int, unk_word: str
) -> BinarizeSummary:
    """Raw text bytes [start, end) of `path`, encoded with `spec`'s --bpe, into `builder`."""
    encoder = line_encoder_for(spec)
    table = LocalIdTable(encoder, indices, unk, unk_word)
    summary = BinarizeSummary()
    for local, sizes in _iter_encoded(path, start, end, encoder):
        _add_mapped(builder, summary, local, sizes, table, eos)
    return summary


def count_encode_range(path: str, start: int, end: int, spec: tuple, cache_prefix: str):
    """Encode raw text bytes [start, end) once: the local ids and line sizes go to `cache_prefix`.ids/.sizes
    (int32, to be binarized once the dictionary exists) and the token counts come back, with the line count."""
    encoder = line_encoder_for(spec)
    counts = np.zeros(0, dtype=np.int64)
    lines = 0
    with open(cache_prefix + ".ids", "wb") as fi, open(cache_prefix + ".sizes", "wb") as fs:
        for local, sizes in _iter_encoded(path, start, end, encoder):
            block_counts = np.bincount(local)
            if len(block_counts) > len(counts):
                counts = np.concatenate([counts, np.zeros(len(block_counts) - len(counts), np.int64)])
            counts[: len(block_counts)] += block_counts
            local.astype(np.int32).tofile(fi)
            sizes.astype(np.int32).tofile(fs)
            lines += len(sizes)
    symbols = encoder.symbols()
    counter: Counter = Counter()
    for i in np.flatnonzero(counts):  # (a token can have two local ids: a piece and the same text re-encoded)
        counter[symbols[i]] += int(counts[i])
    return counter, lines, (cache_prefix, symbols if not isinstance(encoder, GPT2LineEncoder) else None)


CACHE_LINES = 1 << 16  # lines of a cached range mapped at once


def binarize_cached_range(
    builder, cache: tuple, spec: tuple, indices: Dict[str, int], unk: int, eos: int, unk_word: str
) -> BinarizeSummary:
    """Binarize a range cached by `count_encode_range` into `builder`."""
    cache_prefix, symbols = cache
    encoder = line_encoder_for(spec)
    table = LocalIdTable(encoder, indices, unk, unk_word)
    table.update(symbols)
    summary = BinarizeSummary()

    def mapped(ext):  # read in slices: memory stays bounded whatever the range's size
        path = cache_prefix + ext
        return np.memmap(path, dtype=np.int32, mode="r") if os.path.getsize(path) else np.zeros(0, np.int32)

    sizes_all, ids_all = mapped(".sizes"), mapped(".ids")
    pos = 0
    for a in range(0, len(sizes_all), CACHE_LINES):
        sizes = np.asarray(sizes_all[a : a + CACHE_LINES], dtype=np.int64)
        n = int(sizes.sum())
        _add_mapped(builder, summary, np.asarray(ids_all[pos : pos + n], dtype=np.int64), sizes, table, eos)
        pos += n
    del sizes_all, ids_all
    return summary


def remove_cache(cache: tuple) -> None:
    for ext in (".ids", ".sizes"):
        if os.path.exists(cache[0] + ext):
            os.remove(cache[0] + ext)


def build_dictionary_encoded(
    path: str,
    spec: tuple,
    cache_stem: str,
    num_workers: int = 1,
    threshold: int = -1,
    nwords: int = -1,
    padding_factor: int = 8,
    pool=None,
):
    """(Dictionary, caches): the dictionary of `path` as encoded by `spec` (what build_dictionary gives on the
    encoder script's output), and the encoded ranges cached for `binarize_file_encoded(caches=...)`. The
    caller removes the caches (`remove_cache`)."""
    offsets = find_offsets(path, max(1, num_workers))
    ranges = list(zip(offsets, offsets[1:]))
    prefixes = [f"{cache_stem}.c{k}" for k in range(len(ranges))]
    caches = [(p, None) for p in prefixes]
    pending = []
    try:
        with maybe_pool(pool if len(ranges) > 1 else False, len(ranges) - 1, preload=(__name__,)) as p:
            pending = [
                p.apply_async(count_encode_range, (path, s, e, spec, c)) for (s, e), c in zip(ranges[1:], prefixes[1:])
            ]
            results = [count_encode_range(path, *ranges[0], spec, prefixes[0])]
            results += [r.get() for r in pending]
    except BaseException as err:
        settle(pool, pending, err)  # a caller's pool: our tasks end before their files are removed
        for c in caches:
            remove_cache(c)
        raise
    d = Dictionary()
    counter: Counter = Counter()
    lines = 0
    caches = []
    for c, n, cache in results:
        counter.update(c)
        lines += n
        caches.append(cache)
    counter[d.eos_word] += lines
    d.add_counts(counter)
    d.finalize(threshold=threshold, nwords=nwords, padding_factor=padding_factor)
    return d, caches


def binarize_file_encoded(
    path: str,
    dictionary,
    output_prefix: str,
    spec: tuple,
    num_workers: int = 1,
    pool=None,
    caches: Optional[List[tuple]] = None,
) -> BinarizeSummary:
    """`binarize_file` of `path` as encoded by `spec`'s --bpe (one pass, no encoded text written), or of the
    ranges `build_dictionary_encoded` cached. Byte-identical to binarizing the encoder script's output."""
    if caches is None and not os.path.isfile(path):
        raise FileNotFoundError(f"input file {path} does not exist")
    dtype = best_fitting_dtype(len(dictionary))
    common = (spec, dictionary.indices, dictionary.unk_index, dictionary.eos_index, dictionary.unk_word)
    if caches is not None:
        jobs = [(binarize_cached_range, (cache,) + common) for cache in caches]
    else:
        offsets = find_offsets(path, max(1, num_workers))
        jobs = [(encode_binarize_range, (path, s, e) + common) for s, e in zip(offsets, offsets[1:])]
    return run_jobs_atomically(output_prefix, dtype, jobs, pool)
