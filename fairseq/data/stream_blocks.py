"""One corpus of `--task streaming_language_modeling` as a resumable stream of token blocks.

`BlockPacker` cuts the corpus's token stream into blocks with the data-bin route's break-mode definition
(`token_block_dataset.final_block_slices` over `block_slices`), so the same text gives the same blocks (and
the same shifted sources) on both routes. A block longer than --tokens-per-sample (one line longer than it, in
the complete, complete_doc and eos modes) is cut into --tokens-per-sample pieces here, where the data-bin route
skips it at batching.

`CorpusStream` reads the corpus's files ahead in chunks of lines, which worker processes tokenize (a chunk in
flight per worker and one more), and feeds documents to the packer. Its state is exact and small: the position
after the last document the packer took (file, byte offset, line), the tokens the packer holds that no block
returned yet (the carry-over), and counters. A stream restored from it seeks and continues; nothing is replayed.
When the files run out the corpus starts its next pass from its first file.
"""

import logging
from collections import deque
from typing import Dict, List, Optional

import numpy as np
import torch

from fairseq.data.jsonl_corpus import CorpusError, check_fingerprint, fingerprint, open_shard, read_lines, seek
from fairseq.data.stream_tokenizer import TokenizerSpec, encode_chunk
from fairseq.data.token_block_dataset import final_block_slices

logger = logging.getLogger(__name__)

CHUNK_LINES = 512  # documents a worker tokenizes per task


class BlockPacker:
    """Blocks over a growing token stream (see the module docstring); `state()` / `from_state` carry it over."""

    def __init__(self, block_size: int, break_mode: str, eos: int):
        self.block_size, self.break_mode, self.eos = block_size, break_mode, eos
        self.tokens = np.zeros(0, np.int64)
        self.sizes = np.zeros(0, np.int64)
        self.prev: Optional[int] = None  # the token before tokens[0] when tokens[0] is inside an item
        self._ready: deque = deque()  # [start, end) of final blocks not yet taken
        self._taken = 0  # stream position after the last block taken

    def add(self, ids: np.ndarray, sizes: np.ndarray) -> None:
        self._compact()
        self.tokens = np.concatenate([self.tokens, ids])
        self.sizes = np.concatenate([self.sizes, sizes])

    def take(self, at_end: bool = False):
        """(source, target) of the next final block, or None when more items are needed (`at_end`: none left)."""
        if not self._ready:
            self._compact()
            starts, ends, _ = final_block_slices(self.sizes, self.block_size, self.break_mode, at_end=at_end)
            for s, e in zip(starts.tolist(), ends.tolist()):
                for piece in range(s, e, self.block_size):  # a block longer than the limit: cut into pieces
                    self._ready.append((piece, min(piece + self.block_size, e)))
        if not self._ready:
            return None
        start, end = self._ready.popleft()
        self._taken = end
        target = torch.from_numpy(self.tokens[start:end].copy())
        source = torch.empty_like(target)
        source[0] = self._token_before(start)
        source[1:] = target[:-1]
        return source, target

    def _item_starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)])

    def _token_before(self, pos: int) -> int:
        """As TokenBlockDataset: the previous token inside an item, </s> at an item's start."""
        if pos == 0:
            return self.eos if self.prev is None else self.prev
        starts = self._item_starts()
        at_item_start = starts[np.searchsorted(starts, pos)] == pos if pos <= starts[-1] else False
        return self.eos if at_item_start else int(self.tokens[pos - 1])

    def _carry(self, pos: int):
        """(tokens, sizes, prev) of the stream from `pos` on."""
        starts = self._item_starts()
        k = int(np.searchsorted(starts, pos, side="right")) - 1  # the item holding pos
        sizes = self.sizes[k:].copy()
        inside = k < len(self.sizes) and pos > starts[k]
        if len(sizes):
            sizes[0] -= pos - starts[k]
        prev = self._token_before(pos) if inside or (pos == 0 and self.prev is not None) else None
        return self.tokens[pos:].copy(), sizes, prev

    def _compact(self) -> None:
        if self._ready or self._taken == 0:
            return
        self.tokens, self.sizes, self.prev = self._carry(self._taken)
        self._taken = 0

    def state(self) -> Dict[str, object]:
        tokens, sizes, prev = self._carry(self._taken)
        return {"tokens": torch.from_numpy(tokens), "sizes": torch.from_numpy(sizes), "prev": prev}

    def load_state(self, state: Dict[str, object]) -> None:
        self.tokens = state["tokens"].numpy().astype(np.int64)
        self.sizes = state["sizes"].numpy().astype(np.int64)
        self.prev, self._ready, self._taken = state["prev"], deque(), 0


class _Now:
    """A chunk tokenized in this thread (--num-workers 0), with the pool's result interface."""

    def __init__(self, func, args):
        self.value = func(*args)

    def get(self):
        return self.value


class CorpusStream:
    """Blocks of one corpus, read and tokenized ahead (see the module docstring)."""

    def __init__(
        self,
        name: str,
        files: List[str],
        spec: TokenizerSpec,
        block_size: int,
        break_mode: str,
        eos: int,
        pool=None,
        ahead: int = 2,
        endless: bool = True,
    ):
        self.name, self.files, self.spec, self.pool, self.endless = name, files, spec, pool, endless
        self.ahead = max(1, ahead)
        self.packer = BlockPacker(block_size, break_mode, eos)
        self.position = [0, 0, 0]  # file index, byte offset, line number after the last document taken
        self.passes = 0  # finished passes over the files
        self.docs_in_pass = 0
        self.skipped = 0  # invalid documents skipped (--skip-invalid-documents)
        self._reset_reading()

    def _reset_reading(self) -> None:
        self._head = list(self.position)  # where the next chunk is read from
        self._reader = None
        self._pending: deque = deque()  # (file index, [(end offset, end line)] per line, result)
        self._docs: deque = deque()  # tokenized documents of the oldest chunk, with their end positions
        self._files_done = False

    def _open(self):
        index, offset, _ = self._head
        self._reader = open_shard(self.files[index])
        seek(self._reader, self.files[index], offset)

    def _submit(self) -> None:
        """Read the next chunk of lines at the head and hand it to a worker."""
        while not self._files_done:
            if self._reader is None:
                self._open()
            index, offset, lineno = self._head
            lines, lengths = read_lines(self._reader, CHUNK_LINES)
            if not lines:  # this file is done: the next one, or the end of the pass
                self._reader.close()
                self._reader = None
                if index + 1 < len(self.files):
                    self._head = [index + 1, 0, 0]
                    continue
                self._files_done = True
                return
            ends = np.cumsum(lengths) + offset
            positions = [(int(e), lineno + k + 1) for k, e in enumerate(ends)]
            args = (self.spec, lines, self.files[index], lineno)
            result = self.pool.apply_async(encode_chunk, args) if self.pool else _Now(encode_chunk, args)
            self._pending.append((index, positions, result))
            self._head = [index, int(ends[-1]), lineno + len(lines)]
            return

    def _next_document(self) -> bool:
        """Give the packer the next document; False at the end of the files."""
        while not self._docs:
            while len(self._pending) < self.ahead and not self._files_done:
                self._submit()
            if not self._pending:
                return False
            index, positions, result = self._pending.popleft()
            docs, skipped = result.get()
            for message in skipped:
                self.skipped += 1
                message = message.split(", or pass --skip-invalid-documents")[0]
                logger.warning(
                    f"skipped an invalid document ({self.skipped} so far in corpus {self.name!r}, "
                    f"--skip-invalid-documents): {message}"
                )
            self._docs.extend((index, pos, doc) for pos, doc in zip(positions, docs))
            while len(self._pending) < self.ahead and not self._files_done:
                self._submit()  # keep the workers busy while this chunk is packed
        index, (offset, lineno), doc = self._docs.popleft()
        self.position = [index, offset, lineno]
        if doc is not None:
            self.packer.add(*doc)
            self.docs_in_pass += 1
        return True

    def next_block(self):
        """(source, target) of the corpus's next block; None when a finite corpus (validation) is done."""
        while True:
            block = self.packer.take()
            if block is not None:
                return block
            if self._next_document():
                continue
            block = self.packer.take(at_end=True)
            if block is not None:
                return block
            if self.docs_in_pass == 0:
                raise CorpusError(
                    f"corpus {self.name!r} has no document in {', '.join(self.files)} (empty files, "
                    "or every line skipped); remove it or add documents"
                )
            if not self.endless:
                return None
            self.passes += 1
            logger.info(f"corpus {self.name!r}: pass {self.passes} done, starting pass {self.passes + 1}")
            self.position, self.docs_in_pass = [0, 0, 0], 0
            self.packer = BlockPacker(self.packer.block_size, self.packer.break_mode, self.packer.eos)
            self._reset_reading()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def state(self, with_fingerprint: bool = False) -> Dict[str, object]:
        index, offset, lineno = self.position
        state = {
            "files": list(self.files),
            "file_index": index,
            "offset": offset,
            "line": lineno,
            "passes": self.passes,
            "docs_in_pass": self.docs_in_pass,
            "skipped": self.skipped,
            "carry": self.packer.state(),
        }
        if with_fingerprint:
            state["fingerprint"] = fingerprint(self.files[index], offset)
        return state

    def load_state(self, state: Dict[str, object], check_files: bool = True) -> None:
        """Continue from `state`; with `check_files`, a file list or file that changed is refused (CorpusError)."""
        saved_files = list(state["files"])
        if check_files:
            problem = None
            if saved_files != self.files:
                gone = [f for f in saved_files if f not in self.files]
                new = [f for f in self.files if f not in saved_files]
                problem = (
                    (f"{gone[0]} was removed" if gone else f"{new[0]} was added")
                    if gone or new
                    else "its files are in another order"
                )
            elif "fingerprint" in state:
                problem = check_fingerprint(self.files[state["file_index"]], state["offset"], state["fingerprint"])
            if problem:
                raise CorpusError(
                    f"corpus {self.name!r}: {problem}; the checkpoint's data position no longer "
                    "matches the data. Restore the files, or pass --ignore-data-changes to continue "
                    "anyway (from the saved offset in the current files)"
                )
        index = int(state["file_index"])
        if index >= len(self.files) or self.files[index] != saved_files[index]:
            index, offset, lineno = 0, 0, 0  # that file is gone: this pass restarts
        else:
            offset, lineno = int(state["offset"]), int(state["line"])
        self.position = [index, offset, lineno]
        self.passes, self.docs_in_pass = int(state["passes"]), int(state["docs_in_pass"])
        self.skipped = int(state["skipped"])
        self.packer.load_state(state["carry"])
        self._reset_reading()
