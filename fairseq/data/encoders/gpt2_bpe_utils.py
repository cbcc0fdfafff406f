"""GPT-2's byte-level BPE from `encoder.json` + `vocab.bpe`, encoded by the `tokenizers` library.

Upstream fairseq (and OpenAI's GPT-2 release before it) encode with a pure-Python loop; this module gives
the same ids from the same two files with the Rust BPE of `tokenizers`:

1. pre-tokenization: text is cut by the GPT-2 pattern `PRETOKENIZE_PATTERN` (contractions, optional space +
   letters, optional space + digits, optional space + other symbols, whitespace not followed by a
   non-space, whitespace); every piece becomes its UTF-8 bytes, each byte shown as one character of the
   table `bytes_to_unicode()`. `tokenizers`' `ByteLevel(add_prefix_space=False, use_regex=True)` pre-tokenizer
   applies exactly this pattern and table (its regex engine is Oniguruma, whose Unicode tables reach
   Unicode 15.1; letters and digits added in Unicode 16 and later count as symbols there, as they do for
   upstream with a `regex` release older than those Unicode versions).
2. BPE of each piece: repeatedly take the adjacent pair with the lowest rank (line number in vocab.bpe;
   a pair listed twice keeps its last rank) and merge all its occurrences left to right, until no pair
   has a rank. `tokenizers` merges one occurrence at a time (lowest rank, then leftmost); the two orders
   give the same result whenever every merge that uses a token comes after every merge that produces it,
   which holds for GPT-2's vocab.bpe and for any file written by a BPE trainer. `Encoder` checks that on
   loading and otherwise encodes with a Python loop over the same pre-tokenization (and logs a warning).
3. Each resulting token's id is its value in encoder.json. Upstream raises KeyError when a token is
   missing there; so does this module (a ValueError naming the token and the files), only for text that
   produces such a token, as upstream.

Results do not depend on any cache (the Rust BPE keeps a bounded one, upstream an unbounded dict).
This module imports only the standard library and `tokenizers` (not torch), so the data-preparation
scripts can load it on its own.
"""

import json
import logging
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

ENCODER_JSON_URL = "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/encoder.json"
VOCAB_BPE_URL = "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/vocab.bpe"
DICT_TXT_URL = "https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/dict.txt"
DOWNLOAD_HINT = (
    f"download GPT-2's BPE files first, e.g. `mkdir -p gpt2_bpe && wget -O gpt2_bpe/encoder.json {ENCODER_JSON_URL}"
    f" && wget -O gpt2_bpe/vocab.bpe {VOCAB_BPE_URL}`, and pass their local paths"
)

# GPT-2's pre-tokenization pattern (\p{L}: letters, \p{N}: digits and other numbers).
PRETOKENIZE_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the other 68 bytes
    (controls, space, 0x7F-0xA0, 0xAD) take the characters 256, 257, ... in byte order."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def get_pairs(word: Sequence[str]) -> set:
    """The set of adjacent symbol pairs of a word (upstream's helper of the same name)."""
    return set(zip(word, word[1:]))


# ---- the two files ----------------------------------------------------------------------------------------
def _read_text(path, what: str) -> str:
    if path is None or path == "":
        raise ValueError(f"no path given for GPT-2 BPE {what}: {DOWNLOAD_HINT}")
    path = os.fspath(path)
    if path.startswith(("http://", "https://")):
        raise ValueError(f"GPT-2 BPE {what} {path!r} is a URL; files are not downloaded here: {DOWNLOAD_HINT}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GPT-2 BPE {what} {path!r} does not exist: {DOWNLOAD_HINT}")
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"GPT-2 BPE {what} {path!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
                         f"is it the right file? {DOWNLOAD_HINT}") from None


def load_encoder_json(path) -> Dict[str, int]:
    """encoder.json: one JSON object mapping each byte-level BPE token to its id (distinct ids >= 0)."""
    text = _read_text(path, "encoder.json")
    try:
        encoder = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"GPT-2 BPE encoder.json {path!r} is not valid JSON ({e}); re-download it: "
                         f"{ENCODER_JSON_URL}") from None
    if not isinstance(encoder, dict):
        raise ValueError(f"GPT-2 BPE encoder.json {path!r} must hold one JSON object (token -> id), "
                         f"not a {type(encoder).__name__}; is it the right file? ({ENCODER_JSON_URL})")
    seen: Dict[int, str] = {}
    for token, idx in encoder.items():
        if type(idx) is not int or not 0 <= idx < 2**32 - 1:
            raise ValueError(f"GPT-2 BPE encoder.json {path!r}: token {token!r} has id {idx!r}; ids must be "
                             f"integers from 0 to 2**32 - 2 ({ENCODER_JSON_URL} is the expected format)")
        if idx in seen:
            raise ValueError(f"GPT-2 BPE encoder.json {path!r}: id {idx} is given to both {seen[idx]!r} and "
                             f"{token!r}; each id must name one token")
        seen[idx] = token
    return encoder


def load_vocab_bpe(path) -> List[Tuple[str, str]]:
    """vocab.bpe: a `#version: ...` line, then one merge `A B` per line, in rank order.

    As upstream reads it, the text is split on newlines and the first and the last element are dropped:
    a file that does not end with a newline loses its last merge (a warning says so here). Blank lines
    are skipped; a line that is not two space-separated tokens is an error.
    """
    text = _read_text(path, "vocab.bpe")
    lines = text.split("\n")
    if not lines[0].startswith("#"):
        raise ValueError(f"GPT-2 BPE vocab.bpe {path!r} does not start with a '#version: 0.2' line; got "
                         f"{lines[0][:80]!r}. Is it the right file? ({VOCAB_BPE_URL})")
    if lines[-1] != "":
        logger.warning(f"GPT-2 BPE vocab.bpe {path!r} does not end with a newline: its last line "
                       f"{lines[-1][:80]!r} is ignored, as upstream's reader ignores it")
    merges = []
    for lineno, line in enumerate(lines[1:-1], start=2):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise ValueError(f"GPT-2 BPE vocab.bpe {path!r}, line {lineno}: expected two space-separated BPE "
                             f"tokens (a merge), got {line[:80]!r}. Is it the right file? ({VOCAB_BPE_URL})")
        merges.append((parts[0], parts[1]))
    return merges


# ---- the encoder ------------------------------------------------------------------------------------------
class Encoder:
    """GPT-2 byte-level BPE: `encode(text) -> [ids]`, `decode(ids) -> text`, as upstream's `Encoder`.

    `errors` is how `decode` treats byte sequences that are not valid UTF-8 (a sequence of ids may end in
    the middle of a character): "replace" (upstream's default) gives U+FFFD, "strict" raises ValueError.
    """

    def __init__(self, encoder: Dict[str, int], bpe_merges: Sequence[Tuple[str, str]], errors: str = "replace",
                 *, encoder_path: Optional[str] = None, vocab_path: Optional[str] = None):
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
        self._build_tokenizer()

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
    def _build_tokenizer(self):
        try:
            from tokenizers import Tokenizer, models, pre_tokenizers
        except ImportError:
            raise ImportError("GPT-2 BPE needs the `tokenizers` package: pip install tokenizers") from None
        merges = sorted(self.bpe_ranks, key=self.bpe_ranks.__getitem__)
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
        self._fast = self._merge_order_is_safe(merges)
        model = models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False,
                           byte_fallback=False, ignore_merges=False)
        self._tokenizer = Tokenizer(model)
        self._tokenizer.pre_tokenizer = self._pre_tokenizer
        self._vocab = None if self._fast else vocab
        if not self._fast:
            logger.warning(
                f"{self._where}: some merge uses a token before (at a lower rank than) a merge that produces "
                "it; the Rust BPE could merge differently from upstream there, so this vocabulary is "
                "encoded with the (slow) Python BPE loop"
            )
            self._cache: Dict[str, List[str]] = {}

    @staticmethod
    def _merge_order_is_safe(merges: Sequence[Tuple[str, str]]) -> bool:
        """True when every merge using a token ranks after every merge producing it: then one-at-a-time
        merging (lowest rank, leftmost first) equals upstream's all-occurrences-per-rank merging."""
        last_made: Dict[str, int] = {}
        for rank, (a, b) in enumerate(merges):
            last_made[a + b] = rank
        first_used: Dict[str, int] = {}
        for rank, (a, b) in enumerate(merges):
            first_used.setdefault(a, rank)
            first_used.setdefault(b, rank)
        return all(first_used[t] > r for t, r in last_made.items() if t in first_used)

    # -- encoding --
    def encode(self, text: str) -> List[int]:
        """GPT-2 BPE ids of `text` (no special tokens)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """`encode` of each text; one call into the Rust tokenizer for the whole batch."""
        texts = list(texts)
        if self._fast:
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

    def _raise_bad_text(self, texts):
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"GPT-2 BPE encodes str, got {type(text).__name__}: {text!r:.80}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"GPT-2 BPE: text has a lone surrogate {text[e.start]!r} at position {e.start} "
                                 f"(not valid Unicode; was it decoded with errors='surrogateescape'?): "
                                 f"{text[max(0, e.start - 30):e.start + 30]!r}") from None

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
        """Upstream's merge loop on one byte-level piece (used when the Rust merge order is not safe)."""
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
        """The BPE symbols of one byte-level pre-tokenized piece, joined by spaces (upstream's `bpe`)."""
        if not self._fast:
            return " ".join(self._bpe_symbols(token))
        return " ".join(t.value for t in self._tokenizer.model.tokenize(token))

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
                    raise ValueError(f"GPT-2 BPE decode: {t!r} is neither an id nor made of GPT-2 byte characters "
                                     f"(has {e.args[0]!r})") from None
                continue
            try:
                parts.append(table[t])
            except (KeyError, TypeError):
                if isinstance(t, int) and t in self.decoder:
                    raise ValueError(f"GPT-2 BPE decode: id {t} ({self.decoder[t]!r} in {self._encoder_path}) "
                                     "is not made of GPT-2 byte characters") from None
                raise ValueError(f"GPT-2 BPE decode: id {t!r} is not in {self._encoder_path} "
                                 f"({len(self.encoder)} tokens); was the text encoded with another vocabulary, "
                                 "or does it hold fairseq dictionary indices instead of GPT-2 ids?") from None
        data = b"".join(parts)
        try:
            return data.decode("utf-8", errors=self.errors)
        except UnicodeDecodeError as e:
            raise ValueError(f"GPT-2 BPE decode: the ids do not form valid UTF-8 ({e.reason} at byte {e.start} "
                             f"of {data[max(0, e.start - 8):e.start + 8]!r}); decode whole sequences, or use "
                             "errors='replace'") from None


def get_encoder(encoder_json_path, vocab_bpe_path, errors: str = "replace") -> Encoder:
    """Load GPT-2's BPE from its two files (upstream's `get_encoder`)."""
    encoder = load_encoder_json(encoder_json_path)
    merges = load_vocab_bpe(vocab_bpe_path)
    return Encoder(encoder, merges, errors=errors, encoder_path=os.fspath(encoder_json_path),
                   vocab_path=os.fspath(vocab_bpe_path))
