"""A split written atomically from jobs run in fairseq-preprocess's worker processes (fairseq.data.worker_pool),
and the summary they return.

On an interrupt the parent terminates the pool instead of waiting for the tasks, then removes their files, so
one Ctrl-C or SIGTERM ends the run promptly.
"""

import os
from dataclasses import dataclass
from typing import List

from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder, data_file_path, index_file_path
from fairseq.data.worker_pool import maybe_pool, settle


@dataclass
class BinarizeSummary:
    num_seq: int = 0
    num_tok: int = 0  # including the </s> of every line
    num_replaced: int = 0  # words mapped to <unk> (the literal <unk> token does not count)

    def merge(self, other: "BinarizeSummary") -> None:
        self.num_seq += other.num_seq
        self.num_tok += other.num_tok
        self.num_replaced += other.num_replaced

    @property
    def replaced_percent(self) -> float:
        return 100.0 * self.num_replaced / self.num_tok if self.num_tok else 0.0

    def __str__(self) -> str:  # upstream's wording and its 3-significant-digit percentage
        return f"{self.num_seq} sents, {self.num_tok} tokens, {self.replaced_percent:.3}% replaced"


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
        with maybe_pool(pool if worker_parts else False, len(worker_parts), preload=(__name__,)) as p:
            pending = [
                p.apply_async(_job_to_files, (func, args, dtype, wb, wi))
                for (func, args), (wb, wi) in zip(jobs[1:], worker_parts)
            ]
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
