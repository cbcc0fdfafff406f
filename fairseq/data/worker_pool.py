"""The worker processes of fairseq-preprocess and of the Dictionary's word counter.

Workers leave SIGINT to the parent (a Ctrl-C reaches the whole process group; a worker killed by it would
never report its task and the parent would wait forever). On an interrupt the parent terminates the pool
instead of waiting for the tasks (`settle`), so one Ctrl-C or SIGTERM ends the run promptly. The pool is
`WorkerPool`, not multiprocessing.Pool, whose terminate() can hang when it kills a worker that is sending a
result (see WorkerPool).
"""

from typing import Sequence

from fairseq.data.encoders._worker_processes import WorkerPool


def make_pool(processes: int, preload: Sequence[str] = ()) -> WorkerPool:
    """A process pool whose workers have the modules named in `preload` (those of the tasks) imported."""
    return WorkerPool(processes, preload=preload)


class maybe_pool:
    """Use the caller's pool, or own one for the duration of a `with` block (False: no pool needed)."""

    def __init__(self, pool, processes: int, preload: Sequence[str] = ()):
        self._given, self._processes, self._preload, self._owned = pool, processes, preload, None

    def __enter__(self):
        if self._given is False:
            return None
        if self._given is not None:
            return self._given
        self._owned = make_pool(max(1, self._processes), self._preload)
        return self._owned

    def __exit__(self, exc_type, *_):
        if self._owned is not None:
            if exc_type is None:
                self._owned.close()
            else:
                self._owned.terminate()
            self._owned.join()
        return False


def settle(pool, pending, err: BaseException) -> None:
    """Before removing the files of a caller's `pool`'s `pending` tasks after `err`: on an interrupt, end the
    workers (WorkerPool.terminate kills and reaps them; waiting could take as long as the rest of the run),
    otherwise let the tasks finish."""
    if not pool:
        return
    if isinstance(err, KeyboardInterrupt):
        pool.terminate()
        return
    for r in pending:
        r.wait()
