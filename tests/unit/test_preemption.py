"""fairseq.training.preemption in one process: signal handling and `scontrol requeue` (2 ranks: tests/distributed)."""

import logging
import os
import signal
import stat

import pytest

from fairseq.training.preemption import EXIT_REQUEUED, PreemptionWatcher, requeue_slurm_job


@pytest.fixture
def watcher():
    w = PreemptionWatcher()
    yield w
    w.restore()


def test_no_signal_no_stop(watcher):
    assert watcher.should_stop() is False
    assert watcher.should_stop() is False
    assert watcher.drain() is False


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_stops(watcher, sig, caplog):
    with caplog.at_level(logging.WARNING, logger="fairseq.training.preemption"):
        os.kill(os.getpid(), sig)
    assert watcher.received == sig
    assert watcher.should_stop() is True
    assert watcher.should_stop() is True  # stays set
    assert signal.Signals(sig).name in caplog.text


def test_second_signal_keeps_stopping(watcher):
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert watcher.should_stop() is True


def test_restore_reinstates_previous_handlers():
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    old_usr1 = signal.signal(signal.SIGUSR1, mine)
    old_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        w = PreemptionWatcher()
        assert signal.getsignal(signal.SIGUSR1) == w._on_signal
        assert signal.getsignal(signal.SIGTERM) == w._on_signal
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [] and w.should_stop()
        w.restore()
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, old_usr1)
        signal.signal(signal.SIGTERM, old_term)


def test_exit_code_for_requeue():
    assert EXIT_REQUEUED == 3


# ----------------------------------------------------------------------------- scontrol


def fake_scontrol(tmp_path, monkeypatch, exit_code=0):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "calls.txt"
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{record}"\necho "scontrol says no" >&2\nexit {exit_code}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return record


def test_requeue_calls_scontrol(tmp_path, monkeypatch, caplog):
    record = fake_scontrol(tmp_path, monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "424242")
    with caplog.at_level(logging.INFO, logger="fairseq.training.preemption"):
        assert requeue_slurm_job() is True
    assert record.read_text() == "requeue 424242\n"
    assert "requeued SLURM job 424242" in caplog.text


def test_requeue_outside_slurm_does_nothing(tmp_path, monkeypatch):
    record = fake_scontrol(tmp_path, monkeypatch)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert requeue_slurm_job() is False
    assert not record.exists()


def test_requeue_failure_is_logged(tmp_path, monkeypatch, caplog):
    record = fake_scontrol(tmp_path, monkeypatch, exit_code=1)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    with caplog.at_level(logging.ERROR, logger="fairseq.training.preemption"):
        assert requeue_slurm_job() is False
    assert record.read_text() == "requeue 7\n"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "scontrol requeue 7 failed (1)" in errors[0].getMessage()
    assert "scontrol says no" in errors[0].getMessage()


def test_requeue_without_scontrol_is_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol anywhere
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    with caplog.at_level(logging.ERROR, logger="fairseq.training.preemption"):
        assert requeue_slurm_job() is False
    assert "scontrol requeue 9 failed" in caplog.text


def test_requeue_after_preemption_fails_only_when_slurm_refuses(tmp_path, monkeypatch):
    from fairseq.training.preemption import requeue_after_preemption

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert requeue_after_preemption() is True  # nothing to requeue: the user restarts the command
    monkeypatch.setenv("SLURM_JOB_ID", "11")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol anywhere
    assert requeue_after_preemption() is False


def test_exit_code_for_failed_requeue_is_distinct():
    from fairseq.training.preemption import EXIT_REQUEUE_FAILED

    assert EXIT_REQUEUE_FAILED not in (0, 1, 2, EXIT_REQUEUED)  # 1: errors, 2: argparse's usage errors


# ----------------------------------------------------------------------------- the real command line


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scontrol_status, expected", [(0, EXIT_REQUEUED), (1, 4)])
def test_fairseq_train_exit_status_says_whether_the_requeue_worked(
    tiny_data, tmp_path, monkeypatch, build_train_args, scontrol_status, expected
):
    """SIGUSR1 inside a SLURM job: checkpoint_last is saved either way; exit 3 only if `scontrol requeue`
    worked, else exit 4 with one error line telling the user to resubmit."""
    import subprocess
    import sys
    import time

    record = fake_scontrol(tmp_path, monkeypatch, exit_code=scontrol_status)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    env.update(SLURM_JOB_ID="5151", OMP_NUM_THREADS="1")  # a job id alone: one process, no SLURM launch
    save_dir = tmp_path / "ck"
    log_file = save_dir / "train.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fairseq_cli.train",
            *build_train_args(
                tiny_data,
                save_dir,
                "--required-batch-size-multiple",
                "1",
                "--disable-validation",
                max_update=100000,
                arch="transformer_lm_gpt",
                seed=None,
            ),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if log_file.exists() and "| train_inner |" in log_file.read_text():
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == expected, err[-3000:]
    assert record.read_text() == "requeue 5151\n"
    assert (save_dir / "checkpoint_last.pt").exists()
    assert "Traceback" not in out + err
    error_lines = [line for line in err.splitlines() if "error:" in line]
    if expected == EXIT_REQUEUED:
        assert error_lines == [], err[-3000:]
    else:
        assert error_lines == [
            "fairseq-train: error: checkpoint_last was saved, but the SLURM job 5151 could not be requeued "
            "(scontrol requeue failed; see the log above): resubmit the job, it resumes from checkpoint_last"
        ], err[-3000:]
        assert "scontrol requeue 5151 failed (1): scontrol says no" in out + err  # the log says why
