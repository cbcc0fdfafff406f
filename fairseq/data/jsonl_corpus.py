"""JSONL corpora as `--task streaming_language_modeling` and `fairseq-preprocess --json-key` read them.

Layout (metaseq's): `DATA/<split>/NN/<corpus>.jsonl` (or `DATA/<split>/<corpus>.jsonl`), also `.jsonl.gz` and
`.jsonl.zst` (the `zstd` extra); a corpus is a file stem, and its files in all `NN` shard directories form one
stream, read in shard order. One document per line: a JSON object whose `--json-key` (default `text`) is a
string.

A document becomes the items the data-bin route has for the same text (fairseq.data.token_block_dataset): each
non-empty line of the text (`\\n`, `\\r\\n` and `\\r` end lines, as fairseq-preprocess reads text; lines are
stripped; empty lines are dropped, since in a text file an empty line ends a document), then one end-of-document
item (the empty line of the text format). `document_lines` is that rule, written once for both routes.

Positions are (file index, byte offset of the next line, line number): a reader resumes with one seek
(`.gz`/`.zst` files decompress up to the offset: they cannot seek; no tokenization is replayed).
"""

import gzip
import hashlib
import io
import json
import os
import re
from typing import Dict, List, Optional, Tuple

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
_LINE_ENDS = re.compile(r"\r\n|\r|\n")
FINGERPRINT_BYTES = 4096  # bytes before a resume offset whose hash a checkpoint keeps


class CorpusError(ValueError):
    """A user error in the data: one line naming the file (and line) and the fix."""


class InvalidDocument(CorpusError):
    """A line that is not a document (bad JSON, no key, not UTF-8); --skip-invalid-documents skips it."""


def corpus_stem(name: str) -> Optional[str]:
    for suffix in SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


def find_corpora(split_dir: str) -> Dict[str, List[str]]:
    """{corpus: its files in shard order} of `split_dir` (`NN/<corpus>.jsonl[.gz|.zst]` or `<corpus>.jsonl...`);
    CorpusError when there is none."""
    if not os.path.isdir(split_dir):
        raise CorpusError(
            f"{split_dir} is not a directory: --task streaming_language_modeling reads "
            f"DATA/<split>/NN/<corpus>.jsonl files"
        )
    corpora: Dict[str, List[str]] = {}
    entries = sorted(os.listdir(split_dir))
    shards = [e for e in entries if os.path.isdir(os.path.join(split_dir, e))]
    for directory in [split_dir] + [os.path.join(split_dir, s) for s in shards]:
        for name in sorted(os.listdir(directory)):
            stem = corpus_stem(name)
            path = os.path.join(directory, name)
            if stem is not None and os.path.isfile(path):
                corpora.setdefault(stem, []).append(path)
    if not corpora:
        raise CorpusError(
            f"{split_dir} has no {'/'.join('*' + s for s in SUFFIXES)} file (in it or in its NN/ "
            'shard directories): put one document per line as {"text": ...} there'
        )
    return corpora


def open_shard(path: str):
    """A binary reader of `path`'s JSONL bytes (decompressed for .gz/.zst)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard  # deferred: optional (the zstd extra)
        except ImportError:
            raise CorpusError(
                f"{path}: reading .jsonl.zst needs the zstandard package: pip install "
                "'fairseq[zstd]' (or decompress the file)"
            ) from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def seek(reader, path: str, offset: int) -> None:
    """Move `reader` to byte `offset` of the decompressed stream (compressed streams read forward to it)."""
    if not path.endswith((".gz", ".zst")):
        reader.seek(offset)
        return
    left = offset
    while left > 0:
        got = len(reader.read(min(left, 1 << 22)))
        if got == 0:
            break
        left -= got


def document_lines(text: str) -> List[str]:
    """The items' text of one document: its stripped non-empty lines (see the module docstring)."""
    return [line.strip() for line in _LINE_ENDS.split(text) if line.strip()]


def parse_document(raw: bytes, key: str, path: str, lineno: int) -> List[str]:
    """The lines of the document on line `lineno` of `path`; InvalidDocument (naming file, line and the fix)."""
    where = f"{path}, line {lineno}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidDocument(
            f"{where}: not valid UTF-8 ({e.reason} at byte {e.start}); convert the file to "
            "UTF-8, or pass --skip-invalid-documents to skip such lines"
        ) from None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise InvalidDocument(
            f"{where}: not a JSON object ({e}); each line must be one document like "
            '{"text": "..."}, or pass --skip-invalid-documents to skip such lines'
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get(key), str):
        found = f"keys {sorted(doc)[:5]}" if isinstance(doc, dict) else type(doc).__name__
        raise InvalidDocument(
            f"{where}: no string under key {key!r} (found {found}); pass --json-key KEY naming "
            "the text field, or --skip-invalid-documents to skip such lines"
        )
    return document_lines(doc[key])


def read_lines(reader, max_lines: int, max_bytes: int = 1 << 20) -> Tuple[List[bytes], List[int]]:
    """Up to `max_lines` raw lines (about `max_bytes`), without their "\\n", and the byte length of each with it;
    blank lines are returned too (the caller skips them: they are no document but count as lines)."""
    lines, lengths, size = [], [], 0
    while len(lines) < max_lines and size < max_bytes:
        raw = reader.readline()
        if not raw:
            break
        lengths.append(len(raw))
        size += len(raw)
        lines.append(raw.rstrip(b"\r\n"))
    return lines, lengths


def fingerprint(path: str, offset: int) -> Dict[str, object]:
    """What a checkpoint keeps of a file a corpus has read to `offset`: its size on disk and hashes of its first
    bytes and (uncompressed files) of the bytes before the offset, so a truncated, replaced or rewritten file is
    noticed at resume without reading it whole."""
    with open(path, "rb") as f:
        head = f.read(FINGERPRINT_BYTES)
        before = b""
        if not path.endswith((".gz", ".zst")) and offset > 0:
            f.seek(max(0, offset - FINGERPRINT_BYTES))
            before = f.read(min(offset, FINGERPRINT_BYTES))
    return {
        "size": os.path.getsize(path),
        "head": hashlib.sha1(head).hexdigest(),
        "before": hashlib.sha1(before).hexdigest(),
    }


def check_fingerprint(path: str, offset: int, saved: Dict[str, object]) -> Optional[str]:
    """None when `path` is still the file `saved` (its fingerprint at `offset`) describes; else what changed."""
    if not os.path.isfile(path):
        return f"{path} was removed"
    now = fingerprint(path, offset)
    if now["size"] < offset and not path.endswith((".gz", ".zst")):
        return f"{path} is now shorter ({now['size']} bytes) than the position {offset} the checkpoint read it to"
    if now != saved:
        return f"{path} changed since the checkpoint was written (size or content differs: replaced or rewritten)"
    return None
