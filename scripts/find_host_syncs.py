#!/usr/bin/env python3
"""Every call in a range of fairseq-train's updates that makes the host wait for the GPU, with its stack.

Where the updates synchronize: each synchronizing CUDA call, with the Python stack that made it.

    python scripts/find_host_syncs.py --updates 5:8 -- --task dummy_lm --arch transformer_lm_gpt3_small \\
        --bf16 --ddp-backend fully_sharded --batch-size 8 --tokens-per-sample 2048 --max-update 10 ...

Runs fairseq-train in this process (one GPU) with `torch.cuda.set_sync_debug_mode("warn")` from just before
update A to just after update B, which covers everything the training loop does between those updates as well.
Each distinct stack is printed once with how many times it synchronized. A log interval that ends inside the
range syncs on purpose (one read of the interval's statistics): choose --log-interval so that none does.
Exit status: 0, 3 when anything synchronized (for scripts and the GPU test), 1 when no update of the range ran.
"""

import argparse
import collections
import os
import sys
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's text for sync debug mode "warn"
FOUND_SYNCS = 3


class SyncRecorder:
    """Counts synchronizing CUDA calls by the Python stack that made them, while started."""

    def __init__(self, frames: int = 10):
        self.frames = frames
        self.stacks = collections.Counter()
        self.watched_steps = 0  # train steps run while started
        self._saved = None

    def start(self) -> None:
        import torch

        if self._saved is not None:
            return
        self._saved = (warnings.showwarning, warnings.filters[:])
        warnings.filterwarnings("always", message=SYNC_WARNING)
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        import torch

        if self._saved is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning, warnings.filters[:] = self._saved
        self._saved = None

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return self._saved[0](message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()[:-2]  # without this method and the warnings module's caller
        where = [
            f"{os.path.relpath(f.filename, ROOT) if f.filename.startswith(ROOT) else f.filename}:{f.lineno} "
            f"in {f.name}: {f.line}"
            for f in stack[-self.frames :]
        ]
        self.stacks["\n".join(where)] += 1

    def report(self, updates: str) -> str:
        total = sum(self.stacks.values())
        if not self.watched_steps:
            return (
                f"updates {updates}: none of them ran (the training ended or resumed outside them): raise "
                "--max-update or choose --updates inside the run\n"
            )
        if not total:
            return f"updates {updates}: no synchronizing CUDA operation\n"
        lines = [f"updates {updates}: {total} synchronizing CUDA operation(s) at {len(self.stacks)} place(s)"]
        for stack, count in self.stacks.most_common():
            lines += ["", f"{count} x, innermost call last:"] + ["  " + line for line in stack.splitlines()]
        return "\n".join(lines) + "\n"


def record_updates(recorder: SyncRecorder, start: int, end: int):
    """Wrap Trainer.train_step so that the recorder runs from before update `start` to after update `end`."""
    from fairseq.training.trainer import Trainer

    train_step = Trainer.train_step

    def recorded_train_step(self, samples, batch_source):
        watched = start <= self.num_updates + 1 <= end
        if watched:
            recorder.start()
        try:
            return train_step(self, samples, batch_source)
        finally:
            recorder.watched_steps += watched
            if self.num_updates >= end:
                recorder.stop()

    Trainer.train_step = recorded_train_step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s --updates A:B -- FAIRSEQ_TRAIN_FLAGS..."
    )
    parser.add_argument("--updates", default="3:5", help="first and last update to watch, 1-based (default 3:5)")
    parser.add_argument("--frames", type=int, default=10, help="innermost stack frames shown per place")
    parser.add_argument("train_flags", nargs=argparse.REMAINDER, help="fairseq-train's flags, after --")
    args = parser.parse_args(argv)
    from fairseq.logging.profiler import parse_update_range

    try:
        start, end = parse_update_range(args.updates)
    except ValueError as e:
        parser.error(str(e).replace("--profile-updates", "--updates"))
    flags = args.train_flags[1:] if args.train_flags[:1] == ["--"] else args.train_flags
    import torch

    if not torch.cuda.is_available():
        print("find_host_syncs.py: needs a CUDA GPU (on the CPU nothing waits for a device)", file=sys.stderr)
        return 2
    from fairseq_cli import train

    recorder = SyncRecorder(args.frames)
    record_updates(recorder, start, end)
    try:
        train.cli_main(flags)
    finally:
        recorder.stop()
    sys.stdout.write(recorder.report(args.updates))
    if not recorder.watched_steps:
        return 1
    return FOUND_SYNCS if recorder.stacks else 0


if __name__ == "__main__":
    sys.exit(main())
