"""fairseq-preprocess's worker processes, and a split written atomically from jobs run in them.

Workers leave SIGINT to the parent (a Ctrl-C reaches the whole process group; a worker killed by it would
never report its task and the parent would wait forever). On an interrupt the parent terminates the pool
instead of waiting for the tasks, then removes their files, so one Ctrl-C or SIGTERM ends the run promptly.
"""

import multiprocessing
import os
from typing import List

from fairseq.data.encoders._script_io import worker_signals
from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder, data_file_path, index_file_path


def make_pool(processes: int):
    """A process pool; fork where the platform has it (workers need only numpy and the stdlib)."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method).Pool(processes=processes, initializer=worker_signals)


class maybe_pool:
    """Use the caller's pool, or own one for the duration of a `with` block (False: no pool needed)."""

    def __init__(self, pool, processes: int):
        self._given, self._processes, self._owned = pool, processes, None

    def __enter__(self):
        if self._given is False:
            return None
        if self._given is not None:
            return self._given
        self._owned = make_pool(max(1, self._processes))
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
    workers (Pool.terminate joins them; waiting could take as long as the rest of the run), otherwise let the
    tasks finish."""
    if not pool:
        return
    if isinstance(err, KeyboardInterrupt):
        pool.terminate()
        return
    for r in pending:
        r.wait()


def _job_to_files(func, args, dtype, out_bin: str, out_idx: str):
    builder = MMapIndexedDatasetBuilder(out_bin, dtype=dtype)
    try:
        summary = func(builder, *args)
        builder.finalize(out_idx)
    except BaseException:
        builder.close()
        raise
    return summary


def run_jobs_atomically(output_prefix: str, dtype, jobs: List[tuple], pool):
    """Run `jobs` ((func, args): func(builder, *args) -> summary), the first here and the rest in `pool`,
    concatenated in order into `output_prefix.bin/.idx`, renamed into place only when complete (.idx last)."""
    dest_dir, base = os.path.split(output_prefix)
    stem = os.path.join(dest_dir, f".{base}.{os.getpid()}")
    part_bin, part_idx = stem + ".bin.part", stem + ".idx.part"
    worker_parts = [(f"{stem}.w{k}.bin.part", f"{stem}.w{k}.idx.part") for k in range(1, len(jobs))]
    builder = MMapIndexedDatasetBuilder(part_bin, dtype=dtype)
    pending = []
    try:
        with maybe_pool(pool if worker_parts else False, len(worker_parts)) as p:
            pending = [p.apply_async(_job_to_files, (func, args, dtype, wb, wi))
                       for (func, args), (wb, wi) in zip(jobs[1:], worker_parts)]
            func, args = jobs[0]
            summary = func(builder, *args)
            for r, (wb, wi) in zip(pending, worker_parts):
                summary.merge(r.get())
                builder.merge_files_(wb, wi)
                os.remove(wb)
                os.remove(wi)
        builder.finalize(part_idx)
        final_bin, final_idx = data_file_path(output_prefix), index_file_path(output_prefix)
        if os.path.exists(final_idx):
            os.remove(final_idx)  # an old index must never pair with the new .bin
        os.replace(part_bin, final_bin)
        os.replace(part_idx, final_idx)
    except BaseException as err:
        builder.close()
        settle(pool, pending, err)
        for leftover in [part_bin, part_idx] + [f for pair in worker_parts for f in pair]:
            if os.path.exists(leftover):
                os.remove(leftover)
        raise
    return summary
