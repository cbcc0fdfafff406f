"""Lines of text -> dictionary ids: the one definition both routes use, fairseq-preprocess (the data-bin route,
fairseq.preprocessing.binarizer) and `--task streaming_language_modeling` (fairseq.data.stream_tokenizer).

Each line is followed by `</s>`; a line's tokens are the whitespace-separated tokens of its text (no --bpe) or
of its --bpe encoding, which is what the two-step route (the encoder script with --keep-empty, then
fairseq-preprocess on its output) splits: an empty line stays an empty line (`</s>` alone).

- No --bpe: `encode_block` encodes a block of lines at once (one `str.split`, one dict lookup per token into a
  numpy array): line ends become marker tokens, so the markers give both the line sizes and the `</s>` slots.
- --bpe: a `LineEncoder` gives, per list of lines, "local" ids of the tokens the split yields and the token of
  each local id (`symbols`); local ids become dictionary indices through a `LocalIdTable` (`map_local_ids`), so
  GPT-2 ids never become text at all, and fairseq-preprocess counts local ids (np.bincount), not strings.
"""

import dataclasses
from collections import defaultdict
from itertools import chain, repeat
from typing import Dict, List, Optional, Tuple

import numpy as np

from fairseq.data.encoders import build_bpe
from fairseq.data.encoders.gpt2_bpe import GPT2BPE
from fairseq.data.encoders.sentencepiece_bpe import SentencepieceBPE

LINE_MARK = "\x00"  # stands for a line end inside a block; never whitespace, so split() keeps it a token


# ---- no --bpe: whitespace words ------------------------------------------------------------------------------
def marked_indices(indices: Dict[str, int]) -> Dict[str, int]:
    """`indices` plus the line-end marker (-> -1), as `encode_block` takes them."""
    marked = dict(indices)
    marked[LINE_MARK] = -1
    return marked


def encode_block(
    text: str, indices: Dict[str, int], marked: Dict[str, int], unk: int, eos: int, unk_word: str
) -> Tuple[np.ndarray, np.ndarray, int]:
    """(token ids int64, sizes per line, words replaced by unk) of a block of whole lines (`marked`:
    `marked_indices(indices)`)."""
    if not text:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    if not text.endswith("\n"):
        text += "\n"
    if LINE_MARK in text:  # the marker would be ambiguous: encode line by line
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


# ---- --bpe: local ids ----------------------------------------------------------------------------------------
class LineEncoder:
    """Generic: `bpe.encode(line)` per line, tokens split on whitespace, local ids in order of appearance."""

    def __init__(self, bpe):
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

    def _sp_encode(self, lines: List[str], out_type):
        return self.bpe.sp.Encode(
            lines, out_type=out_type, enable_sampling=self.bpe.enable_sampling, alpha=self.bpe.alpha
        )

    def encoded_lines(self, lines: List[str]) -> List[str]:
        todo = [line for line in lines if line]
        pieces = iter(self._sp_encode(todo, str) if todo else [])
        return [" ".join(next(pieces)) if line else "" for line in lines]

    def encode(self, lines):
        todo = [line for line in lines if line]
        encoded = self._sp_encode(todo, int) if todo else []
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
    if isinstance(bpe, GPT2BPE):
        return GPT2LineEncoder(bpe)
    if isinstance(bpe, SentencepieceBPE):
        return SentencepieceLineEncoder(bpe)
    return LineEncoder(bpe)


def bpe_spec(bpe_cfg) -> tuple:
    """Hashable description of a --bpe config (its name and field values)."""
    fields = dataclasses.fields(bpe_cfg)
    values = tuple(sorted((f.name, getattr(bpe_cfg, f.name)) for f in fields if not f.name.startswith("_")))
    return (bpe_cfg._name, values)


_LINE_ENCODERS: Dict[tuple, LineEncoder] = {}  # per process: the main one registers, workers build on demand


def register_line_encoder(spec: tuple, bpe) -> None:
    """Make the encoder for `spec` (`bpe_spec`'s) available to this process (worker processes build their own
    from `spec` on first use: `line_encoder_for`)."""
    _LINE_ENCODERS[spec] = make_line_encoder(bpe)


def line_encoder_for(spec: tuple) -> LineEncoder:
    """This process's encoder for `spec` (built from its config values the first time)."""
    if spec not in _LINE_ENCODERS:
        name, values = spec
        _LINE_ENCODERS[spec] = make_line_encoder(build_bpe(dict(values, _name=name)))
    return _LINE_ENCODERS[spec]


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
