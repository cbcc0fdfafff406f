"""--write-checkpoints-asynchronously through the real fairseq-train: a checkpoint written in the background is the
one a synchronous save writes at the same update (single file; sharded on 2 gloo processes), resumes exactly,
survives kill -9 and a failing disk with the previous checkpoint whole, waits for itself before the next save
and before a preemption checkpoint, and retention never removes the last complete checkpoint.

Where a test must act while a write is in flight, the writer is slowed through its documented seam
(FAIRSEQ_TEST_SLOW_CHECKPOINT_WRITE, fairseq.checkpoint.writer): each background write pauses between its bytes
and its publication (the rename).
"""

import glob
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch

from fairseq.checkpoint.io import load_checkpoint_file
from fairseq.checkpoint.writer import SLOW_WRITE_ENV
from tests.train_fixtures import TRAIN_RECIPE, tiny_train_argv, train_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASYNC = "--write-checkpoints-asynchronously"


def single_file_argv(data, save_dir, *extra, max_update=4):
    """The tiny transformer_lm of tests/train_fixtures.py, a checkpoint every 2 updates, json log on stdout."""
    return tiny_train_argv(
        data, save_dir, *TRAIN_RECIPE, "--save-interval-updates", "2", *extra, max_update=max_update, log_file=False
    )


def sharded_argv(data, save_dir, *extra, max_update=4):
    """The tiny transformer_lm_gpt on 2 gloo processes, fully sharded, DCP checkpoints every 2 updates."""
    return tiny_train_argv(
        data,
        save_dir,
        "--disable-validation",
        "--ddp-backend",
        "fully_sharded",
        "--use-sharded-state",
        "--save-interval-updates",
        "2",
        "--distributed-world-size",
        "2",
        "--heartbeat-timeout",
        "120",
        *extra,
        max_update=max_update,
        arch="transformer_lm_gpt",
        seed="5",
        log_file=False,
    )


def load(path):
    return load_checkpoint_file(str(path))


def updates_of(path):
    return load(path)["extra_state"]["trainer"]["num_updates"]


def assert_same_layout_and_tensors(a, b, where="state", resumed=False):
    """Same keys (recursively) and bitwise the same tensors; other values (clocks, the async flag in cfg) may
    differ. `resumed`: `b` comes from a run resumed from a checkpoint, whose restored meters lack the times of the
    saves logged after that checkpoint was taken: the meters (extra_state.metrics) are not compared."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for key in a:
            if not (resumed and where.endswith("extra_state") and key == "metrics"):
                assert_same_layout_and_tensors(a[key], b[key], f"{where}.{key}", resumed)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_layout_and_tensors(x, y, f"{where}[{i}]", resumed)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where


def start(argv, slow=None):
    """fairseq-train in a process group of its own (not a SLURM job: no requeue), its log on stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    if slow is not None:
        env[SLOW_WRITE_ENV] = str(slow)
    return subprocess.Popen(
        [sys.executable, "-m", "fairseq_cli.train", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def act_when(proc, seen, what, act, ready=lambda lines: None, timeout=180):
    """Read the log until a line makes `seen(line)` true (else fail: `what` never happened), call `ready(lines)`
    (a wait before acting), then `act(proc)`; returns (exit status, the whole log). The process group is killed
    if it is still running when this returns or fails."""
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if seen(line):
                break
        else:
            pytest.fail(f"{what} never happened:\n{''.join(lines)[-4000:]}")
        ready(lines)
        act(proc)
        rest = proc.communicate(timeout=timeout)[0]
        return proc.returncode, "".join(lines) + rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def act_after_update(proc, update, act):
    """Once the log's train_inner line of `update` is printed, call `act(proc)`."""
    return act_when(
        proc,
        lambda line: "train_inner" in line and f'"num_updates": "{update}"' in line,
        f"the end of update {update}",
        act,
    )


def act_during_write(proc, save_dir, name, act):
    """Once the log says checkpoint `name` (a file `x.pt` or a sharded directory `x`) is being written in the
    background and its temporary exists, call `act(proc)`."""
    temporary = f".{name}.*.tmp" if name.endswith(".pt") else f"{name}.tmp"
    pattern = os.path.join(glob.escape(str(save_dir)), temporary)

    def temporary_exists(lines):
        deadline = time.time() + 30
        while not glob.glob(pattern):
            assert time.time() < deadline and proc.poll() is None, "".join(lines)[-4000:]
            time.sleep(0.005)

    return act_when(
        proc,
        lambda line: f"{os.path.join(str(save_dir), name)} (epoch" in line and "in the background" in line,
        f"the write of {name}",
        act,
        temporary_exists,
    )


def kill_9(proc):
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks at once, as a node failure would


# ----------------------------------------------------------------------------- single file


@pytest.fixture(scope="module")
def sync_single(tiny_data, tmp_path_factory):
    """The synchronous run (checkpoints at updates 2 and 4) the background writes are compared with."""
    save_dir = tmp_path_factory.mktemp("sync_single")
    status, out, err = train_in_process(single_file_argv(tiny_data, save_dir))
    assert status == 0, out[-3000:] + err[-3000:]
    return save_dir


def test_background_single_file_checkpoint_is_the_synchronous_one(tiny_data, tmp_path, sync_single, monkeypatch):
    monkeypatch.setenv(SLOW_WRITE_ENV, "0.2")  # training goes on while each write is in flight
    status, out, err = train_in_process(single_file_argv(tiny_data, tmp_path, ASYNC))
    assert status == 0, out[-3000:] + err[-3000:]
    for name in ("checkpoint_1_2.pt", "checkpoint_1_4.pt", "checkpoint_best.pt", "checkpoint_last.pt"):
        assert_same_layout_and_tensors(load(sync_single / name), load(tmp_path / name), name)
    assert "checkpoint_1_2.pt (epoch 1 @ 2 updates, score" in out and "in the background; training was blocked" in out
    assert "at the end of training" in out  # the last write is whole before the run says it is done
    saved_lines = [line for line in out.splitlines() if "| train_inner |" in line and '"save_blocked"' in line]
    assert saved_lines and '"save_wall"' in saved_lines[0]


def test_two_saves_in_quick_succession_each_wait_for_the_one_before(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv(SLOW_WRITE_ENV, "0.4")  # longer than an update: every save finds the previous in flight
    argv = single_file_argv(
        tiny_data, tmp_path, ASYNC, "--disable-validation", "--keep-interval-updates", "2", max_update=3
    )
    argv[argv.index("--save-interval-updates") + 1] = "1"
    status, out, err = train_in_process(argv)
    assert status == 0, out[-3000:] + err[-3000:]
    waits = [line for line in out.splitlines() if "for the background write of" in line]
    assert [w.split("write of ")[1] for w in waits] == [
        f"{tmp_path / 'checkpoint_1_1.pt'} before the next save",
        f"{tmp_path / 'checkpoint_1_2.pt'} before the next save",
        f"{tmp_path / 'checkpoint_1_3.pt'} at the end of training",
    ], waits
    # both later saves waited: one warning, with the write's time and an interval that would not wait
    [advice] = [line for line in out.splitlines() if "wait for it;" in line]
    write_time = float(advice.split("checkpoint write took ")[1].split(" s;")[0])
    assert write_time >= 0.4 and "saves every 1 updates (~" in advice, advice
    interval = int(advice.split("--save-interval-updates >= ")[1].split()[0])
    assert interval >= 2 and advice.endswith(" would not"), advice
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint")) == [
        "checkpoint_1_2.pt",
        "checkpoint_1_3.pt",
        "checkpoint_last.pt",
    ]
    assert [updates_of(tmp_path / n) for n in ("checkpoint_1_2.pt", "checkpoint_1_3.pt", "checkpoint_last.pt")] == [
        2,
        3,
        3,
    ]


def test_kill_9_during_a_background_write_keeps_the_last_whole_checkpoint_and_resumes_exactly(
    tiny_data, tmp_path, sync_single
):
    # --keep-interval-updates 1: checkpoint_1_2 may go only once checkpoint_1_4 is whole.
    argv = single_file_argv(tiny_data, tmp_path, ASYNC, "--keep-interval-updates", "1")
    status, log = act_during_write(start(argv, slow=3), tmp_path, "checkpoint_1_4.pt", kill_9)
    assert status == -signal.SIGKILL, log[-3000:]
    names = os.listdir(tmp_path)
    assert "checkpoint_1_4.pt" not in names
    assert [n for n in names if n.startswith(".checkpoint_1_4.pt.") and n.endswith(".tmp")], names  # the partial one
    assert updates_of(tmp_path / "checkpoint_1_2.pt") == 2 and updates_of(tmp_path / "checkpoint_last.pt") == 2

    status, out, err = train_in_process(argv)  # the restarted job
    assert status == 0, out[-3000:] + err[-3000:]
    assert "(2 updates)" in out and "left by an interrupted save" in out
    assert_same_layout_and_tensors(
        load(sync_single / "checkpoint_1_4.pt"), load(tmp_path / "checkpoint_1_4.pt"), resumed=True
    )
    assert sorted(n for n in os.listdir(tmp_path) if "checkpoint" in n) == [
        "checkpoint_1_4.pt",
        "checkpoint_best.pt",
        "checkpoint_last.pt",
    ]  # removed once checkpoint_1_4 was whole


def test_background_write_failure_is_one_line_and_keeps_the_previous_checkpoint(tiny_data, tmp_path):
    def argv(max_update):
        return single_file_argv(
            tiny_data, tmp_path, ASYNC, "--keep-interval-updates", "1", "--disable-validation", max_update=max_update
        )

    status, out, err = train_in_process(argv(2))
    assert status == 0, out[-3000:] + err[-3000:]
    before = {n: (tmp_path / n).read_bytes() for n in ("checkpoint_1_2.pt", "checkpoint_last.pt")}
    limit = len(before["checkpoint_last.pt"]) // 2  # below a checkpoint's size: its write fails with EFBIG

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run(
        [sys.executable, "-m", "fairseq_cli.train", *argv(8)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_file_size,
        env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("fairseq-train: error: cannot write checkpoint"), errors
    assert "EFBIG" in errors[0] and str(tmp_path / "checkpoint_1_4.pt") in errors[0]
    assert "previously at that path is intact" in errors[0]
    updates = [
        int(line.split('"num_updates": "')[1].split('"')[0])
        for line in result.stdout.splitlines()
        if "| train_inner |" in line
    ]
    assert 4 <= max(updates) < 8  # reported at an update after the failed save, not at the end of training
    assert {n: (tmp_path / n).read_bytes() for n in before} == before  # the failed write removed nothing
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


# ----------------------------------------------------------------------------- sharded, 2 gloo processes


@pytest.fixture(scope="module")
def sharded_runs(tiny_data, tmp_path_factory):
    """Three runs of the same training on 2 ranks: synchronous to update 4; with background writes, killed -9
    while checkpoint_1_4 is written; that job restarted (background writes), sent SIGUSR1 while checkpoint_1_4
    is written again. Returns (sync dir, async dir, what the kill left, the restart's status and log)."""
    sync_dir, async_dir = tmp_path_factory.mktemp("sharded_sync"), tmp_path_factory.mktemp("sharded_async")
    status, out, err = train_in_process(sharded_argv(tiny_data, sync_dir))  # its 2 ranks spawned from here
    assert status == 0, out[-4000:] + err[-4000:]
    argv = sharded_argv(tiny_data, async_dir, ASYNC, max_update=8)
    status, log = act_during_write(start(argv, slow=3), async_dir, "checkpoint_1_4", kill_9)
    assert status == -signal.SIGKILL, log[-4000:]
    left = sorted(os.listdir(async_dir))
    # The restarted job: SIGUSR1 (to the launcher, which forwards it) once update 3 is logged, so that it lands
    # while checkpoint_1_4 is in flight. The ranks agree on a stop one update after they see the signal, and an
    # interval save at 8 would come first: the tiny model's updates take milliseconds, so the signal is sent a
    # whole update ahead of the write (sent when the write started, it once arrived after update 7 in CI). The
    # write sleeps 5 s, so the preemption checkpoint (at update 4 to 7) waits for it.
    argv[argv.index("--save-interval-updates") + 1] = "4"
    restart = act_after_update(start(argv, slow=5), 3, lambda proc: proc.send_signal(signal.SIGUSR1))
    return sync_dir, async_dir, left, restart


def dcp_files(directory):
    return {n: (directory / n).read_bytes() for n in os.listdir(directory) if n.endswith(".distcp")}


def assert_same_sharded_checkpoint(a, b, resumed=False):
    assert (
        sorted(os.listdir(a)) == sorted(os.listdir(b)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.pt"]
    )
    assert dcp_files(a) == dcp_files(b)  # both ranks' shards of model and optimizer, bitwise
    assert_same_layout_and_tensors(load(a / "metadata.pt"), load(b / "metadata.pt"), resumed=resumed)


def test_background_sharded_checkpoint_is_the_synchronous_one(sharded_runs):
    sync_dir, async_dir, _, _ = sharded_runs
    assert_same_sharded_checkpoint(sync_dir / "checkpoint_1_2", async_dir / "checkpoint_1_2")


def test_kill_9_during_a_sharded_background_write_leaves_no_partial_directory_under_a_name(sharded_runs):
    _, _, left, _ = sharded_runs
    assert left == [".fairseq-train.lock", "checkpoint_1_2", "checkpoint_1_4.tmp", "checkpoint_last"], left


def test_sigusr1_during_a_sharded_background_write_waits_for_it_then_saves_and_resumes_exactly(sharded_runs):
    sync_dir, async_dir, _, (status, log) = sharded_runs
    assert status == 3, log[-4000:]  # EXIT_REQUEUED
    assert "loaded checkpoint" in log and "(2 updates)" in log and "left by an interrupted save" in log
    waited = [line for line in log.splitlines() if "for the background write of" in line]
    assert len(waited) == 1 and waited[0].endswith(f"{async_dir / 'checkpoint_1_4'} before the preemption checkpoint")
    assert log.index("saved checkpoint " + str(async_dir / "checkpoint_1_4")) < log.index(
        "saved checkpoint " + str(async_dir / "checkpoint_last")
    )
    assert_same_sharded_checkpoint(sync_dir / "checkpoint_1_4", async_dir / "checkpoint_1_4", resumed=True)
    assert f"writing checkpoint {async_dir / 'checkpoint_1_4'} (epoch 1 @ 4 updates" in log  # in the background
    last = load(async_dir / "checkpoint_last" / "metadata.pt")["extra_state"]["trainer"]["num_updates"]
    assert 4 <= last < 8
    assert not [n for n in os.listdir(async_dir) if n.endswith(".tmp")]
