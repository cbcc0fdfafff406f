"""Real multi-process launches on CPU with gloo: spawn, simulated SLURM, torchrun, explicit init method,
and failure propagation (a rank that raises, a rank that stalls a collective, a rank that never starts).

Every launch runs under a short --heartbeat-timeout and a subprocess timeout, so a hang fails the test
instead of blocking the suite.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from fairseq.dataclass.configs import FairseqConfig
from fairseq.distributed import rank_failures
from fairseq.distributed import utils as dist_utils
from fairseq.distributed.launch import call_main

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
PROCESS_TIMEOUT_S = 60
# A failure must end the job well before PROCESS_TIMEOUT_S; the margin absorbs process start-up on a
# loaded 2-core machine (a hang would run into the 120 s stall or the 600 s default timeout instead).
FAIL_WITHIN_S = 45
DEFAULT_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}

# The program each launched process runs: it builds a config from key=value arguments (fields of
# distributed_training, plus cpu=0|1), then call_main runs `main` on every rank.
WORKER_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.distributed import utils as dist_utils
    from fairseq.distributed.launch import call_main

    def main(cfg, out_dir, behaviour):
        rank = dist_utils.get_rank()
        if behaviour == "raise" and rank == 1:
            raise ValueError("rank one exploded on purpose")
        if behaviour == "stall" and rank == 1:
            time.sleep(120)  # never reaches the all-reduce rank 0 waits in
        dt = cfg.distributed_training
        device = "cpu" if cfg.common.cpu else f"cuda:{dt.device_id}"
        total = dist_utils.all_reduce_sum(torch.tensor([float(rank + 1)], device=device))
        largest = dist_utils.all_reduce_max(torch.tensor([float(rank)], device=device))
        record = dict(
            rank=rank, world=dist_utils.get_world_size(), total=total.item(), largest=largest.item(),
            cfg_rank=dt.distributed_rank, cfg_world=dt.distributed_world_size, device_id=dt.device_id,
            pid=os.getpid(), master=dist_utils.is_master(),
        )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)

    if __name__ == "__main__":
        out_dir, behaviour, *settings = sys.argv[1:]
        cfg = FairseqConfig()
        cfg.common.cpu = True
        for setting in settings:
            name, value = setting.split("=", 1)
            if name == "cpu":  # cpu=0 runs the same program on GPUs (NCCL), for checks on a GPU machine
                cfg.common.cpu = bool(int(value))
                continue
            setattr(cfg.distributed_training, name, value if name == "distributed_init_method" else int(value))
        call_main(cfg, main, out_dir=out_dir, behaviour=behaviour)
    """
)


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER_SCRIPT)
    return str(path)


@pytest.fixture
def out_dir(tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    return path


def clean_env(**extra):
    """This environment minus any launcher variables the test run itself might carry."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def slurm_task_env(procid, ntasks, tasks_per_node, **extra):
    return clean_env(
        SLURM_JOB_ID="4242",
        SLURM_PROCID=procid,
        SLURM_LOCALID=procid,
        SLURM_NODEID=0,
        SLURM_NTASKS=ntasks,
        SLURM_NTASKS_PER_NODE=tasks_per_node,
        SLURM_NNODES=1,
        SLURM_JOB_NODELIST="localhost",
        **extra,
    )


def run_together(commands_and_envs, timeout=PROCESS_TIMEOUT_S):
    """Start every (command, env) at once; return [(returncode, output)] and the wall time taken."""
    start = time.monotonic()
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in commands_and_envs
    ]
    results = []
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
            results.append((proc.returncode, output))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results, time.monotonic() - start


def read_records(out_dir, world=2):
    records = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, record in enumerate(records):
        assert record["rank"] == record["cfg_rank"] == rank
        assert record["world"] == record["cfg_world"] == world
        assert record["total"] == world * (world + 1) / 2  # sum of rank + 1 over all ranks
        assert record["largest"] == world - 1
        assert record["master"] == (rank == 0)
    return records


# ------------------------------------------------------------------------------------ in-process spawn


def all_reduce_main(cfg, out_dir):
    """Runs in each spawned process (module level so that it pickles by reference)."""
    rank = dist_utils.get_rank()
    total = dist_utils.all_reduce_sum(torch.tensor([float(rank + 1)]))
    largest = dist_utils.all_reduce_max(torch.tensor([float(rank)]))
    dist_utils.barrier()
    dt = cfg.distributed_training
    record = dict(
        rank=rank,
        world=dist_utils.get_world_size(),
        total=total.item(),
        largest=largest.item(),
        cfg_rank=dt.distributed_rank,
        cfg_world=dt.distributed_world_size,
        device_id=dt.device_id,
        pid=os.getpid(),
        master=dist_utils.is_master(),
        env={name: os.environ.get(name) for name in DEFAULT_ENV},
    )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


@pytest.mark.timeout(60)
def test_spawn_two_cpu_processes_all_reduce(out_dir, monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    for name in DEFAULT_ENV:  # unset for the test, restored afterwards
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    cfg = FairseqConfig()
    cfg.common.cpu = True
    cfg.distributed_training.distributed_world_size = 2
    cfg.distributed_training.heartbeat_timeout = 20

    assert call_main(cfg, all_reduce_main, out_dir=str(out_dir)) is None

    records = read_records(out_dir)
    assert [r["device_id"] for r in records] == [0, 1]
    for record in records:  # the launcher's defaults reach the processes it starts
        assert record["env"] == DEFAULT_ENV
    assert len({r["pid"] for r in records} | {os.getpid()}) == 3  # two fresh processes, not this one
    assert dist_utils.get_world_size() == 1  # the launcher itself never joined a process group


# --------------------------------------------------------------------------------------- other launchers


@pytest.mark.timeout(90)
def test_simulated_slurm_one_task_per_gpu(worker, out_dir):
    port = dist_utils.get_free_port()
    cmd = [sys.executable, worker, str(out_dir), "ok", f"distributed_port={port}", "heartbeat_timeout=20"]
    results, _ = run_together([(cmd, slurm_task_env(procid=r, ntasks=2, tasks_per_node=2)) for r in (0, 1)])
    for returncode, output in results:
        assert returncode == 0, output
    records = read_records(out_dir)
    assert [r["device_id"] for r in records] == [0, 1]  # from SLURM_LOCALID


@pytest.mark.timeout(90)
def test_simulated_slurm_one_task_per_node_spawns(worker, out_dir):
    env = slurm_task_env(procid=0, ntasks=1, tasks_per_node=1)
    cmd = [sys.executable, worker, str(out_dir), "ok", "distributed_num_procs=2", "heartbeat_timeout=20"]
    [(returncode, output)], _ = run_together([(cmd, env)])
    assert returncode == 0, output
    records = read_records(out_dir)
    assert len({r["pid"] for r in records}) == 2


@pytest.mark.timeout(90)
def test_torchrun_two_processes(worker, out_dir):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        worker,
        str(out_dir),
        "ok",
        "heartbeat_timeout=20",
    ]
    [(returncode, output)], _ = run_together([(cmd, clean_env())])
    assert returncode == 0, output
    read_records(out_dir)


@pytest.mark.timeout(90)
def test_explicit_init_method_one_rank_per_process(worker, out_dir):
    init_method = f"tcp://localhost:{dist_utils.get_free_port()}"
    commands = [
        (
            [
                sys.executable,
                worker,
                str(out_dir),
                "ok",
                f"distributed_init_method={init_method}",
                "distributed_world_size=2",
                f"distributed_rank={rank}",
                "heartbeat_timeout=20",
            ],
            clean_env(),
        )
        for rank in (0, 1)
    ]
    results, _ = run_together(commands)
    for returncode, output in results:
        assert returncode == 0, output
    read_records(out_dir)


# ---------------------------------------------------------------------------------- failure propagation


@pytest.mark.timeout(90)
def test_spawned_rank_that_raises_fails_the_job(worker, out_dir):
    cmd = [sys.executable, worker, str(out_dir), "raise", "distributed_world_size=2", "heartbeat_timeout=10"]
    [(returncode, output)], elapsed = run_together([(cmd, clean_env())])
    assert returncode != 0
    assert "rank one exploded on purpose" in output
    assert "rank 1 of 2 failed" in output
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.1f} s to fail"
    assert not list(out_dir.iterdir())  # rank 0 never got past the all-reduce


@pytest.mark.timeout(90)
def test_spawned_rank_stalling_a_collective_times_out(worker, out_dir):
    cmd = [sys.executable, worker, str(out_dir), "stall", "distributed_world_size=2", "heartbeat_timeout=3"]
    [(returncode, output)], elapsed = run_together([(cmd, clean_env())])
    assert returncode != 0
    assert "rank 0 of 2 failed" in output  # rank 0's all-reduce gave up; rank 1 was still asleep
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.1f} s to fail"


def kill_or_exit_main(cfg, how):
    """Rank 1 (how="sigkill") or rank 0 (how="exit7", "os_exit7") leaves after one all-reduce; its peer then blocks in the
    next all-reduce and fails with a connection error."""
    rank = dist_utils.get_rank()
    dist_utils.all_reduce_sum(torch.tensor([1.0]))
    if how == "sigkill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit7" and rank == 0:
        sys.exit(7)
    if how == "os_exit7" and rank == 0:
        os._exit(7)  # no Python clean-up, no report: only the process's end tells
    dist_utils.all_reduce_sum(torch.tensor([1.0]))


def spawn_two(monkeypatch, main_fn, **kwargs):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    cfg = FairseqConfig()
    cfg.common.cpu = True
    cfg.distributed_training.distributed_world_size = 2
    cfg.distributed_training.heartbeat_timeout = 20
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        call_main(cfg, main_fn, **kwargs)
    return str(exit_info.value.code), time.monotonic() - start


@pytest.mark.timeout(90)
@pytest.mark.parametrize("slack_ns", [None, 0])
def test_spawned_rank_killed_by_a_signal_is_named_first(monkeypatch, slack_ns):
    """Rank 0's connection error comes after rank 1's death but is often reported before the launcher notices
    that death (by up to 12 ms on a busy machine): the message must still blame rank 1, and say how it died.
    With no slack for the launcher's delay (slack_ns=0) the order must come from rank 0's report, which says
    that rank 1 had already ended."""
    if slack_ns is not None:
        if not os.path.isdir("/proc/self"):
            pytest.skip("the reports tell which peers had ended only where /proc exists")
        monkeypatch.setattr(rank_failures, "DEATH_NOTICE_SLACK_NS", slack_ns)
    message, elapsed = spawn_two(monkeypatch, kill_or_exit_main, how="sigkill")
    assert message.startswith("rank 1 of 2 was killed by signal SIGKILL, then rank(s) 0 failed too."), message
    assert "Traceback" not in message  # rank 0's connection error is not what went wrong
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.1f} s to fail"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["exit7", "os_exit7"])
def test_spawned_rank_exiting_with_a_status_is_named_first(monkeypatch, how):
    """sys.exit(7) ends the process only after interpreter teardown, long after its peer failed; os._exit(7)
    leaves no report at all. Either way rank 0 is named, with its status."""
    message, elapsed = spawn_two(monkeypatch, kill_or_exit_main, how=how)
    assert message.startswith("rank 0 of 2 exited with status 7, then rank(s) 1 failed too."), message
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.1f} s to fail"


def failed_save_main(cfg, path):
    """Every rank fails as a sharded save over a file-size limit does."""
    import errno

    from fairseq.checkpoint.io import save_error

    raise save_error(path, OSError(errno.EFBIG, "File too large"))


@pytest.mark.timeout(90)
def test_spawned_rank_checkpoint_error_is_its_one_line(monkeypatch, tmp_path):
    """A checkpoint error in a rank (a sharded save on a full disk) reads as in one process: one line with the
    path and the errno, no traceback."""
    path = str(tmp_path / "checkpoint_last")
    message, elapsed = spawn_two(monkeypatch, failed_save_main, path=path)
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    assert message.startswith("rank ") and f"cannot write checkpoint {path}: File too large (EFBIG)" in message
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.1f} s to fail"


@pytest.mark.timeout(90)
def test_slurm_rank_that_raises_fails_every_rank(worker, out_dir):
    port = dist_utils.get_free_port()
    cmd = [sys.executable, worker, str(out_dir), "raise", f"distributed_port={port}", "heartbeat_timeout=10"]
    results, elapsed = run_together([(cmd, slurm_task_env(procid=r, ntasks=2, tasks_per_node=2)) for r in (0, 1)])
    (rc0, out0), (rc1, out1) = results
    assert rc1 != 0 and "[rank 1] ValueError: rank one exploded on purpose" in out1
    assert rc0 != 0, out0  # its peer vanished mid-job: it must not carry on or hang
    assert "rank 0 of 2 failed" in out0
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.1f} s to fail"


@pytest.mark.timeout(90)
def test_slurm_rank_whose_peer_never_starts_times_out(worker, out_dir):
    port = dist_utils.get_free_port()
    cmd = [sys.executable, worker, str(out_dir), "ok", f"distributed_port={port}", "heartbeat_timeout=3"]
    [(returncode, output)], elapsed = run_together([(cmd, slurm_task_env(procid=0, ntasks=2, tasks_per_node=2))])
    assert returncode != 0
    assert "could not create the gloo process group" in output
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.1f} s to fail"


@pytest.mark.timeout(90)
def test_torchrun_rank_that_raises_fails_the_job(worker, out_dir):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        worker,
        str(out_dir),
        "raise",
        "heartbeat_timeout=10",
    ]
    [(returncode, output)], elapsed = run_together([(cmd, clean_env())])
    assert returncode != 0
    assert "rank one exploded on purpose" in output
    assert elapsed < FAIL_WITHIN_S, f"took {elapsed:.1f} s to fail"


def test_helpers_without_a_process_group():
    assert (dist_utils.get_rank(), dist_utils.get_world_size(), dist_utils.is_master()) == (0, 1, True)
    dist_utils.barrier()
    assert dist_utils.all_reduce_sum(torch.tensor([2.0])).item() == 2.0
    assert dist_utils.all_reduce_max(torch.tensor([-3.0])).item() == -3.0
    assert 0 < dist_utils.get_free_port() < 65536
