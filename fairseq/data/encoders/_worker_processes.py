"""Worker processes for the data-preparation scripts and fairseq-preprocess, and their SIGINT/SIGTERM handling:
`WorkerPool` (whose `terminate()` cannot hang), `ordered_map` (work in input order, in bounded memory), and
`stopping_on_signals` / `worker_signals` (a signal ends the main process's work cleanly; workers leave it to it).

Only the standard library: the scripts load this file on its own, beside `_script_io` (which re-exports its names).
"""

import contextlib
import multiprocessing
import queue
import signal
import sys
import threading
from collections import deque
from multiprocessing import forkserver, resource_tracker
from multiprocessing.reduction import ForkingPickler
from typing import Iterable, List, Optional, Sequence

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
