"""GPT-2's byte-level BPE from `encoder.json` + `vocab.bpe`, encoded by tiktoken (or `tokenizers`).

Upstream fairseq (and OpenAI's GPT-2 release before it) encode with a pure-Python loop; this module gives
the same ids from the same two files in Rust:

1. pre-tokenization: text is cut by the GPT-2 pattern `PRETOKENIZE_PATTERN` (contractions, optional space +
   letters, optional space + digits, optional space + other symbols, whitespace not followed by a
   non-space, whitespace); every piece becomes its UTF-8 bytes, each byte shown as one character of the
   table `bytes_to_unicode()`.
2. BPE of each piece: repeatedly take the adjacent pair with the lowest rank (line number in vocab.bpe;
   a pair listed twice keeps its last rank) and merge all its occurrences left to right, until no pair
   has a rank.
3. Each resulting token's id is its value in encoder.json. Upstream raises KeyError when a token is
   missing there; so does this module (a ValueError naming the token and the files), only for text that
   produces such a token, as upstream.

Engines (`Encoder.engine`), the first that is exact for the vocabulary:

- "tiktoken": OpenAI's tiktoken, given the GPT-2 pattern (as `TIKTOKEN_PATTERN`: regrouped, the same
  matches, twice as fast) and a table of the 256 bytes and of every merge result that step 2 can output
  (`producible_tokens`). Its regex engine is Rust's (fancy-regex over the regex crate, Unicode 16.0
  tables in tiktoken 0.14). Its BPE differs from step 2 in form: it merges one occurrence at a time, any
  adjacent pair whose concatenation is in its table, by the rank of the concatenation, and returns a
  piece found in the table as one token. That gives step 2's result when (a) every merge that uses a
  token ranks after every merge that produces it (`merge_order_is_safe`; true of GPT-2's vocab.bpe and of
  any file a BPE trainer writes), and (b) the table holds exactly the producible merge results, ranked
  as their merges. Under (a) the merges apply in rank order, one rank at a time, leftmost occurrence
  first (which is also what merging all occurrences left to right does); so the symbols over a span of
  a piece evolve as the span alone would until a merge joins a symbol inside with one outside, two
  adjacent symbols whose concatenation is a producible token t are always the pair that t's own encoding
  merges last, and the candidate pairs and their order are step 2's. encoder.json's ids are tiktoken's
  ranks when they are in merge order (GPT-2's files, a trainer's), else a table maps ranks to ids.
  `Encoder.encode_lines` (the scripts' path) encodes a list of stripped lines as one text joined by
  "\\n" and formats the ids in Rust too.
- "tokenizers": Hugging Face `tokenizers`' BPE (Oniguruma regex, Unicode 15.1), exact under (a); used
  when encoder.json lacks a byte or a producible token (the error above is raised after encoding), or
  when tiktoken is not installed.
- "python": step 2 as a Python loop over `tokenizers`' pre-tokenization, when (a) does not hold (a warning
  says so).

Results do not depend on any cache (upstream's is an unbounded dict). The regex engines' Unicode tables
are older than those of recent `regex` releases (2026.11.19 has Unicode 17.0): a letter or digit assigned
after them counts as a symbol, as it does for upstream with a `regex` release of their Unicode version.
This module imports only the standard library, tiktoken and `tokenizers` (not torch), so the
data-preparation scripts can load it on its own.
"""

import gc
import itertools
import logging
import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

if __package__:
    from .gpt2_bpe_files import (  # noqa: F401 (upstream's and the scripts' names)
        DICT_TXT_URL,
        DOWNLOAD_HINT,
        ENCODER_JSON_URL,
        VOCAB_BPE_URL,
        load_encoder_json,
        load_vocab_bpe,
    )
    from .gpt2_bpe_merges import bytes_to_unicode, get_pairs, merge_order_is_safe, producible_tokens  # noqa: F401
else:  # loaded on its own, from a script that put fairseq/data/encoders on sys.path (no package, no torch)
    from gpt2_bpe_files import (  # noqa: F401
        DICT_TXT_URL,
        DOWNLOAD_HINT,
        ENCODER_JSON_URL,
        VOCAB_BPE_URL,
        load_encoder_json,
        load_vocab_bpe,
    )
    from gpt2_bpe_merges import bytes_to_unicode, get_pairs, merge_order_is_safe, producible_tokens  # noqa: F401

# GPT-2's pre-tokenization pattern (\p{L}: letters, \p{N}: digits and other numbers).
PRETOKENIZE_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same pattern, as given to tiktoken: it matches the same text at every position. The contractions
# all start with "'" and differ in the next letter, so at most one of them matches anywhere and their
# order does not matter; grouping the first branches does not change leftmost-first alternation. It is
# twice as fast in fancy-regex, which hands the lookahead-free group to the regex crate in one piece
# instead of trying eleven branches in its backtracking VM.
TIKTOKEN_PATTERN = r"""(?:'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+)|\s+(?!\S)|\s+"""


# ---- the encoder ------------------------------------------------------------------------------------------
_SURROGATE = re.compile("[\ud800-\udfff]")


class Encoder:
    """GPT-2 byte-level BPE: `encode(text) -> [ids]`, `decode(ids) -> text`, as upstream's `Encoder`.

    `errors` is how `decode` treats byte sequences that are not valid UTF-8 (a sequence of ids may end in
    the middle of a character): "replace" (upstream's default) gives U+FFFD, "strict" raises ValueError.
    `engine` says what encodes: "tiktoken", "tokenizers" or "python" (see the module's docstring).
    """

    def __init__(
        self,
        encoder: Dict[str, int],
        bpe_merges: Sequence[Tuple[str, str]],
        errors: str = "replace",
        *,
        encoder_path: Optional[str] = None,
        vocab_path: Optional[str] = None,
    ):
        self.encoder = dict(encoder)
        self.errors = errors
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        # Upstream's ranks: a pair listed twice keeps its last line.
        self.bpe_ranks = dict(zip((tuple(m) for m in bpe_merges), range(len(bpe_merges))))
        self._where = f"{encoder_path or 'encoder.json'} / {vocab_path or 'vocab.bpe'}"
        self._encoder_path = encoder_path or "encoder.json"
        self._decoder: Optional[Dict[int, str]] = None  # built on first use: encoding needs neither table
        self._id_bytes: Optional[Dict[int, bytes]] = None
        self._cache: Dict[str, List[str]] = {}  # of `bpe`, the Python loop
        self._line_format = None
        merges = sorted(self.bpe_ranks, key=self.bpe_ranks.__getitem__)
        gc_was_enabled = gc.isenabled()
        gc.disable()  # (the tables below are 100,000s of small objects, none of them garbage)
        try:
            safe = merge_order_is_safe(merges)
            self._tiktoken = self._build_tiktoken(merges) if safe else None
        finally:
            if gc_was_enabled:
                gc.enable()
        if self._tiktoken is not None:
            self.engine = "tiktoken"
        else:
            self._build_tokenizer(merges, safe)
            self.engine = "tokenizers" if safe else "python"
            if not safe:
                logger.warning(
                    f"{self._where}: some merge uses a token before (at a lower rank than) a merge that produces "
                    "it; the Rust BPEs could merge differently from upstream there, so this vocabulary is "
                    "encoded with the (slow) Python BPE loop"
                )

    @property
    def decoder(self) -> Dict[int, str]:
        """id -> token (upstream's attribute)."""
        if self._decoder is None:
            self._decoder = {v: k for k, v in self.encoder.items()}
        return self._decoder

    def _id_bytes_table(self) -> Dict[int, bytes]:
        if self._id_bytes is None:
            table = {}
            for token, idx in self.encoder.items():
                try:
                    table[idx] = bytes(self.byte_decoder[c] for c in token)
                except KeyError:
                    pass  # a token outside the byte alphabet: never produced by encode, an error in decode
            self._id_bytes = table
        return self._id_bytes

    # -- construction --
    def _build_tiktoken(self, merges):
        """tiktoken's Encoding over the byte tokens and the producible merge results, or None when this
        vocabulary needs the tokenizers path (a byte or a producible token without an id in encoder.json:
        upstream's KeyError, reported there; ids not distinct)."""
        try:
            import tiktoken  # deferred: optional (without it, the tokenizers engine)
        except ImportError:
            logger.warning(
                "GPT-2 BPE: tiktoken is not installed (pip install tiktoken); encoding with the slower tokenizers BPE"
            )
            return None
        encoder = self.encoder
        alphabet = list(self.byte_encoder.values())
        if any(c not in encoder for c in alphabet):
            return None
        live = producible_tokens(self.bpe_ranks, merges, alphabet)
        if any(t not in encoder for t in live):
            return None
        tokens = alphabet + sorted(live, key=live.__getitem__)
        ids = [encoder[t] for t in tokens]
        if len(set(ids)) != len(ids):
            return None
        # tiktoken merges by the rank of the concatenation and returns ranks as ids: use encoder.json's ids as
        # ranks where their order is the merges' order (GPT-2's files, any trainer's), else 256 + the merge's
        # place and a table back to ids. Bytes' ranks are never compared.
        merge_ids = ids[256:]
        if all(x < y for x, y in zip(merge_ids, merge_ids[1:])):
            ranks, self._rank_to_id = ids, None
        else:
            ranks, self._rank_to_id = list(range(len(ids))), ids
        self._tt_ranks, self._tt_ids = ranks, ids
        # Each character stands for one byte: translate all tokens at once and cut by their lengths.
        data = "".join(tokens).translate({ord(c): b for b, c in self.byte_encoder.items()}).encode("latin-1")
        ends = list(itertools.accumulate(map(len, tokens)))
        mergeable = dict(zip(map(data.__getitem__, map(slice, [0] + ends[:-1], ends)), ranks))
        self._newline_rank = ranks[alphabet.index(self.byte_encoder[ord("\n")])]
        encoding = tiktoken.Encoding(
            f"gpt2-bpe:{self._where}", pat_str=TIKTOKEN_PATTERN, mergeable_ranks=mergeable, special_tokens={}
        )
        # The Rust call itself: Encoding.encode_ordinary would replace lone surrogates silently.
        core = getattr(encoding, "_core_bpe", None)
        self._tiktoken_encode = getattr(core, "encode_ordinary", None) or self._checked_encoder(encoding)
        return encoding

    @staticmethod
    def _checked_encoder(encoding):
        def encode(text):
            if not isinstance(text, str):
                raise TypeError(f"expected str, got {type(text).__name__}")
            if not text.isascii() and _SURROGATE.search(text):
                raise UnicodeEncodeError("utf-8", text, 0, 1, "surrogates not allowed")
            return encoding.encode_ordinary(text)

        return encode

    def _build_tokenizer(self, merges, safe: bool):
        try:
            from tokenizers import Tokenizer, models, pre_tokenizers  # deferred: optional (an error says to install it)
        except ImportError:
            raise ImportError("GPT-2 BPE needs the `tokenizers` package: pip install tokenizers") from None
        # The Rust BPE needs every base symbol, merge operand and merge result in its vocabulary (a missing
        # base symbol would be dropped silently). Tokens that encoder.json lacks get ids above all of its
        # ids; producing one is upstream's KeyError, reported after encoding.
        vocab = dict(self.encoder)
        self._missing_from = max(vocab.values(), default=-1) + 1
        extra = {}
        needed = list(self.byte_encoder.values())
        for a, b in merges:
            needed += (a, b, a + b)
        for token in needed:
            if token not in vocab and token not in extra:
                extra[token] = self._missing_from + len(extra)
        vocab.update(extra)
        self._has_missing = bool(extra)
        self._token_of = {i: t for t, i in extra.items()}
        self._pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._vocab = vocab
        if safe:
            model = models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                unk_token=None,
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=False,
            )
            self._tokenizer = Tokenizer(model)
            self._tokenizer.pre_tokenizer = self._pre_tokenizer

    # -- encoding --
    def encode(self, text: str) -> List[int]:
        """GPT-2 BPE ids of `text` (no special tokens)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """`encode` of each text."""
        texts = list(texts)
        if self.engine == "tiktoken":
            return [self._encode_tiktoken(t) for t in texts]
        if self.engine == "tokenizers":
            try:
                encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
            except TypeError:
                self._raise_bad_text(texts)
                raise
            out = [e.ids for e in encodings]
        else:
            out = [self._encode_slow(t) for t in texts]
        if self._has_missing:
            limit = self._missing_from
            for text, ids in zip(texts, out):
                if ids and max(ids) >= limit:
                    token = self._token_of[next(i for i in ids if i >= limit)]
                    self._raise_missing(token, text)
        return out

    def _encode_tiktoken(self, text: str) -> List[int]:
        try:
            ids = self._tiktoken_encode(text)
        except (TypeError, UnicodeEncodeError):
            self._raise_bad_text([text])
            raise
        if self._rank_to_id is not None:
            table = self._rank_to_id
            ids = [table[i] for i in ids]
        return ids

    def encode_lines(self, lines: Sequence[str], *, check: bool = True) -> bytes:
        """The ids of each line as one text line each (`" ".join(map(str, ids)) + "\\n"`), UTF-8 (ASCII) bytes:
        what the data-preparation scripts write. Each line must be stripped (`str.strip`: no whitespace at
        either end, so none of "\\n" or "\\r" either); an empty line gives an empty output line.

        With tiktoken the lines are encoded as one text joined by "\\n": every whitespace character of the
        GPT-2 pattern is whitespace for `str.strip`, so each "\\n" between two stripped non-empty lines is a
        piece of its own (the id of the byte "\\n") and the other pieces are those of the lines alone; the ids
        are turned into text by a second tiktoken table whose "token bytes" are the ids' decimal forms.
        `check=False` skips checking that the lines are stripped (for callers that just stripped them)."""
        if self.engine != "tiktoken":
            return "".join([" ".join(map(str, ids)) + "\n" for ids in self.encode_batch(lines)]).encode("ascii")
        for line in lines if check else ():
            if "\n" in line or "\r" in line or line != line.strip():
                raise ValueError(f"encode_lines takes stripped lines without line breaks, got {line[:80]!r}")
        if self._line_format is None:
            self.prepare_encode_lines()
        kept = lines if all(lines) else [line for line in lines if line]
        if not kept:
            return b"\n" * len(lines)
        text = "\n".join(kept)
        try:
            ids = self._tiktoken_encode(text)
        except (TypeError, UnicodeEncodeError):
            self._raise_bad_text(kept)
            raise
        out = self._line_format.decode_bytes(ids).replace(b" \n", b"\n")
        out = out[:-1] + b"\n"  # the last line's last id was written as "N "
        if len(kept) == len(lines):
            return out
        encoded = iter(out.split(b"\n"))
        return b"".join([next(encoded) + b"\n" if line else b"\n" for line in lines])

    def encode_lines_to_ids(self, lines: Sequence[str], *, check: bool = True):
        """(ids, sizes): numpy int64 arrays of the ids of all lines concatenated and the number of ids of each
        line; the same ids as `encode_lines` writes (stripped lines, an empty line has none). Used by
        fairseq-preprocess --bpe gpt2, which maps ids to dictionary indices without going through text.
        `check=False` skips checking that the lines are stripped (for callers that just stripped them)."""
        import numpy as np  # deferred: startup (the scripts load this module on its own; only this path needs numpy)

        if self.engine != "tiktoken":
            encoded = self.encode_batch(lines)
            sizes = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
            ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(sizes.sum()))
            return ids, sizes
        for line in lines if check else ():
            if "\n" in line or "\r" in line or line != line.strip():
                raise ValueError(f"encode_lines_to_ids takes stripped lines without line breaks, got {line[:80]!r}")
        sizes = np.zeros(len(lines), dtype=np.int64)
        kept = lines if all(lines) else [line for line in lines if line]
        if not kept:
            return np.zeros(0, dtype=np.int64), sizes
        try:
            text = "\n".join(kept)
            to_buffer = getattr(getattr(self._tiktoken, "_core_bpe", None), "encode_to_tiktoken_buffer", None)
            if to_buffer is not None:  # (no special tokens are registered: the same ids as encode_ordinary)
                ranks = np.frombuffer(to_buffer(text, set()), dtype=np.uint32).astype(np.int64)
            else:
                ranks = np.asarray(self._tiktoken_encode(text), dtype=np.int64)
        except (TypeError, UnicodeEncodeError):
            self._raise_bad_text(kept)
            raise
        # Each "\n" between two stripped lines is a piece of its own (see encode_lines): the line separators.
        newline = np.flatnonzero(ranks == self._newline_rank)
        kept_sizes = np.diff(np.concatenate([[-1], newline, [len(ranks)]])) - 1
        ranks = np.delete(ranks, newline)
        if self._rank_to_id is not None:
            if getattr(self, "_rank_to_id_array", None) is None:
                self._rank_to_id_array = np.asarray(self._rank_to_id, dtype=np.int64)
            ranks = self._rank_to_id_array[ranks]
        if len(kept) == len(lines):
            return ranks, kept_sizes
        sizes[[i for i, line in enumerate(lines) if line]] = kept_sizes
        return ranks, sizes

    def prepare_encode_lines(self) -> None:
        """Build `encode_lines`' id -> text table now (else on first use)."""
        if self.engine != "tiktoken" or self._line_format is not None:
            return
        import tiktoken  # deferred: optional (present: the tiktoken engine is in use)

        newline = self._newline_rank
        table = {(b"\n" if r == newline else b"%d " % i): r for r, i in zip(self._tt_ranks, self._tt_ids)}
        self._line_format = tiktoken.Encoding(
            "gpt2-ids-as-text", pat_str=r"\n", mergeable_ranks=table, special_tokens={}
        )

    def _raise_bad_text(self, texts):
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"GPT-2 BPE encodes str, got {type(text).__name__}: {text!r:.80}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"GPT-2 BPE: text has a lone surrogate {text[e.start]!r} at position {e.start} "
                    f"(not valid Unicode; was it decoded with errors='surrogateescape'?): "
                    f"{text[max(0, e.start - 30) : e.start + 30]!r}"
                ) from None

    def _raise_missing(self, token: str, text: str):
        raise ValueError(
            f"GPT-2 BPE: the token {token!r} (bytes {bytes(self.byte_decoder.get(c, 63) for c in token)!r}), "
            f"produced by the merges of {self._where} for the text {text[:80]!r}, has no id in "
            f"{self._encoder_path}: the two files do not belong together (every merge result and every byte "
            f"that can remain unmerged needs an id; upstream raises KeyError here)"
        )

    def _encode_slow(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise TypeError(f"GPT-2 BPE encodes str, got {type(text).__name__}: {text!r:.80}")
        try:
            pieces = self._pre_tokenizer.pre_tokenize_str(text)
        except TypeError:
            self._raise_bad_text([text])
            raise
        ids = []
        vocab = self._vocab
        for piece, _ in pieces:
            for token in self._bpe_symbols(piece):
                ids.append(vocab[token])
        return ids

    def _bpe_symbols(self, token: str) -> List[str]:
        """Upstream's merge loop on one byte-level piece (the "python" engine and `bpe`)."""
        cached = self._cache.get(token)
        if cached is not None:
            return cached
        word = list(token)
        ranks = self.bpe_ranks
        while len(word) > 1:
            best = min(zip(word, word[1:]), key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == best[0] and word[i + 1] == best[1]:
                    merged.append(best[0] + best[1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        if len(self._cache) >= 100_000:
            self._cache.clear()
        self._cache[token] = word
        return word

    def bpe(self, token: str) -> str:
        """The BPE symbols of one byte-level pre-tokenized piece, joined by spaces (upstream's `bpe`, by the
        Python loop whatever the engine)."""
        return " ".join(self._bpe_symbols(token))

    # -- decoding --
    def decode(self, tokens: Iterable) -> str:
        """Text of a sequence of ids. A str item stands for itself (upstream passes `<unk>`, `<s>`, ... through);
        an id that encoder.json lacks is a ValueError."""
        table = self._id_bytes_table()
        parts = []
        for t in tokens:
            if isinstance(t, str):
                try:
                    parts.append(bytes(self.byte_decoder[c] for c in t))
                except KeyError as e:
                    raise ValueError(
                        f"GPT-2 BPE decode: {t!r} is neither an id nor made of GPT-2 byte characters "
                        f"(has {e.args[0]!r})"
                    ) from None
                continue
            try:
                parts.append(table[t])
            except (KeyError, TypeError):
                if isinstance(t, int) and t in self.decoder:
                    raise ValueError(
                        f"GPT-2 BPE decode: id {t} ({self.decoder[t]!r} in {self._encoder_path}) "
                        "is not made of GPT-2 byte characters"
                    ) from None
                raise ValueError(
                    f"GPT-2 BPE decode: id {t!r} is not in {self._encoder_path} "
                    f"({len(self.encoder)} tokens); was the text encoded with another vocabulary, "
                    "or does it hold fairseq dictionary indices instead of GPT-2 ids?"
                ) from None
        data = b"".join(parts)
        try:
            return data.decode("utf-8", errors=self.errors)
        except UnicodeDecodeError as e:
            raise ValueError(
                f"GPT-2 BPE decode: the ids do not form valid UTF-8 ({e.reason} at byte {e.start} "
                f"of {data[max(0, e.start - 8) : e.start + 8]!r}); decode whole sequences, or use "
                "errors='replace'"
            ) from None


def get_encoder(encoder_json_path, vocab_bpe_path, errors: str = "replace") -> Encoder:
    """Load GPT-2's BPE from its two files (upstream's `get_encoder`)."""
    encoder = load_encoder_json(encoder_json_path)
    merges = load_vocab_bpe(vocab_bpe_path)
    return Encoder(
        encoder, merges, errors=errors, encoder_path=os.fspath(encoder_json_path), vocab_path=os.fspath(vocab_bpe_path)
    )
