"""Start the processes a job needs and give each its process group.

`call_main(cfg, main_fn)` is what the command-line tools call: it detects the launch (see
`fairseq.runtime.env`), then either runs `main_fn(cfg, **kwargs)` here (single process, or one rank
started by torchrun / srun / the user) or spawns the local processes and runs it in each.

Failures never hang silently:
- every process group gets a timeout (`--heartbeat-timeout`, default 600 s) that also bounds collectives;
- spawned processes are watched through their sentinels: when one fails, the others get a few seconds to
  end by themselves and are then stopped (SIGINT, then SIGKILL), and this process exits non-zero with a
  message that names the rank that failed first and how ("rank 1 of 2 was killed by signal SIGKILL",
  "... exited with status 7", or "... failed" and its traceback), then the ranks that failed after it.
  Its peers fail right after it, and may be noticed first, so the order comes from time-stamped reports:
  a rank that raises (or calls sys.exit with a non-zero status) writes one, saying which of its peers had
  already ended; a process killed by a signal writes none and is placed by those reports, or else by when
  this process saw it end (fairseq.distributed.rank_failures);
- a rank started by torchrun or srun that fails logs its error with its rank, shuts its process group down
  (bounded wait) and exits non-zero, so torchrun tears the others down (under SLURM, run srun with
  --kill-on-bad-exit=1 to get the same).
"""

import contextlib
import gc
import json
import logging
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Callable, List, MutableMapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing

from fairseq.runtime.env import PREEMPTION_SIGNALS, LaunchPlan, detect_launch
from fairseq.distributed.mesh import ParallelLayout
from fairseq.distributed.rank_failures import PIDS_FILE, failure_message, read_failure_reports, write_failure_report

# Written by the first spawned rank: main_fn's return value (JSON), returned by call_main in the parent.
RESULT_FILE = "main_result.txt"

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600
# How long a rank waits for its process group to shut down before leaving without it (seen on GPUs: NCCL's
# shutdown can block while a peer still has a collective outstanding).
SHUTDOWN_WAIT_S = 5.0

_DEFAULT_ENV = {
    # Cheap insurance against fragmentation on long runs; must be set before the first CUDA allocation.
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    # On an NCCL error or collective timeout, abort the communicators and end the process instead of
    # leaving it blocked in a collective.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # After a collective times out, NCCL's watchdog waits 4x this long for debug dumps before ending the
    # process; torch's 15 s default adds a silent minute to every timeout.
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
}
# A user who already set either spelling of a variable has chosen; we leave both spellings alone then.
_ALSO_SPELLED = {
    "PYTORCH_CUDA_ALLOC_CONF": ("PYTORCH_ALLOC_CONF",),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("NCCL_ASYNC_ERROR_HANDLING",),
}


def apply_default_env(environ: MutableMapping[str, str] = os.environ) -> dict:
    """Set the launcher's environment defaults where the user has not set them; return what was set.

    - PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (skipped if it or PYTORCH_ALLOC_CONF is set);
    - TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (skipped if it or the older NCCL_ASYNC_ERROR_HANDLING is set) so a
      failed or timed-out NCCL collective ends the process;
    - TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=1000 so that ending comes about 4 s after --heartbeat-timeout
      rather than 60 s (raise it when collecting NCCL flight-recorder dumps).
    NCCL_NVLS_ENABLE is deliberately never touched: NVLink SHARP must stay whatever the machine set.
    Called by `call_main` before anything touches CUDA; spawned processes inherit the result.
    """
    applied = {}
    for name, value in _DEFAULT_ENV.items():
        if any(environ.get(n) for n in (name, *_ALSO_SPELLED.get(name, ()))):
            continue
        environ[name] = value
        applied[name] = value
    return applied


def process_group_timeout(cfg_distributed) -> timedelta:
    """--heartbeat-timeout seconds (600 when unset or not positive): bounds group creation and collectives."""
    seconds = cfg_distributed.heartbeat_timeout
    return timedelta(seconds=seconds if seconds and seconds > 0 else DEFAULT_TIMEOUT_S)


def _use_cuda(cfg) -> bool:
    return not cfg.common.cpu and torch.cuda.is_available()


def init_distributed(cfg, plan: LaunchPlan) -> Tuple[int, int]:
    """Create the default process group for this rank; record rank, world size and device in the config.

    Backend: --distributed-backend (nccl by default) on GPU, gloo on CPU (--cpu or no CUDA). On GPU the
    device is cuda:<local rank>. Returns (rank, world_size).
    """
    dt = cfg.distributed_training
    device, backend = _device_and_backend(cfg, plan)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (plan.rank, plan.world_size):
            raise RuntimeError(
                f"a process group already exists as rank {dist.get_rank()} of {dist.get_world_size()}, but "
                f"the launch plan says rank {plan.rank} of {plan.world_size}; destroy it before relaunching"
            )
    else:
        _create_process_group(plan, backend, device, process_group_timeout(dt))
    _probe_peers(plan, device)
    dt.distributed_rank = plan.rank
    dt.distributed_world_size = plan.world_size
    dt.device_id = plan.local_rank
    logger.info(
        "rank %d of %d ready (%s launch, %s backend, device %s, init method %s)",
        plan.rank,
        plan.world_size,
        plan.mode,
        backend,
        device,
        plan.init_method,
    )
    return plan.rank, plan.world_size


def _device_and_backend(cfg, plan: LaunchPlan) -> Tuple[torch.device, str]:
    """This rank's device (cuda:<local rank>, made current; or the CPU) and its process group's backend."""
    if not _use_cuda(cfg):
        return torch.device("cpu"), "gloo"
    visible = torch.cuda.device_count()
    if plan.local_rank >= visible:
        raise RuntimeError(
            f"rank {plan.rank} has local rank {plan.local_rank} but only {visible} GPU(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most one "
            "process per GPU on each node, or pass --cpu"
        )
    torch.cuda.set_device(plan.local_rank)
    return torch.device("cuda", plan.local_rank), cfg.distributed_training.distributed_backend or "nccl"


def _create_process_group(plan: LaunchPlan, backend: str, device: torch.device, timeout: timedelta) -> None:
    options = dict(
        backend=backend, init_method=plan.init_method, rank=plan.rank, world_size=plan.world_size, timeout=timeout
    )
    if backend == "nccl":
        options["device_id"] = device  # binds the group to this GPU and creates the communicator now
    try:
        dist.init_process_group(**options)
    except (RuntimeError, TimeoutError, ValueError) as err:
        raise RuntimeError(
            f"rank {plan.rank} of {plan.world_size} ({plan.mode} launch) could not create the {backend} "
            f"process group at {plan.init_method} within {timeout.total_seconds():.0f} s: {err}. "
            "Check that every rank started, that the master address and --distributed-port are "
            "reachable from all nodes, and raise --heartbeat-timeout if start-up is just slow"
        ) from err


def _probe_peers(plan: LaunchPlan, device: torch.device) -> None:
    """One tiny collective right away: a rank that can join the store but not reach its peers fails here,
    within the timeout, rather than at the first training step."""
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != plan.world_size:
        raise RuntimeError(f"rank {plan.rank}: probe all-reduce gave {probe.item()}, expected {plan.world_size}")


def _shutdown_process_group(wait_s: float = SHUTDOWN_WAIT_S) -> bool:
    """Destroy the default process group, waiting at most `wait_s`; True if it is gone."""
    if not dist.is_initialized():
        return True
    # Free what the finished run left in reference cycles (an FSDP model's device meshes hold process groups)
    # now, while the groups exist, rather than in the interpreter's final teardown.
    gc.collect()

    def destroy():
        try:
            dist.destroy_process_group()
        except Exception as err:  # already broken by the failure we are reporting; nothing more to do
            logger.debug("destroy_process_group failed: %s", err)

    # A thread because destroying a group whose peers are gone can block inside the backend.
    worker = threading.Thread(target=destroy, name="destroy_process_group", daemon=True)
    worker.start()
    worker.join(wait_s)
    return not worker.is_alive()


def _record_for_torchrun(exc: BaseException) -> None:
    """Put the error where torchrun's end-of-run summary looks for the root cause."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        # torch.distributed.elastic (~20 ms) only when a rank fails under torchrun
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler  # deferred: startup

        get_error_handler().record_exception(exc)
    except Exception as err:  # reporting must not mask the original failure
        logger.debug("could not write the torchrun error file: %s", err)


def _run_launched_rank(cfg, main_fn: Callable, kwargs: dict, plan: LaunchPlan):
    """One rank started by torchrun, srun or the user: run it, and on failure exit non-zero promptly."""
    try:
        init_distributed(cfg, plan)
        result = main_fn(cfg, **kwargs)
    except (Exception, KeyboardInterrupt) as exc:
        logger.error("rank %d of %d failed", plan.rank, plan.world_size, exc_info=True)
        _record_for_torchrun(exc)
        if not _shutdown_process_group():
            _exit_now(plan.rank, f"{type(exc).__name__}: {exc}")
        raise SystemExit(f"[rank {plan.rank}] {type(exc).__name__}: {exc}") from exc
    if not _shutdown_process_group():
        logger.warning("rank %d: the process group did not shut down within %.0f s", plan.rank, SHUTDOWN_WAIT_S)
    return result


def _exit_now(rank: int, reason: str, status: int = 1) -> None:
    """Leave at once: the backend is stuck, and a normal interpreter exit could block on it too."""
    sys.stderr.write(f"[rank {rank}] {reason}\n[rank {rank}] process group did not shut down; exiting now\n")
    sys.stderr.flush()
    logging.shutdown()  # flush log files; os._exit skips the usual clean-up
    os._exit(status)


def _exit_status(exc: SystemExit) -> int:
    """The status a process leaving with `exc` ends with (as Python decides it: None 0, an int itself, else 1)."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _run_spawned_process(index: int, cfg, main_fn: Callable, kwargs: dict, plan: LaunchPlan, report_dir: str):
    """Entry point of a spawned process (module level so that it pickles)."""
    own_plan = plan.for_spawned_process(index)
    try:
        init_distributed(cfg, own_plan)
        result = main_fn(cfg, **kwargs)
        if own_plan.rank == plan.rank:  # the first spawned rank's result is what call_main returns
            with open(os.path.join(report_dir, RESULT_FILE + ".tmp"), "w") as f:
                json.dump(result if isinstance(result, (str, int, float, bool, type(None))) else repr(result), f)
            os.replace(os.path.join(report_dir, RESULT_FILE + ".tmp"), os.path.join(report_dir, RESULT_FILE))
    except Exception:
        # The report goes first: once this rank lets go of its peers they fail too, and the launcher must
        # still be able to tell which rank failed first.
        write_failure_report(report_dir, own_plan.rank)
        if not _shutdown_process_group():
            _exit_now(own_plan.rank, "failed (see the launcher's report)")
        raise
    except SystemExit as exc:  # sys.exit(N) in main_fn: the process ends only after interpreter teardown
        status = _exit_status(exc)
        if status != 0:
            detail = "" if isinstance(exc.code, int) else f" ({exc.code})"
            write_failure_report(
                report_dir, own_plan.rank, f"exited with status {status}{detail}", with_traceback=False
            )
        if not _shutdown_process_group():
            _exit_now(own_plan.rank, f"exiting with status {status}", status=status)
        raise
    if not _shutdown_process_group():
        logger.warning("rank %d: the process group did not shut down in %.0f s", own_plan.rank, SHUTDOWN_WAIT_S)


# After the first failure the other processes get this long to end by themselves (a peer of a failed rank
# normally fails within a second and leaves its own report); then they get SIGINT, and after as long again
# SIGKILL. SIGINT rather than torch's SIGTERM: SIGTERM asks a training rank to save for preemption (see
# fairseq.training.preemption), while SIGINT ends a spawned process quietly (torch's wrapper swallows the
# KeyboardInterrupt, and no failure report is written for it).
STOP_GRACE_S = 2.0


class _Watch:
    """The spawned processes, watched through their sentinels: when each ended and how."""

    def __init__(self, processes):
        self.processes = processes
        self.ended_ns = {}  # process index -> time.time_ns() when the launcher saw it end
        self.stopped = set()  # indexes of processes this launcher stopped after the first failure

    def running(self) -> List[int]:
        return [i for i in range(len(self.processes)) if i not in self.ended_ns]

    def wait(self, timeout: Optional[float]) -> None:
        """Wait until some process ends (at most `timeout` s); record the ones that ended."""
        sentinels = {self.processes[i].sentinel: i for i in self.running()}
        if not sentinels:
            return
        ready = multiprocessing.connection.wait(list(sentinels), timeout=timeout)
        now = time.time_ns()  # first: when each failure happened is what the launcher's message is about
        for sentinel in ready:
            index = sentinels[sentinel]
            self.processes[index].join()
            self.ended_ns[index] = now

    def wait_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            self.wait(max(0.0, deadline - time.monotonic()))

    def failed(self) -> bool:
        return any(self.processes[i].exitcode != 0 for i in self.ended_ns)

    def stop_the_rest(self, grace_s: float = STOP_GRACE_S) -> None:
        """Give the processes still running `grace_s` to end, then SIGINT them, then (after `grace_s`) SIGKILL."""
        self.wait_all(grace_s)
        for sig, then_wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 60.0)):
            for index in self.running():
                self.stopped.add(index)
                logger.warning("stopping rank process %d (pid %d) with %s", index, self.processes[index].pid, sig.name)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.processes[index].pid, sig)
            self.wait_all(then_wait_s)


def _spawn(cfg, main_fn: Callable, kwargs: dict, plan: LaunchPlan):
    logger.info(
        "spawning %d processes (%s launch, ranks %d-%d of %d, init method %s)",
        plan.nprocs_to_spawn,
        plan.mode,
        plan.rank,
        plan.rank + plan.nprocs_to_spawn - 1,
        plan.world_size,
        plan.init_method,
    )
    with tempfile.TemporaryDirectory(prefix="fairseq-rank-failures-") as report_dir:
        context = torch.multiprocessing.start_processes(
            _run_spawned_process,
            args=(cfg, main_fn, kwargs, plan, report_dir),
            nprocs=plan.nprocs_to_spawn,
            join=False,
            start_method="spawn",
        )
        pids_file = os.path.join(report_dir, PIDS_FILE)
        with open(pids_file + ".tmp", "w") as f:  # long before any rank can fail: they are still importing
            json.dump({plan.rank + i: process.pid for i, process in enumerate(context.processes)}, f)
        os.replace(pids_file + ".tmp", pids_file)
        watch = _Watch(context.processes)
        try:
            with _forward_preemption_signals(context):
                while watch.running() and not watch.failed():
                    watch.wait(timeout=None)
                if watch.failed():
                    watch.stop_the_rest()
        finally:
            if watch.running():  # leaving abnormally (e.g. Ctrl-C, which the ranks got too): leave none behind
                watch.stop_the_rest(grace_s=1.0)
            for error_file in context.error_files:  # torch's copies of the tracebacks, which are not read
                with contextlib.suppress(OSError):
                    os.remove(error_file)
        if watch.failed():
            raise SystemExit(failure_message(watch, read_failure_reports(report_dir), plan))
        result_file = os.path.join(report_dir, RESULT_FILE)
        if os.path.exists(result_file):
            with open(result_file) as f:
                return json.load(f)
        return None


@contextlib.contextmanager
def _forward_preemption_signals(context):
    """SLURM (or a user) signals the process it started; the spawned ranks are the ones that must save."""

    def forward(signum, frame):
        for process in context.processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):  # it may end between the check and the kill
                    os.kill(process.pid, signum)

    previous = {}
    for sig in PREEMPTION_SIGNALS:
        try:
            previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread
            pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def call_main(cfg, main_fn: Callable, **kwargs):
    """Run `main_fn(cfg, **kwargs)` on every rank of the job this process belongs to.

    Returns main_fn's result (when spawning: the first spawned rank's, if it is a plain JSON value).
    Raises SystemExit (non-zero, with the failing rank's error) when any rank fails.
    """
    apply_default_env()
    plan = detect_launch(cfg.distributed_training, os.environ, cpu=not _use_cuda(cfg))
    # The mesh must fit the world before any process group exists: every rank raises the same one-line error.
    ParallelLayout.from_config(cfg.distributed_training, plan.world_size)
    if plan.nprocs_to_spawn > 0:
        return _spawn(cfg, main_fn, kwargs, plan)
    if not plan.is_distributed:
        return main_fn(cfg, **kwargs)
    return _run_launched_rank(cfg, main_fn, kwargs, plan)
