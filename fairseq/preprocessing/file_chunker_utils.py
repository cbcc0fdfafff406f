"""Upstream's `fairseq.preprocessing.file_chunker_utils`: split a text file into byte ranges that start at line beginnings
(`find_offsets`, the same offsets fairseq-preprocess's workers use) and read one range line by line
(`Chunker`). Lines are read as upstream's text-mode files yield them (`\\r\\n` and `\\r` end a line too)."""

import os
from typing import Iterator, List

from fairseq.data.text_files import find_offsets as _find_offsets, iter_text_blocks


def find_offsets(filename: str, num_chunks: int) -> List[int]:
    """`num_chunks + 1` byte offsets: 0, the start of the line after each 1/num_chunks point, file size."""
    return _find_offsets(filename, num_chunks)


class ChunkLineIterator:
    """The lines of bytes [start_offset, end_offset) of a file (end_offset <= 0: to the end)."""

    def __init__(self, path: str, start_offset: int, end_offset: int):
        self._path = path
        self._start_offset = start_offset
        self._end_offset = end_offset if end_offset > 0 else os.path.getsize(path)

    def __iter__(self) -> Iterator[str]:
        for block in iter_text_blocks(self._path, self._start_offset, self._end_offset):
            lines = block.split("\n")  # only \n ends a line (str.splitlines also splits on \x0c, \u2028, ...)
            for line in lines[:-1]:
                yield line + "\n"
            if lines[-1]:
                yield lines[-1]


class Chunker:
    """Context manager giving the lines of one byte range of `path` (see ChunkLineIterator)."""

    def __init__(self, path: str, start_offset: int, end_offset: int):
        self.path = path
        self.start_offset = start_offset
        self.end_offset = end_offset

    def __enter__(self) -> ChunkLineIterator:
        return ChunkLineIterator(self.path, self.start_offset, self.end_offset)

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        pass
