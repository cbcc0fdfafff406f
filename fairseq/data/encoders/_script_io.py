"""Streaming text in and out for the data-preparation scripts (examples/roberta/multiprocessing_bpe_encoder.py,
scripts/spm_encode.py, scripts/spm_decode.py).

Only the standard library: the scripts load this file on its own (not through `fairseq.data`, which
imports torch). Lines are read as Python's text mode reads them (`\\n`, `\\r\\n` and a lone `\\r` end a line),
but decoded one line at a time so that invalid UTF-8 is reported with its file and line number. Outputs
are written to a hidden temporary file beside the destination and renamed over it only once complete.
"""

import contextlib
import io
import multiprocessing
import os
import queue
import signal
import sys
import tempfile
import threading
from collections import deque
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

try:
    from . import _write_errors
except ImportError:  # loaded on its own by a script, beside it
    import _write_errors

CHUNK_LINES = 4096  # lines (or line tuples) sent to a worker at once
CHUNK_BYTES = 1 << 18  # ... or fewer, once they hold this much text (encoding a chunk takes ~20x this)
BLOCK_BYTES = 1 << 19  # bytes of a single input sent to a worker at once (`iter_blocks`)


class ScriptError(Exception):
    """An error to print as one line (no traceback) before exiting with status 1."""


# ---- SIGINT and SIGTERM -------------------------------------------------------------------------------------
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main process so that the clean-up code runs (`stopping_on_signals`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, frame):
    for sig in STOP_SIGNALS:  # one signal is enough: the clean-up that follows must not be cut short
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


@contextlib.contextmanager
def stopping_on_signals():
    """Within the block, SIGINT and SIGTERM raise Interrupted in this (main) thread: temporary files are removed
    on the way out and worker pools terminated (their workers ignore SIGINT: `worker_signals`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def worker_signals() -> None:
    """In a pool worker: a Ctrl-C (sent to the whole process group) is for the parent, which then ends the
    workers (`WorkerPool.terminate`); a worker that handled it itself would die without reporting its task.
    SIGTERM ends a worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def interrupted_exit(prog: str, err: KeyboardInterrupt) -> None:
    """One line and the shell's status for a death by that signal (130 for SIGINT, 143 for SIGTERM)."""
    signum = getattr(err, "signum", signal.SIGINT)
    print(
        f"{prog}: interrupted by {signal.Signals(signum).name}; temporary files removed, files written "
        "before are intact",
        file=sys.stderr,
    )
    sys.exit(128 + signum)


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


# ---- worker processes that one signal can always stop -------------------------------------------------------
class WorkerPool:
    """Worker processes for `apply_async(func, args).get()`, as multiprocessing.Pool gives them
    (`initializer(*initargs)` runs in each), built so that `terminate()` cannot hang whatever it interrupts.
    Workers come from multiprocessing's forkserver where the platform has one (spawned elsewhere), never from a
    fork of this process: a fork copies only the calling thread, and a library that later touches state one of
    the missing threads held can abort the worker (seen in CI: a worker of fairseq-preprocess, forked from a
    process with live threads, died of "terminate called ... std::system_error: No such process"). The
    forkserver is single-threaded; the modules named in `preload` are imported there once, so each worker is a
    cheap fork of it. Pool's terminate can: its workers share one task pipe and one result pipe, each
    behind a lock that a worker holds while it waits for a task or sends a result, and terminate() SIGTERMs them
    while its threads still use those pipes, then joins the threads and the workers. Seen under load: a worker
    killed while sending a large result leaves half a message, and terminate() waits forever for Pool's result
    thread, which waits for the rest of it; or a worker left alive waits forever for the task pipe's lock that
    the killed one held, and terminate() waits for that worker.

    Here every worker has a task pipe and a result pipe of its own, with no lock: only this process writes the
    one and reads the other. Results are read in this (the calling) thread, when asked for; a daemon thread per
    worker writes its tasks (so that a large task never waits for the worker to be read from). `terminate()`
    SIGKILLs the workers, then only waits for them to be gone: nothing is read from a pipe again, no lock is
    taken, and a writer thread whose worker died gets a broken pipe. Workers start with SIGINT and SIGTERM
    blocked and unblock them once they ignore SIGINT (`worker_signals`): none ever runs this process's handlers.
    """

    def __init__(self, processes: int, initializer=None, initargs=(), preload: Sequence[str] = ()):
        ctx = _worker_context(preload)
        self._workers: List[_Worker] = []
        self._closed = False
        try:
            with _stop_signals_blocked(ctx.get_start_method() != "forkserver"):
                for _ in range(max(1, processes)):
                    self._workers.append(_Worker(ctx, initializer, initargs))
            for w in self._workers:
                w.start_writer()
        except BaseException:
            self.terminate()
            raise

    def apply_async(self, func, args=(), kwds=None) -> "_Result":
        if self._closed:
            raise ValueError("WorkerPool not running")
        worker = min(self._workers, key=lambda w: len(w.pending))  # the least busy; ties: the first
        return worker.submit(func, args, kwds or {})

    def close(self) -> None:
        """No more tasks: each worker exits once its tasks are done (their results can still be read)."""
        if not self._closed:
            self._closed = True
            for w in self._workers:
                w.tasks.put(None)

    def terminate(self) -> None:
        """Kill every worker now (their unread results are lost) and wait until they are gone."""
        self._closed = True
        for w in self._workers:
            w.kill()
        for w in self._workers:
            w.reap()

    def join(self) -> None:
        """After close(): wait for the workers to finish their tasks (results are kept for get()) and exit;
        after terminate(): wait for them to be gone."""
        for w in self._workers:
            if not w.killed:
                w.drain()
            w.reap()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.terminate()
        return False


class _Result:
    """What `WorkerPool.apply_async` returns: `get()` waits for the value (or raises the worker's exception)."""

    def __init__(self, worker: "_Worker"):
        self._worker, self._done, self._ok, self._value = worker, False, False, None

    def ready(self) -> bool:
        return self._done

    def wait(self, timeout=None) -> None:
        while not self._done:
            self._worker.read_one()

    def get(self, timeout=None):
        self.wait()
        if self._ok:
            return self._value
        raise self._value

    def _set(self, ok: bool, value) -> None:
        self._done, self._ok, self._value = True, ok, value


class _Worker:
    """One worker process, its two pipes, its results not yet read (in the order of its tasks) and the thread
    that writes its tasks."""

    def __init__(self, ctx, initializer, initargs):
        task_r, self.task_w = ctx.Pipe(duplex=False)
        self.result_r, result_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_worker_main, args=(task_r, result_w, initializer, initargs), daemon=True)
        self.process.start()
        task_r.close()  # the worker holds the only reading end: a write after its death fails (no hang)
        result_w.close()  # ... and the only writing end: its death is an end of file here
        self.tasks = queue.SimpleQueue()
        self.pending: deque = deque()
        self.killed = False
        self._writer: Optional[threading.Thread] = None

    def start_writer(self) -> None:
        self._writer = threading.Thread(target=_write_tasks, args=(self.tasks, self.task_w), daemon=True)
        self._writer.start()

    def submit(self, func, args, kwds) -> _Result:
        data = bytes(ForkingPickler.dumps((func, args, kwds)))  # pickling errors here, in the caller
        result = _Result(self)
        self.pending.append(result)
        self.tasks.put(data)
        return result

    def read_one(self) -> None:
        """Read the next result of this worker (this thread; a signal's exception may end the wait)."""
        try:
            ok, value = ForkingPickler.loads(self.result_r.recv_bytes())
        except EOFError:
            self.process.join()
            raise RuntimeError(
                f"worker process {self.process.pid} ended (exit code {self.process.exitcode}) "
                "without returning its result"
            ) from None
        self.pending.popleft()._set(ok, value)

    def drain(self) -> None:
        while self.pending:
            self.read_one()

    def kill(self) -> None:
        self.killed = True
        if self.process.exitcode is None:
            with contextlib.suppress(OSError, ValueError):
                self.process.kill()
        self.tasks.put(None)  # a writer thread waiting for a task ends; one writing gets a broken pipe

    def reap(self) -> None:
        self.process.join()
        if self._writer is not None:
            self._writer.join()
        for conn in (self.task_w, self.result_r):
            conn.close()


def _worker_context(preload: Sequence[str]):
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # Global to multiprocessing and read when its forkserver starts (once per process); a module not preloaded
    # is imported by each worker when a task first needs it.
    ctx.set_forkserver_preload(["__main__", *preload])
    _start_forkserver()
    return ctx


def _start_forkserver() -> None:
    """Start multiprocessing's forkserver (once per process) with SIGINT and SIGTERM blocked, so that it and every
    worker it forks start with them blocked: it ignores SIGINT only after importing the preload modules (seconds,
    with torch), and a Ctrl-C meanwhile printed its KeyboardInterrupt traceback; blocked, the signal waits until
    it ignores SIGINT, which discards it. Its resource tracker is started first, outside the block: starting it
    unblocks both signals in the calling thread (multiprocessing.resource_tracker.ensure_running), which would
    undo the block. This process is not blocked while the workers start (each waits for the preload): a Ctrl-C
    then ends it at once (WorkerPool terminates the workers started so far)."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    with _stop_signals_blocked():
        forkserver.ensure_running()


@contextlib.contextmanager
def _stop_signals_blocked(block: bool = True):
    """SIGINT and SIGTERM held back in this thread meanwhile: a process started meanwhile (the forkserver, and
    so every worker it forks; or a spawned worker) starts with them blocked."""
    if not block or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one that came meanwhile is handled now


def _write_tasks(tasks, conn) -> None:
    try:
        for data in iter(tasks.get, None):
            conn.send_bytes(data)
        conn.send_bytes(b"")  # close(): no more tasks
    except OSError:  # the worker was killed
        pass


def _worker_main(tasks, results, initializer, initargs) -> None:
    worker_signals()
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            data = tasks.recv_bytes()
        except EOFError:
            return
        if not data:
            return
        try:
            func, args, kwds = ForkingPickler.loads(data)
            out = (True, func(*args, **kwds))
        except Exception as e:
            out = (False, e)
        try:
            payload = ForkingPickler.dumps(out)
        except Exception as e:
            payload = ForkingPickler.dumps(
                (
                    False,
                    RuntimeError(
                        f"the worker's {'result' if out[0] else 'error'} could not be pickled: {e!r}: {out[1]!r}"
                    ),
                )
            )
        results.send_bytes(payload)


# ---- work in order, in bounded memory -----------------------------------------------------------------------
def ordered_map(func, items: Iterable, workers: int, initializer=None, initargs=(), max_pending: Optional[int] = None):
    """`func(item)` for every item, yielded in input order, computed by `workers` processes (in this
    process when `workers` <= 1). At most `max_pending` items (default 2 per worker) are read ahead, so
    memory does not grow with the input.

    Worker processes (WorkerPool's: never a fork of this process) run `initializer(*initargs)` first, leave
    SIGINT to this process (`worker_signals`), and an exception here (a signal's `Interrupted`) kills them
    (`WorkerPool.terminate`, which cannot hang).
    """
    if workers <= 1:
        for item in items:
            yield func(item)
        return
    with WorkerPool(workers, initializer=initializer, initargs=initargs) as pool:
        limit = max_pending or 2 * workers
        pending = deque()
        for item in items:
            pending.append(pool.apply_async(func, (item,)))
            if len(pending) >= limit:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
        pool.join()


def progress(count_before: int, count_after: int, every: int = 10000) -> None:
    """Upstream's "processed N lines" on stderr for every multiple of `every` passed."""
    for k in range(count_before // every + 1, count_after // every + 1):
        print(f"processed {k * every} lines", file=sys.stderr)


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
        import sentencepiece as spm
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
