"""A vocabulary: symbols <-> consecutive integer ids, stored as upstream fairseq's `dict.txt`.

File format (one symbol per line, specials not stored): `<symbol> <count>`, split on the LAST space so a
symbol may itself contain spaces; an optional trailing ` #fairseq:overwrite` lets a line re-add a symbol
that already exists (the later line wins the symbol's id). Ids 0..3 are `<s>`, `<pad>`, `</s>`, `<unk>`;
the file's lines follow from id 4 (after any extra special symbols).
"""

import os
from collections import Counter
from typing import Dict, Iterable, List, Optional, TextIO, Union

import torch

from fairseq.data.text_files import count_words

OVERWRITE_FLAG = "#fairseq:overwrite"


class DuplicateSymbolError(RuntimeError, ValueError):
    """A dict.txt lists a symbol twice without the overwrite flag: a RuntimeError as upstream's is, and a
    ValueError like this fork's other input errors (the commands print it as one line)."""


def tokenize_line(line: str) -> List[str]:
    # Upstream collapses `\s+` to one space, strips, then splits on spaces; for str that is exactly
    # str.split() (both use Python's Unicode whitespace definition).
    return line.split()


class Dictionary:
    """A mapping from symbols to consecutive integers, with upstream fairseq's special symbols."""

    def __init__(
        self,
        *,
        bos: str = "<s>",
        pad: str = "<pad>",
        eos: str = "</s>",
        unk: str = "<unk>",
        extra_special_symbols: Optional[Iterable[str]] = None,
    ):
        self.bos_word, self.pad_word, self.eos_word, self.unk_word = bos, pad, eos, unk
        self.symbols: List[str] = []
        self.count: List[int] = []
        self.indices: Dict[str, int] = {}
        self.bos_index = self.add_symbol(bos)
        self.pad_index = self.add_symbol(pad)
        self.eos_index = self.add_symbol(eos)
        self.unk_index = self.add_symbol(unk)
        for symbol in extra_special_symbols or ():
            self.add_symbol(symbol)
        self.nspecial = len(self.symbols)
        self.path: Optional[str] = None  # the dict.txt this was loaded from, for error messages

    # ---- lookups ------------------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return isinstance(other, Dictionary) and self.indices == other.indices

    def __getitem__(self, idx: int) -> str:
        if 0 <= idx < len(self.symbols):
            return self.symbols[idx]
        return self.unk_word

    def __len__(self) -> int:
        return len(self.symbols)

    def get_count(self, idx: int) -> int:
        """How often the symbol with id `idx` was counted (upstream's accessor of `count`)."""
        return self.count[idx]

    def __contains__(self, sym: str) -> bool:
        return sym in self.indices

    def index(self, sym: str) -> int:
        """The id of `sym`, or the id of `<unk>` when it is not in the dictionary."""
        if not isinstance(sym, str):
            raise TypeError(f"Dictionary.index expects a str symbol, got {type(sym).__name__}: {sym!r}")
        return self.indices.get(sym, self.unk_index)

    def bos(self) -> int:
        return self.bos_index

    def pad(self) -> int:
        return self.pad_index

    def eos(self) -> int:
        return self.eos_index

    def unk(self) -> int:
        return self.unk_index

    def unk_string(self, escape: bool = False) -> str:
        return f"<{self.unk_word}>" if escape else self.unk_word

    # ---- building -----------------------------------------------------------------------------------
    def add_symbol(self, word: str, n: int = 1, overwrite: bool = False) -> int:
        """Add `n` occurrences of `word` (a new id unless it exists and `overwrite` is False)."""
        if word in self.indices and not overwrite:
            idx = self.indices[word]
            self.count[idx] += n
            return idx
        idx = len(self.symbols)
        self.indices[word] = idx
        self.symbols.append(word)
        self.count.append(n)
        return idx

    def update(self, new_dict: "Dictionary") -> None:
        """Merge another dictionary's symbols and counts into this one."""
        for word in new_dict.symbols:
            other_count = new_dict.count[new_dict.indices[word]]
            if word in self.indices:
                self.count[self.indices[word]] += other_count
            else:
                self.indices[word] = len(self.symbols)
                self.symbols.append(word)
                self.count.append(other_count)

    def add_counts(self, counter: Dict[str, int]) -> None:
        """Add word counts (e.g. from a corpus); symbols are added in sorted order as upstream does."""
        for word, n in sorted(counter.items()):
            self.add_symbol(word, n)

    def finalize(self, threshold: int = -1, nwords: int = -1, padding_factor: int = 8) -> None:
        """Sort symbols by count, prune, and pad the size to a multiple of `padding_factor`.

        Specials keep their ids. The rest are ordered by count descending, ties by symbol (code point
        order), as upstream's `Counter(dict(sorted(...))).most_common()` orders them. Only symbols with
        count >= `threshold` are kept, at most `nwords` ids in total (specials included; <= 0: no limit).
        Padding symbols are `madeupword0000`, `madeupword0001`, ... with count 0.
        """
        if nwords <= 0:
            nwords = len(self)
        new_symbols = self.symbols[: self.nspecial]
        new_count = self.count[: self.nspecial]
        new_indices = {s: i for i, s in enumerate(new_symbols)}
        # dict() over (symbol, count) pairs sorted by symbol: a duplicated symbol keeps its last entry.
        counts = Counter(dict(sorted(zip(self.symbols[self.nspecial :], self.count[self.nspecial :]))))
        for symbol, count in counts.most_common(nwords - self.nspecial):
            if count < threshold:
                break  # most_common is sorted, so every later count is below the threshold too
            new_indices[symbol] = len(new_symbols)
            new_symbols.append(symbol)
            new_count.append(count)
        self.symbols, self.count, self.indices = new_symbols, new_count, new_indices
        self.pad_to_multiple_(padding_factor)

    @staticmethod
    def add_file_to_dictionary(filename: str, dict: "Dictionary", tokenize=tokenize_line, num_workers: int = 1) -> None:
        """Upstream's: add the words of a text file to `dict` (one `</s>` per line), counted by
        `num_workers` processes; symbols are added in sorted order, as upstream adds each count."""
        if tokenize is tokenize_line:  # the fast counter of fairseq-preprocess (the same whitespace split)
            counter, lines = count_words(filename, num_workers)
        else:
            counter, lines = Counter(), 0
            with open(filename, "r", encoding="utf-8") as f:
                for line in f:
                    counter.update(tokenize(line))
                    lines += 1
        if lines:
            counter[dict.eos_word] += lines
        dict.add_counts(counter)

    def pad_to_multiple_(self, padding_factor: int) -> None:
        if padding_factor > 1:
            i = 0
            while len(self) % padding_factor != 0:
                self.add_symbol(f"madeupword{i:04d}", n=0)
                i += 1

    # ---- dict.txt -----------------------------------------------------------------------------------
    @classmethod
    def load(cls, f: Union[str, os.PathLike, TextIO]) -> "Dictionary":
        """Load a `dict.txt` (path or open text file)."""
        d = cls()
        d.add_from_file(f)
        return d

    def add_from_file(self, f: Union[str, os.PathLike, TextIO]) -> None:
        if isinstance(f, (str, os.PathLike)):
            self.path = os.fspath(f)
            try:
                with open(f, "r", encoding="utf-8") as fd:
                    self._add_lines(fd, self.path)
            except UnicodeDecodeError as e:
                raise ValueError(f"dictionary {f}: not valid UTF-8 ({e}); rebuild it with fairseq-preprocess") from e
            return
        self._add_lines(f, getattr(f, "name", "<stream>"))

    def _add_lines(self, lines: Iterable[str], name: str) -> None:
        for lineno, raw in enumerate(lines, start=1):
            line = raw.rstrip()
            word, sep, field = line.rpartition(" ")
            overwrite = False
            if sep and field == OVERWRITE_FLAG:
                overwrite = True
                word, sep, field = word.rpartition(" ")
            try:
                if not sep:
                    raise ValueError("no space")
                count = int(field)
            except ValueError:
                raise ValueError(
                    f"dictionary {name}, line {lineno}: expected '<token> <count> [{OVERWRITE_FLAG}]', "
                    f"got {raw.rstrip(chr(10))!r}"
                ) from None
            if word in self.indices and not overwrite:
                raise DuplicateSymbolError(  # "Duplicate" first, as upstream's message (callers match it)
                    f"Duplicate word in dictionary {name}, line {lineno}: duplicate symbol {word!r}; append "
                    f"' {OVERWRITE_FLAG}' to the line if the duplicate is intended"
                )
            self.add_symbol(word, n=count, overwrite=overwrite)

    def save(self, f: Union[str, os.PathLike, TextIO]) -> None:
        """Write `dict.txt` (specials omitted). A symbol listed twice gets the overwrite flag the second
        time, so the file loads back to the same ids."""
        if isinstance(f, (str, os.PathLike)):
            parent = os.path.dirname(os.fspath(f))
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(f, "w", encoding="utf-8") as fd:
                self.save(fd)
            return
        seen = set(self.symbols[: self.nspecial])
        lines = []
        for word, count in zip(self.symbols[self.nspecial :], self.count[self.nspecial :]):
            lines.append(f"{word} {count} {OVERWRITE_FLAG}\n" if word in seen else f"{word} {count}\n")
            seen.add(word)
        f.write("".join(lines))

    # ---- encoding -----------------------------------------------------------------------------------
    def encode_line(
        self,
        line: str,
        line_tokenizer=tokenize_line,
        add_if_not_exist: bool = False,
        consumer=None,
        append_eos: bool = True,
        reverse_order: bool = False,
    ) -> torch.IntTensor:
        """Token ids of a line split on whitespace, followed by `</s>`; unknown words become `<unk>`
        (or are added, with `add_if_not_exist`). `consumer(word, idx)` is called for every word."""
        words = line_tokenizer(line)
        if reverse_order:
            words = list(reversed(words))
        if add_if_not_exist:
            ids = [self.add_symbol(w) for w in words]
        else:
            get, unk = self.indices.get, self.unk_index
            ids = [get(w, unk) for w in words]
        if consumer is not None:
            for w, idx in zip(words, ids):
                consumer(w, idx)
        if append_eos:
            ids.append(self.eos_index)
        return torch.tensor(ids, dtype=torch.int32)

    def string(
        self,
        tensor,
        bpe_symbol: Optional[str] = None,
        escape_unk: bool = False,
        extra_symbols_to_ignore: Optional[Iterable[int]] = None,
        unk_string: Optional[str] = None,
        include_eos: bool = False,
        separator: str = " ",
    ) -> str:
        """Symbols of a 1-D tensor/list of ids joined by `separator` (rows joined by newlines for 2-D).
        `<s>` and, unless `include_eos`, `</s>` are dropped; `bpe_symbol` is removed as upstream's
        post-processing does (e.g. "@@ " joins subword pieces)."""
        if torch.is_tensor(tensor) and tensor.dim() == 2:
            return "\n".join(
                self.string(row, bpe_symbol, escape_unk, extra_symbols_to_ignore, unk_string, include_eos, separator)
                for row in tensor
            )
        ignore = set(extra_symbols_to_ignore or ())
        ignore.add(self.bos_index)
        if not include_eos:
            ignore.add(self.eos_index)
        unk_text = unk_string if unk_string is not None else self.unk_string(escape_unk)
        ids = tensor.tolist() if torch.is_tensor(tensor) else [int(i) for i in tensor]
        sent = separator.join(unk_text if i == self.unk_index else self[i] for i in ids if i not in ignore)
        return post_process(sent, bpe_symbol)

    def dummy_sentence(self, length: int) -> torch.LongTensor:
        t = torch.empty(length).uniform_(self.nspecial + 1, len(self)).long()
        t[-1] = self.eos()
        return t


def post_process(sentence: str, symbol: Optional[str]) -> str:
    """Undo subword segmentation: "@@ " (subword-nmt), "sentencepiece", or any literal marker."""
    if symbol is None or symbol == "none":
        return sentence
    if symbol == "sentencepiece":
        return sentence.replace(" ", "").replace("\u2581", " ").strip()
    if symbol == "subword_nmt":
        symbol = "@@ "
    return (sentence + " ").replace(symbol, "").rstrip()


class TruncatedDictionary:
    """The first `length` symbols of a dictionary (`--output-dictionary-size`); other lookups delegate."""

    def __init__(self, wrapped: Dictionary, length: int):
        self.wrapped = wrapped
        self.length = min(len(wrapped), length)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> str:
        return self.wrapped[idx] if idx < self.length else self.wrapped.unk_word

    def __getattr__(self, name):
        return getattr(self.wrapped, name)
