"""Streaming text in and out for the data-preparation scripts (examples/roberta/multiprocessing_bpe_encoder.py,
scripts/spm_encode.py, scripts/spm_decode.py).

Only the standard library: the scripts load this file on its own (not through `fairseq.data`, which
imports torch). Lines are read as Python's text mode reads them (`\\n`, `\\r\\n` and a lone `\\r` end a line),
but decoded one line at a time so that invalid UTF-8 is reported with its file and line number. Outputs
are written to a hidden temporary file beside the destination and renamed over it only once complete.
"""

import contextlib
import io
import os
import sys
import tempfile
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

try:
    from . import _write_errors
    from ._worker_processes import (  # noqa: F401 (ordered_map, WorkerPool: the scripts' and importers' names)
        WorkerPool,
        interrupted_exit,
        ordered_map,
        stopping_on_signals,
    )
except ImportError:  # loaded on its own by a script, beside them
    import _write_errors
    from _worker_processes import (  # noqa: F401
        WorkerPool,
        interrupted_exit,
        ordered_map,
        stopping_on_signals,
    )

CHUNK_LINES = 4096  # lines (or line tuples) sent to a worker at once
CHUNK_BYTES = 1 << 18  # ... or fewer, once they hold this much text (encoding a chunk takes ~20x this)
BLOCK_BYTES = 1 << 19  # bytes of a single input sent to a worker at once (`iter_blocks`)


class ScriptError(Exception):
    """An error to print as one line (no traceback) before exiting with status 1."""


def run_main(main: Callable[[], None], prog: str) -> None:
    """Run `main()`; user errors (bad files, bad input) end the process with one line on stderr and status 1,
    SIGINT or SIGTERM with one line and status 130 or 143 (no output replaced, no temporary file left)."""
    try:
        with stopping_on_signals():
            main()
    except KeyboardInterrupt as e:
        interrupted_exit(prog, e)
    except (
        ScriptError,
        ValueError,
        FileNotFoundError,
        IsADirectoryError,
        PermissionError,
        ImportError,
        _write_errors.OutputError,
    ) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:  # e.g. `... | head`: stop quietly, as a filter should
        try:
            sys.stdout = None
        finally:
            os._exit(1)


# ---- reading ----------------------------------------------------------------------------------------------
def open_binary_input(path: str):
    """The byte stream of `path`, or of stdin for "-"."""
    if path == "-":
        return sys.stdin.buffer
    if not os.path.exists(path):
        raise FileNotFoundError(f"input file {path} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"input {path} is a directory, not a text file")
    return open(path, "rb")


def iter_lines(stream, name: str, first_lineno: int = 0) -> Iterator[str]:
    """Lines of a byte stream decoded as UTF-8, each ending in "\\n" (the last one may not), with `\\r\\n` and a
    lone `\\r` read as line ends, exactly as iterating over `open(path, encoding="utf-8")` yields them.
    Errors count lines from `first_lineno` + 1."""
    lineno = first_lineno
    for raw in iter(stream.readline, b""):
        lineno += 1
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ScriptError(
                f"{name}, line {lineno}: not valid UTF-8 ({e.reason} at byte {e.start} of the line: "
                f"{raw[max(0, e.start - 20) : e.start + 20]!r}); convert the file to UTF-8 first "
                "(e.g. `iconv -f latin1 -t utf-8`)"
            ) from None
        if "\r" not in text:
            yield text
            continue
        # readline() split on "\n" only: a segment may hold lone "\r" line ends, and "\r\n" only at its end.
        if text.endswith("\r\n"):
            text = text[:-2] + "\n"
        parts = text.split("\r")
        for part in parts[:-1]:
            yield part + "\n"
        if parts[-1]:
            yield parts[-1]


def count_lines(block: bytes) -> int:
    """How many lines `iter_lines` reads from `block` (line ends "\\n", "\\r\\n" and "\\r"; a last line without one)."""
    if not block:
        return 0
    n = block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n")
    return n if block.endswith((b"\n", b"\r")) else n + 1


def iter_blocks(stream, size: int = BLOCK_BYTES) -> Iterator[Tuple[bytes, int]]:
    """(block, lines before it) for consecutive blocks of a byte stream, each of about `size` bytes or one
    line more, ending with "\\n" (the last one may not): whole lines, for `split_lines` in a worker."""
    lineno = 0
    while True:
        block = stream.read(size)
        if not block:
            return
        if not block.endswith(b"\n"):
            block += stream.readline()
        yield block, lineno
        lineno += count_lines(block)


def split_lines(block: bytes, name: str, first_lineno: int = 0) -> List[str]:
    """The lines of a block of whole lines, without their line ends: `[l.rstrip("\\r\\n") for l in
    iter_lines(block)]` (the same lines, the same error for invalid UTF-8), at the speed of str methods."""
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:
        for _ in iter_lines(io.BytesIO(block), name, first_lineno):  # raises the error naming the line
            pass
        raise
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the block ended with a line end
    return lines


def iter_line_tuples(paths: Sequence[str], streams) -> Iterator[Tuple[str, ...]]:
    """One tuple of lines per line number, across all inputs, ending with the shortest input (as zip)."""
    return zip(*(iter_lines(s, p if p != "-" else "<stdin>") for p, s in zip(paths, streams)))


def chunked(
    rows: Iterable[Tuple[str, ...]], max_rows: int = CHUNK_LINES, max_chars: int = CHUNK_BYTES
) -> Iterator[List[Tuple[str, ...]]]:
    """Lists of consecutive rows, each at most `max_rows` rows or about `max_chars` characters."""
    chunk: List[Tuple[str, ...]] = []
    size = 0
    for row in rows:
        chunk.append(row)
        size += sum(map(len, row))
        if len(chunk) >= max_rows or size >= max_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def check_outputs(inputs: Sequence[str], outputs: Sequence[str]) -> None:
    """Refuse outputs that would lose text: a file named twice (the last rename would keep one split's encoding
    and drop the other's) or an output that is also an input (the text would be replaced by its encoding)."""
    sources = {os.path.realpath(p): p for p in inputs if p != "-"}
    seen = {}
    for path in outputs:
        if path == "-":
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise ScriptError(
                f"--outputs names one file twice ({seen[key]} and {path}): each input needs an output file of its own"
            )
        if key in sources:
            raise ScriptError(
                f"output {path} is also an input ({sources[key]}): it would be replaced by its "
                "encoding; write to another file"
            )
        seen[key] = path


# ---- writing ----------------------------------------------------------------------------------------------
class AtomicOutputs:
    """Text outputs that appear under their names only when complete ("-" is stdout, written as it comes).

    Each file is written to a hidden temporary file in the destination directory and renamed over the
    destination by `commit()`; on an error (leaving the `with` block by an exception) the temporary files
    are removed and existing destinations are left as they were.
    """

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)
        self.handles: List = []
        self._tmp: List[Optional[str]] = []

    def __enter__(self):
        try:
            for path in self.paths:
                if path == "-":
                    self.handles.append(sys.stdout)
                    self._tmp.append(None)
                    continue
                directory = os.path.dirname(os.path.abspath(path))
                if not os.path.isdir(directory):
                    raise FileNotFoundError(f"output directory {directory} (for {path}) does not exist")
                if os.path.isdir(path):
                    raise IsADirectoryError(f"output {path} is a directory")
                with _write_errors.writing(path, "--outputs"):  # e.g. a read-only directory: one line
                    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".part", dir=directory)
                self._tmp.append(tmp)
                self.handles.append(io.open(fd, "w", encoding="utf-8", newline="\n"))
        except BaseException:
            self._discard()
            raise
        return self

    def write(self, index: int, text: str) -> None:
        with _write_errors.writing(self.paths[index], "--outputs"):  # e.g. the file system filled up
            self.handles[index].write(text)

    def write_bytes(self, index: int, data: bytes) -> None:
        """Write UTF-8 bytes (after any text written so far)."""
        handle = self.handles[index]
        with _write_errors.writing(self.paths[index], "--outputs"):
            handle.flush()
            handle.buffer.write(data)

    def commit(self) -> None:
        umask = os.umask(0)
        os.umask(umask)
        for handle, tmp, path in zip(self.handles, self._tmp, self.paths):
            if tmp is None:
                handle.flush()
                continue
            with _write_errors.writing(path, "--outputs"):  # e.g. the file system filled up
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
                os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it 0600; give it a plain new file's mode
                os.replace(tmp, path)
        self._tmp = [None] * len(self._tmp)

    def _discard(self) -> None:
        for handle, tmp in zip(self.handles, self._tmp):
            if tmp is not None:
                try:
                    with contextlib.suppress(OSError):  # the text is dropped: a failed flush does not matter
                        handle.close()
                finally:
                    if os.path.exists(tmp):
                        os.remove(tmp)
        self._tmp = [None] * len(self._tmp)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.commit()
            except BaseException:  # e.g. a signal between two renames: the rest are not left behind
                self._discard()
                raise
        else:
            self._discard()
        return False


def progress(count_before: int, count_after: int, every: int = 10000) -> None:
    """Upstream's "processed N lines" on stderr for every multiple of `every` passed."""
    for k in range(count_before // every + 1, count_after // every + 1):
        # one write with its newline: print writes the text and the newline apart, and a signal's
        # KeyboardInterrupt between the two put the interruption message on the progress line
        sys.stderr.write(f"processed {k * every} lines\n")


def load_sentencepiece(path):
    """A SentencePieceProcessor for `path`, with errors that name the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"sentencepiece model {path} does not exist; train one with "
            "`python scripts/spm_train.py --input=train.txt --model_prefix=spm --vocab_size=...`"
            " and pass the .model file"
        )
    try:
        import sentencepiece as spm  # deferred: optional (absent: an error says to install it)
    except ImportError:
        raise ImportError("needs the sentencepiece package: pip install sentencepiece") from None
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(path)
    except (OSError, RuntimeError) as e:
        raise ValueError(
            f"sentencepiece model {path} could not be loaded ({str(e).strip()}); is it a "
            ".model file written by sentencepiece's trainer (not the .vocab)?"
        ) from None
    return sp
