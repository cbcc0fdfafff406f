"""Reading a text file as fairseq-preprocess and `Dictionary.add_file_to_dictionary` do: byte ranges that start
at line beginnings (`find_offsets`), each read in blocks of about BLOCK_BYTES that end at a line end
(`iter_text_blocks`), so memory stays bounded whatever the file size. Lines are what upstream's text-mode
reading yields: `\\n`, `\\r\\n` and a lone `\\r` all end a line. `count_words` counts a file's words and lines,
split among worker processes.
"""

import os
from collections import Counter
from typing import Iterator, List, Optional, Tuple

from fairseq.data.worker_pool import maybe_pool

BLOCK_BYTES = 1 << 20  # text decoded and encoded at once; a worker holds ~20x this in word objects


def find_offsets(path: str, num_chunks: int) -> List[int]:
    """`num_chunks + 1` byte offsets splitting `path` into ranges that start at line beginnings."""
    size = os.path.getsize(path)
    offsets = [0]
    with open(path, "rb") as f:
        for i in range(1, num_chunks):
            f.seek(max(size * i // num_chunks, offsets[-1]))
            f.readline()  # move to the start of the next line
            offsets.append(min(f.tell(), size))
    offsets.append(size)
    return offsets


def iter_text_blocks(path: str, start: int, end: int, block_bytes: Optional[int] = None) -> Iterator[str]:
    """Decoded text of bytes [start, end) in pieces that each end at a line end (or at `end`), with
    `\\r\\n` and lone `\\r` turned into `\\n`."""
    block_bytes = block_bytes or BLOCK_BYTES
    with open(path, "rb") as f:
        f.seek(start)
        pos = block_start = start
        parts: List[bytes] = []  # read but not yet yielded: no complete line end among them
        while pos < end:
            data = f.read(min(block_bytes, end - pos))
            if not data:
                break
            pos += len(data)
            cut = len(data) if pos >= end else data.rfind(b"\n") + 1
            if cut == 0:  # a lone \r also ends a line, unless it is the last byte (it may start \r\n)
                cut = data.rfind(b"\r", 0, len(data) - 1) + 1
            if cut == 0:  # still inside a line longer than a block: keep reading
                parts.append(data)
                continue
            parts.append(data[:cut])
            block = b"".join(parts)
            yield _decode(block, path, block_start)
            block_start += len(block)
            parts = [data[cut:]] if cut < len(data) else []
        if parts:  # the file shrank while being read
            yield _decode(b"".join(parts), path, block_start)


def _decode(buf: bytes, path: str, offset: int) -> str:
    try:
        text = buf.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: invalid UTF-8 at byte {offset + e.start} ({e.reason}); convert the file to UTF-8"
        ) from None
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def _count_lines(text: str) -> int:
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def count_words_range(path: str, start: int, end: int) -> Tuple[Counter, int]:
    """Word counts and number of lines in bytes [start, end) of `path`."""
    counter: Counter = Counter()
    lines = 0
    for text in iter_text_blocks(path, start, end):
        counter.update(text.split())
        lines += _count_lines(text)
    return counter, lines


def count_words(path: str, num_workers: int = 1, pool=None) -> Tuple[Counter, int]:
    """Word counts and line count of a whole file, the work split by byte ranges among workers."""
    offsets = find_offsets(path, num_workers)
    ranges = list(zip(offsets, offsets[1:]))
    if num_workers <= 1 or len(ranges) <= 1:
        return count_words_range(path, 0, offsets[-1])
    with maybe_pool(pool, num_workers - 1, preload=(__name__,)) as p:
        pending = [p.apply_async(count_words_range, (path, s, e)) for s, e in ranges[1:]]
        counter, lines = count_words_range(path, *ranges[0])  # the first range in this process
        for r in pending:
            c, n = r.get()
            counter.update(c)
            lines += n
    return counter, lines
