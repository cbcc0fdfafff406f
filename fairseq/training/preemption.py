"""Preemption: on SIGUSR1 or SIGTERM, finish the step, agree across ranks, save checkpoint_last, requeue.

SLURM sends the signal shortly before it stops a job (`#SBATCH --signal=B:USR1@180`). Ranks may receive it
at slightly different times, so each rank contributes its flag to a tiny all-reduce at every step boundary.
The all-reduce runs on a CPU (gloo) group, is started without waiting and read one step later, so the CPU
never waits for the GPU because of it; all ranks read the same results in the same order and therefore stop
after the same update.
Rank 0 then runs `scontrol requeue $SLURM_JOB_ID` (inside SLURM) and every process exits with
EXIT_REQUEUED. The restarted job resumes from checkpoint_last with no flag needed.

Exit statuses after a preemption signal:
- EXIT_REQUEUED (3): checkpoint_last saved, and the job requeued (inside SLURM) or ready to be restarted
  with the same command (outside SLURM, nothing to requeue);
- EXIT_REQUEUE_FAILED (4): checkpoint_last saved, but `scontrol requeue` failed (or could not run): SLURM
  will not restart the job, so resubmit it; it resumes from checkpoint_last.
"""

import logging
import os
import signal
import subprocess
import sys
from typing import NoReturn, Optional

import torch
import torch.distributed as dist

from fairseq.runtime.env import PREEMPTION_SIGNALS

logger = logging.getLogger(__name__)

EXIT_REQUEUED = 3  # "stopped for preemption, checkpoint saved, job requeued (or ready to be restarted)"
EXIT_REQUEUE_FAILED = 4  # "stopped for preemption, checkpoint saved, but the SLURM requeue failed: resubmit"
# What the training function (fairseq.training.loop.train) returns after a preemption stop: the requeue went
# through, or it failed.
REQUEUED = "requeued"
REQUEUE_FAILED = "requeue failed"


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


def requeue_after_preemption() -> bool:
    """Rank 0, once checkpoint_last is saved: requeue the job if inside SLURM. False only when inside SLURM
    and the requeue failed (outside SLURM there is nothing to requeue: the user restarts the command)."""
    if not os.environ.get("SLURM_JOB_ID"):
        requeue_slurm_job()  # says how to resume
        return True
    return requeue_slurm_job()


def exit_requeue_failed(name: str) -> NoReturn:
    """End a command whose training saved checkpoint_last for preemption but whose job was not requeued:
    one error line (from the first process only, where a launcher started one per GPU), exit status 4."""
    if _is_first_process():
        job = " ".join(filter(None, ["the SLURM job", os.environ.get("SLURM_JOB_ID")]))
        sys.stdout.flush()
        print(
            f"{name}: error: checkpoint_last was saved, but {job} could not be requeued (scontrol requeue "
            "failed; see the log above): resubmit the job, it resumes from checkpoint_last",
            file=sys.stderr,
            flush=True,
        )
    sys.exit(EXIT_REQUEUE_FAILED)


def _is_first_process() -> bool:
    """False for the second and later processes a launcher started (torchrun's RANK, srun's SLURM_PROCID)."""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value) == 0
    return True


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
        logger.error(
            f"scontrol requeue {job_id} failed ({result.returncode}): {result.stderr.strip()}; "
            "resubmit the job to resume from checkpoint_last"
        )
        return False
    logger.info(f"requeued SLURM job {job_id}")
    return True
