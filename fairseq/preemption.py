"""Preemption: on SIGUSR1 or SIGTERM, finish the step, agree across ranks, save checkpoint_last, requeue.

SLURM sends the signal shortly before it stops a job (`#SBATCH --signal=B:USR1@180`). Ranks may receive it
at slightly different times, so each rank contributes its flag to a tiny all-reduce at every step boundary.
The all-reduce runs on a CPU (gloo) group, is started without waiting and read one step later, so the CPU
never waits for the GPU because of it; all ranks read the same results in the same order and therefore stop
after the same update.
Rank 0 then runs `scontrol requeue $SLURM_JOB_ID` (inside SLURM) and every process exits with
EXIT_REQUEUED. The restarted job resumes from checkpoint_last with no flag needed.
"""

import logging
import os
import signal
import subprocess
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
EXIT_REQUEUED = 3  # "stopped for preemption, checkpoint saved, job requeued (or ready to be restarted)"


class Preempted(Exception):
    """Raised out of the training loop once checkpoint_last is saved."""


class PreemptionWatcher:
    def __init__(self, timeout=None, separate_group: Optional[bool] = None):
        self.received: Optional[int] = None
        # The flags travel through a CPU (gloo) group: reading the result then never waits for the GPU, as
        # reading an NCCL result on a CUDA tensor would. Collective: every rank creates the watcher.
        # `separate_group` (default: when the default group is not gloo already) exists for tests.
        self._group = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if separate_group if separate_group is not None else dist.get_backend() != "gloo":
                kwargs = {"timeout": timeout} if timeout is not None else {}
                self._group = dist.new_group(backend="gloo", **kwargs)
        self._pending = None  # (work handle, flag tensor) of the all-reduce started at the last boundary
        self._previous = {}
        for sig in PREEMPTION_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: signals cannot be handled here
                pass

    def _on_signal(self, signum, frame):
        if self.received is None:
            logger.warning(f"received {signal.Signals(signum).name}: saving checkpoint_last after this update")
        self.received = signum

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def should_stop(self) -> bool:
        """Call once per update, on every rank. True on all ranks at the same update."""
        local = 1 if self.received is not None else 0
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return bool(local)
        flag = torch.tensor([local], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        previous, self._pending = self._pending, (work, flag)
        if previous is None:
            return False
        previous[0].wait()
        return bool(previous[1].item())  # the previous boundary's result: waits for peers, never the GPU

    def drain(self) -> bool:
        """At the end of training: finish the outstanding all-reduce (no collective left hanging)."""
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        work.wait()
        return bool(flag.item())


def requeue_slurm_job() -> bool:
    """Rank 0, inside SLURM: ask SLURM to put this job back in the queue. Returns whether it was asked."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        logger.info("not inside a SLURM job: restart the same command to resume from checkpoint_last")
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.error(f"scontrol requeue {job_id} failed: {e}; resubmit the job to resume from checkpoint_last")
        return False
    if result.returncode != 0:
        logger.error(f"scontrol requeue {job_id} failed ({result.returncode}): {result.stderr.strip()}; "
                     "resubmit the job to resume from checkpoint_last")
        return False
    logger.info(f"requeued SLURM job {job_id}")
    return True
