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
from itertools import repeat
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from fairseq.data.dictionary import Dictionary
from fairseq.data.indexed_dataset import best_fitting_dtype

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

_LINE_MARK = "\x00"  # stands for a line end inside a block; never whitespace, so split() keeps it a token


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


# ---- encoding ---------------------------------------------------------------------------------------------
def encode_block(
    text: str, indices: Dict[str, int], marked: Dict[str, int], unk: int, eos: int, unk_word: str
) -> Tuple[np.ndarray, np.ndarray, int]:
    """(token ids int64, sizes per line, words replaced by unk) of a block of whole lines.

    `marked` is `indices` plus `_LINE_MARK -> -1`: line ends become marker tokens, so one split and one
    lookup pass encode the whole block, and the markers give both the line sizes and the </s> slots.
    """
    if not text:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    if not text.endswith("\n"):
        text += "\n"
    if _LINE_MARK in text:  # the marker would be ambiguous: encode line by line
        return _encode_lines(text, indices, unk, eos, unk_word)
    words = text.replace("\n", " \x00 ").split()
    ids = np.fromiter(map(marked.get, words, repeat(unk)), dtype=np.int64, count=len(words))
    ends = np.flatnonzero(ids < 0)
    sizes = np.diff(ends, prepend=-1)
    ids[ends] = eos
    replaced = int(np.count_nonzero(ids == unk))
    if marked.get(unk_word) == unk:  # the literal <unk> token maps to <unk> but was not replaced
        replaced -= words.count(unk_word)
    return ids, sizes, replaced


def _encode_lines(text, indices, unk, eos, unk_word):
    ids: List[int] = []
    sizes = []
    replaced = 0
    get = indices.get
    for line in text[:-1].split("\n"):
        words = line.split()
        line_ids = [get(w, unk) for w in words]
        replaced += sum(1 for w, i in zip(words, line_ids) if i == unk and w != unk_word)
        ids.extend(line_ids)
        ids.append(eos)
        sizes.append(len(words) + 1)
    return np.asarray(ids, dtype=np.int64), np.asarray(sizes, dtype=np.int64), replaced


def binarize_range(
    builder, path: str, start: int, end: int, indices: Dict[str, int], unk: int, eos: int, unk_word: str
) -> BinarizeSummary:
    """Encode bytes [start, end) of `path` into `builder` (one job of `run_jobs_atomically`)."""
    marked = dict(indices)
    marked[_LINE_MARK] = -1
    return _encode_into(builder, path, start, end, indices, marked, unk, eos, unk_word)


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
# fairseq-preprocess on its output): each line is stripped and encoded, an empty line stays an empty line
# (`</s>` alone), and the encoded line is split on whitespace exactly as `encode_block` splits the encoded
# text. An encoder gives, per block of lines, "local" ids of the tokens that split yields and the token of each
# local id (`symbols`); local ids become dictionary indices through a lookup table, so GPT-2 ids never become
# text at all, and building the dictionary counts local ids (np.bincount) instead of strings.

_LINE_ENCODERS: Dict[tuple, "LineEncoder"] = {}  # per process: the main one registers, workers build on demand


class LineEncoder:
    """Generic: `bpe.encode(line)` per line, tokens split on whitespace, local ids in order of appearance."""

    def __init__(self, bpe):
        from collections import defaultdict

        self.bpe = bpe
        self._ids: Dict[str, int] = defaultdict()
        self._ids.default_factory = self._ids.__len__

    def symbols(self) -> List[str]:
        return list(self._ids)

    def _local_ids(self, words: List[str]) -> np.ndarray:
        # A missing word gets the next id: the table's default factory is its own length.
        return np.fromiter(map(self._ids.__getitem__, words), dtype=np.int64, count=len(words))

    def encoded_lines(self, lines: List[str]) -> List[str]:
        return [self.bpe.encode(line) if line else "" for line in lines]

    def encode(self, lines: List[str]) -> Tuple[np.ndarray, np.ndarray]:
        """(local ids of all lines' tokens, number of tokens per line) of stripped lines."""
        encoded = self.encoded_lines(lines)
        per_line = [e.split() for e in encoded]
        sizes = np.fromiter(map(len, per_line), dtype=np.int64, count=len(per_line))
        words = [w for ws in per_line for w in ws]
        return self._local_ids(words), sizes


class SentencepieceLineEncoder(LineEncoder):
    """--bpe sentencepiece: spm_encode.py's pieces (`sp.Encode(lines, out_type=str)`), as the two-step route
    joins and splits them. Lines are encoded to sentencepiece ids (local ids 0..V-1: the pieces); a line with
    an id whose text is not that piece alone (an unknown piece, shown as its surface text, or a piece that
    holds whitespace, which the two-step route splits) is encoded again as text, its tokens getting ids from V."""

    def __init__(self, bpe):
        super().__init__(bpe)
        sp = bpe.sp
        self._pieces = [sp.IdToPiece(i) for i in range(sp.GetPieceSize())]
        self._safe = np.array(
            [p.split() == [p] and not sp.IsUnknown(i) for i, p in enumerate(self._pieces)], dtype=bool
        )
        self._ids.default_factory = lambda: len(self._ids) + len(self._pieces)

    def symbols(self) -> List[str]:
        return self._pieces + list(self._ids)

    def encoded_lines(self, lines: List[str]) -> List[str]:
        todo = [line for line in lines if line]
        pieces = iter(
            self.bpe.sp.Encode(todo, out_type=str, enable_sampling=self.bpe.enable_sampling, alpha=self.bpe.alpha)
            if todo
            else []
        )
        return [" ".join(next(pieces)) if line else "" for line in lines]

    def encode(self, lines):
        from itertools import chain

        todo = [line for line in lines if line]
        encoded = (
            self.bpe.sp.Encode(todo, out_type=int, enable_sampling=self.bpe.enable_sampling, alpha=self.bpe.alpha)
            if todo
            else []
        )
        sizes = np.zeros(len(lines), dtype=np.int64)
        nonempty = [i for i, line in enumerate(lines) if line]
        sizes[nonempty] = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = np.fromiter(chain.from_iterable(encoded), dtype=np.int64, count=int(sizes.sum()))
        if self._safe[ids].all():
            return ids, sizes
        # Some lines need their text: re-encode those as spm_encode.py writes them and split.
        per_line = np.split(ids, np.cumsum(sizes)[:-1])
        for k, line_ids in enumerate(per_line):
            if not self._safe[line_ids].all():
                words = self.encoded_lines([lines[k]])[0].split()
                per_line[k] = self._local_ids(words)
                sizes[k] = len(words)
        return np.concatenate(per_line) if per_line else ids, sizes


class GPT2LineEncoder(LineEncoder):
    """--bpe gpt2: local ids are GPT-2 ids (their tokens are the ids' decimal forms, as the encoder script
    writes them)."""

    def __init__(self, bpe):
        super().__init__(bpe)
        self.encoder = bpe.bpe
        self._n = max(self.encoder.encoder.values()) + 1

    def symbols(self) -> List[str]:
        return [str(i) for i in range(self._n)]

    def encode(self, lines):
        return self.encoder.encode_lines_to_ids(lines, check=False)


def make_line_encoder(bpe) -> LineEncoder:
    from fairseq.data.encoders.gpt2_bpe import GPT2BPE
    from fairseq.data.encoders.sentencepiece_bpe import SentencepieceBPE

    if isinstance(bpe, GPT2BPE):
        return GPT2LineEncoder(bpe)
    if isinstance(bpe, SentencepieceBPE):
        return SentencepieceLineEncoder(bpe)
    return LineEncoder(bpe)


def register_line_encoder(spec: tuple, bpe) -> None:
    """Make the encoder for `spec` (hashable: the scheme's name and config values) available to this process
    (workers build their own from `spec` on first use)."""
    _LINE_ENCODERS[spec] = make_line_encoder(bpe)


def _line_encoder(spec: tuple) -> LineEncoder:
    if spec not in _LINE_ENCODERS:  # a worker: build it from the config values
        from fairseq.data.encoders import build_bpe

        name, values = spec
        _LINE_ENCODERS[spec] = make_line_encoder(build_bpe(dict(values, _name=name)))
    return _LINE_ENCODERS[spec]


def bpe_spec(bpe_cfg) -> tuple:
    """Hashable description of a --bpe config (its name and field values)."""
    import dataclasses as dc

    values = tuple(sorted((f.name, getattr(bpe_cfg, f.name)) for f in dc.fields(bpe_cfg) if not f.name.startswith("_")))
    return (bpe_cfg._name, values)


def _iter_encoded(path: str, start: int, end: int, encoder: LineEncoder) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """(local ids, tokens per line) for each block of bytes [start, end) of `path`: lines stripped, as the
    encoder scripts strip them, and encoded."""
    for text in iter_text_blocks(path, start, end):
        lines = text.split("\n")
        if lines[-1] == "":
            lines.pop()
        yield encoder.encode([line.strip() for line in lines])


class LocalIdTable:
    """local id -> dictionary index (and whether that is a replacement by <unk>), grown as symbols appear."""

    def __init__(self, encoder: LineEncoder, indices: Dict[str, int], unk: int, unk_word: str):
        self.encoder, self.indices, self.unk, self.unk_word = encoder, indices, unk, unk_word
        self.index = np.zeros(0, dtype=np.int64)
        self.replaced = np.zeros(0, dtype=bool)

    def update(self, symbols: Optional[List[str]] = None):
        symbols = self.encoder.symbols() if symbols is None else symbols
        if len(symbols) > len(self.index):
            new = symbols[len(self.index) :]
            idx = np.fromiter((self.indices.get(s, self.unk) for s in new), dtype=np.int64, count=len(new))
            rep = (idx == self.unk) & np.fromiter((s != self.unk_word for s in new), dtype=bool, count=len(new))
            self.index = np.concatenate([self.index, idx])
            self.replaced = np.concatenate([self.replaced, rep])


def map_local_ids(
    local: np.ndarray, sizes: np.ndarray, table: LocalIdTable, eos: int
) -> Tuple[np.ndarray, np.ndarray, int]:
    """(dictionary indices with </s> after each line, tokens per line with it, tokens replaced by <unk>) of lines
    given as local ids (`sizes` tokens each): fairseq-preprocess's ids, also the streaming task's."""
    if len(local) and int(local.max()) >= len(table.index):
        table.update()
    out_sizes = sizes + 1
    ends = np.cumsum(out_sizes) - 1
    out = np.full(int(ends[-1]) + 1 if len(ends) else 0, eos, dtype=np.int64)
    keep = np.ones(len(out), dtype=bool)
    keep[ends] = False
    out[keep] = table.index[local]
    return out, out_sizes, int(np.count_nonzero(table.replaced[local]))


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
    encoder = _line_encoder(spec)
    table = LocalIdTable(encoder, indices, unk, unk_word)
    summary = BinarizeSummary()
    for local, sizes in _iter_encoded(path, start, end, encoder):
        _add_mapped(builder, summary, local, sizes, table, eos)
    return summary


def count_encode_range(path: str, start: int, end: int, spec: tuple, cache_prefix: str):
    """Encode raw text bytes [start, end) once: the local ids and line sizes go to `cache_prefix`.ids/.sizes
    (int32, to be binarized once the dictionary exists) and the token counts come back, with the line count."""
    encoder = _line_encoder(spec)
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
    encoder = _line_encoder(spec)
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
